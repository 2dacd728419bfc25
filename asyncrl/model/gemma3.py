"""Gemma 3 text models (``model_type: gemma3_text``, and the text part of a ``gemma3`` config):
what their ``config.json`` means as a :class:`~asyncrl.model.config.DecoderConfig`, and back.

Gemma 3 is the shared decoder (:mod:`asyncrl.model.transformer`) with the options
transformers' ``Gemma3ForCausalLM`` computes: RMSNorm by ``(1 + weight)`` in float32
(``norm_plus_one``), norms after attention and around the MLP (``sandwich_norms``), GeGLU
with tanh-approximated GELU (``hidden_act: gelu_pytorch_tanh``), embeddings times
``sqrt(hidden_size)``, q/k norms, attention scaled by ``query_pre_attn_scalar ** -0.5``,
interleaved sliding-window (``sliding_attention``) and global layers with their own rope bases
(``rope_local_base_freq`` for the sliding ones, ``rope_theta`` and any rope scaling for the
global ones), optional final-logit soft-capping, and tied embeddings.

Refused, one line naming the option: a ``gemma3`` config with a vision tower
(``vision_config``), attention-logit soft-capping (``attn_logit_softcapping``), bidirectional
attention (``use_bidirectional_attention``), and rope scaling on the sliding layers.
A ``gemma3`` config without ``vision_config`` is its ``text_config`` (what a checkpoint of the
language model alone saves under ``model.language_model.``).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from asyncrl.errors import ModelError

TEXT_MODEL_TYPE = "gemma3_text"
MULTIMODAL_MODEL_TYPE = "gemma3"
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
GELU_TANH = "gelu_pytorch_tanh"

# What transformers 5's Gemma3TextConfig gives a field config.json leaves out.
DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation=GELU_TANH, max_position_embeddings=131_072,
    initializer_range=0.02, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    tie_word_embeddings=True, rope_parameters=None, attention_bias=False, query_pre_attn_scalar=256,
    sliding_window=4096, layer_types=None, final_logit_softcapping=None, attn_logit_softcapping=None,
    use_bidirectional_attention=False,
)
DEFAULT_SLIDING_WINDOW_PATTERN = 6  # every 6th layer global, the rest sliding
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def is_gemma3(raw: dict[str, Any]) -> bool:
    return raw.get("model_type") in (TEXT_MODEL_TYPE, MULTIMODAL_MODEL_TYPE)


def text_config_view(raw: dict[str, Any], source: str) -> SimpleNamespace:
    """A Gemma 3 ``config.json`` (``gemma3_text``, or ``gemma3`` with a ``text_config``) as the
    attributes transformers' Gemma3TextConfig gives it: defaults, ``layer_types`` from
    ``sliding_window_pattern``, rope settings per layer type under ``rope_parameters``. A
    ``gemma3`` config keeps ``vision_config`` for :func:`decoder_fields` to refuse."""
    outer: dict[str, Any] = {}
    if raw.get("model_type") == MULTIMODAL_MODEL_TYPE:
        outer = raw
        raw = raw.get("text_config") or {}
        if not isinstance(raw, dict):
            raise ModelError(f"{source}: text_config must be an object, got {raw!r}")
    values = {**DEFAULTS, **json.loads(json.dumps(raw)), "model_type": TEXT_MODEL_TYPE}
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        if name in outer and name not in raw:  # the multimodal config's own values win over text defaults
            values[name] = outer[name]
    pattern = values.pop("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN)
    if values["layer_types"] is None:
        values["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(values["num_hidden_layers"])]
    values["rope_parameters"] = _rope_by_layer_type(values)
    values["vision_config"] = outer.get("vision_config")
    values["multimodal"] = bool(outer)
    return SimpleNamespace(**values)


def _rope_by_layer_type(values: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` as Gemma3TextConfig standardises it: ``{full_attention: ..., sliding_attention: ...}``,
    a legacy ``rope_scaling`` applying to the global layers, ``rope_theta`` / ``rope_local_base_freq``
    their bases."""
    rope = values.get("rope_parameters") or {FULL: {"rope_type": "default"}, SLIDING: {"rope_type": "default"}}
    scaling = values.pop("rope_scaling", None)
    full = dict(rope.get(FULL) or {"rope_type": "default"})
    if scaling:
        full.update(scaling)
    full.setdefault("rope_theta", values.pop("rope_theta", DEFAULT_THETA[FULL]))
    sliding = dict(rope.get(SLIDING) or {"rope_type": "default"})
    sliding.setdefault("rope_theta", values.pop("rope_local_base_freq", DEFAULT_THETA[SLIDING]))
    for params in (full, sliding):
        params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
    return {FULL: full, SLIDING: sliding}


