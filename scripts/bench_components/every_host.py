"""Rollouts with every host generating against process 0 alone: new tokens per second.

    python scripts/bench.py every_host [--processes 2] [--cores 0,1] [--model bench-40m] [--steps 4] [--rounds 2]

The rollout side of a multi-process run: each process builds the run's engine on its own device
(one forced CPU device per process) and runs the rollout executor, the workflow and the rewards over
its share of the prompts (``Hosts.share``: a block of each step's ``--batch-size`` groups), the
copy task, ``--group-size`` completions of ``--new`` new tokens each, for ``--steps`` batches. Two
layouts of the same work on the same devices, each process pinned to a core of its own
(``os.sched_setaffinity`` before JAX starts, so the processes do not share cores):

* ``every_host``: every process generates its share of each batch, all at once;
* ``process0_only``: process 0 generates every batch alone (the others' devices train only), as a
  run whose rollouts ran on process 0 did.

Every process's engine is the same (``--slots`` slots, as ``engine.slots`` gives every host), and
the work fills them (``rollout.max_concurrent`` = slots / group size): a decode step costs the
same whatever share of the slots is busy, so an engine with half its slots idle would do the same
steps for half the tokens.

On a machine whose cores are shared with other work the split buys less; the line says how much
the same cores give at the moment: ``core_scaling`` is the control, a fixed float32 matmul loop run
once as one process on the first core and once split over the processes (each on its core), the
first's time over the second's (2.0 on two cores of their own), measured before each round.

Fields: ``*_new_tokens_per_s`` (the decode tokens of all processes over the wall time from the first
process's start to the last one's end, after an untimed round that compiles; the median of
``--rounds`` rounds, the layouts interleaved, each round's in ``*_rounds_new_tokens_per_s``),
``*_seconds`` per process, ``speedup`` (every host over process 0 alone; the target is at least 1.6 with two processes
on two cores), ``cores`` (each process's CPUs), and the shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--processes", type=int, default=2, help="processes (one device and one core each)")
    parser.add_argument("--cores", default=None,
                        help="comma-separated CPUs, one per process (default: the first --processes this process may use)")
    parser.add_argument("--model", default="bench-40m", help="bench-40m (41.6M parameters) or tiny")
    parser.add_argument("--batch-size", type=int, default=8, help="groups per batch, shared by the generating processes")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    parser.add_argument("--new", type=int, default=64, help="new tokens per completion")
    parser.add_argument("--steps", type=int, default=4, help="batches generated in the timed round")
    parser.add_argument("--slots", type=int, default=16,
                        help="engine slots of each process (the same engine on every host; rollout.max_concurrent is "
                             "slots / group size, so the work fills them)")
    parser.add_argument("--layouts", nargs="+", default=["process0_only", "every_host"],
                        choices=["process0_only", "every_host"])
    parser.add_argument("--rounds", type=int, default=2,
                        help="timed rounds of each layout, interleaved (A B A B...); the figures are their medians")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "<layout>:<process>:<core>:<sync dir>"


def run(args: argparse.Namespace) -> dict:
    if args.worker is not None:
        return worker(args)
    from bench_common import load_avg, load_avg_since

    load_start = load_avg()
    allowed = sorted(os.sched_getaffinity(0))
    cores = [int(c) for c in args.cores.split(",")] if args.cores else allowed[: args.processes]
    if len(cores) < args.processes or len(set(cores)) < args.processes:
        raise SystemExit(f"bench.py every_host: {args.processes} processes need as many cores of their own; "
                         f"this process may use {allowed} (--cores)")
    result: dict = {"processes": args.processes, "model": args.model, "batch_size": args.batch_size,
                    "group_size": args.group_size, "new_tokens": args.new, "steps": args.steps,
                    "cores": {f"process{p}": [cores[p]] for p in range(args.processes)}}
    rounds: dict[str, list[dict]] = {layout: [] for layout in args.layouts}
    controls = []
    for _ in range(args.rounds):
        controls.append(_core_scaling(cores[: args.processes]))
        for layout in args.layouts:
            rounds[layout].append(_round(args, layout, cores))
    result["core_scaling"] = sorted(controls)[len(controls) // 2]
    result["core_scaling_rounds"] = controls
    for layout, measured in rounds.items():
        median = sorted(measured, key=lambda m: m["new_tokens_per_s"])[len(measured) // 2]
        result[f"{layout}_new_tokens_per_s"] = median["new_tokens_per_s"]
        result[f"{layout}_new_tokens"] = median["new_tokens"]
        result[f"{layout}_seconds"] = median["seconds"]
        result[f"{layout}_rounds_new_tokens_per_s"] = [m["new_tokens_per_s"] for m in measured]
    if {"every_host", "process0_only"} <= set(args.layouts):
        result["speedup"] = round(result["every_host_new_tokens_per_s"] / result["process0_only_new_tokens_per_s"], 3)
    return {**result, **load_avg_since(load_start)}


_SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
import numpy as np
a = np.random.default_rng(0).random((256, 256), dtype=np.float32)
for _ in range(int(sys.argv[2])):
    a = (a @ a) * np.float32(1 / 256)
"""


