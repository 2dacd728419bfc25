"""SFT learning curves on the synthetic tasks: greedy exact match on held-out prompts vs
SFT steps and seconds, for several tasks and seeds, on the ``tiny`` model (CPU).

    PYTHONPATH=. python scripts/sft_demo.py --tasks copy reverse --seeds 0 1 2 --steps 300

Prints one JSON line: per task and seed the curve ``[{step, train_s, exact_match,
eval_loss}]`` (``train_s`` counts SFT steps only, not evals; the first step includes its
compilation), the first step reaching exact match >= 0.5, and the median SFT step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.config import load_config  # noqa: E402
from asyncrl.model import load_model  # noqa: E402
from asyncrl.rollout.rewards import RewardFunction  # noqa: E402
from asyncrl.rollout.workflow import SingleTurnWorkflow  # noqa: E402
from asyncrl.run.sft import SFTData, eval_loss  # noqa: E402
from asyncrl.trainer import Trainer  # noqa: E402
from tests.sft_helpers import greedy_exact_match  # noqa: E402
from workflows.synthetic import exact_match, synthetic_task  # noqa: E402


def run(task_name: str, seed: int, args: argparse.Namespace) -> dict:
    cfg = load_config(None, [
        f"run.seed={seed}", f"sft.batch_size={args.batch_size}", f"optim.lr={args.lr}",
        "rollout.length_bucket=16", "rollout.max_new_tokens=8", "data.max_prompt_tokens=16",
    ])
    loaded = load_model(f"tiny:seed={seed}")
    task = synthetic_task(task_name, seed=seed, min_digits=2, max_digits=4, eval_size=args.eval_size)
    workflow = SingleTurnWorkflow(cfg, loaded.tokenizer, rewards=[RewardFunction(exact_match)])
    graphdef, params = loaded.split()
    trainer = Trainer(cfg, graphdef, params, objective="sft")
    eos = loaded.stop_token_ids[0]
    train = SFTData.for_task(task, workflow, cfg, eos_token_id=eos, row_multiple=trainer.row_multiple)
    held_out = SFTData.for_task(task, workflow, cfg, split="eval", eos_token_id=eos, row_multiple=trainer.row_multiple)

    def point(step: int, train_s: float) -> dict:
        em = greedy_exact_match(graphdef, trainer.params, trainer.model_cfg, workflow, task.eval,
                                max_new_tokens=6, stop_token_ids=loaded.stop_token_ids)
        return {"step": step, "train_s": round(train_s, 2), "exact_match": em,
                "eval_loss": round(eval_loss(trainer, held_out)["eval/loss"], 4)}

    curve, step_times, train_s = [point(0, 0.0)], [], 0.0
    for step in range(1, args.steps + 1):
        batch = train.next_batch().batch
        start = time.perf_counter()
        trainer.step(batch)
        elapsed = time.perf_counter() - start
        train_s += elapsed
        step_times.append(elapsed)
        if step % args.eval_every == 0 or step == args.steps:
            curve.append(point(step, train_s))
    first = next((p for p in curve if p["exact_match"] >= 0.5), None)
    return {
        "task": task_name, "seed": seed, "curve": curve,
        "first_step_em_0.5": first["step"] if first else None,
        "train_s_to_em_0.5": first["train_s"] if first else None,
        "final_exact_match": curve[-1]["exact_match"],
        "median_step_s": statistics.median(step_times[1:]),
        "first_step_s": step_times[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["copy", "reverse"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-size", type=int, default=64)
    args = parser.parse_args()
    started = time.perf_counter()
    runs = [run(task, seed, args) for task in args.tasks for seed in args.seeds]
    print(json.dumps({
        "bench": "sft_demo", "model": "tiny", "batch_size": args.batch_size, "lr": args.lr, "steps": args.steps,
        "median_step_s": statistics.median(r["median_step_s"] for r in runs),
        "wall_s": round(time.perf_counter() - started, 1), "runs": runs,
    }))


if __name__ == "__main__":
    main()
