"""What asynchrony buys: the GRPO work of ``bench_vs_trl.py`` at ``max_staleness`` 0, 1 and 2,
colocated and split; prints one JSON line.

The work of every run is ``bench_vs_trl.py``'s asyncrl side (:func:`bench_vs_trl.asyncrl_config`:
the random-init ``bench-40m`` llama-layout directory of :func:`bench_common.bench_40m_dir`,
``--prompts`` prompts x ``--group`` completions x ``--new`` new tokens, temperature 1, one update
per step, float32), with ``rollout.max_staleness`` set to each η of ``--staleness``, in each
layout of ``--layouts``:

* ``colocated``: ``asyncrl train`` with its in-process engine: one process, every core.
* ``split``: the engine as ``asyncrl serve`` (the same engine settings, plus a prefill bucket
  that holds a resubmitted prompt: prompt + the tokens drawn before a publish cut it) pinned to
  the first half of the cores, ``asyncrl train`` with ``engine.remote`` pinned to the other
  half, over loopback; published weights go through ``--weights-root`` (default: under the work
  directory; ``/dev/shm/...`` skips the disk). A fresh server per run, so each starts at version 0.

Each run is its own process (a server too); the first ``--warmup`` steps (compilation) are left
out of every figure. Per run (``runs.<layout>.eta<η>``): ``step_s`` (median ``perf/step_time``:
batch wait + train + publish), ``wall_step_s`` (wall time per step between the console lines
of the first and the last kept step: everything, logging included), ``train_s`` (median
``perf/train_time``), ``rollout_wait_s`` (median ``rollout/wait_s``: the trainer waiting for its
batch), ``publish_s`` (median ``perf/publish_time``), ``lag_max`` (the largest version lag
trained), ``speedup`` (this layout's η = 0 ``step_s`` over this run's) and ``load_avg_1m``
(at the run's start and end).

Per layout: ``generation_s``, one batch's generation time, i.e. η = 0's ``rollout_wait_s`` (at
η = 0 the engine starts the batch only once the trainer has published, and the trainer waits
for all of it); ``ceiling``, the most asynchrony can buy: ``(train_s + generation_s) /
max(train_s, generation_s)`` of the η = 0 run (generation hidden entirely behind training or the
reverse); ``speedup_of_ceiling`` of the largest η run.

``targets``: colocated η = 2 at least 1.35 x η = 0, split η = 2 at least 1.6 x split η = 0, and
both within 10% of their ceiling (``speedup >= 0.9 x ceiling``); each with its ``value`` and
``pass`` (null when a run it needs was not asked for). ``ok``: every measured target passes. A
missed target is reported, not an error (a shared or slow machine misses them without a
defect); ``--check`` makes the exit status 1 when one is missed. Top level also: ``machine``
(CPU, cores), the jax version and ``load_avg`` (start and end of the whole benchmark).

Usage: PYTHONPATH=. python scripts/bench_async.py [--layouts colocated split] [--staleness 0 1 2] [--steps 12]
       [--warmup 2] [--model bench-40m|tiny] [--prompts 8] [--group 4] [--new 64] [--weights-root DIR] [--check]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import bench_40m_dir, load_avg, load_avg_since, machine  # noqa: E402
from bench_vs_trl import asyncrl_config, write_prompts  # noqa: E402
from runlib import ChildRun, child_env, free_port, pinned, read_metrics, split_cpus, train_argv, wait_for_health  # noqa: E402

LAYOUTS = ("colocated", "split")
SPEEDUP_TARGETS = {"colocated": 1.35, "split": 1.6}  # η = 2 over η = 0, same layout
CEILING_FRACTION = 0.9  # "within 10% of the ceiling"


# --------------------------------------------------------------------------- configs


def run_config(args: argparse.Namespace, model: str, prompts: Path, out: Path, staleness: int,
               server: Optional[tuple[str, Path]] = None) -> dict:
    """bench_vs_trl's asyncrl config at ``max_staleness: staleness``; ``server``: (URL, weights
    directory) of an ``asyncrl serve`` to generate on instead of the in-process engine."""
    cfg = asyncrl_config(args, Path(model), prompts, out)  # model: a directory, or "tiny"
    cfg["run"]["name"] = f"bench-async-{out.name}"
    cfg["rollout"]["max_staleness"] = staleness
    if server is not None:
        url, weights = server
        cfg["engine"]["remote"] = {"urls": [url], "weights_dir": str(weights), "api_key_env": None}
    return cfg


def serve_config(cfg: dict) -> dict:
    """The server's config: the run's engine, with a prefill bucket of ``kv_capacity``, so that a
    resubmitted prompt (a publish cuts requests in flight; each comes back as prompt + its tokens
    so far) is prefilled in one chunk."""
    served = json.loads(json.dumps(cfg))
    engine = served["engine"]
    engine["prefill_buckets"] = sorted({*engine["prefill_buckets"], engine["kv_capacity"]})
    return served


# --------------------------------------------------------------------------- figures


def _median(rows: list[dict], name: str) -> Optional[float]:
    values = [row[name] for row in rows if name in row]
    return round(statistics.median(values), 4) if values else None


def summarise(rows: list[dict], step_times: dict[int, float], warmup: int) -> dict[str, Any]:
    """One run's figures over the steps after ``warmup`` (``rows``: its metrics.jsonl; ``step_times``:
    step -> seconds at its console line)."""
    kept = [row for row in rows if row["step"] > warmup]
    if not kept:
        raise ValueError(f"no steps after the {warmup} warm-up steps: raise --steps above --warmup")
    last = max(row["step"] for row in kept)
    wall = None
    if warmup in step_times and last in step_times and last > warmup:
        wall = round((step_times[last] - step_times[warmup]) / (last - warmup), 4)
    lags = [row["rollout/lag_max"] for row in kept if "rollout/lag_max" in row]
    return {"steps_kept": len(kept), "step_s": _median(kept, "perf/step_time"), "wall_step_s": wall,
            "train_s": _median(kept, "perf/train_time"), "rollout_wait_s": _median(kept, "rollout/wait_s"),
            "publish_s": _median(kept, "perf/publish_time"), "lag_max": max(lags) if lags else None}


def layout_figures(runs: dict[int, dict]) -> dict[str, Any]:
    """Per-η speed-ups over η = 0 (written into ``runs``), the generation time and the ceiling."""
    base = runs.get(0)
    if base is None:
        return {"generation_s": None, "ceiling": None, "speedup_of_ceiling": None}
    for run in runs.values():
        run["speedup"] = round(base["step_s"] / run["step_s"], 3)
    train, generation = base["train_s"], base["rollout_wait_s"]
    ceiling = round((train + generation) / max(train, generation), 3)
    top = runs[max(runs)]
    return {"generation_s": generation, "ceiling": ceiling, "speedup_of_ceiling": round(top["speedup"] / ceiling, 3)}


def targets(layouts: dict[str, dict]) -> dict[str, dict]:
    """Each target with its measured value and pass (None: a run it needs was not made)."""
    out: dict[str, dict] = {}
    for name, minimum in SPEEDUP_TARGETS.items():
        layout = layouts.get(name, {})
        eta2, eta0 = layout.get("eta2"), layout.get("eta0")
        speedup = eta2["speedup"] if eta2 and eta0 else None
        of_ceiling = round(speedup / layout["ceiling"], 3) if speedup is not None else None
        out[f"{name}_eta2_speedup"] = {"value": speedup, "min": minimum,
                                       "pass": None if speedup is None else speedup >= minimum}
        out[f"{name}_eta2_of_ceiling"] = {"value": of_ceiling, "min": CEILING_FRACTION,
                                          "pass": None if of_ceiling is None else of_ceiling >= CEILING_FRACTION}
    return out


# --------------------------------------------------------------------------- runs


def run_one(layout: str, staleness: int, args: argparse.Namespace, model: str, prompts: Path, work: Path,
            env: dict[str, str]) -> dict:
    """One ``asyncrl train`` (with its ``asyncrl serve`` when split) to its end; its figures."""
    import yaml

    name = f"{layout}-eta{staleness}"
    out, logs = work / "runs" / name, work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    config = work / f"{name}.yaml"
    started_load = load_avg()
    if layout == "colocated":
        config.write_text(yaml.safe_dump(run_config(args, model, prompts, out, staleness)))
        run = ChildRun(train_argv(config), env, log=logs / f"{name}.log").expect_success(args.timeout_s)
        placement: dict[str, Any] = {}
    else:
        engine_cpus, trainer_cpus = split_cpus()
        url = f"http://127.0.0.1:{free_port()}"
        weights = (Path(args.weights_root) if args.weights_root else work / "weights") / name
        weights.mkdir(parents=True, exist_ok=True)
        cfg = run_config(args, model, prompts, out, staleness, server=(url, weights))
        config.write_text(yaml.safe_dump(cfg))
        served = work / f"{name}-serve.yaml"
        served.write_text(yaml.safe_dump(serve_config(cfg)))
        with pinned(engine_cpus):
            server = ChildRun(["serve", str(served), "--port", url.rsplit(":", 1)[1], "--weights-root", str(weights)],
                              env, log=logs / f"{name}-serve.log")
        try:
            wait_for_health(url, server.proc, args.timeout_s, lambda: server.output)
            with pinned(trainer_cpus):
                run = ChildRun(train_argv(config), env, log=logs / f"{name}.log")
            run.expect_success(args.timeout_s)
        finally:
            server.signal(signal.SIGTERM)
            server.finish(timeout=30)
            if args.weights_root:  # outside the work directory (RAM, with /dev/shm): not left behind
                shutil.rmtree(weights, ignore_errors=True)
        placement = {"engine_cpus": engine_cpus, "trainer_cpus": trainer_cpus}
    figures = summarise(read_metrics(out), run.step_times, args.warmup)
    end_load = load_avg()
    figures["load_avg_1m"] = [started_load and started_load[0], end_load and end_load[0]]
    return {**figures, **placement}


def measure(args: argparse.Namespace, work: Path) -> dict:
    start_load = load_avg()
    model = "tiny" if args.model == "tiny" else str(bench_40m_dir(work / "bench-40m-hf"))
    prompts = write_prompts(work / "prompts.jsonl")
    env = child_env(compile_cache=work / "jax-cache", keep_cache=args.keep_cache)
    env.pop("ASYNCRL_API_KEY", None)  # the server runs without a key; the trainer must not send one
    layouts: dict[str, dict] = {}
    for layout in args.layouts:
        runs = {eta: run_one(layout, eta, args, model, prompts, work, env) for eta in sorted(args.staleness)}
        summary = layout_figures(runs)
        layouts[layout] = {**{f"eta{eta}": run for eta, run in runs.items()}, **summary}
    checks = targets(layouts)
    measured = [c["pass"] for c in checks.values() if c["pass"] is not None]
    import jax

    return {"bench": "async", "model": args.model, "prompts": args.prompts, "group": args.group, "new_tokens": args.new,
            "steps": args.steps, "warmup": args.warmup, "runs": layouts, "targets": checks,
            "ok": all(measured) if measured else None, "machine": machine(), "jax": jax.__version__,
            **load_avg_since(start_load)}


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--staleness", nargs="+", type=int, default=[0, 1, 2], help="max_staleness values (η)")
    parser.add_argument("--steps", type=int, default=12, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of every figure (compilation)")
    parser.add_argument("--model", default="bench-40m", choices=["bench-40m", "tiny"],
                        help="tiny: the built-in 2-layer model, to check the script in seconds")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--new", type=int, default=64, help="new tokens per completion")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--weights-root", default=None, help="split: where published weights go (default: the work directory)")
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory, removed")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per run (and per server start)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use $JAX_COMPILATION_CACHE_DIR when set instead of a cache in the work directory")
    parser.add_argument("--check", action="store_true", help="exit 1 when a measured target is missed")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be above --warmup ({args.warmup}): no step would be kept")
    if any(eta < 0 for eta in args.staleness):
        parser.error("--staleness values must be >= 0")
    if 0 not in args.staleness:
        parser.error("--staleness must include 0: every speed-up and the ceiling are against η = 0")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = measure(args, work)
    print(json.dumps(result), flush=True)
    return 1 if args.check and result["ok"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
