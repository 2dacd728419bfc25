"""Measure what ``rollout.max_staleness`` buys: one training run per setting, one JSON line each.

    python scripts/staleness_sweep.py                       # the quickstart at max_staleness 0 1 2 4
    python scripts/staleness_sweep.py --staleness 0 2 --set stages.1.total_steps=100
    python scripts/staleness_sweep.py --staleness 0 1 2 --plot rewards.png   # and the reward curves of the runs

Each setting runs ``asyncrl train CONFIG`` in a fresh process (same seed, same config
otherwise) into ``OUT/eta<k>/`` and is summarised from its ``metrics.jsonl``:

  trained_tokens_per_s  trained (loss-mask) tokens of the RL stage / the RL stage's step time
  rl_time_s             sum of the RL steps' ``perf/step_time`` (batch wait + train + publish)
  final_eval_reward     the last ``eval/reward`` (greedy, held-out prompts)
  lag_max, lag_mean     version lag of trained tokens, over the RL steps
  dropped_stale         groups dropped by the staleness filter (0 with batch_order: admission)
  wait_s_mean           mean time ``executor.next_batch`` waited for rollouts per step
  engine_busy           share of the RL steps' time the engine spent decoding (eval excluded)
  load_avg              the load averages at the run's start and end: other work on the machine skews timings

Timings depend on the machine and on what else runs on it; compare settings from one sweep.
``--plot PNG`` draws the runs' training and eval reward against the step, one line per setting
(``plot_metrics.py``'s comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import load_avg, load_avg_since  # noqa: E402
from runlib import ChildRun, child_env, read_metrics, train_argv  # noqa: E402


def summarise(metrics_path: Path) -> dict:
    """The sweep's numbers from one run's ``metrics.jsonl`` (RL rows only)."""
    rows = read_metrics(metrics_path)
    rl = [r for r in rows if r.get("stage", "rl") == "rl" and r.get("perf/step_time") is not None]
    if not rl:
        raise SystemExit(f"{metrics_path}: no RL steps recorded (is there a stage named 'rl'?)")
    step_time = sum(r["perf/step_time"] for r in rl)
    tokens = sum(r["perf/trained_tokens_per_s"] * r["perf/step_time"] for r in rl)
    evals = [r["eval/reward"] for r in rows if r.get("eval/reward") is not None]
    return {
        "rl_steps": len(rl),
        "trained_tokens_per_s": round(tokens / step_time, 1),
        "rl_time_s": round(step_time, 2),
        "final_eval_reward": round(evals[-1], 4) if evals else None,
        "lag_max": max(r.get("rollout/lag_max", 0.0) for r in rl),
        "lag_mean": round(sum(r.get("rollout/lag_mean", 0.0) for r in rl) / len(rl), 3),
        "dropped_stale": rl[-1].get("rollout/dropped_stale", 0.0),
        "wait_s_mean": round(sum(r.get("rollout/wait_s", 0.0) for r in rl) / len(rl), 4),
        "engine_busy": engine_busy(rl),
    }


def engine_busy(rl: list[dict]) -> float | None:
    """Share of the RL steps' time the engine spent decoding. ``engine/decode_s`` is cumulative and
    sampled after each step's publish, before that step's eval: a step whose predecessor ran eval
    also holds the eval's decoding, so those steps are left out."""
    decoding = stepping = 0.0
    for prev, row in zip(rl, rl[1:]):
        if "eval/reward" in prev or "engine/decode_s" not in prev or "engine/decode_s" not in row:
            continue
        decoding += row["engine/decode_s"] - prev["engine/decode_s"]
        stepping += row["perf/step_time"]
    return round(decoding / stepping, 3) if stepping else None


def run_one(config: str, eta: int, out: Path, extra: list[str]) -> dict:
    # The child runs in the repository root: paths the caller gave are resolved against the caller's cwd.
    run_dir = (out / f"eta{eta}").resolve()
    argv = train_argv(Path(config).resolve(), [f"rollout.max_staleness={eta}", f"run.output_dir={run_dir}",
                                               "run.overwrite=true", *extra])
    load_start = load_avg()
    start = time.perf_counter()
    run = ChildRun(argv, child_env())
    code = run.finish(timeout=None)
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"max_staleness={eta}: training failed (exit {code}):\n{run.output[-4000:]}")
    return {
        "max_staleness": eta,
        **summarise(run_dir / "metrics.jsonl"),
        "wall_s": round(wall, 1),
        **load_avg_since(load_start),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml", help="the config every setting starts from")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="max_staleness values to run")
    parser.add_argument("--out", default="runs/staleness_sweep", help="parent directory of the runs")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="after the runs, draw their reward curves (one line per setting) into PNG")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="extra config override for every run (repeatable)")
    args = parser.parse_args(argv)
    if any(eta < 0 for eta in args.staleness):
        parser.error("--staleness: values must be >= 0")
    for eta in args.staleness:
        print(json.dumps(run_one(args.config, eta, Path(args.out), args.overrides)), flush=True)
    if args.plot is not None:
        plot_rewards(Path(args.out), args.staleness, args.plot)
    return 0


def plot_rewards(out: Path, staleness: list[int], png: Path) -> dict[str, dict[str, int]]:
    """The sweep's runs in ``out`` drawn against each other (reward and eval reward by step); the
    points drawn per run and series."""
    from plot_metrics import plot_compare

    runs = [(f"max_staleness {eta}", read_metrics(out / f"eta{eta}" / "metrics.jsonl")) for eta in staleness]
    return plot_compare(runs, png, "the quickstart's reward by step at each max_staleness (one seed each)")


if __name__ == "__main__":
    raise SystemExit(main())
