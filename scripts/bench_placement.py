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
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYOUTS = {
    "colocated": [],  # the default: trainer mesh on all devices, the engine on the trainer's arrays
    "colocated_half": ["placement.trainer=0:{half}", "mesh.fsdp=2"],  # both on the first half
    "split": ["placement.trainer=0:{half}", "placement.engine={half}:{all}", "mesh.fsdp=2",
              "engine.tensor_parallel=2"],  # trainer on the first half, a 2-way tensor-parallel engine on the rest
}

METRICS = ("perf/step_time", "perf/train_time", "perf/gen_tokens_per_s", "perf/publish_time")

CHILD = """
import io, sys
from asyncrl.config import load_config
from asyncrl.run.loop import train
train(load_config(sys.argv[1], sys.argv[2:]), console=io.StringIO())
"""


def run_layout(name: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    overrides = [o.format(half=args.devices // 2, all=args.devices) for o in LAYOUTS[name]]
    overrides += ["stages=[]", f"run.total_steps={args.steps}", f"rollout.max_staleness={args.max_staleness}",
                  "eval.every_steps=0", "checkpoint.every_steps=0", "logging.dump_every_steps=0",
                  f"run.output_dir={out / name}"]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, str(REPO / "configs" / "quickstart.yaml"), *overrides],
                   env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if row.get("step", 0) > 2]
    result = {m.split("/")[1]: round(statistics.median(row[m] for row in rows), 4) for m in METRICS}
    return {**result, "wall_s": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_layout(name, args, Path(tmp)) for name in args.layouts}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(json.dumps({"devices": args.devices, "steps": args.steps, "max_staleness": args.max_staleness,
                      "load_avg_1m": load, **results}))


if __name__ == "__main__":
    main()
