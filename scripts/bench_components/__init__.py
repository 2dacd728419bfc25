"""The subcommands of ``scripts/bench.py``: each module has ``add_arguments(parser)`` and ``run(args) -> dict``."""
