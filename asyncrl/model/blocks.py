"""Small pieces the decoder's blocks share (asyncrl/model/transformer.py, asyncrl/model/moe.py):
dtypes by name, the projection every block builds, Gemma 3's sliding-window mask and
soft-capping, and the gated MLP's activations by ``hidden_act``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from asyncrl.model.config import DecoderConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_of(name: str) -> Any:
    """The jnp dtype of a config's dtype name (``float32``, ``bfloat16``)."""
    return _DTYPES[name]


def normal_init(std: float) -> Any:
    return nnx.initializers.normal(stddev=std)


def linear(cfg: DecoderConfig, n_in: int, n_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    """A projection in the config's dtypes (parameters in ``param_dtype``, computed in
    ``compute_dtype``) with HF's normal init."""
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=bias,
        dtype=dtype_of(cfg.compute_dtype),
        param_dtype=dtype_of(cfg.param_dtype),
        kernel_init=normal_init(cfg.initializer_range),
        rngs=rngs,
    )


def sliding_window_mask(mask: jax.Array, query_index: jax.Array, key_index: jax.Array, window: int) -> jax.Array:
    """``mask`` bool ``[B, T, S]`` narrowed to keys fewer than ``window`` indices before the query
    (itself included), as transformers' sliding-window mask (``kv_idx > q_idx - window``).
    ``query_index`` int ``[B, T]`` and ``key_index`` int ``[S]`` are sequence indices without a cache
    and cache slots with one: real tokens of a row are contiguous in both (pads lie only before
    or after them), so the index distance is the distance in tokens."""
    return mask & (query_index[:, :, None] - key_index[None, None, :] < window)


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """``cap * tanh(x / cap)``: Gemma's soft-capping, bounding ``x`` to ``(-cap, cap)``."""
    return cap * jnp.tanh(x / cap)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
"""The gated MLP's gate activation by ``DecoderConfig.hidden_act``."""


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding of x [B, T, heads, D]; cos/sin [B, T, D]."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """:class:`~asyncrl.model.transformer.RMSNorm`'s arithmetic over ``x``'s last axis, ``weight``
    broadcast against ``x``."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(dtype)
    return weight.astype(dtype) * x32.astype(dtype)
