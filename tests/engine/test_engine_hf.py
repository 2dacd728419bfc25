"""JaxEngine greedy decoding equals transformers' greedy ``generate`` token for token.

Random-weight Qwen2, Llama and Gemma 3 checkpoints are written by transformers itself; prompts of
different lengths go through the engine concurrently (different prefill buckets, shared
decode batch). Tokens are compared up to the first step where HF's top-1/top-2 logit gap
is at most 1e-4 (beyond a near tie, float rounding may legitimately pick either).
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.config import EngineConfig
from asyncrl.engine.jax_engine import JaxEngine
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.model import load_model
from tests.model_helpers import FAMILIES as MODEL_FAMILIES
from tests.model_helpers import save_hf_model

pytestmark = pytest.mark.timeout(120)

# The model tests' Qwen2 config; their Llama one with q/k/v/o biases and a pad token too
# (the tiny model's layout), so both engine paths see biases.
# Gemma 3's: prompts and generations run past its sliding window of 4 (prefill and decode).
OVERRIDES = {"qwen2": {}, "llama": {"attention_bias": True, "pad_token_id": 0}, "gemma3": {}}
FAMILIES = {name: {**MODEL_FAMILIES[name], **extra} for name, extra in OVERRIDES.items()}
PROMPT_LENGTHS = (1, 5, 12, 23)
MAX_NEW = 16
CFG = EngineConfig(slots=4, kv_capacity=48, decode_chunk=8, prefill_buckets=[32])  # buckets: see test_engine.py


@pytest.mark.parametrize("family", [f if f == "qwen2" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)])
def test_greedy_matches_transformers_generate(family, tmp_path):
    import torch

    # Every weight random and sharp (std 0.15), so near-ties in greedy decoding are rare.
    hf = save_hf_model(family, tmp_path, weight_std=0.15, config_overrides=OVERRIDES[family])
    lm = load_model(str(tmp_path), with_tokenizer=False)
    assert set(lm.stop_token_ids) == set(FAMILIES[family]["eos_token_id"])
    graphdef, params = lm.split()
    vocab = FAMILIES[family]["vocab_size"]
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(5, vocab, size=n)] for n in PROMPT_LENGTHS]
    engine = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=CFG)
    try:
        futures = [engine.submit(GenerationRequest(prompt_ids=p, greedy=True, max_new_tokens=MAX_NEW)) for p in prompts]
        ours = [f.result(timeout=90)[0] for f in futures]
    finally:
        engine.shutdown()

    compared = 0
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
                max_new_tokens=MAX_NEW, return_dict_in_generate=True, output_logits=True, pad_token_id=0,
            )
        want = out.sequences[0, len(prompt):].numpy()
        logits = torch.stack(out.logits, dim=1)[0].float().numpy()  # [steps, V], raw
        top2 = np.sort(logits, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-4
        upto = len(want) if clear.all() else int(np.argmin(clear))  # up to the first near tie
        assert upto >= 3, f"{family}: HF logits too flat to compare"
        np.testing.assert_array_equal(got.output_ids[:upto], want[:upto], err_msg=f"{family} prompt of {len(prompt)}")
        if upto == len(want):
            # Same length and ending: EOS included on both sides.
            np.testing.assert_array_equal(got.output_ids, want)
            assert got.stop_reason == ("eos" if want[-1] in lm.stop_token_ids else "length")
        compared += upto
    assert compared >= 20
