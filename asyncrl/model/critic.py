"""The critic: the policy's decoder architecture with a scalar value head (PPO with GAE).

Parameters are a pure dict ``{"decoder": <decoder params>, "value_head": {"kernel" [H, 1],
"bias" [1]}}`` (float32 head, zero-initialised: every value starts at 0, so the first
advantages are the discounted rewards). The decoder is built with ``tie_word_embeddings``
true whatever the source: the critic never runs the lm head, and a tied decoder has no
``lm_head`` parameter to carry, update or checkpoint.

``values[b, t]`` is V of the state before token t, ``w . h[b, t - 1] + c`` with ``h`` the
final-norm hidden states (the same shift as the log-prob of token t); 0 at ``t = 0`` and
wherever token t or t - 1 is padding. transformers' ``*ForTokenClassification`` with one label
(:func:`export_critic`) scores position t with ``h[b, t]``: its ``logits[b, t - 1, 0]`` is our
``values[b, t]``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.errors import ModelError
from asyncrl.model.config import DecoderConfig

TOKEN_CLASSIFICATION = {"qwen2": "Qwen2ForTokenClassification", "qwen3": "Qwen3ForTokenClassification",
                        "llama": "LlamaForTokenClassification"}
"""The transformers class an exported critic (``hf_critic/``) loads as, by ``model_type``."""


class CriticModel(NamedTuple):
    """A critic ready for the trainer: ``graphdef`` of its (tied) decoder, ``params`` as in the
    module docstring, ``config`` the decoder's :class:`DecoderConfig`."""

    graphdef: Any
    params: dict
    config: DecoderConfig


def critic_config(cfg: DecoderConfig) -> DecoderConfig:
    """The critic decoder's config: ``cfg`` without an lm head (tied embeddings). A model type
    transformers has no ``*ForTokenClassification`` for (Gemma 3) is refused here, before training,
    rather than when its ``hf_critic/`` export fails at the end of the run."""
    if cfg.model_type not in TOKEN_CLASSIFICATION:
        raise ModelError(f"critic (algo.estimator: gae) of model_type {cfg.model_type!r} is not supported: transformers has "
                         f"no token-classification model of it to export the critic as (supported: {', '.join(TOKEN_CLASSIFICATION)})")
    return cfg.replace(tie_word_embeddings=True)


def _graphdef(cfg: DecoderConfig) -> Any:
    from flax import nnx

    from asyncrl.model.transformer import Decoder

    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))[0]


def zero_value_head(hidden_size: int) -> dict:
    """The value head at initialisation: ``kernel [H, 1]`` and ``bias [1]`` float32 zeros."""
    return {"kernel": jnp.zeros((hidden_size, 1), jnp.float32), "bias": jnp.zeros((1,), jnp.float32)}


def critic_from_policy(policy_cfg: DecoderConfig, policy_params: dict) -> CriticModel:
    """A critic whose decoder starts as a copy of the policy's weights (lm head dropped) with a zero head."""
    cfg = critic_config(policy_cfg)
    # Copies: the critic's buffers are donated to its updates, the policy's may be published.
    decoder = jax.tree.map(lambda x: jnp.array(x, copy=True), {k: v for k, v in policy_params.items() if k != "lm_head"})
    return CriticModel(_graphdef(cfg), {"decoder": decoder, "value_head": zero_value_head(cfg.hidden_size)}, cfg)


def load_critic(path: str | os.PathLike, *, vocab_size: int, runtime: Optional[dict] = None,
                field: str = "critic.path") -> CriticModel:
    """Read a critic from a local Hugging Face directory: a causal LM (its lm head ignored, a
    zero value head) or a ``*ForTokenClassification`` with one label (its ``score`` is the head,
    e.g. an earlier run's ``hf_critic/``). ``vocab_size`` is the policy's: the critic reads the
    policy's token ids, so its vocabulary must be the same size. Errors name ``field``."""
    from asyncrl.model.config import from_hf_config
    from asyncrl.model.hf import params_from_hf, read_hf_config, read_safetensors

    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise ModelError(f"{field}: {str(path)!r} is not a local Hugging Face directory")
    try:
        hf = read_hf_config(model_dir)
        architectures = list(getattr(hf, "architectures", None) or [])
        token_classification = any(a.endswith("ForTokenClassification") for a in architectures)
        other = [a for a in architectures if not a.endswith(("ForCausalLM", "ForTokenClassification"))]
        if other:
            raise ModelError(f"architecture {other[0]} is neither a causal LM nor a token classifier")
        labels = _num_labels(hf) if token_classification else 1
        if labels != 1:
            raise ModelError(f"num_labels is {labels}; a value head has exactly 1")
        cfg = critic_config(from_hf_config(hf, source=str(model_dir / "config.json"), **(runtime or {})))
        if cfg.vocab_size != vocab_size:
            raise ModelError(f"vocab_size {cfg.vocab_size} differs from the policy's {vocab_size} (the critic reads the policy's tokens)")
        tensors = read_safetensors(model_dir)
        score_w, score_b = tensors.pop("score.weight", None), tensors.pop("score.bias", None)
        if token_classification and score_w is None:
            raise ModelError("a ForTokenClassification checkpoint without score.weight")
        decoder = params_from_hf(cfg, tensors, str(model_dir))
    except ModelError as err:
        first = str(err).splitlines()[0]
        raise ModelError(f"{field}: {model_dir}: {first}; give a directory of the policy's architecture "
                         "(a causal LM or an exported hf_critic/)") from None
    head = zero_value_head(cfg.hidden_size)
    if score_w is not None:
        if tuple(score_w.shape) != (1, cfg.hidden_size):
            raise ModelError(f"{field}: {model_dir}: score.weight has shape {list(score_w.shape)}, expected [1, {cfg.hidden_size}]")
        head["kernel"] = jnp.asarray(np.asarray(score_w, np.float32).T)
        if score_b is not None:
            head["bias"] = jnp.asarray(np.asarray(score_b, np.float32).reshape(1))
    return CriticModel(_graphdef(cfg), {"decoder": decoder, "value_head": head}, cfg)


