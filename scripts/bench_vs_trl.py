"""asyncrl's synchronous GRPO step against TRL's ``GRPOTrainer`` on the same work; prints one JSON line.

One random-init model directory (the ``bench-40m`` shape as a llama-layout Hugging Face
directory, :func:`bench_common.bench_40m_dir`) and one prompt set (3-digit copy prompts, one user
message each, the same chat template) are trained on by both, with identical settings:
``--prompts`` prompts x ``--group`` completions per step, ``--new`` new tokens, temperature 1
(no top-k/top-p), AdamW at a constant ``--lr``, no KL term (TRL ``beta=0``, no reference
model), one update per step, the ``positional_match`` reward, float32 on the CPU; TRL's
gradient checkpointing off. asyncrl runs ``asyncrl train`` twice per round: with
``max_staleness: 0`` (its synchronous step, the same on-policy work as TRL's) and with
``max_staleness: --async-staleness`` (default 2: generation overlaps training, batches up to 2
versions old). Each run is its own subprocess (torch and jax never share one), interleaved
``--rounds`` times (asyncrl, asyncrl async, TRL, asyncrl, ...) so that drifting load hits all
alike.

Fields: ``asyncrl_step_s`` / ``trl_step_s`` (median step wall time over steps 2..N of every
round: asyncrl's ``perf/step_time``, i.e. batch wait + train + publish; TRL's time between
``on_step_end`` callbacks, i.e. generate + score + train), ``speedup`` (TRL's over asyncrl's:
above 1 means asyncrl is faster), ``asyncrl_train_s`` (median ``perf/train_time``),
``*_first_step_s`` (subprocess start to the first step done, per round): all at
``max_staleness: 0``; ``asyncrl_async``: the same four for ``max_staleness: --async-staleness``
(its ``speedup`` also TRL's step over it), with ``max_staleness``; the versions, and
``load_avg`` (before and after). ``--async-staleness 0`` leaves the asynchronous runs out.

TRL is an optional extra (``pip install -e '.[compare]'``); ``--dry-run`` writes the prompts
and prints the two configurations (the asyncrl one validated) without building the model,
importing TRL or running anything (what the tests run).

Usage: PYTHONPATH=. python scripts/bench_vs_trl.py [--steps 6] [--rounds 2] [--prompts 8] [--group 4] [--new 64]
       [--lr 1e-5] [--async-staleness 2] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import bench_40m_dir, load_avg, load_avg_since  # noqa: E402
from runlib import REPO_ROOT, child_env, read_metrics, run_train, train_argv  # noqa: E402


def write_prompts(path: Path, count: int = 512, seed: int = 0) -> Path:
    """``count`` copy prompts (``C:482`` -> ``482``) as JSONL with ``prompt`` and ``answer``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        rows.append(json.dumps({"prompt": f"C:{digits}", "answer": digits}))
    path.write_text("\n".join(rows) + "\n")
    return path


def asyncrl_config(args: argparse.Namespace, model_dir: Path, prompts: Path, out: Path) -> dict:
    slots = args.prompts * args.group
    return {
        "run": {"name": "vs-trl", "output_dir": str(out), "total_steps": args.steps, "seed": 0, "overwrite": True},
        "model": {"path": str(model_dir)},
        "data": {"dataset": {"target": "jsonl", "kwargs": {"path": str(prompts), "prompt_field": "prompt",
                                                           "answer_field": "answer"}},
                 "max_prompt_tokens": 16},
        "rewards": [{"fn": "positional_match"}],
        # length_bucket 8: TRL pads each batch to its longest sequence, asyncrl to a multiple of the
        # bucket (64 by default, capped by max_seq_len = 16 + new): 72 positions here instead of 80,
        # so both train the same positions. The default bucket bounds recompilation when lengths vary.
        "rollout": {"batch_size": args.prompts, "group_size": args.group, "max_staleness": 0, "max_new_tokens": args.new,
                    "temperature": 1.0, "max_concurrent": args.prompts, "length_bucket": 8},
        "engine": {"slots": slots, "kv_capacity": 16 + args.new, "prefill_buckets": [16], "decode_chunk": 8},
        "optim": {"lr": args.lr, "schedule": "constant", "warmup_steps": 0},
        "algo": {"kl_coef": 0.0, "ppo_epochs": 1, "mini_batches": 1},
        "eval": {"every_steps": 0},
        "checkpoint": {"every_steps": 0, "keep": 1},
        "logging": {"dump_every_steps": 0},
    }


def trl_config(args: argparse.Namespace, out: Path) -> dict:
    """GRPOConfig keyword arguments matching :func:`asyncrl_config`."""
    return {
        "output_dir": str(out), "max_steps": args.steps, "per_device_train_batch_size": args.prompts * args.group,
        "gradient_accumulation_steps": 1, "steps_per_generation": 1, "num_generations": args.group,
        "num_iterations": 1, "max_completion_length": args.new, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
        "learning_rate": args.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.01,
        "max_grad_norm": 1.0, "beta": 0.0, "gradient_checkpointing": False, "bf16": False, "use_cpu": True,
        "logging_steps": 1, "report_to": [], "save_strategy": "no", "seed": 0, "disable_dropout": True,
        "log_completions": False, "dataloader_num_workers": 0,
    }


# --------------------------------------------------------------------------- the two runs


def run_asyncrl(config_path: Path, out: Path, env: dict[str, str], steps: int, staleness: int = 0) -> dict:
    """One ``asyncrl train`` of the config at ``rollout.max_staleness: staleness``; its step figures."""
    times = run_train(train_argv(config_path, [f"rollout.max_staleness={staleness}"]), env, timeout=3600).step_times
    window = [row for row in read_metrics(out) if 2 <= row["step"] <= steps]
    return {"first_step_s": times[1], "step_s": [row["perf/step_time"] for row in window],
            "train_s": [row["perf/train_time"] for row in window]}


