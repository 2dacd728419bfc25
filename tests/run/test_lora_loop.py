"""LoRA through the training loop: one adapter over ``[sft, rl]``, checkpoints of
adapters only, exports (PEFT adapter and merged), exact resume, a mismatched base refused.

The slow test is the quickstart with LoRA learning (the issue's acceptance); the default ones
run a few steps.
"""

from __future__ import annotations

import io
import json
import re
import shutil

import numpy as np
import pytest

from asyncrl.checkpoint import checkpoints_root, load_checkpoint, step_dir_name
from asyncrl.config import load_config
from asyncrl.errors import CheckpointError
from tests.checkpoint.test_resume import (
    PROCESS_WIDE,
    assert_rows_equal,
    assert_saved_at_publish,
    read_rows,
    run_in_process,
    write_config,
)
from tests.helpers import REPO_ROOT
from tests.model.test_lora import hf_logprobs
from tests.run.test_train_loop import FAST, QUICKSTART

LORA = ["model.lora={rank: 8, alpha: 16}", "optim.lr=0.01", "stages.0.optim.lr=0.01"]
"""Both quickstart stages (SFT then RL) on one rank-8 adapter, 10x the RL learning rate."""


def is_adapter(key: str) -> bool:
    return re.search(r"lora[./]lora_[ab]$", key) is not None