def _num_labels(hf: Any) -> int:
    """A classifier config's label count as transformers reads it: ``num_labels``, else the size
    of ``id2label`` (what ``save_pretrained`` writes), else transformers' default 2."""
    if getattr(hf, "num_labels", None) is not None:
        return int(hf.num_labels)
    id2label = getattr(hf, "id2label", None)
    return len(id2label) if id2label else 2


def critic_shardings(cfg: DecoderConfig, params: dict, mesh: Any) -> dict:
    """Shardings of critic ``params``: the decoder's by the policy's partition rules, the head replicated.
    ``params["decoder"]`` may be LoRA adapters (their rules follow the base kernels')."""
    from jax.sharding import NamedSharding, PartitionSpec

    from asyncrl.model.sharding import param_shardings

    replicated = NamedSharding(mesh, PartitionSpec())
    return {"decoder": param_shardings(cfg, params["decoder"], mesh),
            "value_head": jax.tree.map(lambda _: replicated, params["value_head"])}


def per_token_values(graphdef: Any, decoder_params: Any, value_head: dict, input_ids: jax.Array,
                     attention_mask: jax.Array, *, window: Optional[int] = None,
                     window_start: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """float32 ``[B, L]`` (or ``[B, W]`` with a window, positions as in
    :func:`~asyncrl.model.logprobs.per_token_logprobs`) values V(state before token t); 0 where
    token t has no context or is padding (packed rows, ``segment_ids`` ``[B, L]``: or is its
    segment's first). Traceable and differentiable."""
    from flax import nnx

    from asyncrl.model.logprobs import take_window

    model = nnx.merge(graphdef, decoder_params)
    attention_mask = attention_mask.astype(bool)
    if segment_ids is None:
        hidden, _ = model.hidden_states(input_ids, None, attention_mask)  # [B, L, H]
    else:
        hidden, _ = model.hidden_states(input_ids, None, attention_mask, segment_ids=segment_ids)
    b, length, _ = hidden.shape
    scored = jnp.concatenate([jnp.zeros((b, 1), bool), attention_mask[:, 1:] & attention_mask[:, :-1]], axis=1)
    if segment_ids is not None:
        scored = scored & jnp.concatenate([jnp.zeros((b, 1), bool), segment_ids[:, 1:] == segment_ids[:, :-1]], axis=1)
    context = jnp.concatenate([hidden[:, :1], hidden[:, :-1]], axis=1)  # hidden of position t - 1
    if window is not None:
        if window_start is None:
            raise ValueError("per_token_values: window needs window_start [B]")
        in_range = (window_start[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]) < length
        scored = take_window(scored, window_start, window) & in_range
        context = take_window(context, window_start, window)
    kernel = value_head["kernel"].astype(jnp.float32)
    values = jnp.einsum("blh,ho->blo", context.astype(jnp.float32), kernel)[..., 0] + value_head["bias"].astype(jnp.float32)[0]
    return jnp.where(scored, values, 0.0)


def critic_hf_tensors(cfg: DecoderConfig, params: dict) -> dict[str, np.ndarray]:
    """HF tensor names of a ``*ForTokenClassification`` (``model.*`` and ``score.weight [1, H]``,
    ``score.bias [1]``) from critic ``params`` (the merged decoder when LoRA), host numpy."""
    from asyncrl.model.hf import hf_tensors_from_params

    tensors = {k: np.ascontiguousarray(jax.device_get(v)) for k, v in hf_tensors_from_params(cfg, params["decoder"]).items()}
    head = params["value_head"]
    tensors["score.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(head["kernel"])).T)
    tensors["score.bias"] = np.asarray(jax.device_get(head["bias"])).reshape(1)
    return tensors


def export_critic(cfg: DecoderConfig, params: dict, out_dir: str | os.PathLike, *, tokenizer: Any = None,
                  overwrite: bool = False) -> Path:
    """Write the critic as a Hugging Face directory that ``AutoModelForTokenClassification``
    loads (``num_labels = 1``; :data:`TOKEN_CLASSIFICATION`), assembled beside ``out_dir`` and
    renamed into place. ``params`` as in the module docstring (decoder merged when LoRA)."""
    from safetensors.numpy import save_file

    from asyncrl.model.config import to_hf_config
    from asyncrl.model.hf import _default_permissions, install_dir

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise ModelError(f"export_critic: {out_dir} already exists (pass overwrite=True to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        hf_cfg = to_hf_config(cfg)
        hf_cfg.architectures = [TOKEN_CLASSIFICATION[cfg.model_type]]
        hf_cfg.num_labels = 1
        hf_cfg.save_pretrained(str(tmp))
        save_file(critic_hf_tensors(cfg, params), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        _default_permissions(tmp)
        install_dir(tmp, out_dir, overwrite=overwrite, exist_ok=False)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
