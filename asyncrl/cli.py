"""The ``asyncrl`` command line.

Config handling imports no jax, flax or transformers: ``--print-config`` and config
errors are instant. User errors (:class:`~asyncrl.errors.AsyncRLError`) print one
line per problem and exit with status 2 for config errors, 1 otherwise; never a
traceback.

``train`` and ``eval`` put the current working directory first on ``sys.path`` (as
``python -m`` does), so ``pkg.module:Symbol`` specs find modules next to where the
command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Callable, Iterator, Optional, Sequence

from asyncrl import __version__
from asyncrl.errors import AsyncRLError, ConfigError

EXIT_CONFIG_ERROR = 2
EXIT_SIGINT = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous RL post-training of language models in JAX.",
        epilog="Example: asyncrl train configs/quickstart.yaml --set rollout.batch_size=16",
    )
    parser.add_argument("--version", action="version", version=f"asyncrl {__version__}")
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
    _add_serve_parser(commands)
    _add_launch_parser(commands)
    _add_plan_parser(commands)
    _add_export_lora_args(export)
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in run.output_dir, or start fresh if there is none "
        "(same as --set checkpoint.resume=auto)",
    )
    return parser


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a model over SGLang's HTTP API (a rollout server for engine.remote)",
        description="Serve MODEL_OR_CONFIG (a model directory, tiny, or a run config's model/engine/run.seed) with the "
        "in-process JAX engine behind SGLang's native HTTP API (/generate, /pause_generation, /continue_generation, "
        "/update_weights_from_disk, /health, /get_model_info, ...). See docs/remote.md.",
    )
    serve.add_argument("model", metavar="MODEL_OR_CONFIG", help="model path, tiny[:...], or a YAML run config")
    serve.add_argument("--port", type=int, default=30000, help="TCP port (default 30000, SGLang's)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this host only)")
    serve.add_argument("--weights-root", default=None, metavar="DIR",
                       help="/update_weights_from_disk loads only directories under DIR (without it, updates are refused)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every endpoint (default: $ASYNCRL_API_KEY, else none)")
    serve.add_argument("--seed", type=int, default=None, help="root of the sample keys (default: the config's run.seed, else 0)")
    serve.add_argument("--weight-version", default="0", help="weight_version label of the starting weights (default 0)")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                       help="override a field of the config (e.g. --set engine.prefill_buckets=[32]); repeatable")


def _add_launch_parser(commands: argparse._SubParsersAction) -> None:
    launch = commands.add_parser(
        "launch",
        help="run an asyncrl command as N processes on this host (multi-process development and tests)",
        description="Start N processes of 'asyncrl COMMAND ...' on this host with JAX_COORDINATOR_ADDRESS (a free port "
        "on 127.0.0.1), JAX_NUM_PROCESSES and JAX_PROCESS_ID set for each; prefix their output with [p<i>]; forward "
        "SIGINT/SIGTERM to all of them; when one fails, name it, stop the others (SIGTERM after --grace-s, then "
        "SIGKILL) and exit with its code. On a cluster use one process per host instead (docs/scaling.md).",
        epilog="Example: asyncrl launch --nproc 2 --cpu-devices 2 -- train configs/quickstart.yaml",
    )
    launch.add_argument("--nproc", type=int, required=True, metavar="N", help="number of processes")
    launch.add_argument("--cpu-devices", type=int, default=None, metavar="K",
                        help="for testing on CPU: give each process K forced host devices "
                        "(XLA_FLAGS=--xla_force_host_platform_device_count=K); no effect on GPUs or TPUs")
    launch.add_argument("--grace-s", type=float, default=10.0, metavar="S",
                        help="after a process fails, seconds the others get to stop by themselves before SIGTERM, "
                        "and again before SIGKILL (default 10)")
    launch.add_argument("child", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the asyncrl command each process runs, after --, e.g. -- train CONFIG --set ...")


def _add_plan_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan",
        help="what a config needs per device (parameters, optimizer, activations, KV cache), before running it",
        description="Print, per device, the memory CONFIG needs: the trainer's parameters, gradients, optimizer "
        "state, activations and reference model, the engine's weights and KV cache, for the config's placement and "
        "mesh on --devices devices. Reads the model's config.json only (model.path: a directory, its config.json, "
        "tiny, or a hub id in the local cache); nothing is allocated. With --device-memory: exits 1 when it does not "
        "fit, with the changes that would make it fit and their totals.",
        epilog="Example: asyncrl plan configs/gsm8k_grpo.yaml --set model.path=tests/fixtures/configs/qwen3-1.7b.json "
        "--device-memory 80",
    )
    _add_config_args(plan)
    plan.add_argument("--devices", type=int, default=None, metavar="N",
                      help="devices of the run, all processes (default 1; with --target: the target's)")
    plan.add_argument("--processes", type=int, default=None, metavar="P",
                      help="processes (hosts) they are spread over (default 1; with --target: the target's)")
    plan.add_argument("--device-memory", type=float, default=None, metavar="GB",
                      help="memory of one device in GiB (e.g. 80); without it the table is printed with no verdict")
    plan.add_argument("--backend", choices=("cpu", "gpu", "tpu"), default=None,
                      help="what model.compute_dtype: auto resolves to (bfloat16 on gpu/tpu, float32 on cpu); default: this machine's")
    plan.add_argument("--xla", action="store_true",
                      help="also compile the real train step and decode step here on abstract shapes and show XLA's "
                      "memory figures (this backend's; needs the planned devices here)")
    plan.add_argument("--target", default=None, metavar="NAME",
                      help="compile the run's programs for a GPU or TPU it will rent (h100, h200, a100-80gb, l4, v4-8, "
                      "v5e-1/4/8, v5p-8, v5p-32, v6e-1/4/8/16/32, cpu) on this machine, in a process of its own, and print "
                      "XLA's per-device memory per program beside the plan's, the verdict and the compile seconds (GPU "
                      "decode: kernels per step, host round trips per token); needs jax's CUDA plugin or libtpu installed "
                      "(docs/performance.md \"Compiled for the target\")")
    plan.add_argument("--json", action="store_true", help="one JSON object per line: with --target one per program, each "
                      "stage's device total last; without, the device total (\"program\": \"device_total\")")
    plan.add_argument("--program", action="append", default=[], metavar="NAME", dest="programs",
                      help="with --target or --xla: compile only this program (repeatable): train_step, critic_step, "
                      "prefill, decode_chunk, beam_search, publish")
    plan.add_argument("--dump", default=None, metavar="DIR",
                      help="with --target on a GPU: keep XLA's dump of the decode chunks (thunk sequences) in DIR")


def _launch(args: argparse.Namespace) -> int:
    from asyncrl.cluster.launch import launch

    child = args.child[1:] if args.child[:1] == ["--"] else args.child
    if args.nproc < 1 or (args.cpu_devices is not None and args.cpu_devices < 1) or not child:
        print("asyncrl launch: give --nproc N >= 1 (and --cpu-devices K >= 1) and the command after --, e.g. "
              "asyncrl launch --nproc 2 -- train CONFIG", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return launch(child, args.nproc, cpu_devices=args.cpu_devices, grace_s=args.grace_s)


def _serve(args: argparse.Namespace) -> int:
    from asyncrl.serve.server import serve

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(args.model, host=args.host, port=args.port, weights_root=args.weights_root, api_key=args.api_key,
          seed=args.seed, weight_version=args.weight_version, overrides=args.overrides)
    return 0
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


def entry() -> None:
    """The ``asyncrl`` command (console script and ``python -m asyncrl``): :func:`main`, then exit
    with its code. From here until the process is gone (JAX's and the threads' exit work, which
    can take seconds after the last checkpoint is written), SIGINT/SIGTERM exit at once with one
    line, as during start-up, instead of a KeyboardInterrupt traceback from an exit callback.
    ``main`` itself restores the handlers it found, so calling it in-process changes nothing.
    A failed or interrupted command ends without the interpreter's finalization
    (:func:`asyncrl.run.shutdown.end_process`): never SIGABRT from a thread still in native code."""
    from asyncrl.run.shutdown import end_process

    try:
        code = main()
    except Exception:  # a bug, not a user error: its traceback, then the same ending as any failure
        traceback.print_exc()
        code = 1
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _exit_while_exiting(code))
    end_process(code)


def _exit_while_exiting(code: int) -> Callable[[int, object], None]:
    def exit_now(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        os.write(2, f"asyncrl: interrupted ({name}) while exiting; the command had finished (exit status {code}) "
                    "and checkpoints already written are intact\n".encode())
        os._exit(128 + signum)

    return exit_now


_error_line: Optional[str] = None
"""The one line :func:`_main` printed for the error that ended the command (None: none)."""


def main(argv: Sequence[str] | None = None) -> int:
    global _error_line
    _error_line = None
    code = _main(argv)
    if code != 0 and "asyncrl.cluster.distributed" in sys.modules:
        # A failed process of a multi-process run: tell the others (with its error line, which
        # they print if they stop before reaching the same error) and exit now, instead of JAX's
        # graceful shutdown waiting for processes stuck in a collective with this one.
        from asyncrl.cluster.distributed import SIGNAL_EXIT_CODES, exit_after_failure

        if code not in SIGNAL_EXIT_CODES:
            exit_after_failure(code, _error_line or "see its log")
    return code


def _say_error(text: str) -> None:
    global _error_line
    _error_line = text
    print(f"asyncrl: error: {text}", file=sys.stderr)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":  # the server handles its own signals (graceful shutdown)
            return _dispatch(args)
        if args.command == "launch":  # forwards signals to its processes
            return _launch(args)
        with _exit_on_signal_outside_the_run():
            return _dispatch(args)
    except KeyboardInterrupt:
        # SIGINT before the run's own handler is installed (imports, config, model loading):
        # nothing was trained or checkpointed; exit like a shell does, without a traceback.
        print("asyncrl: interrupted (SIGINT) outside the training steps (start-up or export); checkpoints already "
              "written are intact", file=sys.stderr)
        return EXIT_SIGINT
    except ConfigError as err:
        print("asyncrl: config error:", file=sys.stderr)
        for line in err.problems:
            print(f"  {line}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except AsyncRLError as err:
        _say_error(str(err))
        return 1
    except OSError as err:
        _say_error(_describe_os_error(err))
        return 1


def _describe_os_error(err: OSError) -> str:
    """One line for an I/O failure (disk full, EIO, permissions): the path and the errno."""
    if err.errno is None:
        return str(err)
    where = f" ({err.filename})" if err.filename else ""
    return f"I/O error{where}: [Errno {err.errno}] {err.strerror}"


@contextlib.contextmanager
def _exit_on_signal_outside_the_run() -> Iterator[None]:
    """SIGINT/SIGTERM before the run's own handler is installed (imports, config, model
    loading) or after it is removed (the final export) exit at once with 130/143 and one line.

    A KeyboardInterrupt raised there could land anywhere, e.g. in a garbage-collection
    callback, where Python prints "Exception ignored" and carries on: the run would then
    start as if nothing happened. Nothing is lost by exiting: no step has been trained
    outside the run's handler, and every file asyncrl writes is written to a temporary name
    and renamed. The run's :class:`~asyncrl.run.shutdown.ShutdownGuard` takes over during training.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        os.write(2, f"asyncrl: interrupted ({name}) outside the training steps (start-up or export); checkpoints "
                    "already written are intact\n".encode())
        os._exit(128 + signum)

    previous = {signum: signal.signal(signum, exit_now) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _import_flax_without_ipython() -> None:
    """Import flax now, without the import of IPython it makes only to ask whether an IPython
    shell is running (``flax.nnx.reprlib``; 0.4 to 1 s of start-up where IPython is installed).
    A shell runs only where IPython is already imported, so when it is not, the answer without
    it (no shell) is the same; the command has started no other thread yet."""
    from asyncrl.imports import import_without

    import_without("flax.nnx", "IPython")


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "version":
        print(f"asyncrl {__version__}")
        return 0
    if args.command in ("serve", "train", "eval"):
        # Before any backend starts (XLA reads XLA_FLAGS once): command buffers on GPUs.
        from asyncrl.engine.platform import apply_platform_xla_flags

        apply_platform_xla_flags()
    if args.command == "serve":
        return _serve(args)
    if args.command == "export":
        from asyncrl.run.export import export_run

        written = export_run(args.run_dir, args.out_dir, merged=args.merged)
        print(f"asyncrl: wrote {written}")
        return 0

    if os.getcwd() not in sys.path:
        # As `python -m`: modules in the working directory are importable (user workflows, rewards).
        sys.path.insert(0, os.getcwd())
    from asyncrl.config import dump_config, load_config

    overrides = list(args.overrides)
    if getattr(args, "resume", False):
        overrides.append("checkpoint.resume=auto")
    cfg = load_config(args.config, overrides)
    if args.print_config:
        sys.stdout.write(dump_config(cfg))
        return 0
    if args.command == "plan":
        from asyncrl.plan.programs import PROGRAMS

        unknown = [p for p in args.programs if p not in PROGRAMS]
        if unknown:
            raise ConfigError(f"--program {unknown[0]}: no such program; known: {', '.join(PROGRAMS)}")
        if args.target is not None:
            from asyncrl.plan.target import run_plan_target

            for given, option in ((args.xla, "--xla"), (args.device_memory is not None, "--device-memory"),
                                  (args.backend is not None, "--backend")):
                if given:
                    raise ConfigError(f"{option}: not with --target (the target gives the devices, their memory and backend)")
            return run_plan_target(args.config, overrides, args.target, devices=args.devices, processes=args.processes,
                                   as_json=args.json, keep_dump=args.dump, programs=args.programs)
        if args.dump:
            raise ConfigError("--dump: only with --target NAME")
        if args.programs and not args.xla:
            raise ConfigError("--program: only with --target NAME or --xla (it names programs to compile)")
        from asyncrl.plan.command import run_plan

        return run_plan(args.config, overrides, devices=1 if args.devices is None else args.devices,
                        processes=1 if args.processes is None else args.processes,
                        device_memory_gb=args.device_memory, backend=args.backend, xla=args.xla, as_json=args.json,
                        programs=args.programs)
    # Other libraries (jax, transformers) speak at WARNING and up; asyncrl at logging.level.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncrl").setLevel(cfg.logging.level)
    _import_flax_without_ipython()
    if args.command == "train":
        from asyncrl.run.loop import train
        from asyncrl.run.run_state import TrainingInterrupted

        try:
            train(cfg, argv=["asyncrl", *sys.argv[1:]])
        except TrainingInterrupted as stop:
            print(f"asyncrl: {stop}", file=sys.stderr)
            return stop.exit_code
        return 0
    if args.command == "eval":
        from asyncrl.run.compile_cache import enable_compile_cache
        from asyncrl.run.evaluate import evaluate_model

        enable_compile_cache(cfg.run.compile_cache)
        evaluate_model(cfg)
        return 0
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    raise SystemExit(main())
