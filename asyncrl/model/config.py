"""The architecture description of a decoder, translated from and to Hugging Face configs.

:class:`DecoderConfig` is a frozen (hashable) dataclass: it lives inside the NNX
graphdef as static data, so two models with equal configs share jit compilations.
It holds the architecture (what ``config.json`` says) and the runtime options that
change the computation but not the weights (dtypes, remat, log-prob chunking).

Only what the supported families (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama, Gemma 3) need is representable; anything
else in an HF config that would change the model (Qwen2's sliding windows, other rope types, partial
rotary, a different activation) is a :class:`~asyncrl.errors.ModelError` naming the
option, never a silently different model. Gemma 3's options and their translation are
:mod:`asyncrl.model.gemma3`'s.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any, Optional

import asyncrl.model.gemma3 as gemma3
from asyncrl.errors import ModelError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash", "reference")
ACTIVATIONS = ("silu", gemma3.GELU_TANH)
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("full", "save_dots")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture plus runtime options of a decoder-only transformer."""

    model_type: str  # qwen2 | qwen3 | llama | gemma3_text: decides the config written on export
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # explicit: Qwen3's differs from hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position: int = 8192  # llama3 only
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: true; Llama/Qwen3: attention_bias
    o_bias: bool = False  # Llama/Qwen3: attention_bias
    mlp_bias: bool = False  # Llama: mlp_bias
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before rope
    initializer_range: float = 0.02
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int | tuple[int, ...]] = None
    pad_token_id: Optional[int] = None
    # mixture of experts (qwen3_moe; num_experts 0: every layer dense). See asyncrl/model/moe.py.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse iff (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    # Gemma 3 (asyncrl.model.gemma3); the defaults are the other families' computation
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_pytorch_tanh
    norm_plus_one: bool = False  # RMSNorm scales by (1 + weight) in float32 (weights stored zero-centred)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs, and a pre-MLP norm of its own
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: Optional[float] = None  # attention scores scale by its ** -0.5 (None: head_dim's)
    final_logit_softcap: Optional[float] = None  # logits = cap * tanh(logits / cap)
    sliding_window: Optional[int] = None  # a sliding layer's query sees this many tokens (itself included)
    layer_types: Optional[tuple[str, ...]] = None  # per layer: full_attention | sliding_attention (None: all full)
    rope_local_theta: Optional[float] = None  # sliding layers' rope base (default rope type)
    # runtime options (not part of the checkpoint)
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False  # rematerialise each layer in the backward pass
    remat_policy: str = "full"  # full | save_dots: what a rematerialised layer keeps (transformer.REMAT_POLICIES)
    scan_layers: bool = False  # without a KV cache, runs of identical layers as one lax.scan (transformer.scanned_layers)
    logprob_chunk_size: Optional[int] = None  # per_token_logprobs: positions per lm-head chunk
    logprob_chunk_budget_mb: Optional[float] = 1024.0  # auto chunk when [B, positions, V] float32 logits exceed it
    attention: str = "auto"  # auto | xla | cudnn | splash | reference: see asyncrl.model.attention

    def __post_init__(self) -> None:
        problems = []
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            problems.append(f"model_type {self.model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            problems.append(f"rope_type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if self.num_heads % max(self.num_kv_heads, 1) != 0 or self.num_kv_heads < 1:
            problems.append(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                problems.append(f"{name}={getattr(self, name)!r} must be one of {', '.join(DTYPES)}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            problems.append(f"logprob_chunk_size={self.logprob_chunk_size} must be >= 1")
        if self.remat_policy not in REMAT_POLICIES:
            problems.append(f"remat_policy={self.remat_policy!r} must be one of {', '.join(REMAT_POLICIES)}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            problems.append(f"attention={self.attention!r} must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        if self.logprob_chunk_budget_mb is not None and self.logprob_chunk_budget_mb < 0:
            problems.append(f"logprob_chunk_budget_mb={self.logprob_chunk_budget_mb} must be >= 0")
        problems += self._moe_problems()
        problems += self._layer_type_problems()
        if problems:
            raise ModelError("invalid model config: " + "; ".join(problems))

    def _moe_problems(self) -> list[str]:
        if self.num_experts == 0:
            return []
        problems = []
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            problems.append(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]")
        if self.moe_intermediate_size < 1:
            problems.append(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        if self.decoder_sparse_step < 1:
            problems.append(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        return problems

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` has a sparse MoE block (transformers' Qwen3-MoE rule)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def _layer_type_problems(self) -> list[str]:
        if isinstance(self.layer_types, list):  # hashable, as the graphdef's static data must be
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        problems = []
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"hidden_act={self.hidden_act!r} must be one of {', '.join(ACTIVATIONS)}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            if set(self.layer_types) - set(gemma3.LAYER_TYPES):
                problems.append(f"layer_types must be among {', '.join(gemma3.LAYER_TYPES)}")
            if gemma3.SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
                problems.append(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}")
        return problems

    def layer_type(self, layer: int) -> str:
        """``full_attention`` or ``sliding_attention`` (only with a ``sliding_window``)."""
        return self.layer_types[layer] if self.layer_types is not None else gemma3.FULL

    def replace(self, **changes: Any) -> "DecoderConfig":
        return dataclasses.replace(self, **changes)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def num_params(self) -> int:
        """Parameter count (tied head counted once)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        attn += 2 * d if self.qk_norm else 0
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts + router
        mlps = sum(moe if self.is_moe_layer(n) else mlp for n in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        norms = 4 * h if self.sandwich_norms else 2 * h  # Gemma 3's sandwich norms: two more per layer
        return self.vocab_size * h + self.num_layers * (attn + norms) + mlps + h + head


# --------------------------------------------------------------------------- config.json without transformers

# What transformers 5's LlamaConfig / Qwen2Config / Qwen3Config give a field config.json leaves
# out, for every field from_hf_config and the loader read (tests/model/test_model_config_reader.py
# compares this reader with AutoConfig on each family).
_LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048,
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=None,
    attention_bias=False, mlp_bias=False, pad_token_id=None, bos_token_id=1, eos_token_id=2,
)
_QWEN2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768, initializer_range=0.02,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=None, use_sliding_window=False,
    sliding_window=4096, max_window_layers=28, layer_types=None, pad_token_id=None, bos_token_id=None,
    eos_token_id=None,
)
_HF_DEFAULTS = {
    "llama": _LLAMA_DEFAULTS,
    "qwen2": _QWEN2_DEFAULTS,
    "qwen3": {**_QWEN2_DEFAULTS, "head_dim": 128, "attention_bias": False},
}
_HF_DEFAULTS["qwen3_moe"] = {  # transformers 5's Qwen3MoeConfig (it writes num_experts as num_local_experts)
    **_HF_DEFAULTS["qwen3"], "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_key_value_heads": 4, "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
    "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": [],
}
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "max_window_layers",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
_FLOAT_FIELDS = ("rms_norm_eps", "initializer_range")
_ROPE_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def hf_config_from_dict(raw: dict[str, Any], *, source: str = "config.json") -> SimpleNamespace:
    """The parsed ``config.json`` of a supported family as the attributes ``AutoConfig`` would
    give it (class defaults filled in, rope settings normalised into ``rope_parameters``), for
    :func:`from_hf_config`; without importing transformers (whose config classes import torch
    whenever it is installed, seconds of every start-up).

    Other model types come back as they are, for :func:`from_hf_config` to refuse by name.
    A field of the wrong type, or a rope setting missing a required key, is a ModelError
    naming ``source``, where transformers would refuse the file too."""
    model_type = raw.get("model_type")
    if gemma3.is_gemma3(raw):
        return gemma3.text_config_view(raw, source)
    if model_type not in _HF_DEFAULTS:
        return SimpleNamespace(**raw)
    values = {**_HF_DEFAULTS[model_type], **raw}
    if "num_local_experts" in values:  # the name transformers 5 saves num_experts under
        values["num_experts"] = values.pop("num_local_experts")
    if values.get("mlp_only_layers") is None and model_type == "qwen3_moe":
        values["mlp_only_layers"] = []
    for name in _INT_FIELDS:
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ModelError(f"{source}: {name} must be an integer, got {value!r}")
    for name in _FLOAT_FIELDS:
        value = values.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelError(f"{source}: {name} must be a number, got {value!r}")
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if model_type == "llama":
        if values["head_dim"] is None:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        if values["hidden_size"] % values["num_attention_heads"]:
            raise ModelError(f"{source}: hidden_size={values['hidden_size']} is not a multiple of "
                             f"num_attention_heads={values['num_attention_heads']}")
    else:  # Qwen2/Qwen3: sliding layers are those from max_window_layers on, when use_sliding_window
        values["sliding_window"] = values["sliding_window"] if values["use_sliding_window"] else None
        if values["layer_types"] is None:
            values["layer_types"] = [
                "sliding_attention" if values["sliding_window"] is not None and i >= values["max_window_layers"]
                else "full_attention" for i in range(values["num_hidden_layers"])
            ]
    values["rope_parameters"] = _normalised_rope(values, model_type, source)
    return SimpleNamespace(**values)


def _normalised_rope(values: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """``rope_parameters`` as transformers 5 standardises it: a legacy ``rope_scaling`` wins,
    top-level ``rope_theta`` / ``partial_rotary_factor`` move in, ``type`` becomes ``rope_type``,
    llama3 scaling gets ``original_max_position_embeddings`` from ``max_position_embeddings``."""
    rope = values.pop("rope_scaling", None) or values.get("rope_parameters")
    rope = json.loads(json.dumps(rope)) if rope else {}  # a deep copy: the caller's dict stays as read
    theta = values.pop("rope_theta", 10000.0)
    partial = values.pop("partial_rotary_factor", None)
    # per-layer-type parameters are nested under layer-type names (from_hf_config refuses them)
    labels = values.get("layer_types") if model_type != "llama" else None
    nested = [key for key in rope if key in (labels or ())]
    for params in [rope[key] for key in nested] or [rope]:
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ModelError(f"{source}: rope_parameters must be an object, got {params!r}")
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", theta)
        if partial is not None:
            params.setdefault("partial_rotary_factor", partial)
        if params["rope_type"] in ("llama3", "yarn", "longrope"):
            params.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
        missing = [key for key in _ROPE_REQUIRED.get(params["rope_type"], ()) if key not in params]
        if missing:
            raise ModelError(f"{source}: rope_parameters of rope_type {params['rope_type']!r} needs "
                             f"{', '.join(missing)}")
    return rope


# --------------------------------------------------------------------------- from / to HF


def _has_sliding_layers(hf: Any) -> bool:
    """Whether a ``use_sliding_window`` config slides any layer. As in transformers' Qwen2, only
    layers from ``max_window_layers`` on slide, and none without a ``sliding_window``; a window
    covering every layer is full attention."""
    if getattr(hf, "sliding_window", None) is None:
        return False
    first_sliding = getattr(hf, "max_window_layers", None)
    return first_sliding is None or first_sliding < hf.num_hidden_layers


def from_hf_config(hf: Any, *, source: str = "config.json", **runtime: Any) -> DecoderConfig:
    """Translate a ``transformers`` config object (from ``AutoConfig``), or the equivalent view
    :func:`hf_config_from_dict` makes of a ``config.json``, into a DecoderConfig.

    ``runtime`` sets the runtime fields (param_dtype, compute_dtype, remat, remat_policy,
    logprob_chunk_size, logprob_chunk_budget_mb, attention). Unsupported model types or options raise ModelError naming
    ``source`` and every offending option.
    """
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and model_type != gemma3.MULTIMODAL_MODEL_TYPE:
        raise ModelError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    family: dict[str, Any] = {}  # a family's own fields and checks (Gemma 3)
    if model_type in (gemma3.TEXT_MODEL_TYPE, gemma3.MULTIMODAL_MODEL_TYPE):
        family = gemma3.decoder_fields(hf, source)
        hf = getattr(hf, "text_config", None) or hf  # transformers' Gemma3Config nests the text model
        model_type = family["model_type"]
    problems = []
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu" and not family:
        problems.append(f"hidden_act={act!r} (only 'silu' is supported)")
    layer_types = getattr(hf, "layer_types", None)
    if layer_types and not family and any(t != "full_attention" for t in layer_types):
        problems.append(f"layer_types={sorted(set(layer_types))} (sliding-window attention is not supported)")
    if getattr(hf, "use_sliding_window", False) and _has_sliding_layers(hf):
        problems.append("use_sliding_window=true (sliding-window attention is not supported)")

    rope = family.pop("rope", None) or getattr(hf, "rope_parameters", None) or {}
    if rope and "rope_theta" not in rope and any(isinstance(v, dict) for v in rope.values()):
        problems.append(f"per-layer-type rope_parameters {sorted(rope)} are not supported")
        rope = {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor={partial} (only 1.0 is supported)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        problems.append(f"rope_type={rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    if family:
        qkv_bias, o_bias, mlp_bias, qk_norm = (family.pop(k) for k in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm"))
    elif model_type == "qwen2":
        qkv_bias, o_bias, mlp_bias, qk_norm = True, False, False, False
    elif model_type in ("qwen3", "qwen3_moe"):
        qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))
        mlp_bias, qk_norm = False, True
    else:  # llama
        qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))
        mlp_bias, qk_norm = bool(getattr(hf, "mlp_bias", False)), False
    moe = _moe_fields(hf, problems) if model_type == "qwen3_moe" else {}
    if problems:
        raise ModelError(f"{source}: unsupported option(s) for model_type {model_type!r}: " + "; ".join(problems))

    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    eos = getattr(hf, "eos_token_id", None)
    if isinstance(eos, list):
        eos = tuple(eos)
    cfg = dict(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=float(theta),
        rope_type=rope_type,
        rope_factor=float(rope.get("factor", 1.0) or 1.0),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192) or 8192),
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048) or 2048),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        initializer_range=float(getattr(hf, "initializer_range", 0.02)),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_id=eos,
        pad_token_id=getattr(hf, "pad_token_id", None),
    )
    cfg.update(moe)
    cfg.update(family)
    cfg.update(runtime)
    try:
        return DecoderConfig(**cfg)
    except ModelError as err:  # e.g. heads not a multiple of kv heads: say which file
        raise ModelError(f"{source}: {err}") from None


# Options of other MoE families that change the model and that the Qwen3-MoE block does not have:
# refused by name if a qwen3_moe config.json carries them with an active value.
_UNSUPPORTED_MOE_OPTIONS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                            "router_jitter_noise", "moe_layer_freq", "first_k_dense_replace")


def _moe_fields(hf: Any, problems: list[str]) -> dict[str, Any]:
    """The DecoderConfig MoE fields of a qwen3_moe config; options we do not implement go to ``problems``."""
    for name in _UNSUPPORTED_MOE_OPTIONS:
        if getattr(hf, name, None):
            problems.append(f"{name}={getattr(hf, name)!r} (Qwen3-MoE has no such option; only qwen3_moe's "
                            f"routed experts are supported)")
    num_experts = int(getattr(hf, "num_experts", 0) or 0)
    if num_experts < 1:
        problems.append(f"num_experts={num_experts} (a qwen3_moe model needs >= 1 expert)")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(hf.moe_intermediate_size),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
        decoder_sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(int(i) for i in (getattr(hf, "mlp_only_layers", None) or ())),
    )


def to_hf_config(cfg: DecoderConfig) -> Any:
    """The ``transformers`` config object describing the same architecture."""
    from transformers import AutoConfig

    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type in ("linear", "llama3"):
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position,
        )
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        dtype=cfg.param_dtype,
    )
    if cfg.model_type in ("llama", "qwen3", "qwen3_moe"):
        if cfg.qkv_bias != cfg.o_bias:
            raise ModelError(f"{cfg.model_type}: q/k/v and o biases must agree (attention_bias)")
        kwargs["attention_bias"] = cfg.qkv_bias
    if cfg.model_type == "llama":
        kwargs["mlp_bias"] = cfg.mlp_bias
    if cfg.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        kwargs["use_sliding_window"] = False
    if cfg.model_type == "qwen3_moe":
        kwargs.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                      moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                      decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers))
    if cfg.model_type == gemma3.TEXT_MODEL_TYPE:
        del kwargs["hidden_act"]
        kwargs.update(gemma3.hf_config_kwargs(cfg, rope))
    return AutoConfig.for_model(cfg.model_type, **kwargs)