@pytest.mark.slow  # 14 s; the documented LoRA commands (test_doc_commands.py, lora chain) train and export adapters
def test_quickstart_with_lora_keeps_one_adapter_and_exports_it(tmp_path):
    from asyncrl.cli import main
    from asyncrl.run.loop import train

    out = tmp_path / "run"
    # A KL term makes every checkpoint keep the stage's starting adapters (its reference).
    cfg = load_config(QUICKSTART, [f"run.output_dir={out}", *FAST, *LORA, "algo.kl_coef=0.05"])
    result = train(cfg, argv=["test"], console=io.StringIO())
    assert result.steps == 5
    rows = read_rows(out)
    assert rows[-1]["memory/opt_state_bytes"] < rows[-1]["memory/frozen_param_bytes"]

    # Checkpoints (stage ends: steps 2 and 5) hold adapters and their optimizer state only,
    # with the base model's identity; the RL stage started from the SFT stage's adapter.
    sft_end = load_checkpoint(checkpoints_root(out) / step_dir_name(2))
    last = load_checkpoint(checkpoints_root(out) / step_dir_name(5))
    flat = lambda tree, prefix="": {k2: v2 for k, v in tree.items() for k2, v2 in (
        flat(v, f"{prefix}{k}/").items() if isinstance(v, dict) else [(f"{prefix}{k}", v)])}
    params, opt_state = flat(last.arrays["params"]), flat(last.arrays["opt_state"])
    assert params and all(is_adapter(k) for k in params)
    assert all(is_adapter(k) for k, v in opt_state.items() if np.ndim(v) > 0)
    assert len(last.state["lora"]["base_hash"]) == 64 and last.state["lora"]["base_model_path"]
    start = flat(last.arrays["stage_start_params"])
    assert start.keys() == params.keys()
    assert all(np.array_equal(start[k], flat(sft_end.arrays["params"])[k]) for k in start)

    # The run's own exports and `asyncrl export`: PEFT on the base == transformers on the merged model.
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "hf" / "config.json").is_file()
    assert main(["export", str(out), str(tmp_path / "peft")]) == 0
    assert main(["export", str(out), str(tmp_path / "merged"), "--merged"]) == 0
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = last.state["lora"]["base_model_path"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(tmp_path / "peft")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    final = AutoModelForCausalLM.from_pretrained(str(out / "hf")).eval()
    ids = np.random.default_rng(0).integers(6, 28, size=(2, 10)).astype(np.int32)
    mask = np.ones(ids.shape, bool)
    want = hf_logprobs(peft_model, ids, mask)
    np.testing.assert_allclose(hf_logprobs(merged, ids, mask), want, atol=1e-4)
    np.testing.assert_allclose(hf_logprobs(final, ids, mask), want, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    assert np.max(np.abs(hf_logprobs(base, ids, mask) - want)) > 1e-3  # the adapter was trained


@pytest.mark.slow
def test_lora_run_resumes_exactly_and_refuses_another_base(tmp_path):
    """The full-weight resume promise (tests/checkpoint/test_resume.py) with adapters, dropout and a KL
    reference; then the base weights change under the same model.path and the resume is refused."""
    from asyncrl.model.loading import resolve_model_dir

    base_dir = tmp_path / "base"
    shutil.copytree(resolve_model_dir("tiny"), base_dir)
    out = tmp_path / "lora"
    config = write_config(tmp_path, out, model={"path": str(base_dir), "lora": {"rank": 4, "alpha": 8, "dropout": 0.1}},
                          optim={"lr": 0.01})
    run_in_process(config)
    want = read_rows(out)
    assert len(want) == 4 and any(row["loss/kl"] != 0 for row in want)

    shutil.rmtree(checkpoints_root(out) / step_dir_name(4))
    shutil.rmtree(out / "hf")
    shutil.rmtree(out / "adapter")
    assert_saved_at_publish(load_checkpoint(checkpoints_root(out) / step_dir_name(2)))
    run_in_process(config, "checkpoint.resume=auto")
    assert_rows_equal(read_rows(out), want, also=frozenset(PROCESS_WIDE))

    # Another base under the same path: one weight perturbed.
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(base_dir / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + np.float32(1e-3)
    save_file(weights, str(base_dir / "model.safetensors"), metadata={"format": "pt"})
    saved_hash = load_checkpoint(checkpoints_root(out) / step_dir_name(4)).state["lora"]["base_hash"]
    with pytest.raises(CheckpointError) as refused:
        run_in_process(config, "checkpoint.resume=auto")
    message = str(refused.value)
    assert saved_hash in message and "content hash" in message
    assert message.count("content hash") == 2


BASE_SFT = ["run.name=quickstart-base",
            "stages=[{name: sft, type: sft, total_steps: 20, optim: {lr: 0.003, warmup_steps: 0}}]"]
"""docs/lora.md, step 1: the quickstart's full-weight SFT warm start alone (its hf/ is the LoRA base)."""
LORA_RL = ["run.name=quickstart-lora", "model.path=runs/quickstart-base/hf",
           "stages=[{name: rl, type: rl, total_steps: 300}]", "model.lora={rank: 8, alpha: 16}", "optim.lr=0.01"]
"""docs/lora.md, step 2: the quickstart's RL stage with rank-8 adapters on that base, 10x the lr."""


def command(overrides: list[str]) -> str:
    quoted = [f"'{o}'" if any(c in o for c in " {[") else o for o in overrides]
    return "asyncrl train configs/quickstart.yaml " + " ".join(f"--set {o}" for o in quoted)


def test_docs_show_the_tested_lora_quickstart_commands():
    text = (REPO_ROOT / "docs" / "lora.md").read_text()
    assert command(BASE_SFT) in text and command(LORA_RL) in text
    assert "docs/lora.md" in (REPO_ROOT / "README.md").read_text()


@pytest.mark.slow
def test_quickstart_with_lora_learns(tmp_path):
    """The issue's acceptance: rank 8, adjusted lr, seeded, CPU: held-out eval reward +0.3 over
    the LoRA run (docs/lora.md's two commands; the base is the quickstart's SFT warm start)."""
    from asyncrl.run.loop import train

    base = tmp_path / "base"
    train(load_config(QUICKSTART, [*BASE_SFT, f"run.output_dir={base}"]), console=io.StringIO())
    out = tmp_path / "lora"
    overrides = [o for o in LORA_RL if not o.startswith("model.path=")]
    train(load_config(QUICKSTART, [*overrides, f"model.path={base / 'hf'}", f"run.output_dir={out}"]),
          console=io.StringIO())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/reward"] for row in rows if "eval/reward" in row]
    print(json.dumps({"eval_first": evals[0], "eval_last": evals[-1], "evals": evals}))
    assert evals[-1] - evals[0] >= 0.3
