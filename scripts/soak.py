"""Soak test: a long RL run of the ``tiny`` model, measured from outside; prints one JSON line.

Runs ``asyncrl train`` (``--steps`` RL steps, default 2,000, on the ``copy`` task, with
evaluation and checkpoints) in a child process and samples the child's resident memory
(``VmRSS``) and OS thread count (``Threads``) from ``/proc/<pid>/status`` while it runs.
Prints::

    {"steps": 2000, "rss_mb_at_200": ..., "rss_mb_at_end": ..., "rss_growth_pct": ...,
     "threads_min": ..., "threads_max": ..., "wall_s": ..., "exit_code": 0, ...}

where the thread range covers every sample taken from step ``--from-step`` (default 200) on
(also split into the first and the second half of those steps: the rollout side runs on a
fixed pool of ``rollout.max_concurrent`` worker threads, each with one reused reward helper
thread, so a leak would raise the second half's range; evaluation still starts its own
threads while it runs),
and the run's own ``perf/host_rss_gb`` and ``perf/threads`` (in ``metrics.jsonl``) at the
same two steps are quoted beside the outside measurement. A soak passes with RSS growth under
5% between step 200 and the end, and a constant thread count.

Usage: PYTHONPATH=. python scripts/soak.py [--steps 2000] [--from-step 200] [--out runs/soak]
Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import ChildRun, child_env, read_metrics, train_argv  # noqa: E402


def soak_config(out: Path, steps: int) -> dict:
    """The soak run: tiny model, copy task, async GRPO with eval and checkpoints every 200 steps."""
    return {
        "run": {"name": "soak", "seed": 0, "total_steps": steps, "output_dir": str(out)},
        "model": {"path": "tiny"},
        "data": {"dataset": {"target": "copy", "kwargs": {"train_size": 2048, "eval_size": 32}}, "max_prompt_tokens": 16},
        "rollout": {"batch_size": 4, "group_size": 4, "max_staleness": 1, "max_concurrent": 8, "max_new_tokens": 8,
                    "length_bucket": 32},
        "engine": {"slots": 16, "kv_capacity": 32, "prefill_buckets": [16]},
        "eval": {"every_steps": 200, "max_prompts": 16},
        "checkpoint": {"every_steps": 200, "keep": 2},
        "logging": {"dump_every_steps": 100, "dump_groups": 1},
    }


def proc_status(pid: int) -> Optional[dict[str, int]]:
    """``{"rss_kb", "threads"}`` of a live process, from /proc (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a process that has exited (a zombie) has no memory
        return None
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"].split()[0])}


def last_step(metrics: Path) -> int:
    """The newest step in a metrics.jsonl that is being appended to (a torn last line is ignored)."""
    try:
        rows = read_metrics(metrics, torn_tail_ok=True)
    except OSError:
        return 0
    return int(rows[-1]["step"]) if rows else 0


def row_at(metrics: Path, step: int) -> dict:
    return next((row for row in read_metrics(metrics) if row.get("step") == step), {})


def watch(proc: subprocess.Popen, metrics: Path, from_step: int, to_step: int, poll_s: float) -> dict:
    """Sample the child until it exits: RSS when it passes ``from_step`` and ``to_step``
    (the first sample at or after each), and the thread-count range in between."""
    at_from: Optional[dict] = None
    last: Optional[dict] = None
    threads: list[tuple[int, int]] = []  # (step, thread count) of each sample
    while proc.poll() is None:
        status = proc_status(proc.pid)
        step = last_step(metrics)
        if status is not None:
            sample = {**status, "step": step}
            if step >= from_step and last is None:
                at_from = at_from or sample
                threads.append((step, status["threads"]))
            if step >= to_step:
                last = last or sample
        time.sleep(poll_s)
    return {"at_from": at_from, "last": last, "threads": threads}


def thread_range(samples: list[tuple[int, int]], start: int, stop: int) -> Optional[list[int]]:
    counts = [n for step, n in samples if start <= step < stop]
    return [min(counts), max(counts)] if counts else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--from-step", type=int, default=200)
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one, deleted after)")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between samples")
    args = parser.parse_args()

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="asyncrl-soak-")) / "run"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = out.parent / f"{out.name}-soak.yaml"
    config.write_text(yaml.safe_dump(soak_config(out, args.steps)))
    started = time.monotonic()
    # The whole console goes to a file, the last lines are kept for the report.
    run = ChildRun(train_argv(config, ["run.overwrite=true"]), child_env(), log=out.parent / f"{out.name}-console.log",
                   keep_lines=50, cwd=Path.cwd())
    try:
        seen = watch(run.proc, out / "metrics.jsonl", args.from_step, args.steps, args.poll)
    finally:
        run.finish(timeout=0 if run.proc.poll() is None else 60)
    proc, stderr = run.proc, run.output
    wall = time.monotonic() - started
    at_from, last = seen["at_from"] or {}, seen["last"] or {}
    first_row, last_row = row_at(out / "metrics.jsonl", args.from_step), row_at(out / "metrics.jsonl", args.steps)
    middle = (args.from_step + args.steps) // 2
    rss_from, rss_end = at_from.get("rss_kb", 0) / 1024, last.get("rss_kb", 0) / 1024
    result = {
        "steps": last_step(out / "metrics.jsonl"),
        "rss_mb_at_200" if args.from_step == 200 else f"rss_mb_at_{args.from_step}": round(rss_from, 1),
        "rss_step_sampled": at_from.get("step"),
        "rss_mb_at_end": round(rss_end, 1),
        "rss_end_step_sampled": last.get("step"),
        "rss_growth_pct": round(100 * (rss_end - rss_from) / rss_from, 2) if rss_from else None,
        "threads_min": min((n for _, n in seen["threads"]), default=None),
        "threads_max": max((n for _, n in seen["threads"]), default=None),
        # the range in the first and the second half of the measured steps: a leak raises the second
        "threads_first_half": thread_range(seen["threads"], args.from_step, middle),
        "threads_second_half": thread_range(seen["threads"], middle, args.steps + 1),
        "logged_host_rss_gb": [first_row.get("perf/host_rss_gb"), last_row.get("perf/host_rss_gb")],
        "logged_threads": [first_row.get("perf/threads"), last_row.get("perf/threads")],
        "wall_s": round(wall, 1),
        "exit_code": proc.returncode,
    }
    if proc.returncode != 0:
        result["stderr_tail"] = stderr[-400:]
    print(json.dumps(result))
    if not args.out:
        shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
