"""The checkpoint layer: atomic, sharded, asynchronous, verified, pickle-free trainer checkpoints.

:mod:`~asyncrl.checkpoint.store` writes and reads whole checkpoints (the layout and its
guarantees are in its docstring and docs/checkpoints.md), :mod:`~asyncrl.checkpoint.arrays`
the array trees on Orbax (each process its own shards), :mod:`~asyncrl.checkpoint.files`
the rollout state's JSON and npz files, :mod:`~asyncrl.checkpoint.convert` format-2 checkpoints, :mod:`~asyncrl.checkpoint.schema` the schemas a load
validates and the config checks a resume runs. Nothing here knows the rollout executor or the loop.
"""

from asyncrl.checkpoint.store import (
    CHECKPOINT_FORMAT,
    Checkpoint,
    checkpoint_problems,
    checkpoints_root,
    latest_checkpoint,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    start_checkpoint,
    step_dir_name,
)

__all__ = [
    "CHECKPOINT_FORMAT", "Checkpoint", "checkpoint_problems", "checkpoints_root", "latest_checkpoint",
    "load_checkpoint", "resume_checkpoint", "save_checkpoint", "start_checkpoint", "step_dir_name",
]
