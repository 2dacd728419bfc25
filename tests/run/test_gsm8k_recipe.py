"""configs/gsm8k_grpo.yaml end to end: it validates as written, and the same recipe runs on this
CPU with the Qwen3-shaped `tiny-qwen3` (its shipped BPE tokenizer, trained on GSM8K) and GSM8K by
name from the local copy (``$ASYNCRL_DATA_DIR``, as a user without network gives it): the
documented 10-step smoke run and a 2-step one, both slow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.cli import main
from tests.helpers import REPO_ROOT, SHARED_DATA, documented_cpu_commands, subprocess_env

RECIPE = "configs/gsm8k_grpo.yaml"
TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"

pytestmark = pytest.mark.skipif(not TRAIN.exists(), reason=f"{TRAIN} not present")


def documented_smoke_command() -> list[str]:
    """The CPU smoke command from the recipe's header comment, as argv (after ``asyncrl``)."""
    commands = documented_cpu_commands(REPO_ROOT / RECIPE)
    assert commands and commands[-1][:3] == ["asyncrl", "train", RECIPE], "the smoke command is missing from the recipe"
    return commands[-1][1:]


def test_recipe_validates_as_written(capsys):
    assert main(["train", RECIPE, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "total_steps: 10" in printed and "decoupled: true" in printed and "gsm8k_format" in printed
    argv = documented_smoke_command()
    assert argv[:2] == ["train", RECIPE] and "model.path=tiny-qwen3" in argv
    assert main([*argv, "--print-config"]) == 0


def check_run(out: Path, steps: int, checkpoints: list[str]) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == steps
    final = rows[-1]
    for name in ("eval/accuracy_strict", "eval/accuracy_lenient", "reward/gsm8k_correct", "reward/gsm8k_format"):
        assert name in final and 0.0 <= final[name] <= 1.0, name
    assert final["rollout/lag_max"] <= 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == checkpoints
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    # GSM8K's real lengths: prompts are whole questions in a subword vocabulary.
    config = (out / "config.yaml").read_text()
    assert "tiny-qwen3" in config

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    assert type(model).__name__ == "Qwen3ForCausalLM"
    encoded = tokenizer("Natalia sold 48 clips in April.", return_tensors="pt")
    assert 4 <= encoded["input_ids"].shape[1] <= 12  # subwords, not characters
    assert model(**encoded).logits.shape[-1] == model.config.vocab_size
    return final


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
@pytest.mark.timeout(300)
def test_two_steps_of_the_recipe_on_cpu(tmp_path, monkeypatch):
    from asyncrl.config import load_config
    from asyncrl.run.loop import train

    argv = documented_smoke_command()
    overrides = [a for a in argv[2:] if a != "--set"]
    overrides += [
        f"run.output_dir={tmp_path / 'run'}", "run.total_steps=2", "rollout.batch_size=2", "rollout.group_size=2",
        "rollout.max_new_tokens=48", "engine.slots=8", "engine.kv_capacity=432", "eval.max_prompts=2",
        # fewer programs to compile: one batch length, one prefill bucket
        "rollout.length_bucket=432", "engine.prefill_buckets=[384]",
    ]
    result = train(load_config(RECIPE, overrides))
    assert result.steps == 2
    check_run(tmp_path / "run", 2, ["step_00000002"])


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ten_step_smoke_run_of_the_recipe(tmp_path):
    """The documented command, as a user runs it (plus an output dir; GSM8K from the local copy)."""
    argv = [*documented_smoke_command(), "--set", f"run.output_dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", *argv], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=1150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "asyncrl: 10 steps" in proc.stdout and "training completed" in proc.stdout
    final = check_run(tmp_path / "run", 10, ["step_00000005", "step_00000010"])
    assert final["eval/n_prompts"] == 8


def test_tiny_qwen3_spec_options_and_errors(tmp_path):
    from asyncrl.errors import ModelError
    from asyncrl.model.tiny_qwen3 import TinyQwen3Spec, corpus_path, parse_spec

    assert parse_spec("tiny-qwen3") == TinyQwen3Spec()
    spec = parse_spec(f"tiny-qwen3:vocab=1024,layers=3,corpus={TRAIN}")
    assert (spec.vocab, spec.layers, corpus_path(spec)) == (1024, 3, TRAIN)
    for bad, match in [("tiny-qwen3:depth=2", "bad option 'depth=2'"), ("tiny-qwen3:vocab=big", "needs an integer"),
                       ("tiny-qwen3:vocab=100", "at least 259"), ("tiny-qwen3:heads=3", "multiple of kv_heads")]:
        with pytest.raises(ModelError, match=match):
            parse_spec(bad)
    with pytest.raises(ModelError, match="tokenizer corpus .*missing.jsonl not found"):
        corpus_path(parse_spec(f"tiny-qwen3:corpus={tmp_path / 'missing.jsonl'}"))
    with pytest.raises(ModelError, match="shipped tokenizer has 4096 tokens.*add corpus="):
        corpus_path(parse_spec("tiny-qwen3:vocab=1024"))
