"""prepare_batch's validate-and-pack time of one tiny-model-sized batch.

Batch: 8 groups x 4 trajectories x ~96 tokens (32 prompt + up to 64 generated), the shape
of the ``tiny`` reference runs. The per-trajectory schema check (run in rollout threads, not
on the trainer's path) is timed too. The share is against the ~0.1 s tiny training step
of a 2-core CPU; the target is < 1 %.

    python scripts/bench.py batch [--groups 8 --group-size 4 --reps 200]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
from bench_common import load_avg, load_avg_since

from asyncrl.rollout.trajectory import Trajectory, TrajectoryGroup

TINY_STEP_S = 0.1


def make_groups(n_groups: int, group_size: int, prompt: int, max_new: int, seed: int = 0) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        trajs = []
        for i in range(group_size):
            gen = int(rng.integers(max_new // 2, max_new + 1))
            n = prompt + gen
            trajs.append(Trajectory(
                input_ids=rng.integers(4, 32, n).astype(np.int32),
                loss_mask=np.r_[np.zeros(prompt, bool), np.ones(gen, bool)],
                behavior_logprobs=np.r_[np.zeros(prompt, np.float32), -rng.uniform(0, 3, gen).astype(np.float32)],
                versions=np.r_[np.full(prompt, -1, np.int32), np.full(gen, 5, np.int32)],
                temperature=1.0, reward=float(rng.integers(0, 2)), stop_reason="eos" if gen < max_new else "length",
                metadata={"sample_id": g, "index_in_group": i},
            ))
        groups.append(TrajectoryGroup(trajectories=trajs, metadata={"sample_id": g}))
    return groups


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=200)


def run(args: argparse.Namespace) -> dict:
    from asyncrl.config import load_config
    from asyncrl.rollout.batch import prepare_batch
    from asyncrl.rollout.trajectory import check_group

    load_start = load_avg()
    cfg = load_config(data={
        "rollout": {"batch_size": args.groups, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
                    "max_staleness": 1, "length_bucket": 32},
        "data": {"max_prompt_tokens": args.prompt_tokens},
    })
    groups = make_groups(args.groups, args.group_size, args.prompt_tokens, args.max_new_tokens)
    batch, _ = prepare_batch(groups, 5, cfg)  # warm-up
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        prepare_batch(groups, 5, cfg)
        times.append(time.perf_counter() - t0)
    checks = []
    for _ in range(max(1, args.reps // 10)):
        t0 = time.perf_counter()
        for g in groups:
            check_group(g, group_size=args.group_size, workflow="bench", sample_id=0, expected_temperature=1.0)
        checks.append((time.perf_counter() - t0) / len(groups))
    median = float(np.median(times))
    return {
        "batch_shape": list(batch.input_ids.shape),
        "groups": args.groups, "group_size": args.group_size,
        "prepare_batch_median_s": round(median, 6),
        "prepare_batch_p90_s": round(float(np.percentile(times, 90)), 6),
        "share_of_tiny_step": round(median / TINY_STEP_S, 5),
        "tiny_step_s_assumed": TINY_STEP_S,
        "per_group_schema_check_s": round(float(np.median(checks)), 6),
        "reps": args.reps,
        "cpu": platform.processor() or platform.machine(),
        **load_avg_since(load_start),
    }
