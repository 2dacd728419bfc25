"""Prefix reuse on real runs: prompt tokens the engine computes per generated token, and its
seconds per RL step, with ``engine.prefix_cache`` on against off, same seeds.

    python scripts/bench.py prefix [--runs agent multi_turn] [--rl-steps 8]

Two training runs per workload, each ``asyncrl train`` in a process of its own, on the CPU:

* ``agent``: ``configs/calculator_agent.yaml`` (the OpenAI-SDK calculator agent on tiny-qwen3: every
  call sends the whole conversation, its ~340-token tools block first), 5 SFT steps then
  ``--rl-steps`` RL steps;
* ``multi_turn``: ``configs/gsm8k_grpo.yaml`` with ``workflow: multi_turn`` (GSM8K with calculator
  calls; a group's 4 trajectories are ``n = 1`` requests on one prompt) in the recipe's CPU smoke
  shape (``tiny-qwen3``), ``--rl-steps`` RL steps.

Fields per run ``{workload}_{on,off}``, over its RL steps after the first two (whose programs
compile on first use; from ``metrics.jsonl``'s cumulative engine counters): ``prefill_per_generated`` (``engine/prefill_tokens``
over ``engine/decode_tokens``), ``hit_rate`` (``engine/prefix_hit_rate`` of those steps),
``engine_s_per_step`` (``engine/prefill_s + engine/decode_s`` per step) and ``prefill_s_per_step``.
``{workload}_prefill_reduction`` is off's prefill tokens per generated token over on's (the
targets: at least 5 for the agent, 2 for the multi-turn run), ``{workload}_engine_time_ratio``
on's engine seconds per step over off's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

SFT_STEPS = 5
WORKLOADS = {
    "agent": ("configs/calculator_agent.yaml", lambda rl: [f"stages.0.total_steps={SFT_STEPS}", f"stages.1.total_steps={rl}"]),
    "multi_turn": ("configs/gsm8k_grpo.yaml", lambda rl: [
        "model.path=tiny-qwen3", "model.compute_dtype=float32", "model.remat=false", "rollout.batch_size=4",
        "rollout.group_size=4", "rollout.max_new_tokens=256", "engine.slots=32", "engine.kv_capacity=640",
        "optim.micro_batches=1", "eval.every_steps=0", "workflow=multi_turn", f"run.total_steps={rl}"]),
}
COUNTERS = ("engine/prefill_tokens", "engine/prefix_hit_tokens", "engine/decode_tokens", "engine/prefill_s",
            "engine/decode_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rl-steps", type=int, default=8, help="RL steps of each run (the first two are not counted)")


def run(args: argparse.Namespace) -> dict:
    from bench_common import load_avg, load_avg_since
    from runlib import REPO_ROOT, child_env, read_metrics, run_train, train_argv

    load_start = load_avg()
    result: dict = {"rl_steps": args.rl_steps}
    work = Path(tempfile.mkdtemp(prefix="asyncrl-bench-prefix-"))
    env = child_env(compile_cache=work / "jax-cache", JAX_PLATFORMS="cpu")
    for workload in args.runs:
        config, overrides = WORKLOADS[workload]
        for reuse in ("on", "off"):
            out = work / f"{workload}-{reuse}"
            sets = [*overrides(args.rl_steps), f"engine.prefix_cache.enabled={reuse == 'on'}", "checkpoint.every_steps=0",
                    "logging.dump_every_steps=0", f"run.output_dir={out}"]
            run_train(train_argv(REPO_ROOT / config, sets), env, timeout=3600)
            result.update({f"{workload}_{reuse}_{k}": v for k, v in rl_figures(read_metrics(out)).items()})
        on, off = (result[f"{workload}_{r}_prefill_per_generated"] for r in ("on", "off"))
        result[f"{workload}_prefill_reduction"] = round(off / on, 2) if on else None
        result[f"{workload}_engine_time_ratio"] = round(result[f"{workload}_on_engine_s_per_step"]
                                                        / result[f"{workload}_off_engine_s_per_step"], 3)
    return {**result, **load_avg_since(load_start)}


def rl_figures(rows: list[dict], skip: int = 2) -> dict:
    """The share of the engine's cumulative counters of the RL steps after the first ``skip`` (whose
    programs compile on first use; rows of one run's metrics.jsonl)."""
    counted = [row for row in rows if all(name in row for name in COUNTERS)]
    rl = [row for row in counted if row.get("stage", "rl") == "rl"]
    if len(rl) <= skip:
        raise ValueError(f"bench.py prefix: {len(rl)} RL steps logged; give --rl-steps > {skip}")
    start, end = rl[skip - 1], rl[-1]
    delta = {name: end[name] - start[name] for name in COUNTERS}
    steps = len(rl) - skip
    computed = delta["engine/prefill_tokens"]
    reused = delta["engine/prefix_hit_tokens"]
    return {
        "prefill_per_generated": round(computed / max(delta["engine/decode_tokens"], 1), 3),
        "hit_rate": round(reused / (computed + reused), 3) if computed + reused else 0.0,
        "engine_s_per_step": round((delta["engine/prefill_s"] + delta["engine/decode_s"]) / steps, 3),
        "prefill_s_per_step": round(delta["engine/prefill_s"] / steps, 3),
    }
