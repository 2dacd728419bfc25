"""A Qwen2.5-0.5B-shaped run end to end on this CPU: ``scripts/real_shape_run.py``
writes a random-init model of Qwen2.5-0.5B's exact configuration (494M parameters, vocabulary
151,936, tied embeddings, rope theta 1e6) with the project's offline tokenizer, trains 3 GRPO steps
with the in-process engine, is SIGKILLed after step 2's checkpoint and resumed, evaluates and
exports. Here the run's records are read back with the resume tests' helpers, and the export is
compared with transformers' logits by the model tests' helper. About 18 GB resident at the peak and
ten minutes: slow."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import REPO_ROOT, SHARED_DATA, subprocess_env

GSM8K = SHARED_DATA / "gsm8k"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600),
              pytest.mark.skipif(not (GSM8K / "train.jsonl").exists(), reason=f"{GSM8K} not present")]


def test_qwen2_5_0_5b_shaped_run_survives_a_sigkill_and_exports_what_transformers_loads(tmp_path):
    from asyncrl.checkpoint import checkpoint_problems, latest_checkpoint, load_checkpoint
    from asyncrl.model import forward_jit, load_model
    from tests.checkpoint.test_resume import read_rows
    from tests.model_helpers import hf_logits

    work = tmp_path / "qwen-shaped"
    done = subprocess.run([sys.executable, "scripts/real_shape_run.py", "--out", str(work), "--data", str(GSM8K)],
                          cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=3500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result))  # the figures, for `pytest -s`

    model = result["model"]
    assert model["params"] == 494_032_768 and model["vocab_size"] == 151_936, model
    assert model["tokenizer_tokens"] < model["vocab_size"]  # fewer tokens than rows, as Qwen's own
    exported = json.loads((work / "export" / "config.json").read_text())
    assert exported["vocab_size"] == 151_936 and exported["tie_word_embeddings"] is True
    assert exported["num_hidden_layers"] == 24 and exported["hidden_size"] == 896
    assert float(exported.get("rope_theta") or exported["rope_parameters"]["rope_theta"]) == 1e6

    # The kill came after step 2's checkpoint, before step 3's; the resume trained step 3 once.
    assert result["killed_at_step"] <= 3 and result["resumed_from"] == 2
    rows = read_rows(work / "run")
    assert [row["step"] for row in rows if row["step"] > 0] == [1, 2, 3]
    assert all(np.isfinite(row["loss/total"]) for row in rows if row["step"] > 0)
    last = latest_checkpoint(work / "run")
    assert last is not None and last.name.endswith("3") and checkpoint_problems(last) == []
    assert load_checkpoint(last).state["stage_step"] == 3
    assert result["eval"]["eval/n_prompts"] == 2

    # transformers loads the export; its float32 logits equal ours on the same bf16 weights.
    import torch
    from transformers import AutoModelForCausalLM

    loaded = load_model(str(work / "export"), param_dtype="float32", compute_dtype="float32")
    ids = np.asarray(loaded.tokenizer("Natalia sold clips to 48 of her friends in April.")["input_ids"], np.int32)[None, :]
    ours = np.asarray(forward_jit(*loaded.split(), ids)[0])
    del loaded
    reference = AutoModelForCausalLM.from_pretrained(work / "export", dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    theirs = hf_logits(reference, ids)
    # 24 layers of float32 on the same weights: summation order alone moves the logits by ~1e-5 of their scale.
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3 * float(np.abs(theirs).max()))
    assert result["logits_max_abs_diff"] <= 1e-3 * result["logits_max_abs"]
