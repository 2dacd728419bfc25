"""Reward models: HF sequence-classification checkpoints (decoder + ``score`` head) in JAX,
against transformers' PyTorch models on the same random weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncrl.errors import ModelError
from asyncrl.model.reward_model import load_reward_model, pad_id_array, reward_scores_jit
from tests.model_helpers import hf_config, randomize_weights

torch = pytest.importorskip("torch")

CLASSES = {"qwen2": "Qwen2ForSequenceClassification", "qwen3": "Qwen3ForSequenceClassification",
           "llama": "LlamaForSequenceClassification", "gemma3": "Gemma3TextForSequenceClassification"}


def save_reward_model(family: str, out_dir, seed: int = 0, *, num_labels: int = 1, **overrides):
    """A random-weight ``<Family>ForSequenceClassification`` written by transformers (every
    weight random, norms and biases included); returns the torch model."""
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(family, num_labels=num_labels, **overrides)
    cfg._attn_implementation = "eager"
    model = randomize_weights(getattr(transformers, CLASSES[family])(cfg).eval())
    model.save_pretrained(out_dir)
    return model


def torch_scores(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long))
    return out.logits[:, 0].float().numpy()


# One family in the default selection (qwen2: q/k/v bias, tied head); the others are slow, their
# decoders being checked against transformers in test_model.py.
@pytest.mark.parametrize("family", ["qwen2", pytest.param("qwen3", marks=pytest.mark.slow), pytest.param("llama", marks=pytest.mark.slow),
                                    pytest.param("gemma3", marks=pytest.mark.slow)])
def test_scores_equal_transformers_on_a_right_padded_batch(tmp_path, family):
    pad = 0
    model = save_reward_model(family, tmp_path, seed=1, pad_token_id=pad)
    rm = load_reward_model(tmp_path, with_tokenizer=False)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    lengths = [9, 4, 12, 1]
    ids = np.full((len(lengths), 12), pad, np.int32)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(1, vocab, length)
    ids[2, 11] = pad  # a real token equal to the pad id at the end: transformers scores the one before
    mask = np.arange(12)[None, :] < np.array(lengths)[:, None]
    ours = np.asarray(reward_scores_jit(rm.graphdef, rm.params, rm.score_weight, ids, mask, pad_id_array(rm.pad_id)))
    np.testing.assert_allclose(ours, torch_scores(model, ids, mask), atol=1e-4, rtol=1e-4)


def test_config_without_pad_id_scores_the_last_real_token(tmp_path):
    model = save_reward_model("llama", tmp_path, seed=2)
    assert model.config.pad_token_id is None
    rm = load_reward_model(tmp_path, with_tokenizer=False)
    ids = np.array([[5, 9, 0, 3, 7]], np.int32)
    mask = np.ones_like(ids, bool)
    ours = np.asarray(reward_scores_jit(rm.graphdef, rm.params, rm.score_weight, ids, mask, pad_id_array(rm.pad_id)))
    np.testing.assert_allclose(ours, torch_scores(model, ids, mask), atol=1e-4, rtol=1e-4)
    # right-padded beside a shorter row, each row still matches its unpadded transformers score
    padded = np.array([[5, 9, 0, 3, 7], [5, 9, 1, 1, 1]], np.int32)
    pmask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], bool)
    batch = np.asarray(reward_scores_jit(rm.graphdef, rm.params, rm.score_weight, padded, pmask, pad_id_array(rm.pad_id)))
    np.testing.assert_allclose(batch[1], torch_scores(model, padded[1:, :2], pmask[1:, :2])[0], atol=1e-4, rtol=1e-4)


def test_another_architecture_is_one_line_error(tmp_path):
    from tests.model_helpers import save_hf_model

    save_hf_model("qwen2", tmp_path)
    with pytest.raises(ModelError) as err:
        load_reward_model(tmp_path, with_tokenizer=False)
    message = str(err.value)
    assert "\n" not in message and "Qwen2ForCausalLM" in message and "Qwen2ForSequenceClassification" in message


def test_num_labels_other_than_one_is_one_line_error(tmp_path):
    save_reward_model("qwen3", tmp_path, num_labels=2)
    with pytest.raises(ModelError) as err:
        load_reward_model(tmp_path, with_tokenizer=False)
    assert "\n" not in str(err.value) and "num_labels is 2" in str(err.value)


def test_missing_score_head_is_named(tmp_path):
    save_reward_model("qwen2", tmp_path, pad_token_id=0)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["score.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="no score.weight"):
        load_reward_model(tmp_path, with_tokenizer=False)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