def _core_scaling(cores: list[int], iterations: int = 2000) -> float:
    """The control: one process on ``cores[0]`` doing ``iterations`` matmuls, against the processes
    on ``cores`` doing an equal part each at once; the first's wall time over the second's."""
    from runlib import child_env

    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")

    def timed(parts: list[tuple[int, int]]) -> float:
        started = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(core), str(n)], env=env) for core, n in parts]
        for proc in procs:
            proc.wait(timeout=600)
        return time.perf_counter() - started

    one = timed([(cores[0], iterations)])
    split = timed([(core, iterations // len(cores)) for core in cores])
    return round(one / split, 3)


def _round(args: argparse.Namespace, layout: str, cores: list[int]) -> dict:
    """One timed round of ``layout``: its generating processes started together, pinned to their cores."""
    from runlib import REPO_ROOT, child_env

    generating = args.processes if layout == "every_host" else 1
    with tempfile.TemporaryDirectory() as sync:
        procs = []
        for p in range(generating):
            argv = [sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "every_host",
                    "--worker", f"{layout}:{p}:{cores[p]}:{sync}", "--processes", str(generating),
                    "--model", args.model, "--batch-size", str(args.batch_size), "--group-size", str(args.group_size),
                    "--new", str(args.new), "--steps", str(args.steps), "--slots", str(args.slots)]
            env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                          cwd=REPO_ROOT))
        outputs = [proc.communicate(timeout=3600) for proc in procs]
    for p, (proc, (_, err)) in enumerate(zip(procs, outputs)):
        if proc.returncode != 0:
            raise RuntimeError(f"bench.py every_host: {layout} process {p} failed:\n{err[-4000:]}")
    measured = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    wall = max(m["end"] for m in measured) - min(m["start"] for m in measured)
    tokens = sum(m["new_tokens"] for m in measured)
    return {"new_tokens_per_s": round(tokens / wall, 1), "new_tokens": tokens,
            "seconds": [round(m["end"] - m["start"], 3) for m in measured]}


def worker(args: argparse.Namespace) -> dict:
    """One generating process: pinned to its core, its share of ``--steps`` batches, timed from the
    moment every generating process is ready (files in the sync directory)."""
    layout, process, core, sync = args.worker.split(":", 3)
    os.sched_setaffinity(0, {int(core)})  # before JAX starts its thread pools
    from bench_common import bench_40m_dir

    from asyncrl.config import load_config
    from asyncrl.data import SampleOrder
    from asyncrl.model import load_model
    from asyncrl.rollout.executor import WorkflowExecutor
    from asyncrl.rollout.ledger import process_share
    from asyncrl.run.build import build_local_engine, build_task_and_workflow

    path = "tiny" if args.model == "tiny" else str(bench_40m_dir(Path(tempfile.gettempdir()) / "asyncrl-bench-40m"))
    prompt = 16
    cfg = load_config(data={
        "model": {"path": path}, "data": {"dataset": {"target": "copy", "kwargs": {"min_digits": 3, "max_digits": 3}},
                                          "max_prompt_tokens": prompt},
        "rollout": {"batch_size": args.batch_size, "group_size": args.group_size, "max_new_tokens": args.new,
                    "temperature": 1.0,
                    "max_concurrent": max(1, args.slots // args.group_size)},
        "engine": {"slots": args.slots, "kv_capacity": prompt + args.new, "prefill_buckets": [prompt], "tensor_parallel": 1},
    })
    loaded = load_model(cfg.model)
    cfg, task, workflow = build_task_and_workflow(cfg, loaded.tokenizer)
    graphdef, params = loaded.split()
    engine = build_local_engine(cfg, graphdef, params, loaded.stop_token_ids)
    share = process_share(args.batch_size, int(process), args.processes)
    try:
        def generate(steps: int, seed_offset: int) -> int:
            """``steps`` batches of this process's share, every episode admitted at once and none more
            (``max_staleness`` steps - 1), so nothing is left running after the last batch."""
            before = engine.metrics()["engine/decode_tokens"]
            order = SampleOrder(task.train, cfg.run.seed + seed_offset)
            rollout = cfg.rollout.model_copy(update={"max_staleness": steps - 1})
            executor = WorkflowExecutor(workflow, engine, order, cfg.model_copy(update={"rollout": rollout}),
                                        share=share).start()
            try:
                for _ in range(steps):
                    executor.next_batch(0, timeout=3600)
            finally:
                executor.close()
            return int(engine.metrics()["engine/decode_tokens"] - before)

        generate(1, 1)  # untimed: compiles every program the timed round runs
        Path(sync, f"ready{process}").touch()
        while len(list(Path(sync).glob("ready*"))) < args.processes:
            time.sleep(0.01)
        start = time.time()
        tokens = generate(args.steps, 0)
        end = time.time()
    finally:
        engine.shutdown()
    return {"layout": layout, "process": int(process), "start": start, "end": end, "new_tokens": tokens}
