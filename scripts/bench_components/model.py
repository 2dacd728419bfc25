"""Forward+backward time and peak memory of the policy model's log-prob loss, with and without chunking.

For ``tiny`` and ``bench-40m`` (docs/design.md "Reference models", random-init in memory) at
batch 16 x 96 tokens, with and without ``logprob_chunk_size``. Each case runs in its
own interpreter so its peak RSS is its own. Prints one JSON line:

    {"bench": "model", "batch": 16, "seq": 96, "device": ..., "results": [{"model", "chunk", "params",
     "compile_s", "step_s" (median wall), "step_cpu_s" (median CPU time of all threads),
     "xla_temp_mb", "peak_rss_mb"}, ...], "load_avg": ...}

``step_cpu_s`` is the robust number on a shared machine: wall time grows with the
other processes' load (reported as ``load_avg``), CPU time much less.

``xla_temp_mb`` is XLA's own count of the compiled step's temporary buffers (the
activation memory, deterministic); ``peak_rss_mb`` is the process's peak resident
memory (includes the interpreter, jax and the parameters).

Usage: ``python scripts/bench.py model [--steps N] [--chunk C] [--models tiny,bench-40m]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_common import load_avg, load_avg_since

BENCH = Path(__file__).resolve().parents[1] / "bench.py"

BATCH, SEQ = 16, 96


def run_case(model: str, chunk: int | None, steps: int) -> dict:
    import resource
    import statistics

    import jax
    import jax.numpy as jnp
    import numpy as np

    from asyncrl.model import bench_40m_config, init_decoder, per_token_logprobs, split_params
    from asyncrl.model.tiny import parse_tiny_spec, tiny_decoder_config

    cfg = tiny_decoder_config(parse_tiny_spec("tiny")) if model == "tiny" else bench_40m_config()
    graphdef, params = split_params(init_decoder(cfg, seed=0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (BATCH, SEQ)), jnp.int32)
    lengths = rng.integers(SEQ // 2, SEQ + 1, BATCH)
    mask = jnp.asarray(np.arange(SEQ)[None, :] < lengths[:, None])

    def loss(p):
        lp, ent = per_token_logprobs(graphdef, p, ids, mask, 1.0, chunk_size=chunk)
        return -(lp.sum() + 0.01 * ent.sum()) / mask.sum()

    step = jax.jit(jax.value_and_grad(loss))
    t0 = time.perf_counter()
    compiled = step.lower(params).compile()
    compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()
    temp_mb = getattr(memory, "temp_size_in_bytes", 0) / 2**20 if memory is not None else None
    jax.block_until_ready(compiled(params))  # warm-up
    times, cpu_times = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(params))
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return {
        "model": model,
        "chunk": chunk,
        "params": cfg.num_params(),
        "compile_s": round(compile_s, 2),
        "step_s": round(statistics.median(times), 4),
        "step_cpu_s": round(statistics.median(cpu_times), 4),
        "xla_temp_mb": round(temp_mb, 1) if temp_mb is not None else None,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "device": jax.devices()[0].device_kind,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case (median reported)")
    parser.add_argument("--chunk", type=int, default=16, help="logprob_chunk_size of the chunked cases")
    parser.add_argument("--models", default="tiny,bench-40m", help="comma-separated model specs (tiny only: a quick check)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: model,chunk


def run(args: argparse.Namespace) -> dict:
    if args.case:  # one case, in the interpreter the parent started for it
        model, chunk = args.case.split(",")
        return run_case(model, int(chunk) or None, args.steps)

    load_start = load_avg()
    results = []
    for model in args.models.split(","):
        for chunk in (0, args.chunk):
            proc = subprocess.run(
                [sys.executable, str(BENCH), "model", "--case", f"{model},{chunk}", "--steps", str(args.steps)],
                capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
            )
            if proc.returncode != 0:
                sys.exit(f"case {model} chunk={chunk} failed:\n{proc.stderr}")
            case = json.loads(proc.stdout.strip().splitlines()[-1])
            case.pop("bench")
            results.append(case)
    device = results[0].pop("device")
    for r in results[1:]:
        r.pop("device")
    return {"batch": BATCH, "seq": SEQ, "device": device, "results": results, "cpus": os.cpu_count(),
            **load_avg_since(load_start)}
