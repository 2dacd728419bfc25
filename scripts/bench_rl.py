"""Benchmark the whole RL loop (``asyncrl train`` in a subprocess); prints one JSON line.

Each entry is one real ``python -m asyncrl.cli train`` run of ``--steps`` RL steps on a fixed
synthetic task (the built-in ``copy`` dataset: 3-digit prompts, random-init model) for one
model and one ``rollout.max_staleness``. The parent timestamps the run's per-step console
lines and reads its ``metrics.jsonl`` afterwards. Figures are over the steady window
from the end of step 1 to the end of the last step (steps 2..N; step 1 includes the
compiles), and ``ttfs_s`` is the time from the subprocess start to step 1's line (import,
model load, compile or cache load, the step-0 eval when eval is on, the first batch and the
first train step).

Fields of an entry: ``trained_tokens_per_s`` (loss-mask tokens trained per wall second),
``generated_tokens_per_s`` (tokens the engine decoded, eval included), ``step_time_median_s``
and ``train_time_median_s``, and ``share``: the fraction of the window's wall time spent in
``training`` (``perf/train_time``), ``batch_wait`` (``rollout/wait_s``), ``publishing``
(``perf/publish_time``; null when this asyncrl does not report it), ``eval``
(``perf/eval_time``), ``checkpoint`` (``perf/checkpoint_time``) and ``other`` (the rest of
the main thread: metrics, logging, host work). Those add up to 1. ``generation`` (the
engine's prefill + decode time) runs in its own thread beside them, so it overlaps the rest
and is not part of the sum.

Per model, unless ``--no-prime``, a one-step run in an empty compilation cache comes first:
its ``ttfs_s`` is ``ttfs_cold_s``; the measured runs then find the cache warm.
``--quickstart`` also times ``asyncrl train configs/quickstart.yaml`` to its first step twice
in an empty cache (``quickstart_ttfs_s``: [first run, second run]).

Usage: PYTHONPATH=. python scripts/bench_rl.py [--models tiny,bench-40m] [--staleness 0 2] [--steps 12]
       [--quickstart] [--quick]
``--quick``: ``tiny``, ``max_staleness`` 0, 4 steps, no priming, and the compilation cache of
``$JAX_COMPILATION_CACHE_DIR`` if set (the tests').
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import bench_40m_dir, load_avg, load_avg_since  # noqa: E402
from runlib import child_env, read_metrics, run_train, train_argv  # noqa: E402

# The work of a step per model: (groups, group size, new tokens, engine slots, KV capacity).
SHAPES = {
    "tiny": {"batch_size": 8, "group_size": 8, "max_new_tokens": 8, "kv_capacity": 32},
    "bench-40m": {"batch_size": 8, "group_size": 4, "max_new_tokens": 64, "kv_capacity": 96},
}


# --------------------------------------------------------------------------- one run


def run_config(model_path: str, shape: dict, staleness: int, steps: int, out: Path, every: int) -> dict:
    """The YAML of one benchmark run (RL only, the copy task, eval and checkpoint every ``every`` steps)."""
    slots = shape["batch_size"] * shape["group_size"]
    return {
        "run": {"name": "bench-rl", "output_dir": str(out), "total_steps": steps, "seed": 0},
        "model": {"path": model_path},
        "data": {"dataset": {"target": "copy", "kwargs": {"train_size": 2048, "eval_size": 16, "min_digits": 3,
                                                          "max_digits": 3}},
                 "max_prompt_tokens": 16},
        "rollout": {"batch_size": shape["batch_size"], "group_size": shape["group_size"], "max_staleness": staleness,
                    "max_new_tokens": shape["max_new_tokens"], "temperature": 1.0, "max_concurrent": 2 * shape["batch_size"]},
        "engine": {"slots": slots, "kv_capacity": shape["kv_capacity"], "prefill_buckets": [16], "decode_chunk": 8},
        "optim": {"lr": 1.0e-5},
        "eval": {"every_steps": every, "max_prompts": 16},
        "checkpoint": {"every_steps": every, "keep": 1},
        "logging": {"dump_every_steps": 0},
    }


def bench_run(model: str, model_path: str, staleness: int, steps: int, work: Path, env: dict[str, str],
              every: int) -> dict:
    """One run's entry (see the module docstring)."""
    import yaml

    out = work / f"{model}-s{staleness}-n{steps}"
    config = work / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(run_config(model_path, SHAPES[model], staleness, steps, out, every)))
    times = run_train(train_argv(config, ["run.overwrite=true"]), env, timeout=3600).step_times
    return {"model": model, "max_staleness": staleness, "steps": steps, "ttfs_s": round(times[1], 2),
            **summarise(read_metrics(out), times, steps)}


