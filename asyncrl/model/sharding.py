"""Partition rules for the decoder's parameters on a mesh with axes ``data``, ``fsdp``, ``tensor``.

Every parameter dimension is assigned a mesh axis or ``None`` (replicated) by the
rules in :data:`PARTITION_RULES` (first match on the dotted parameter path):

* ``tensor`` splits the Megatron way: attention heads of q/k/v (output) and o (input),
  the MLP's intermediate dimension, and the vocabulary of the embedding and lm head;
* ``fsdp`` splits the hidden dimension of every matrix (ZeRO-3 style: gathered per use);
* ``data`` never splits parameters (they are replicated over data-parallel replicas);
* vectors along the hidden dimension (norm weights, o/down biases) are replicated.

Fallback: a dimension whose size is not divisible by its axis size is replicated
(``None``) instead. For head dimensions the test is on heads, not on the flattened
``heads * head_dim`` size, so 2 KV heads on a ``tensor`` axis of 4 replicate k/v
rather than splitting a head across devices; q and o stay split when
``num_heads`` divides. An axis missing from the mesh counts as size 1. The fallback
is silent by design (the result is still correct, only less memory-efficient);
:func:`param_shardings` returns what each parameter got.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asyncrl.errors import ConfigError
from asyncrl.model.config import DecoderConfig
from asyncrl.pytree import dotted_name

MESH_AXES = ("data", "fsdp", "tensor")

# (path regex, per-dimension axes, per-dimension unit): unit "heads"/"kv_heads" means
# the dimension is heads * head_dim and divisibility is checked on the head count.
PARTITION_RULES: tuple[tuple[str, tuple[Optional[str], ...], tuple[Optional[str], ...]], ...] = (
    (r"embed_tokens\.embedding$", ("tensor", "fsdp"), (None, None)),
    (r"lm_head\.kernel$", ("fsdp", "tensor"), (None, None)),
    (r"self_attn\.q_proj\.kernel$", ("fsdp", "tensor"), (None, "heads")),
    (r"self_attn\.[kv]_proj\.kernel$", ("fsdp", "tensor"), (None, "kv_heads")),
    (r"self_attn\.q_proj\.bias$", ("tensor",), ("heads",)),
    (r"self_attn\.[kv]_proj\.bias$", ("tensor",), ("kv_heads",)),
    (r"self_attn\.o_proj\.kernel$", ("tensor", "fsdp"), ("heads", None)),
    (r"self_attn\.o_proj\.bias$", (None,), (None,)),
    (r"self_attn\.[qk]_norm\.weight$", (None,), (None,)),
    (r"mlp\.(gate|up)_proj\.kernel$", ("fsdp", "tensor"), (None, None)),
    (r"mlp\.(gate|up)_proj\.bias$", ("tensor",), (None,)),
    (r"mlp\.down_proj\.kernel$", ("tensor", "fsdp"), (None, None)),
    (r"mlp\.down_proj\.bias$", (None,), (None,)),
    (r"(input_layernorm|post_attention_layernorm|norm)\.weight$", (None,), (None,)),
    # Mixture of experts (asyncrl/model/moe.py): fsdp splits the expert dimension, so each device
    # stores whole experts (E / fsdp of them) and gathers a layer's experts per use like any fsdp
    # weight; tensor splits each expert's intermediate dimension like the dense MLP's.
    (r"mlp\.gate\.kernel$", ("fsdp", None), (None, None)),  # router [hidden, experts]
    (r"mlp\.experts\.(gate|up)_proj$", ("fsdp", None, "tensor"), (None, None, None)),  # [E, hidden, I]
    (r"mlp\.experts\.down_proj$", ("fsdp", "tensor", None), (None, None, None)),  # [E, I, hidden]
)


def _axis_size(mesh: Mesh, axis: Optional[str]) -> int:
    return int(mesh.shape[axis]) if axis is not None and axis in mesh.shape else 1


_LORA_LEAF = re.compile(r"^(.*)\.lora\.lora_([ab])$")


def _lora_rule(name: str) -> Optional[tuple[str, tuple, tuple]]:
    """LoRA adapters (``<linear>.lora.lora_a [in, r]``, ``.lora_b [r, out]``) follow their base
    kernel's rule on the dimension they share with it; the rank dimension is replicated."""
    match = _LORA_LEAF.match(name)
    if match is None:
        return None
    kernel = f"{match.group(1)}.kernel"
    for pattern, axes, units in PARTITION_RULES:
        if re.search(pattern, kernel):
            if match.group(2) == "a":
                return pattern, (axes[0], None), (units[0], None)
            return pattern, (None, axes[1]), (None, units[1])
    raise ValueError(f"no partition rule matches the base kernel {kernel!r} of adapter {name!r}")


