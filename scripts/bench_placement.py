"""Colocated vs split placement on forced CPU devices: step time, train time, generated tokens/s
and publish time of the quickstart's RL stage (random-init ``tiny``, no SFT warm start).

    python scripts/bench_placement.py                      # 8 devices, 30 steps per layout
    python scripts/bench_placement.py --steps 6 --devices 8

Each layout runs in its own subprocess with ``--xla_force_host_platform_device_count`` (set
before JAX starts); figures are medians over the steps after the first two (compilation), read
from the run's ``metrics.jsonl``. Prints one JSON line. On a CPU host all "devices" share the
same cores, so a split placement is not expected to be faster here: this measures what the
placement costs (publish across devices, the engine's collectives), not what it buys on
accelerators.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import load_avg, load_avg_since  # noqa: E402
from runlib import REPO_ROOT, child_env, read_metrics, run_train, train_argv  # noqa: E402

LAYOUTS = {
    "colocated": [],  # the default: trainer mesh on all devices, the engine on the trainer's arrays
    "colocated_half": ["placement.trainer=0:{half}", "mesh.fsdp=2"],  # both on the first half
    "split": ["placement.trainer=0:{half}", "placement.engine={half}:{all}", "mesh.fsdp=2",
              "engine.tensor_parallel=2"],  # trainer on the first half, a 2-way tensor-parallel engine on the rest
}

METRICS = ("perf/step_time", "perf/train_time", "perf/gen_tokens_per_s", "perf/publish_time")


def run_layout(name: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    overrides = [o.format(half=args.devices // 2, all=args.devices) for o in LAYOUTS[name]]
    overrides += ["stages=[]", f"run.total_steps={args.steps}", f"rollout.max_staleness={args.max_staleness}",
                  "eval.every_steps=0", "checkpoint.every_steps=0", "logging.dump_every_steps=0",
                  f"run.output_dir={out / name}"]
    env = child_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}", JAX_PLATFORMS="cpu")
    started = time.perf_counter()
    run_train(train_argv(REPO_ROOT / "configs" / "quickstart.yaml", overrides), env, timeout=3600)
    wall = time.perf_counter() - started
    rows = [row for row in read_metrics(out / name) if row.get("step", 0) > 2]
    result = {m.split("/")[1]: round(statistics.median(row[m] for row in rows), 4) for m in METRICS}
    return {**result, "wall_s": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    load_start = load_avg()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_layout(name, args, Path(tmp)) for name in args.layouts}
    print(json.dumps({"bench": "placement", "devices": args.devices, "steps": args.steps,
                      "max_staleness": args.max_staleness, **results, **load_avg_since(load_start)}))


if __name__ == "__main__":
    main()
