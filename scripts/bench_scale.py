"""Memory and time of the trainer's large state across processes; prints one JSON line.

For each process count N of ``--processes`` (1, 2 and 4 by default) it starts N JAX processes on
loopback (gloo collectives, ``--devices`` forced CPU devices each) that train one random-init
model of ``--layers`` x ``--hidden`` (about 151M parameters by default) with fsdp over all of their
devices (a global batch of ``--rows`` x ``--length`` tokens, each process its block), and measures
in every process:

* peak host RSS during a train step, a checkpoint save, a restore and a publish, each above the
  process's RSS just before it (after garbage collection and ``malloc_trim``, so what one phase
  leaves in the allocator is not the next one's; Linux's ``VmHWM``, reset before each phase
  through ``/proc/self/clear_refs``); ``baseline_rss_mb`` is the RSS after setup, two warm-up
  steps and a warm-up publish;
* step time: the median of ``--steps`` steps, then of ``--steps`` steps with a save in flight (a
  save begun before them and waited for after);
* publish time: :class:`asyncrl.engine.publish.WeightsWriter` writing the weights for servers
  (``engine.remote.dtype`` bfloat16, each process its share), after a warm-up publish that compiles.

The checkpoint calls are :func:`begin_save` and :func:`restore` (one small function each, over
whatever checkpoint API the checkout has). The two checks, per N (``ok`` is both for every N):

* ``save_restore_memory_ok``: every process's peak during save and restore is at most
  1.25 x (state / N) above its RSS before the phase, state = params + optimizer state in bytes;
* ``save_in_flight_ok``: the median step time with a save in flight is at most 1.15 x without.

``--model-config`` takes a Hugging Face ``config.json`` instead of the default shape, e.g.
``configs/models/qwen2.5-0.5b/config.json`` for Qwen2.5-0.5B's (random init; nothing downloaded).
``--platform gpu`` runs each process on one GPU of its own (``CUDA_VISIBLE_DEVICES`` = its index)
instead of forced CPU devices; ``--devices`` is then 1.

Usage: PYTHONPATH=. python scripts/bench_scale.py [--processes 1,2,4] [--devices 2] [--layers 10]
       [--hidden 1024] [--model-config FILE] [--platform cpu|gpu] [--rows 8] [--length 64]
       [--steps 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import reset_peak_rss, rss_bytes  # noqa: E402  (scripts/ on the path first)
from runlib import free_port  # noqa: E402

# ---------------------------------------------------------------------------- memory


def settle() -> int:
    """RSS after freeing what can be freed: Python garbage, and glibc's free heap pages returned to
    the system (so what an earlier phase left in the allocator is not counted as the next one's)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss_bytes()


def measured(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    """``(fn's result, seconds, peak RSS above the RSS just before)`` of one call."""
    before = settle()
    reset_peak_rss()
    started = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - started
    return result, seconds, max(0, rss_bytes("VmHWM") - before)


# ---------------------------------------------------------------------------- checkpoint calls


def begin_save(trainer: Any, directory: Path, step: int) -> Callable[[], None]:
    """Begin a checkpoint of ``trainer``'s params and optimizer state; returns the wait for its end.
    Every process calls it. The loop's path (``Run.save`` / ``Run.finish_checkpoint``):
    :func:`asyncrl.checkpoint.start_checkpoint` of the live sharded trees, asynchronous (each
    process writes its own shards; it returns once they are off the devices), the wait ends the
    write, then a barrier (complete for everyone)."""
    from asyncrl.checkpoint import start_checkpoint
    from asyncrl.cluster.distributed import wait_at_barrier

    pending = start_checkpoint(directory, step, arrays={"params": trainer.params, "opt_state": trainer.opt_state},
                               state={"trainer": trainer.counters()}, config_yaml="{}\n", keep=1, asynchronous=True,
                               timeout_s=1800.0)

    def wait() -> None:
        pending.wait()
        wait_at_barrier(f"bench/save-{step}", 1800)

    return wait


def restore(trainer: Any, directory: Path, step: int) -> None:
    """Read the checkpoint of ``step`` back into ``trainer`` (every process) as a resume does
    (``asyncrl.run.loop._load_trainer_state``): each tree read straight onto the trainer's live
    shardings (each process reads only its shards), then ``Trainer.load_state_dict``."""
    from asyncrl.checkpoint import checkpoints_root, load_checkpoint, step_dir_name
    from asyncrl.run.loop import _load_trainer_state

    _load_trainer_state(trainer, load_checkpoint(checkpoints_root(directory) / step_dir_name(step), verify=False))


# ---------------------------------------------------------------------------- one process


def model_config(args: argparse.Namespace) -> Any:
    from asyncrl.model.config import DecoderConfig, from_hf_config
    from asyncrl.model.hf import read_hf_config_file

    if args.model_config:
        return from_hf_config(read_hf_config_file(Path(args.model_config)), source=args.model_config)
    layers, hidden = args.layers, args.hidden
    return DecoderConfig(model_type="qwen2", vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_layers=layers, num_heads=max(1, hidden // 64), num_kv_heads=max(1, hidden // 128),
                         head_dim=64, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True)


def worker(args: argparse.Namespace) -> None:
    from types import SimpleNamespace

    from asyncrl.cluster.distributed import initialize_distributed
    from asyncrl.config.sections import DistributedConfig

    initialize_distributed(SimpleNamespace(distributed=DistributedConfig()))
    import jax
    from bench_common import random_train_batch

    from asyncrl.config import load_config
    from asyncrl.engine.publish import WeightsWriter
    from asyncrl.model import init_decoder, split_params
    from asyncrl.run.multihost import split_rows
    from asyncrl.trainer import Trainer

    count, me = jax.process_count(), jax.process_index()
    devices = jax.device_count()
    model_cfg = model_config(args)
    graphdef, params = split_params(init_decoder(model_cfg, seed=0))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    cfg = load_config(data={"mesh": {"data": 1, "fsdp": devices, "tensor": 1},
                            "rollout": {"group_size": 4, "batch_size": args.rows // 4}})
    trainer = Trainer(cfg, graphdef, params)
    del params
    gc.collect()
    data = random_train_batch(args.rows, args.length, model_cfg.vocab_size, prompt=8)
    mine = split_rows(data, count, jax.local_device_count())[me]  # this process's block, as the loop gives it
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((trainer.params, trainer.opt_state)))
    for _ in range(2):  # compiles, then settles the allocator
        trainer.step(mine)
    out = Path(args.out)
    writer = WeightsWriter(model_cfg, out / "weights", dtype="bfloat16", keep=1)
    writer.write(trainer.params_for_publish(), 0)  # compiles the gather programs
    baseline = settle()
    _, train_s, train_peak = measured(lambda: trainer.step(mine))
    step = trainer.version
    _, save_s, save_peak = measured(lambda: begin_save(trainer, out / "ckpt", step)())
    _, restore_s, restore_peak = measured(lambda: restore(trainer, out / "ckpt", step))
    _, publish_s, publish_peak = measured(lambda: writer.write(trainer.params_for_publish(), step))
    plain = []
    for _ in range(args.steps):
        started = time.perf_counter()
        trainer.step(mine)
        plain.append(time.perf_counter() - started)
    wait = begin_save(trainer, out / "ckpt", trainer.version)
    in_flight = []
    for _ in range(args.steps):
        started = time.perf_counter()
        trainer.step(mine)
        in_flight.append(time.perf_counter() - started)
    wait()
    report = {
        "process": me, "device_kind": jax.devices()[0].device_kind, "params": n_params, "state_bytes": state_bytes,
        "baseline_rss": baseline,
        "peak_above_baseline": {"train_step": train_peak, "save": save_peak, "restore": restore_peak,
                                "publish": publish_peak},
        "seconds": {"train_step": train_s, "save": save_s, "restore": restore_s, "publish": publish_s},
        "step_time_s": statistics.median(plain), "step_time_save_in_flight_s": statistics.median(in_flight),
        "publish_bytes_written": writer.last_bytes,
    }
    (out / f"report-{me}.json").write_text(json.dumps(report))


# ---------------------------------------------------------------------------- the parent


def process_env(args: argparse.Namespace, n: int, pid: int, port: int) -> dict[str, str]:
    """The environment of process ``pid`` of ``n``: its devices (``--devices`` forced CPU devices,
    or the GPU of its own index) and, for ``n > 1``, the loopback coordinator at ``port``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.platform == "gpu":
        env.update(JAX_PLATFORMS="cuda", CUDA_VISIBLE_DEVICES=str(pid))
        env.pop("XLA_FLAGS", None)
    else:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}")
    if n > 1:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(pid))
    return env


def run_processes(n: int, args: argparse.Namespace, root: Path) -> dict:
    out = root / f"n{n}"
    out.mkdir(parents=True)
    port = free_port()
    procs = []
    for pid in range(n):
        env = process_env(args, n, pid, port)
        log = open(out / f"p{pid}.log", "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out), "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--model-config", args.model_config, "--rows", str(args.rows),
               "--length", str(args.length), "--steps", str(args.steps)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        log.close()
    deadline = time.monotonic() + args.timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    failed = [(pid, p.returncode) for pid, p in enumerate(procs) if p.returncode != 0]
    if failed:  # recorded in the line (e.g. -9: killed, typically by the kernel's out-of-memory killer)
        pid, code = failed[0]
        lines = [line for line in (out / f"p{pid}.log").read_text().strip().splitlines() if "[Gloo]" not in line]
        print(f"bench_scale: {n} processes, process {pid} exited {code}; its log ends:", *lines[-40:], sep="\n",
              file=sys.stderr)
        tail = lines[-3:]
        return {"processes": n, "error": f"process {pid} exited {code}" + (": " + " | ".join(tail) if tail else ""),
                "save_restore_memory_ok": False, "save_in_flight_ok": False}
    reports = [json.loads((out / f"report-{pid}.json").read_text()) for pid in range(n)]
    return summarize(n, reports)


def summarize(n: int, reports: list[dict]) -> dict:
    mb = 1 << 20
    state = reports[0]["state_bytes"]
    bound = 1.25 * state / n
    peaks = {phase: [round(r["peak_above_baseline"][phase] / mb, 1) for r in reports]
             for phase in ("train_step", "save", "restore", "publish")}
    step = max(r["step_time_s"] for r in reports)
    in_flight = max(r["step_time_save_in_flight_s"] for r in reports)
    memory_ok = all(max(r["peak_above_baseline"]["save"], r["peak_above_baseline"]["restore"]) <= bound for r in reports)
    return {
        "processes": n,
        "device_kind": reports[0]["device_kind"],
        "params": reports[0]["params"],
        "state_mb": round(state / mb, 1),
        "bound_mb": round(bound / mb, 1),
        "baseline_rss_mb": [round(r["baseline_rss"] / mb, 1) for r in reports],
        "peak_above_baseline_mb": peaks,
        "step_time_s": round(step, 3),
        "step_time_save_in_flight_s": round(in_flight, 3),
        "save_s": round(max(r["seconds"]["save"] for r in reports), 3),
        "restore_s": round(max(r["seconds"]["restore"] for r in reports), 3),
        "publish_s": round(max(r["seconds"]["publish"] for r in reports), 3),
        "publish_mb_written": [round(r["publish_bytes_written"] / mb, 1) for r in reports],
        "save_restore_memory_ok": memory_ok,
        "save_in_flight_ok": in_flight <= 1.15 * step,
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--devices", type=int, default=2, help="forced CPU devices per process")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--model-config", default="", help="a Hugging Face config.json (instead of --layers/--hidden)")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: --devices forced CPU devices per process; gpu: one GPU per process")
    parser.add_argument("--rows", type=int, default=8, help="global batch rows (each process trains rows / N)")
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per process count")
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one, removed)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    cli = parser()
    args = cli.parse_args()
    if args.worker:
        worker(args)
        return
    counts = [int(c) for c in args.processes.split(",")]
    if args.platform == "gpu":
        args.devices = 1
    if args.model_config:  # a bad file is named here, before any process starts
        from asyncrl.errors import ModelError

        try:
            model_config(args)
        except ModelError as err:
            cli.error(f"--model-config: {err}")
    if any(args.rows % (n * args.devices) for n in counts):
        cli.error(f"--rows {args.rows} must be a multiple of every process count x --devices")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=args.out) as tmp:
        runs = [run_processes(n, args, Path(tmp)) for n in counts]
    result = {
        "platform": args.platform, "device_kind": next((r["device_kind"] for r in runs if "device_kind" in r), None),
        "model": {**({"config": args.model_config} if args.model_config else {"layers": args.layers, "hidden": args.hidden}),
                  "params": next((r["params"] for r in runs if "params" in r), None)},
        "devices_per_process": args.devices, "rows": args.rows, "length": args.length,
        "runs": runs,
        "ok": all(r["save_restore_memory_ok"] and r["save_in_flight_ok"] for r in runs),
        "loadavg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