def partition_spec(cfg: DecoderConfig, name: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of parameter ``name`` (dotted path) with ``shape`` on ``mesh``."""
    if name.endswith(".dropout_key"):  # a LoRA adapter's raw dropout PRNG key: tiny, replicated
        return PartitionSpec(*([None] * len(shape)))
    lora = _lora_rule(name)
    if lora is None:
        lora = next((rule for rule in PARTITION_RULES if re.search(rule[0], name)), None)
        if lora is None:
            raise ValueError(f"no partition rule matches parameter {name!r}; add one to PARTITION_RULES")
    pattern, axes, units = lora
    if len(axes) != len(shape):
        raise ValueError(f"partition rule {pattern!r} has {len(axes)} dims, parameter {name!r} has shape {shape}")
    spec = []
    for size, axis, unit in zip(shape, axes, units):
        n = _axis_size(mesh, axis)
        count = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}.get(unit, size)
        spec.append(axis if axis is not None and n > 1 and count % n == 0 else None)
    return PartitionSpec(*spec)


def param_partition_specs(cfg: DecoderConfig, params: Any, mesh: Mesh) -> Any:
    """A pytree of PartitionSpec matching ``params`` (pure dict, State, or shape structs)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: partition_spec(cfg, dotted_name(p), tuple(x.shape), mesh), params)


def param_shardings(cfg: DecoderConfig, params: Any, mesh: Mesh) -> Any:
    """A pytree of NamedSharding matching ``params``."""
    specs = param_partition_specs(cfg, params, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


HEAD_VOCAB_AXES = ("fsdp", "tensor")  # the lm head's vocabulary split over these in the trainer (vocab_parallel_head)


def head_vocab_shards(axis_sizes: Any, vocab: int) -> int:
    """How many slices :func:`vocab_parallel_head` splits a ``vocab``-entry head into on a mesh of
    ``axis_sizes`` (axis name -> size, e.g. ``mesh.shape``): ``fsdp x tensor``, or 1 (the parameter
    layout kept) where that is 1 or does not divide the vocabulary."""
    shards = math.prod(int(axis_sizes.get(axis, 1)) for axis in HEAD_VOCAB_AXES)
    return shards if vocab % shards == 0 else 1


def vocab_parallel_head(hidden: jax.Array, weight: jax.Array, vocab_dim: int, mesh: Optional[Mesh]) -> tuple[jax.Array, jax.Array, Any]:
    """The lm head laid out vocabulary-parallel on ``mesh`` (Megatron's way): ``hidden [N, H]``
    gathered over ``fsdp`` and ``tensor`` (rows stay split over ``data``) and the head's
    ``weight`` (``[V, H]`` tied embedding, ``vocab_dim=0``; ``[H, V]`` kernel, ``vocab_dim=1``)
    split over them along the vocabulary, so each device computes all rows' logits for its
    vocabulary slice and its slice of the weight's gradient; what crosses devices is the
    log-softmax's per-position maxima and sums and the hidden states' cotangent. Returns
    ``(hidden, weight, constrain_logits)``. Why: the parameter layout splits the hidden
    dimension, and with rows split over the same devices (the layout splash attention's
    ``shard_map`` pins) XLA would form the whole ``[V, H]`` float32 gradient on every device at each
    lm-head chunk and all-reduce it (1.8 GiB per chip for Qwen3-1.7B on a v6e-8). Unchanged
    (identity) without a mesh or where the vocabulary does not divide."""
    unchanged = hidden, weight, lambda logits: logits
    if mesh is None or head_vocab_shards(mesh.shape, weight.shape[vocab_dim]) == 1:
        return unchanged
    split = tuple(axis for axis in HEAD_VOCAB_AXES if _axis_size(mesh, axis) > 1)
    rows = "data" if _axis_size(mesh, "data") > 1 else None
    constrain = lambda x, *spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))  # noqa: E731
    weight_spec = (split, None) if vocab_dim == 0 else (None, split)
    return (constrain(hidden, rows, None), constrain(weight, *weight_spec),
            lambda logits: constrain(logits, rows, split))


def shard_params(cfg: DecoderConfig, params: Any, mesh: Mesh) -> Any:
    """``params`` placed on ``mesh`` by the partition rules (``jax.device_put``)."""
    return jax.device_put(params, param_shardings(cfg, params, mesh))


def check_tensor_parallel(tensor_parallel: int, cfg: DecoderConfig) -> None:
    """``engine.tensor_parallel`` must divide the model's KV heads: a tensor-parallel engine
    keeps whole KV heads of its cache on each device (the partition rules above would
    silently replicate them instead). One error line naming the field otherwise."""
    if cfg.num_kv_heads % tensor_parallel:
        raise ConfigError(
            f"engine.tensor_parallel = {tensor_parallel} does not divide the model's {cfg.num_kv_heads} KV heads "
            f"(num_key_value_heads); use a divisor of {cfg.num_kv_heads}"
        )
