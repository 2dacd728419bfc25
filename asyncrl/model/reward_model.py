"""Learned reward models: Hugging Face sequence-classification checkpoints in JAX.

A reward model is the policy's decoder (:class:`~asyncrl.model.transformer.Decoder`, the
same Qwen2/Qwen3/Llama/Gemma 3 code) plus a bias-free ``score`` head ``[1, hidden]`` that
``Qwen2ForSequenceClassification``, ``Qwen3ForSequenceClassification``,
``LlamaForSequenceClassification`` and ``Gemma3TextForSequenceClassification`` put on the final
hidden states. The scalar reward of a
sequence is the head's output at one position, read as transformers does: the rightmost token
whose id is not ``config.json``'s ``pad_token_id`` (the last token when the config has no pad
id). So a sequence that ends in a token equal to the pad id (some checkpoints set pad = EOS) is
scored at the token before it, exactly as transformers scores it.

::

    rm = load_reward_model(directory)                 # LoadedRewardModel
    scores = reward_scores_jit(rm.graphdef, rm.params, rm.score_weight,
                               input_ids, attention_mask, pad_id_array(rm.pad_id))   # float32 [B]

``input_ids`` int32 [B, T] and ``attention_mask`` bool [B, T] may be right- or left-padded;
positions come from the mask (``cumsum - 1``), as for the policy. The head runs in float32.
The decoder is loaded with a tied (absent) LM head: a classifier has no ``lm_head``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.errors import ModelError

SEQUENCE_CLASSIFIERS = {
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "LlamaForSequenceClassification": "llama",
    "Gemma3TextForSequenceClassification": "gemma3_text",
}
"""The checkpoint classes (``config.json`` ``architectures``) a reward model may be, and their model type."""

SCORE_WEIGHT = "score.weight"
NO_PAD_ID = -1
"""``pad_id`` of a checkpoint whose config has no ``pad_token_id``: every real token counts."""


@dataclass(frozen=True)
class LoadedRewardModel:
    """A reward model read from an HF directory by :func:`load_reward_model`."""

    graphdef: Any  # nnx.GraphDef of the Decoder (static, hashable: the jit key)
    params: dict  # the decoder's pure params dict of jax.Array
    score_weight: Any  # float32 [hidden]: the ``score`` head's single row
    pad_id: int  # config.json pad_token_id, or NO_PAD_ID
    tokenizer: Any  # the directory's own tokenizer (None with with_tokenizer=False)
    path: Path
    config: Any  # the decoder's DecoderConfig


def check_sequence_classifier(model_dir: Path) -> dict[str, Any]:
    """``config.json`` of ``model_dir`` as a dict, after checking it is a one-label sequence
    classifier of a supported family; else one-line :class:`ModelError` naming the file."""
    cfg_file = Path(model_dir) / "config.json"
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{model_dir}: no config.json (a reward model is a Hugging Face directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelError(f"{cfg_file}: cannot read it as JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{cfg_file}: not a JSON object")
    architectures = raw.get("architectures") or []
    known = [a for a in architectures if a in SEQUENCE_CLASSIFIERS]
    if not known:
        raise ModelError(
            f"{cfg_file}: architectures {architectures} is not a reward model; supported: "
            f"{', '.join(SEQUENCE_CLASSIFIERS)} (a sequence-classification checkpoint with num_labels 1)"
        )
    if SEQUENCE_CLASSIFIERS[known[0]] != raw.get("model_type"):
        raise ModelError(f"{cfg_file}: architectures {known[0]} does not match model_type {raw.get('model_type')!r}")
    labels = len(raw["id2label"]) if isinstance(raw.get("id2label"), dict) else raw.get("num_labels", 2)
    if labels != 1:
        raise ModelError(
            f"{cfg_file}: num_labels is {labels}; a reward model has one label (a scalar score): "
            "save it with num_labels=1"
        )
    return raw


def load_reward_model(model_dir: str | Path, *, with_tokenizer: bool = True, param_dtype: str = "float32",
                      compute_dtype: str = "float32") -> LoadedRewardModel:
    """Read a sequence-classification checkpoint (see the module docstring) from ``model_dir``.

    Errors are one :class:`ModelError` naming the file: another architecture, ``num_labels``
    other than 1, missing/unexpected/mis-shaped tensors (the decoder's, listed together, as for
    the policy), a missing or mis-shaped ``score.weight``.
    """
    from flax import nnx

    from asyncrl.model.config import from_hf_config, hf_config_from_dict
    from asyncrl.model.hf import load_tokenizer, params_from_hf, read_safetensors
    from asyncrl.model.transformer import Decoder, dtype_of, split_params

    model_dir = Path(model_dir)
    raw = check_sequence_classifier(model_dir)
    source = str(model_dir / "config.json")
    # A classifier has no LM head: a tied config makes the decoder expect none.
    cfg = from_hf_config(hf_config_from_dict(raw, source=source), source=source, param_dtype=param_dtype,
                         compute_dtype=compute_dtype).replace(tie_word_embeddings=True)
    tensors = read_safetensors(model_dir)
    score = tensors.pop(SCORE_WEIGHT, None)
    if score is None:
        raise ModelError(f"{model_dir}: the checkpoint has no {SCORE_WEIGHT} (the reward head)")
    if tuple(score.shape) != (1, cfg.hidden_size):
        raise ModelError(f"{model_dir}: {SCORE_WEIGHT} has shape {list(score.shape)}, a reward head needs [1, {cfg.hidden_size}]")
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    params = params_from_hf(cfg, tensors, str(model_dir), abstract=abstract)
    state = nnx.state(abstract)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(abstract, state)
    graphdef, params = split_params(abstract)
    score_weight = jax.device_put(np.asarray(score, dtype=np.float32).reshape(-1).astype(dtype_of("float32")))
    pad = raw.get("pad_token_id")
    pad_id = NO_PAD_ID if pad is None else int(pad)
    tokenizer = load_tokenizer(model_dir) if with_tokenizer else None
    return LoadedRewardModel(graphdef, params, score_weight, pad_id, tokenizer, model_dir, cfg)


def scored_positions(input_ids: jax.Array, attention_mask: jax.Array, pad_id: jax.Array) -> jax.Array:
    """int32 [B]: the position each row is scored at: the rightmost real token (``attention_mask``)
    whose id is not ``pad_id`` (:data:`NO_PAD_ID`: any id), 0 when there is none (as transformers)."""
    t = jnp.arange(input_ids.shape[1], dtype=jnp.int32)[None, :]
    counted = attention_mask.astype(bool) & ((input_ids != pad_id) | (pad_id == NO_PAD_ID))
    return jnp.max(jnp.where(counted, t, 0), axis=1)


def reward_scores(graphdef: Any, params: Any, score_weight: jax.Array, input_ids: jax.Array,
                  attention_mask: jax.Array, pad_id: jax.Array) -> jax.Array:
    """float32 [B] rewards of ``input_ids`` int32 [B, T] (``attention_mask`` bool [B, T]):
    the ``score`` head on the final hidden state at :func:`scored_positions`."""
    from asyncrl.model.transformer import hidden_states

    hidden, _ = hidden_states(graphdef, params, input_ids, None, attention_mask)  # [B, T, hidden]
    position = scored_positions(input_ids, attention_mask, pad_id)
    last = jnp.take_along_axis(hidden, position[:, None, None], axis=1)[:, 0]  # [B, hidden]
    return jnp.einsum("bh,h->b", last.astype(jnp.float32), score_weight.astype(jnp.float32))


reward_scores_jit = jax.jit(reward_scores, static_argnums=0)
"""``reward_scores`` jitted at module level (graphdef static), shared by every scorer."""


def packed_reward_scores(graphdef: Any, params: Any, score_weight: jax.Array, input_ids: jax.Array,
                         segment_ids: jax.Array, rows: jax.Array, positions: jax.Array, segments: int = 0) -> jax.Array:
    """float32 [N] rewards of sequences packed into ``input_ids`` int32 [P, T] (``segment_ids`` int32
    [P, T], 0 = padding; :mod:`asyncrl.rollout.packing`): sequence n is scored at row ``rows[n]``,
    position ``positions[n]`` (its own :func:`scored_positions`, offset by where it starts), each
    segment attending only to itself with positions from 0, so a score equals its unpacked one.
    ``segments`` (static): the most sequences a row holds (cuDNN's packed layout's bound)."""
    from flax import nnx

    from asyncrl.model.attention import compiled_for, current_target

    model = nnx.merge(graphdef, params)
    target = current_target()
    with compiled_for(target.mesh, None if target.mesh is not None else target.platform, target.devices, segments):
        hidden, _ = model.hidden_states(input_ids, None, segment_ids > 0, segment_ids=segment_ids)  # [P, T, hidden]
    last = hidden[rows, positions]  # [N, hidden]
    return jnp.einsum("nh,h->n", last.astype(jnp.float32), score_weight.astype(jnp.float32))


packed_reward_scores_jit = jax.jit(packed_reward_scores, static_argnums=0, static_argnames=("segments",))
"""``packed_reward_scores`` jitted at module level (graphdef static)."""


def pad_id_array(pad_id: Optional[int]) -> Any:
    """The ``pad_id`` argument of :func:`reward_scores` (a traced int32 scalar, so every pad id
    shares one program; None: :data:`NO_PAD_ID`)."""
    return np.int32(NO_PAD_ID if pad_id is None else pad_id)
