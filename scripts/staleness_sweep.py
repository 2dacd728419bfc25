"""Measure what ``rollout.max_staleness`` buys: one training run per setting, one JSON line each.

    python scripts/staleness_sweep.py                       # the quickstart at max_staleness 0 1 2 4
    python scripts/staleness_sweep.py --staleness 0 2 --set stages.1.total_steps=100

Each setting runs ``asyncrl train CONFIG`` in a fresh process (same seed, same config
otherwise) into ``OUT/eta<k>/`` and is summarised from its ``metrics.jsonl``:

  trained_tokens_per_s  trained (loss-mask) tokens of the RL stage / the RL stage's step time
  rl_time_s             sum of the RL steps' ``perf/step_time`` (batch wait + train + publish)
  final_eval_reward     the last ``eval/reward`` (greedy, held-out prompts)
  lag_max, lag_mean     version lag of trained tokens, over the RL steps
  dropped_stale         groups dropped by the staleness filter (0 with batch_order: admission)
  wait_s_mean           mean time ``executor.next_batch`` waited for rollouts per step
  engine_busy           share of the RL steps' time the engine spent decoding (eval excluded)
  loadavg_1m_start/end  ``os.getloadavg()`` around the run: other work on the machine skews timings

Timings depend on the machine and on what else runs on it; compare settings from one sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def summarise(metrics_path: Path) -> dict:
    """The sweep's numbers from one run's ``metrics.jsonl`` (RL rows only)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
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
    command = [
        sys.executable, "-m", "asyncrl.cli", "train", str(Path(config).resolve()),
        "--set", f"rollout.max_staleness={eta}", "--set", f"run.output_dir={run_dir}", "--set", "run.overwrite=true",
    ]
    for item in extra:
        command += ["--set", item]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"max_staleness={eta}: training failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return {
        "max_staleness": eta,
        **summarise(run_dir / "metrics.jsonl"),
        "wall_s": round(wall, 1),
        "loadavg_1m_start": round(load_start, 2),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml", help="the config every setting starts from")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="max_staleness values to run")
    parser.add_argument("--out", default="runs/staleness_sweep", help="parent directory of the runs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="extra config override for every run (repeatable)")
    args = parser.parse_args(argv)
    if any(eta < 0 for eta in args.staleness):
        parser.error("--staleness: values must be >= 0")
    for eta in args.staleness:
        print(json.dumps(run_one(args.config, eta, Path(args.out), args.overrides)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
