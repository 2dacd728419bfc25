"""A Qwen2.5-0.5B-shaped GRPO run on this machine, end to end; prints one JSON line.

    PYTHONPATH=. python scripts/real_shape_run.py --out runs/qwen-shaped

What it does, each stage timed:

1. writes a random-init model of Qwen2.5-0.5B's exact configuration and the project's offline
   tokenizer (``scripts/make_qwen_shaped.py``) into ``OUT/model``;
2. plans ``configs/gsm8k_grpo_qwen2.5_0.5b.yaml`` with :data:`OVERRIDES` (bfloat16 weights, one
   prompt of two completions per step, short completions; ``asyncrl plan``'s trainer and
   engine figures);
3. ``asyncrl train`` (in-process engine) with a synchronous checkpoint after every step, SIGKILLed
   as soon as step 2's checkpoint is in place (during step 3), then ``asyncrl train --resume``
   to step 3 (checks: steps 1, 2, 3 each logged once);
4. restores the last checkpoint's arrays here (Orbax) and times it;
5. ``asyncrl eval`` of the run's ``hf/`` export and ``asyncrl export`` of the run;
6. loads the export with transformers (float32 compute) and with asyncrl, and compares logits.

Figures: ``peak_rss_gb`` (the largest resident set of the train processes, from the kernel's
high-water marks), ``ttfs_s`` (process start to step 1's line; cold and resumed runs),
``step_time_s`` (``perf/step_time``: rollout wait + train + publish), ``checkpoint_save_s``
(``perf/checkpoint_time``, synchronous writes), ``checkpoint_restore_s``, the plan's figures, and
``logits_max_abs_diff``. The shared GSM8K files are read from ``--data``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))
from make_qwen_shaped import write_qwen_shaped  # noqa: E402
from runlib import ChildRun, child_env, read_metrics, train_argv  # noqa: E402

SHARED_DATA = Path(os.environ.get("ASYNCRL_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")
CONFIG = REPO_ROOT / "configs" / "gsm8k_grpo_qwen2.5_0.5b.yaml"
OVERRIDES = (
    "model.param_dtype=bfloat16",       # weights and AdamW state in bf16: 494M x 2 bytes x 4 (plan: fits 23 GB shared)
    "model.compute_dtype=float32",      # XLA's CPU matmuls are fastest (and exact enough) in float32
    "rollout.batch_size=1", "rollout.group_size=2", "rollout.max_concurrent=2",
    "rollout.max_new_tokens=32",
    "rollout.length_bucket=256",        # every batch padded to the KV capacity: one train-step compile, not one per length
    "algo.entropy_coef=0.001",          # a random model's completions all score 0 (zero advantages): the entropy
                                        # bonus makes the gradients, AdamW state and saved weights move
    "data.max_prompt_tokens=224", "engine.prefill_buckets=[224]", "engine.kv_capacity=256", "engine.slots=2",
    "algo.mini_batches=1", "optim.micro_batches=1", "optim.warmup_steps=0",
    "eval.every_steps=0", "eval.max_prompts=2",
    "checkpoint.every_steps=1", "checkpoint.asynchronous=false", "checkpoint.keep=1",  # ~3 GB each
    "logging.dump_every_steps=0", "logging.trackers=[]",
)


def vm_hwm_bytes(pid: int) -> Optional[int]:
    """The process's resident high-water mark (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def children_peak_bytes() -> int:
    """The largest resident set of any child this process has waited for (Linux: KiB)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def train_until_killed(argv: list[str], env: dict[str, str], checkpoint: Path, timeout: float) -> tuple[ChildRun, int]:
    """Run ``argv`` until ``checkpoint`` is in place, then SIGKILL it; returns the run and its peak RSS."""
    run = ChildRun(argv, env)
    deadline, peak = time.monotonic() + timeout, 0
    while not checkpoint.is_dir():
        if run.proc.poll() is not None:
            raise RuntimeError(f"{run.describe()} exited {run.proc.returncode} before {checkpoint}:\n{run.output[-3000:]}")
        if time.monotonic() > deadline:
            run.finish(0)
            raise TimeoutError(f"{run.describe()}: no {checkpoint} after {timeout} s:\n{run.output[-3000:]}")
        peak = max(peak, vm_hwm_bytes(run.proc.pid) or 0)
        time.sleep(0.2)
    peak = max(peak, vm_hwm_bytes(run.proc.pid) or 0)
    run.signal(signal.SIGKILL)
    run.finish(60)
    return run, peak


def restore_seconds(run_dir: Path) -> dict[str, Any]:
    """Load the newest checkpoint (manifest and checksums verified) and read every array tree to the host."""
    from asyncrl.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(run_dir)
    if path is None:
        raise RuntimeError(f"{run_dir}: no complete checkpoint to restore")
    start = time.perf_counter()
    checkpoint = load_checkpoint(path)
    nbytes = sum(array.nbytes for name in checkpoint.arrays for array in checkpoint.arrays[name].values())
    return {"checkpoint": path.name, "checkpoint_restore_s": round(time.perf_counter() - start, 2),
            "checkpoint_gb": round(nbytes / 1e9, 2)}


def logits_parity(model_dir: Path, tokens: int = 32) -> dict[str, Any]:
    """Max |difference| between transformers' and asyncrl's float32 logits on one chat prompt."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.model import forward_jit, load_model

    loaded = load_model(str(model_dir), param_dtype="float32", compute_dtype="float32")
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Natalia sold 48 clips in April."}],
                                                tokenize=False, add_generation_prompt=True)
    ids = np.asarray(loaded.tokenizer(text)["input_ids"][:tokens], np.int32)[None, :]
    ours = np.asarray(forward_jit(*loaded.split(), ids)[0], np.float32)
    del loaded
    torch.set_num_threads(2)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = reference(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    return {"logits_max_abs_diff": float(np.abs(ours - theirs).max()), "logits_max_abs": float(np.abs(theirs).max()),
            "parity_tokens": int(ids.shape[1])}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/qwen-shaped"), help="work directory (model, run, export)")
    parser.add_argument("--data", type=Path, default=SHARED_DATA / "gsm8k",
                        help="directory of GSM8K's train.jsonl and test.jsonl (also the tokenizer's corpus; default: "
                        "shared/data/gsm8k beside the checkout, or under $ASYNCRL_SHARED_DATA)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps (the kill comes after step steps-1's checkpoint)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="more config overrides (after the script's own)")
    parser.add_argument("--timeout", type=float, default=3000, help="seconds each train process may take")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps: at least 2 (one checkpoint before the kill, one step after it)")
    out = args.out.resolve()
    train_file, test_file = args.data / "train.jsonl", args.data / "test.jsonl"
    if not (train_file.is_file() and test_file.is_file()):
        parser.error(f"--data {args.data}: needs train.jsonl and test.jsonl (GSM8K)")

    from asyncrl.config import load_config
    from asyncrl.plan.formulas import plan_config, read_decoder_config

    result: dict[str, Any] = {"config": str(CONFIG.relative_to(REPO_ROOT)), "overrides": [*OVERRIDES, *args.overrides]}
    model_dir, run_dir = out / "model", out / "run"
    result["model"] = write_qwen_shaped(model_dir, corpus=str(train_file))
    overrides = [f"model.path={model_dir}", f"run.output_dir={run_dir}", f"run.total_steps={args.steps}",
                 f"data.dataset.kwargs.path={train_file.resolve()}", f"data.dataset.kwargs.eval_path={test_file.resolve()}",
                 "data.dataset.kwargs.eval_split=null", *OVERRIDES, *args.overrides]
    plan = plan_config(load_config(CONFIG, overrides), model_cfg=read_decoder_config(str(model_dir)))
    result["plan_gb"] = {"trainer": round(plan.part_bytes("trainer") / 1e9, 2), "engine": round(plan.part_bytes("engine") / 1e9, 2),
                         "total": round(plan.total_bytes / 1e9, 2)}

    from asyncrl.checkpoint import checkpoints_root, step_dir_name

    env = child_env(compile_cache=out / "jax-cache")
    kill_after = checkpoints_root(run_dir) / step_dir_name(args.steps - 1)
    first, first_peak = train_until_killed(train_argv(CONFIG, overrides), env, kill_after, args.timeout)
    resumed = ChildRun(train_argv(CONFIG, overrides, "--resume"), env).expect_success(args.timeout)
    rows = [row for row in read_metrics(run_dir) if row["step"] > 0]
    steps = [row["step"] for row in rows]
    if steps != list(range(1, args.steps + 1)):
        raise RuntimeError(f"{run_dir}/metrics.jsonl: steps {steps} after the kill and resume, want 1..{args.steps} once each")
    result.update({
        "killed_at_step": max(first.step_times, default=0), "resumed_from": args.steps - 1, "steps": steps,
        "peak_rss_gb": {"first": round(first_peak / 1e9, 2), "all_train": round(max(first_peak, children_peak_bytes()) / 1e9, 2)},
        "ttfs_s": {"cold": round(first.step_times[1], 1), "resumed": round(resumed.step_times[args.steps], 1)},
        "step_time_s": [round(row["perf/step_time"], 2) for row in rows],
        "train_time_s": [round(row["perf/train_time"], 2) for row in rows if "perf/train_time" in row],
        "checkpoint_save_s": [round(row["perf/checkpoint_time"], 2) for row in rows if "perf/checkpoint_time" in row],
        "reward_mean": [row.get("reward/mean") for row in rows], "loss": [row.get("loss/total") for row in rows],
    })
    result.update(restore_seconds(run_dir))

    common = [*[arg for item in overrides for arg in ("--set", item)]]
    start = time.perf_counter()
    evaluated = ChildRun(["eval", str(CONFIG), *common, "--set", f"model.path={run_dir / 'hf'}"], env).expect_success(args.timeout)
    result["eval"] = json.loads(evaluated.output.strip().splitlines()[-1])
    result["eval_s"] = round(time.perf_counter() - start, 1)
    export_dir = out / "export"
    ChildRun(["export", str(run_dir), str(export_dir)], env).expect_success(args.timeout)
    result.update(logits_parity(export_dir))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
