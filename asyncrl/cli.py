"""The ``asyncrl`` command line.

Config handling imports no jax, flax or transformers: ``--print-config`` and config
errors are instant. User errors (:class:`~asyncrl.errors.AsyncRLError`) print one
line per problem and exit with status 2 for config errors, 1 otherwise; never a
traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from asyncrl import __version__
from asyncrl.errors import AsyncRLError, ConfigError

EXIT_CONFIG_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous RL post-training of language models in JAX.",
        epilog="Example: asyncrl train configs/quickstart.yaml --set rollout.batch_size=16",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    commands.add_parser("version", help="print the asyncrl version", description="Print the asyncrl version.")

    train = commands.add_parser(
        "train",
        help="run training from a YAML config",
        description="Run GRPO/PPO training from a YAML config.",
    )
    _add_config_args(train)

    evaluate = commands.add_parser(
        "eval",
        help="evaluate a model on the config's eval split",
        description="Evaluate model.path (e.g. --set model.path=runs/quickstart/hf) on the eval split of the "
        "config's dataset, with the config's workflow and rewards; prints a table and a JSON line.",
    )
    _add_config_args(evaluate)

    export = commands.add_parser(
        "export",
        help="write a run's policy in Hugging Face format",
        description="Write the policy saved in RUN_DIR (its latest checkpoint, else its final hf/ export) to OUT_DIR "
        "as a Hugging Face model directory; for a LoRA run, its adapters as a PEFT adapter directory (--merged: the "
        "merged Hugging Face model).",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run's output directory (run.output_dir)")
    export.add_argument("out_dir", metavar="OUT_DIR", help="where to write the Hugging Face directory")
    _add_export_lora_args(export)
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in run.output_dir, or start fresh if there is none "
        "(same as --set checkpoint.resume=auto)",
    )
    return parser


def _add_export_lora_args(export: argparse.ArgumentParser) -> None:
    export.add_argument(
        "--merged", action="store_true",
        help="for a LoRA run (model.lora): write the base model with the adapters merged in as a Hugging Face "
        "directory, instead of a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)",
    )


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="path to a YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a field, e.g. --set rollout.batch_size=16 or --set stages.0.total_steps=5 "
        "(VALUE is YAML; str fields take the raw text); repeatable",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except ConfigError as err:
        print("asyncrl: config error:", file=sys.stderr)
        for line in err.problems:
            print(f"  {line}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except AsyncRLError as err:
        print(f"asyncrl: error: {err}", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "version":
        print(f"asyncrl {__version__}")
        return 0
    if args.command == "export":
        from asyncrl.export import export_run

        written = export_run(args.run_dir, args.out_dir, merged=args.merged)
        print(f"asyncrl: wrote {written}")
        return 0

    from asyncrl.config import dump_config, load_config

    overrides = list(args.overrides)
    if getattr(args, "resume", False):
        overrides.append("checkpoint.resume=auto")
    cfg = load_config(args.config, overrides)
    if args.print_config:
        sys.stdout.write(dump_config(cfg))
        return 0
    # Other libraries (jax, transformers) speak at WARNING and up; asyncrl at logging.level.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncrl").setLevel(cfg.logging.level)
    if args.command == "train":
        from asyncrl.train import TrainingInterrupted, train

        try:
            train(cfg, argv=["asyncrl", *sys.argv[1:]])
        except TrainingInterrupted as stop:
            print(f"asyncrl: {stop}", file=sys.stderr)
            return stop.exit_code
        return 0
    if args.command == "eval":
        from asyncrl.export import evaluate_model

        evaluate_model(cfg)
        return 0
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    raise SystemExit(main())
