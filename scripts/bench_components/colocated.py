"""The engine on the trainer's devices: decode speed on forced CPU devices against one device.

    python scripts/bench.py colocated [--devices 8] [--slots 256] [--new 32] [--repeats 3]

The same round of requests (``--slots`` requests of a 32-token prompt, ``--new`` new tokens each,
EOS ignored, each from its own thread, so every slot is busy throughout) on bench-40m, in three
layouts, each in a process of its own (``--xla_force_host_platform_device_count`` is read when
JAX starts):

* ``one_device``: the engine on one device (the reference);
* ``colocated``: the default placement on ``--devices`` devices: the trainer's mesh on all of them
  (``mesh.data`` fills them: replicated weights), the engine's own mesh of ``--devices``
  replicas on the same devices, each decoding ``slots / devices`` of the slots;
* ``colocated_fsdp``: the same with the trainer's weights split over ``mesh.fsdp = --devices``
  (each publish then gathers them into the engine's replicas).

Fields per layout: ``*_decode_ms_per_step`` (the engine's own decode time over its decode steps in
the timed rounds, host work included), ``*_new_tokens_per_s`` (the round's new tokens over its
median wall time) and ``*_publish_s`` (one ``update_weights`` from the trainer's arrays, the old
copy dropped, the new one laid out: median of 3). ``*_vs_one_device`` is the decode step time
over the one-device engine's: a replicated engine (every slot decoded on every device) makes it
about the device count; at most 1.3 is the target at this compute-bound shape (the forced
devices share the machine's cores, so the figure measures what the split costs, not a speed-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=8, help="forced CPU devices of the colocated layouts")
    parser.add_argument("--slots", type=int, default=256, help="engine slots, all busy (a multiple of --devices)")
    parser.add_argument("--new", type=int, default=32, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (after two untimed ones)")
    parser.add_argument("--layouts", nargs="+", default=["one_device", "colocated", "colocated_fsdp"],
                        choices=["one_device", "colocated", "colocated_fsdp"])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a layout, run in this process


def run(args: argparse.Namespace) -> dict:
    if args.child is not None:
        return child(args)
    from bench_common import load_avg, load_avg_since
    from runlib import REPO_ROOT, child_env

    load_start = load_avg()
    result: dict = {"devices": args.devices, "slots": args.slots, "new_tokens": args.new}
    for layout in args.layouts:
        devices = 1 if layout == "one_device" else args.devices
        env = child_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
        argv = [sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "colocated", "--child", layout,
                "--devices", str(args.devices), "--slots", str(args.slots), "--new", str(args.new),
                "--repeats", str(args.repeats)]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"bench.py colocated: layout {layout} failed:\n{proc.stderr[-4000:]}")
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
        result.update({f"{layout}_{name}": value for name, value in measured.items() if name != "bench"})
    if "one_device_decode_ms_per_step" in result:
        for layout in ("colocated", "colocated_fsdp"):
            if f"{layout}_decode_ms_per_step" in result:
                result[f"{layout}_vs_one_device"] = round(
                    result[f"{layout}_decode_ms_per_step"] / result["one_device_decode_ms_per_step"], 3)
    return {**result, **load_avg_since(load_start)}


def child(args: argparse.Namespace) -> dict:
    """One layout's figures, in this process (its device count set by the parent)."""
    import jax
    import numpy as np
    from bench_common import bench_40m_dir, busy_decode

    from asyncrl.cluster.mesh import build_mesh
    from asyncrl.cluster.placement import engine_mesh, resolve_placement
    from asyncrl.config import EngineConfig, load_config
    from asyncrl.engine.jax_engine import JaxEngine
    from asyncrl.model import load_model
    from asyncrl.model.sharding import shard_params

    path = bench_40m_dir(Path(tempfile.gettempdir()) / "asyncrl-bench-40m")
    loaded = load_model(str(path), with_tokenizer=False)
    graphdef, params = loaded.split()
    engine_cfg = {"slots": args.slots, "kv_capacity": PROMPT + args.new, "decode_chunk": 8, "prefill_buckets": [PROMPT]}
    if args.child == "one_device":
        trainer_params = jax.device_put(params, jax.devices()[0])
        engine = JaxEngine(graphdef, trainer_params, config=EngineConfig(**engine_cfg), warmup=True)
    else:
        assert jax.device_count() == args.devices, jax.device_count()
        mesh = {"fsdp": args.devices} if args.child == "colocated_fsdp" else {}
        cfg = load_config(data={"model": {"path": str(path)}, "mesh": mesh, "engine": {**engine_cfg, "tensor_parallel": 1},
                                "data": {"max_prompt_tokens": PROMPT}, "rollout": {"max_new_tokens": args.new}})
        placement = resolve_placement(cfg)
        trainer_params = shard_params(loaded.config, params, build_mesh(cfg.mesh, devices=placement.trainer_devices))
        engine = JaxEngine(graphdef, trainer_params, config=cfg.engine, mesh=engine_mesh(placement), warmup=True)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, loaded.config.vocab_size, size=PROMPT)] for _ in range(args.slots)]
    try:
        seconds, ms_per_step = busy_decode(engine, prompts, args.new, args.repeats)
        publishes = []
        for _ in range(3):
            started = time.perf_counter()
            engine.update_weights(trainer_params, engine.version + 1)
            publishes.append(time.perf_counter() - started)
    finally:
        engine.shutdown()
    return {"decode_ms_per_step": round(ms_per_step, 2), "new_tokens_per_s": round(args.slots * args.new / seconds, 1),
            "publish_s": round(statistics.median(publishes), 4)}