def run_trl(plan: dict, env: dict[str, str]) -> dict:
    """This script's ``--trl-child`` in a subprocess; returns its JSON result."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--trl-child", json.dumps(plan)], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"the TRL run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["first_step_s"] = result["first_step_since_import_s"] + result["import_s"] + (
        time.perf_counter() - start - result["total_s"])  # the interpreter's own start-up, as for asyncrl
    return result


def trl_child(plan: dict) -> None:
    """GRPOTrainer on the plan's model and prompts; prints the step end times as JSON."""
    started = time.perf_counter()
    import pyarrow as pa
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO_ROOT))
    from workflows.synthetic import positional_match

    imported = time.perf_counter()
    rows = [json.loads(line) for line in Path(plan["prompts"]).read_text().splitlines()]
    # An explicit fingerprint: datasets 5.2 cannot hash the table of pyarrow >= 24 itself (PicklingError
    # on pyarrow's MonthDayNano), which Dataset.from_list would try.
    table = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])
    dataset = Dataset(table, fingerprint="bench-vs-trl-prompts")

    def reward(prompts: Any, completions: Any, answer: list[str], **_: Any) -> list[Optional[float]]:  # TRL: None = no score
        return [positional_match("", c[0]["content"], a) for c, a in zip(completions, answer)]

    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

    model = AutoModelForCausalLM.from_pretrained(plan["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(plan["model_dir"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**plan["trl"]), train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    trainer.train()
    import trl

    print(json.dumps({"import_s": imported - started, "first_step_since_import_s": ends[0] - imported,
                      "step_s": [b - a for a, b in zip(ends, ends[1:])], "total_s": time.perf_counter() - started,
                      "trl": trl.__version__, "torch": torch.__version__, "torch_threads": torch.get_num_threads()}))


# --------------------------------------------------------------------------- main


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run (medians over steps 2..N)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved asyncrl/TRL pairs")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--new", type=int, default=64, help="new tokens per completion")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--async-staleness", type=int, default=2,
                        help="max_staleness of the asynchronous asyncrl runs (0: none, only the synchronous one)")
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--dry-run", action="store_true", help="build the inputs, print both configs, run nothing")
    parser.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the medians are over steps 2..N)")
    if args.async_staleness < 0:
        parser.error("--async-staleness must be >= 0")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse(argv)
    if args.trl_child is not None:
        trl_child(json.loads(args.trl_child))
        return
    import yaml

    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        # The dry run checks the configs only: building the 41.6M-parameter directory takes ~10 s.
        model_dir = work / "bench-40m-hf" if args.dry_run else bench_40m_dir(work / "bench-40m-hf")
        prompts = write_prompts(work / "prompts.jsonl")
        out = work / "asyncrl-run"
        config_path = work / "asyncrl.yaml"
        config_path.write_text(yaml.safe_dump(asyncrl_config(args, model_dir, prompts, out)))
        plan = {"model_dir": str(model_dir), "prompts": str(prompts), "trl": trl_config(args, work / "trl-run")}
        if args.dry_run:
            from asyncrl.config import load_config

            load_config(str(config_path))  # the asyncrl side's config is valid
            print(json.dumps({"bench": "vs_trl", "dry_run": True, "asyncrl": yaml.safe_load(config_path.read_text()),
                              "async_staleness": args.async_staleness, "trl": plan["trl"]}))
            return
        print(json.dumps(compare(args, config_path, out, plan, work)))


def compare(args: argparse.Namespace, config_path: Path, out: Path, plan: dict, work: Path) -> dict:
    start_load = load_avg()
    env = child_env(compile_cache=work / "jax-cache")
    ours: list[dict] = []
    ours_async: list[dict] = []
    theirs: list[dict] = []
    for _ in range(args.rounds):
        ours.append(run_asyncrl(config_path, out, env, args.steps))
        if args.async_staleness:
            ours_async.append(run_asyncrl(config_path, out, env, args.steps, staleness=args.async_staleness))
        theirs.append(run_trl(plan, env))
    trl_step = statistics.median(s for run in theirs for s in run["step_s"])
    sync = asyncrl_figures(ours, trl_step)
    import jax

    return {
        "bench": "vs_trl", "prompts": args.prompts, "group": args.group, "new_tokens": args.new, "steps": args.steps,
        "rounds": args.rounds, "asyncrl_step_s": sync["step_s"], "trl_step_s": round(trl_step, 3),
        "speedup": sync["speedup"], "asyncrl_train_s": sync["train_s"], "asyncrl_first_step_s": sync["first_step_s"],
        "asyncrl_async": ({"max_staleness": args.async_staleness, **asyncrl_figures(ours_async, trl_step)}
                          if ours_async else None),
        "trl_first_step_s": [round(run["first_step_s"], 2) for run in theirs],
        "trl": theirs[0]["trl"], "torch": theirs[0]["torch"], "torch_threads": theirs[0]["torch_threads"],
        "jax": jax.__version__, "cpu_count": os.cpu_count(), **load_avg_since(start_load),
    }


def asyncrl_figures(runs: list[dict], trl_step: float) -> dict:
    """Medians over every round's steps 2..N of one asyncrl setting, and TRL's step over its step."""
    step = statistics.median(s for run in runs for s in run["step_s"])
    return {"step_s": round(step, 3), "speedup": round(trl_step / step, 3),
            "train_s": round(statistics.median(s for run in runs for s in run["train_s"]), 3),
            "first_step_s": [round(run["first_step_s"], 2) for run in runs]}


if __name__ == "__main__":
    main()
