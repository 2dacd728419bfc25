"""The critic read from a transformers checkpoint and exported as ``*ForTokenClassification`` (num_labels 1):
transformers loads the export and computes the same values."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.model.critic import TOKEN_CLASSIFICATION, export_critic, load_critic, per_token_values
from tests.model_helpers import FAMILIES, hf_logits, save_hf_model


# One family in the default selection (qwen3: qk-norm, untied head); the others are slow, their
# decoders being checked against transformers in test_model.py.
@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f == "qwen3" else [pytest.mark.slow]) for f in sorted(TOKEN_CLASSIFICATION)])
def test_exported_critic_matches_transformers(family, tmp_path):
    import torch
    from transformers import AutoModelForTokenClassification

    save_hf_model(family, tmp_path / "causal", seed=1)
    vocab = FAMILIES[family]["vocab_size"]
    critic = load_critic(tmp_path / "causal", vocab_size=vocab)
    assert not np.asarray(critic.params["value_head"]["kernel"]).any()  # zero-initialised head
    rng = np.random.default_rng(0)
    hidden = critic.config.hidden_size
    head = {"kernel": jnp.asarray(rng.normal(size=(hidden, 1)).astype(np.float32) * 0.3),
            "bias": jnp.asarray(np.float32([0.25]))}
    params = {"decoder": critic.params["decoder"], "value_head": head}
    out = export_critic(critic.config, params, tmp_path / "hf_critic")
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == [TOKEN_CLASSIFICATION[family]] and len(saved["id2label"]) == 1

    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(out, attn_implementation="eager").eval()
    assert type(model).__name__ == TOKEN_CLASSIFICATION[family]
    ids = rng.integers(5, vocab, size=(3, 10)).astype(np.int32)
    mask = np.ones((3, 10), bool)
    mask[1, 7:] = False  # right padding
    mask[2, :3] = False  # left padding
    ids[~mask] = 0
    theirs = hf_logits(model, ids, mask)[..., 0]  # [B, T]: position t's own state
    ours = np.asarray(per_token_values(critic.graphdef, params["decoder"], head, jnp.asarray(ids), jnp.asarray(mask)))
    scored = np.zeros_like(mask)
    scored[:, 1:] = mask[:, 1:] & mask[:, :-1]
    # Our values[b, t] (the state before token t) are transformers' logits[b, t - 1].
    np.testing.assert_allclose(ours[:, 1:][scored[:, 1:]], theirs[:, :-1][scored[:, 1:]], rtol=1e-4, atol=1e-4)
    assert not ours[~scored].any()

    # Loading the export back keeps the head (a later run's critic.path).
    again = load_critic(out, vocab_size=vocab)
    np.testing.assert_array_equal(np.asarray(again.params["value_head"]["kernel"]), np.asarray(head["kernel"]))
    np.testing.assert_array_equal(np.asarray(again.params["value_head"]["bias"]), np.asarray(head["bias"]))