def summarise(rows: list[dict], times: dict[int, float], steps: int) -> dict:
    """The window's throughput and time shares from the run's metrics rows and step times."""
    by_step = {row["step"]: row for row in rows if row["step"] > 0}
    window = [by_step[s] for s in range(2, steps + 1)]
    wall = times[steps] - times[1]

    def total(name: str) -> float:
        return sum(row.get(name) or 0.0 for row in window)

    def engine_busy(row: dict) -> float:
        rate = row.get("engine/prefill_tokens_per_s") or 0.0
        prefill = row.get("engine/prefill_tokens", 0.0) / rate if rate else 0.0
        return row.get("engine/decode_s", 0.0) + prefill

    first, last = by_step[1], by_step[steps]
    trained = sum(row["perf/trained_tokens_per_s"] * row["perf/step_time"] for row in window)
    publish = total("perf/publish_time") if any("perf/publish_time" in row for row in window) else None
    serial = {"training": total("perf/train_time"), "batch_wait": total("rollout/wait_s"), "publishing": publish,
              "eval": total("perf/eval_time"), "checkpoint": total("perf/checkpoint_time")}
    share: dict[str, Optional[float]] = {k: (None if v is None else round(v / wall, 4)) for k, v in serial.items()}
    share["other"] = round(1.0 - sum(v for v in share.values() if v is not None), 4)
    share["generation"] = round((engine_busy(last) - engine_busy(first)) / wall, 4)
    return {
        "wall_s": round(wall, 3),
        "trained_tokens_per_s": round(trained / wall, 1),
        "generated_tokens_per_s": round((last["engine/decode_tokens"] - first["engine/decode_tokens"]) / wall, 1),
        "step_time_median_s": round(statistics.median(row["perf/step_time"] for row in window), 4),
        "train_time_median_s": round(statistics.median(row["perf/train_time"] for row in window), 4),
        "share": share,
        "lag_max": max(row.get("rollout/lag_max", 0.0) for row in window),
        "engine_compiles": last.get("engine/compiles"),
    }


def quickstart_ttfs(work: Path) -> list[float]:
    """Seconds to the quickstart's first step, twice in one empty compilation cache."""
    env = child_env(compile_cache=work / "quickstart-jax-cache")
    out = []
    for attempt in range(2):
        argv = train_argv("configs/quickstart.yaml", [f"run.output_dir={work / f'quickstart-{attempt}'}",
                                                      "stages.0.total_steps=1", "stages.1.total_steps=1"])
        out.append(round(run_train(argv, env, timeout=600).step_times[1], 2))
    return out


# --------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,bench-40m", help="comma-separated: tiny, bench-40m")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2], help="rollout.max_staleness values")
    parser.add_argument("--steps", type=int, default=12, help="RL steps per run (the window is steps 2..N)")
    parser.add_argument("--every", type=int, default=4, help="eval and checkpoint every this many steps")
    parser.add_argument("--no-prime", action="store_true", help="skip the one-step cold-cache run per model")
    parser.add_argument("--quickstart", action="store_true", help="also time the quickstart's first step, cold and warm")
    parser.add_argument("--quick", action="store_true", help="tiny, max_staleness 0, 4 steps, no priming (for tests)")
    parser.add_argument("--work-dir", default=None, help="where runs and the compilation cache go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.staleness, args.steps, args.every, args.no_prime = "tiny", [0], 4, 2, True
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the window is steps 2..N)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(SHAPES))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {sorted(SHAPES)}")

    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        inherited = os.environ.get("JAX_COMPILATION_CACHE_DIR") if args.quick else None
        env = child_env(compile_cache=Path(inherited) if inherited else work / "jax-cache")
        load_start = load_avg()
        result: dict[str, Any] = {"bench": "rl"}
        entries, cold = [], {}
        for model in models:
            path = str(bench_40m_dir(work / "bench-40m-hf")) if model == "bench-40m" else model
            if not args.no_prime:
                prime = run_train(train_argv(_prime_config(work, model, path), ["run.overwrite=true"]), env, timeout=1800)
                cold[model] = round(prime.step_times[1], 2)
            for staleness in args.staleness:
                entries.append(bench_run(model, path, staleness, args.steps, work, env, args.every))
        result["ttfs_cold_s"] = cold or None
        result["entries"] = entries
        if args.quickstart:
            result["quickstart_ttfs_s"] = quickstart_ttfs(work)
    import jax

    result.update({**load_avg_since(load_start), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                   "cpu_count": os.cpu_count()})
    print(json.dumps(result), flush=True)
    return result


def _prime_config(work: Path, model: str, path: str) -> Path:
    import yaml

    out = work / f"{model}-prime"
    cfg = run_config(path, SHAPES[model], 0, 1, out, every=0)
    config = work / f"{model}-prime.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


if __name__ == "__main__":
    main()