def decoder_fields(hf: Any, source: str) -> dict[str, Any]:
    """The :class:`DecoderConfig` fields of a Gemma 3 text config (from :func:`text_config_view` or
    transformers' Gemma3TextConfig / Gemma3Config). One ModelError lists every unsupported option."""
    if getattr(hf, "model_type", None) == MULTIMODAL_MODEL_TYPE:  # a transformers Gemma3Config object
        if getattr(hf, "vision_config", None) is not None:
            raise _vision_tower(source)
        hf = hf.text_config
    if getattr(hf, "vision_config", None) is not None:
        raise _vision_tower(source)
    problems = []
    act = getattr(hf, "hidden_activation", GELU_TANH)
    if act != GELU_TANH:
        problems.append(f"hidden_activation={act!r} (only {GELU_TANH!r} is supported)")
    if getattr(hf, "attn_logit_softcapping", None) is not None:
        problems.append(f"attn_logit_softcapping={hf.attn_logit_softcapping} (attention-logit soft-capping is not supported)")
    if getattr(hf, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=true (only causal attention is supported)")
    layer_types = tuple(hf.layer_types)
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        problems.append(f"layer_types {unknown} (supported: {', '.join(LAYER_TYPES)})")
    if len(layer_types) != hf.num_hidden_layers:
        problems.append(f"layer_types has {len(layer_types)} entries for num_hidden_layers={hf.num_hidden_layers}")
    window = getattr(hf, "sliding_window", None)
    if SLIDING in layer_types and not isinstance(window, int):
        problems.append(f"sliding_window={window!r} with sliding_attention layers (a window of tokens is needed)")
    rope = getattr(hf, "rope_parameters", None) or {}
    full, sliding = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
    if sliding.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.sliding_attention.rope_type={sliding['rope_type']!r} (only 'default')")
    for name, params in ((FULL, full), (SLIDING, sliding)):
        if params.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
            problems.append(f"rope_parameters.{name}.partial_rotary_factor={params['partial_rotary_factor']} (only 1.0)")
    if problems:
        raise ModelError(f"{source}: unsupported option(s) for model_type {TEXT_MODEL_TYPE!r}: " + "; ".join(problems))
    bias = bool(getattr(hf, "attention_bias", False))
    softcap = getattr(hf, "final_logit_softcapping", None)
    return dict(
        model_type=TEXT_MODEL_TYPE,
        rope=full,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm=True,
        hidden_act=GELU_TANH,
        norm_plus_one=True,
        sandwich_norms=True,
        scale_embeddings=True,
        query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
        final_logit_softcap=None if softcap is None else float(softcap),
        sliding_window=window if SLIDING in layer_types else None,
        layer_types=layer_types if SLIDING in layer_types else None,
        rope_local_theta=float(sliding.get("rope_theta", DEFAULT_THETA[SLIDING])),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )


def _vision_tower(source: str) -> ModelError:
    return ModelError(f"{source}: model_type 'gemma3' with a vision tower (vision_config) is not supported; "
                      "asyncrl trains Gemma 3 text models: use a gemma3_text checkpoint or a config without vision_config")


def hf_config_kwargs(cfg: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """The Gemma3TextConfig keyword arguments of a gemma3_text DecoderConfig beyond the shared ones
    (``rope``: the global layers' rope parameters)."""
    layer_types = list(cfg.layer_types or [FULL] * cfg.num_layers)
    if cfg.qkv_bias != cfg.o_bias:
        raise ModelError(f"{TEXT_MODEL_TYPE}: q/k/v and o biases must agree (attention_bias)")
    return dict(
        hidden_activation=cfg.hidden_act,
        attention_bias=cfg.qkv_bias,
        query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar),  # Gemma3TextConfig declares an int
        final_logit_softcapping=cfg.final_logit_softcap,
        sliding_window=cfg.sliding_window if cfg.sliding_window is not None else DEFAULTS["sliding_window"],
        layer_types=layer_types,
        rope_parameters={FULL: rope, SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
    )


def _int_if_whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value
