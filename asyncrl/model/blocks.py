"""Small pure functions of the decoder's family options (asyncrl/model/transformer.py): Gemma 3's
sliding-window mask and soft-capping, and the gated MLP's activations by ``hidden_act``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
