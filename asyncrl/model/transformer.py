"""The decoder: Qwen2/2.5, Qwen3, Llama and Gemma 3 in Flax NNX, and its pure functional forward.

One implementation serves training and inference. The NNX module (:class:`Decoder`)
holds the parameters; :func:`forward` is the pure function callers jit:
``forward(graphdef, params, input_ids, positions, attention_mask, kv_cache)``, with
``graphdef, params = nnx.split(model)`` (``params`` may be the ``nnx.State`` or its
``to_pure_dict()``: a plain dict of ``jax.Array``).

Numerics follow transformers' PyTorch models: RMSNorm normalises in float32 and
multiplies by its weight in the compute dtype; rotary embeddings use the rotate-half
convention with cos/sin computed in float32; attention scores and softmax run in
float32; logits are float32. Attention over more than one new token (training, scoring,
prefill) goes through ``model.attention``'s kernel with the mask as structure
(:mod:`asyncrl.model.attention`: ``auto`` is cuDNN's flash attention on GPUs, Pallas' splash
attention on TPUs, XLA's on the CPU), decoding one token by einsum on the cache
(:func:`cached_attention`); they apply the same mask rule and agree to float32 rounding.
Gemma 3's sliding-window layers narrow that mask to the last ``sliding_window`` tokens
(:func:`sliding_window_mask`, the one rule for training, scoring, prefill and decoding) and use
their own rope base.

KV cache (:class:`KVCache`)
---------------------------
A fixed-capacity pytree: ``layers``, one :class:`LayerKV` per decoder layer with ``k, v`` in
the compute dtype and in one of two layouts, chosen per platform by the engine
(:func:`asyncrl.engine.layouts.kv_cache_layout`; a layer's ``layout`` says which): ``bksd``, ``[B, kv_heads, capacity, head_dim]``
(heads before slots: a decode step's attention reads each head's keys as one contiguous
``[capacity, head_dim]`` matrix, which XLA's CPU dot and the GPU decode kernel want), or ``bskd``,
``[B, capacity, kv_heads, head_dim]`` (positions before heads: a decode step writes one
``[kv_heads, head_dim]`` tile per row, which XLA's TPU loop wants); ``valid: bool [B, capacity]``
(which slots hold a real token) and ``write_pos: int32 [B]`` (the slot where each row's
next token is written). The cache is per layer, not one stacked ``[layers, ...]`` array:
each layer reads and updates its own arrays in place, so a decode step never slices and
re-stacks (copies) the whole cache. A call with ``T`` new tokens writes row ``b``'s
token ``t`` into slot ``write_pos[b] + t`` (slots past the capacity are dropped: the
caller keeps rows within capacity), marks it valid iff ``attention_mask[b, t]``, and lets
it attend to the valid slots ``<= write_pos[b] + t``. Afterwards ``write_pos[b]`` moves
one past row ``b``'s last real token of the call (it stays put when the row had none). So:

* a left-padded prompt ``[pad pad a b c]`` fills slots 0..4 (0, 1 invalid) and the
  next token goes to slot 5; a right-padded one ``[a b c pad pad]`` fills 0..4 (3, 4
  invalid) and the next token overwrites slot 3;
* a row whose mask is all false in a call (an idle engine slot) keeps its valid slots
  and write position (K/V at and after ``write_pos`` may be overwritten, but those
  slots are invalid: every valid slot lies before ``write_pos``);
* positions default to the number of valid slots before the call plus the running
  count of real tokens in the call (``cumsum(mask) - 1``), so pads never shift the
  rotary positions; pass ``positions`` only to override.

The continuous-batching engine (:mod:`asyncrl.engine.jax_programs`) keeps one cache of
``num_slots`` rows and decodes all slots together through :func:`forward` with ``T = 1``
(``attention_mask[b, 0] = False`` for idle slots). To start requests it prefills their
prompts into a small cache (one row per request, capacity = the prompts' bucket) with
:func:`forward` and copies each row into its request's free slots with
:func:`kv_cache_copy_rows` (``src_rows = [0] * n`` for one request with ``n`` samples):
the slots get the prefix KV, the same ``valid`` and
``write_pos``, and everything past the prefix marked invalid. A finished slot needs no
clearing: the next prefill into it overwrites ``valid`` and ``write_pos`` whole
(:func:`kv_cache_clear_rows` empties rows for callers that reuse them otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncrl.model.attention import (
    SelfAttentionMask,
    attention_kernel,
    cudnn_attention,
    current_target,
    row_shards_divide,
    splash_attention,
)
from asyncrl.model.blocks import ACTIVATIONS, dtype_of, linear, normal_init, sliding_window_mask, softcap
from asyncrl.model.config import DecoderConfig
from asyncrl.model.decode_attention import decode_attention
from asyncrl.model.sharding import vocab_parallel_head

_MASKED = -1e30  # finite, so fully masked rows (pads) give uniform weights, never NaN


# --------------------------------------------------------------------------- KV cache


KV_LAYOUTS = ("bksd", "bskd")
"""A layer's cache as ``[B, kv_heads, capacity, head_dim]`` or ``[B, capacity, kv_heads, head_dim]``."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class LayerKV:
    """One decoder layer's keys and values in a :class:`KVCache` (compute dtype)."""

    k: jax.Array  # [B, kv_heads, capacity, head_dim] (bksd) or [B, capacity, kv_heads, head_dim] (bskd)
    v: jax.Array  # as k
    layout: str = "bksd"  # static: which of KV_LAYOUTS


class KVCache(NamedTuple):
    """Fixed-capacity KV cache (a pytree); see the module docstring for the protocol."""

    layers: tuple[LayerKV, ...]  # one per decoder layer
    valid: jax.Array  # bool [B, capacity]: slot holds a real token
    write_pos: jax.Array  # int32 [B]: slot of the row's next token

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @property
    def layout(self) -> str:
        """The layers' layout (:data:`KV_LAYOUTS`)."""
        return self.layers[0].layout if self.layers else "bksd"

    @property
    def lengths(self) -> jax.Array:
        """int32 [B]: real tokens held per row (the next token's default position)."""
        return self.valid.sum(axis=1).astype(jnp.int32)


def kv_shape(cfg: DecoderConfig, batch: int, capacity: int, layout: str = "bksd") -> tuple[int, int, int, int]:
    """One layer's K (or V) shape in ``layout``."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"KV cache layout {layout!r}: one of {KV_LAYOUTS}")
    if layout == "bksd":
        return (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    return (batch, capacity, cfg.num_kv_heads, cfg.head_dim)


def init_kv_cache(cfg: DecoderConfig, batch: int, capacity: int, dtype: Any = None, layout: str = "bksd") -> KVCache:
    """An empty cache (every slot invalid, write positions 0) in the compute dtype and ``layout``
    (:data:`KV_LAYOUTS`)."""
    dtype = dtype or dtype_of(cfg.compute_dtype)
    shape = kv_shape(cfg, batch, capacity, layout)
    return KVCache(
        layers=tuple(LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), layout) for _ in range(cfg.num_layers)),
        valid=jnp.zeros((batch, capacity), bool),
        write_pos=jnp.zeros((batch,), jnp.int32),
    )


def positions_slice(layout: str, stop: int) -> tuple:
    """The index of a layer's K/V that takes its first ``stop`` positions, whole rows and heads."""
    return (slice(None), slice(None), slice(0, stop)) if layout == "bksd" else (slice(None), slice(0, stop))


def kv_cache_copy_rows(dst: KVCache, src: KVCache, src_rows: jax.Array, dst_rows: jax.Array) -> KVCache:
    """Copy rows ``src_rows`` of ``src`` into rows ``dst_rows`` of ``dst`` (int32 [n] each).

    ``src``'s capacity may be smaller than ``dst``'s: the copied rows get the source
    slots at ``[0, src.capacity)`` and invalid slots after. Copying one prefilled
    prompt into ``n`` sampling slots is ``src_rows = [0] * n``. Entries of ``dst_rows``
    ``>=`` the destination batch are skipped (a fixed-size ``n`` can carry unused entries).
    Both caches have one layout. Pure; jit it with ``donate_argnums=0`` to update in place.
    """
    if src.capacity > dst.capacity:
        raise ValueError(f"source cache capacity {src.capacity} exceeds destination capacity {dst.capacity}")
    if src.layout != dst.layout:
        raise ValueError(f"KV cache layouts differ: source {src.layout}, destination {dst.layout}")
    c = src.capacity
    where = (dst_rows, *positions_slice(dst.layout, c)[1:])

    def copy(d: jax.Array, s: jax.Array) -> jax.Array:
        return d.at[where].set(s[src_rows].astype(d.dtype), mode="drop")

    layers = tuple(LayerKV(copy(d.k, s.k), copy(d.v, s.v), d.layout) for d, s in zip(dst.layers, src.layers))
    valid_rows = jnp.zeros((src_rows.shape[0], dst.capacity), bool).at[:, :c].set(src.valid[src_rows])
    valid = dst.valid.at[dst_rows].set(valid_rows, mode="drop")
    write_pos = dst.write_pos.at[dst_rows].set(src.write_pos[src_rows], mode="drop")
    return KVCache(layers, valid, write_pos)


def kv_cache_clear_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    """Mark rows (bool [B]) empty: every slot invalid, write position 0. K/V are left as is."""
    valid = jnp.where(rows[:, None], False, cache.valid)
    write_pos = jnp.where(rows, 0, cache.write_pos).astype(jnp.int32)
    return KVCache(cache.layers, valid, write_pos)


# --------------------------------------------------------------------------- rotary


def rope_inv_freq(cfg: DecoderConfig) -> np.ndarray:
    """float32 [head_dim // 2] inverse frequencies, as transformers computes them."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv_freq = inv_freq.astype(np.float32)
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / np.float32(cfg.rope_factor)
    elif cfg.rope_type == "llama3":
        factor = cfg.rope_factor
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = cfg.rope_original_max_position
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_cos_sin(cfg: DecoderConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin float32 [B, T, head_dim] for int positions [B, T] (halves repeated)."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding of x [B, T, heads, D]; cos/sin [B, T, D]."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------- modules


class RMSNorm(nnx.Module):
    """HF RMSNorm: normalise in float32, cast back, multiply by the weight. ``plus_one`` (Gemma):
    the weight is stored zero-centred and the float32 result is scaled by ``1 + weight`` before
    the cast, as transformers' Gemma3RMSNorm computes it."""

    def __init__(self, dim: int, eps: float, param_dtype: Any, plus_one: bool = False):
        self.weight = nnx.Param(jnp.zeros((dim,), param_dtype) if plus_one else jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(dtype)
        return self.weight[...].astype(dtype) * x32.astype(dtype)


def _norm(cfg: DecoderConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, dtype_of(cfg.param_dtype), plus_one=cfg.norm_plus_one)


def _dense(layer: Any, x: jax.Array) -> jax.Array:
    """``layer`` (an ``nnx.Linear`` or its LoRA form) on ``x [..., n_in]`` -> ``[..., n_out]``, as one
    2-D ``[tokens, n_in]`` matmul. Why 2-D: the weight gradient is then one plain ``x^T @ dy``;
    on ``[B, T, n]`` operands (two contracting dims) XLA's CPU backend writes a transposed copy
    of ``dy`` before every weight-gradient dot (the MLP's forward + backward ran 1.5x slower)."""
    lead = x.shape[:-1]
    return layer(x.reshape(-1, x.shape[-1])).reshape(*lead, -1)


class Attention(nnx.Module):
    """Grouped-query attention with rotary embeddings, optional q/k norm and biases."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = linear(cfg, h, cfg.num_heads * d, cfg.qkv_bias, rngs)
        self.k_proj = linear(cfg, h, cfg.num_kv_heads * d, cfg.qkv_bias, rngs)
        self.v_proj = linear(cfg, h, cfg.num_kv_heads * d, cfg.qkv_bias, rngs)
        self.o_proj = linear(cfg, cfg.num_heads * d, h, cfg.o_bias, rngs)
        if cfg.qk_norm:
            self.q_norm = _norm(cfg, d)
            self.k_norm = _norm(cfg, d)

    def __call__(self, x, cos, sin, mask, cache: Optional[LayerKV] = None, write_idx=None):
        """x [B, T, H]; mask: a :class:`~asyncrl.model.attention.SelfAttentionMask` (attention among
        the call's tokens) or bool [B, T, C] over a cache. With a cache, the new k/v are scattered
        into the layer's cache [B, KV, C, D] at write_idx [B, T] first (:func:`cached_attention`). Returns (out [B, T, H], the updated LayerKV or None)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = _dense(self.q_proj, x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = _dense(self.k_proj, x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = _dense(self.v_proj, x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
        if cache is not None:
            out, new_cache = cached_attention(q, k, v, mask, cache, write_idx, cfg.attention, scale)
            return _dense(self.o_proj, out.reshape(b, t, cfg.num_heads * cfg.head_dim)), new_cache
        out = _attend(q, k, v, mask, cfg.attention, kv_spec="bskd", scale=scale)
        out = out.reshape(b, t, cfg.num_heads * cfg.head_dim)
        return _dense(self.o_proj, out), None


def attention_implementation(choice: str, dtype: Any, head_dim: int = 64, **kwargs: Any) -> str:
    """The attention path of ``model.attention`` (``choice``) for ``dtype`` activations on the platform
    the program is compiled for: ``reference`` (:func:`reference_attention`), ``xla``, ``cudnn`` or
    ``splash`` (:func:`asyncrl.model.attention.attention_kernel`; ``auto``: cuDNN on GPUs, splash on
    TPUs, XLA's on the CPU)."""
    return attention_kernel(choice, dtype, head_dim, **kwargs)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention by einsum: ``q [B, T, heads, D]``, ``k, v [B, S, kv_heads, D]``,
    ``mask`` bool ``[B, T, S]`` -> ``[B, T, heads, D]``. Scores and softmax in float32; a fully
    masked query row gets uniform weights (never NaN). The path of one-token calls without a
    cache and of ``model.attention: reference``; cached decoding uses :func:`cached_attention`."""
    return _einsum_attention(q, k, v, mask, kv_spec="bskd")


def _einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, kv_spec: str,
                      scale: Optional[float] = None) -> jax.Array:
    """Grouped-query attention by einsum with keys and values laid out as ``kv_spec`` says:
    ``bskd`` (``[B, S, kv_heads, D]``) or ``bksd`` (the cache's ``[B, kv_heads, S, D]``); the
    same float32 scores and softmax, in the same order, either way. Scores scale by ``scale``
    (None: ``head_dim ** -0.5``)."""
    b, t, heads, d = q.shape
    kv_heads = k.shape[kv_spec.index("k")]
    q = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum(f"btkgd,{kv_spec}->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5 if scale is None else scale)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum(f"bkgts,{kv_spec}->btkgd", probs, v).reshape(b, t, heads, d)


def cached_attention(q, k, v, mask, cache: LayerKV, write_idx, choice: str,
                     scale: Optional[float] = None) -> tuple[jax.Array, LayerKV]:
    """Attention of ``q [B, T, heads, D]`` over a layer's cache after writing the new ``k, v``
    ``[B, T, kv_heads, D]`` into it at ``write_idx`` int32 [B, T] (indices past the capacity are
    dropped); ``mask`` bool [B, T, capacity], or a :class:`~asyncrl.model.attention.SelfAttentionMask`
    when the cache was empty before the call (a prefill: the new tokens attend only among
    themselves, by the fused kernel where there is one). Returns ``(out [B, T, heads, D], the updated
    LayerKV)``.

    One new token (a decode step) attends straight on the cache in its layout: with ``bksd``
    through :func:`~asyncrl.model.decode_attention.decode_attention` (one Pallas kernel on GPUs,
    the einsum elsewhere: batch and head dims lead and head_dim is minor, the layout XLA's batched
    dot wants), with ``bskd`` (TPUs) by the einsum over positions-first keys; no transposed copy of
    the cache is made per step. Several new tokens (prefill into a cache) go through
    ``model.attention``'s implementation (``choice``) on a transposed view, once per call.
    """
    layout = cache.layout
    if isinstance(mask, SelfAttentionMask):  # an empty cache (prefill): the call's tokens attend among themselves
        cache_k, cache_v = _scatter(k, v, cache.k, cache.v, write_idx, layout)
        k, v = k.astype(cache.k.dtype).astype(q.dtype), v.astype(cache.v.dtype).astype(q.dtype)
        return _attend(q, k, v, mask, choice, kv_spec="bskd", scale=scale), LayerKV(cache_k, cache_v, layout)
    reference = functools.partial(_scatter_and_attend, choice=choice, scale=scale, layout=layout)
    if q.shape[1] == 1 and layout == "bksd":  # a decode step: one kernel on GPUs (asyncrl.model.decode_attention)
        out, cache_k, cache_v = decode_attention(q, k, v, cache.k, cache.v, write_idx[:, 0], mask, scale, reference, choice)
        return out, LayerKV(cache_k, cache_v, layout)
    out, cache_k, cache_v = reference(q, k, v, cache.k, cache.v, write_idx, mask)
    return out, LayerKV(cache_k, cache_v, layout)


def _scatter(k, v, cache_k, cache_v, write_idx, layout: str = "bksd") -> tuple[jax.Array, jax.Array]:
    """The new ``k, v`` ``[B, T, kv_heads, D]`` written into a layer's caches (``layout``) at
    ``write_idx`` (int32 [B, T], or [B] for one token; indices past the capacity are dropped)."""
    if write_idx.ndim == 1:
        write_idx = write_idx[:, None]
    rows = jnp.arange(write_idx.shape[0])[:, None]
    # bksd: advanced indices around the head slice, so the indexed block is [B, T, kv_heads, D], as k is.
    where = (rows, slice(None), write_idx) if layout == "bksd" else (rows, write_idx)
    cache_k = cache_k.at[where].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[where].set(v.astype(cache_v.dtype), mode="drop")
    return cache_k, cache_v


def _scatter_and_attend(q, k, v, cache_k, cache_v, write_idx, mask, choice: str = "reference",
                        scale: Optional[float] = None, layout: str = "bksd") -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`cached_attention` by XLA: the new ``k, v`` scattered into the cache (:func:`_scatter`),
    then attention over it. Returns ``(out, cache_k, cache_v)``."""
    cache_k, cache_v = _scatter(k, v, cache_k, cache_v, write_idx, layout)
    out = _attend(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), mask, choice, kv_spec=layout, scale=scale)
    return out, cache_k, cache_v


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: Any, choice: str, kv_spec: str,
            scale: Optional[float] = None) -> jax.Array:
    """Attention by ``model.attention``'s kernel (``choice``) for several query tokens, by einsum
    (:func:`_einsum_attention`) for one; ``k, v`` laid out as ``kv_spec`` says (``bskd``, or the
    cache's ``bksd``, which ``jax.nn.dot_product_attention`` gets transposed). ``mask``: a
    :class:`~asyncrl.model.attention.SelfAttentionMask` (attention among the call's own tokens,
    ``bskd``), which the fused kernels take as their own mask structure, or a bool ``[B, T, S]``
    over a cache (the einsum and XLA paths)."""
    if q.shape[1] == 1:
        return _einsum_attention(q, k, v, mask.dense() if isinstance(mask, SelfAttentionMask) else mask, kv_spec, scale)
    target = current_target()
    implementation = attention_implementation(choice, q.dtype, q.shape[-1], target=target)
    if isinstance(mask, SelfAttentionMask):
        if implementation == "cudnn":
            return cudnn_attention(q, k, v, mask, scale, mesh=target.mesh)
        if implementation == "splash" and row_shards_divide(target.mesh, q.shape[0]):
            return splash_attention(q, k, v, mask, scale, mesh=target.mesh, interpret=target.platform != "tpu")
        mask = mask.dense()
    if implementation == "reference":
        return _einsum_attention(q, k, v, mask, kv_spec, scale)
    if kv_spec == "bksd":
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    # Over a cache (a dense mask) splash has no form; cuDNN takes the mask as its bias.
    kernel: Any = "cudnn" if implementation == "cudnn" else "xla"
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation=kernel)


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu), or Gemma's GeGLU (tanh-approximated gelu)."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.hidden_act = cfg.hidden_act
        self.gate_proj = linear(cfg, h, i, cfg.mlp_bias, rngs)
        self.up_proj = linear(cfg, h, i, cfg.mlp_bias, rngs)
        self.down_proj = linear(cfg, i, h, cfg.mlp_bias, rngs)

    def __call__(self, x):
        act = ACTIVATIONS[self.hidden_act]
        return _dense(self.down_proj, act(_dense(self.gate_proj, x)) * _dense(self.up_proj, x))


class DecoderLayer(nnx.Module):
    """Pre-norm layer; with ``sandwich_norms`` (Gemma) ``post_attention_layernorm`` norms the attention
    output and ``pre_/post_feedforward_layernorm`` the MLP's input and output."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs, index: int = 0):
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        self.mlp = _sparse_moe_block(cfg, rngs) if cfg.is_moe_layer(index) else MLP(cfg, rngs)
        self.sandwich_norms = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)

    def __call__(self, x, cos, sin, mask, cache: Optional[LayerKV] = None, write_idx=None):
        attn, new_cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, write_idx)
        if self.sandwich_norms:
            x = x + self.post_attention_layernorm(attn)
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return x, new_cache
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_cache


def _sparse_moe_block(cfg: DecoderConfig, rngs: nnx.Rngs) -> nnx.Module:
    """A mixture-of-experts layer's feed-forward block (asyncrl/model/moe.py; imported here
    because moe.py builds on this module's linear layers)."""
    from asyncrl.model.moe import SparseMoeBlock

    return SparseMoeBlock(cfg, rngs)


def _call_layer(layer, x, cos, sin, mask, cache, write_idx):
    return layer(x, cos, sin, mask, cache, write_idx)


_REMAT_POLICIES = {
    "full": None,
    # The 2-D weight matmuls of _dense have no batch dimensions; attention's einsums have them,
    # so this keeps the projections' outputs and recomputes norms, rope, attention, activations.
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""What a rematerialised layer keeps, by ``DecoderConfig.remat_policy`` (None: only its input)."""
_REMAT_CALLS = {name: nnx.remat(_call_layer, policy=policy) for name, policy in _REMAT_POLICIES.items()}


def _identical_runs(layers: Any) -> list[tuple[nnx.GraphDef, list[nnx.State]]]:
    """Consecutive layers with the same graphdef (structure and static settings), as
    ``(graphdef, [state, ...])`` runs: the layers one ``lax.scan`` can run."""
    runs: list[tuple[nnx.GraphDef, list[nnx.State]]] = []
    for layer in layers:
        graphdef, state = nnx.split(layer)
        if runs and runs[-1][0] == graphdef:
            runs[-1][1].append(state)
        else:
            runs.append((graphdef, [state]))
    return runs


def scanned_layers(layers: Any, x: jax.Array, args: tuple | list[tuple], cfg: DecoderConfig) -> jax.Array:
    """``layers`` applied in order to ``x [B, T, H]`` without a KV cache (training, scoring), each
    run of identical layers as one ``lax.scan`` over its stacked weights: XLA compiles one layer
    per run instead of every layer (the 0.5B shape's 24 layers are one run). ``args``: the layer
    call's arguments after ``x`` (``cos, sin, mask``), shared by every layer, or a list of one
    such tuple per layer: a run then also ends where the arguments change (Gemma 3's sliding and
    global layers, which take their own rope and mask).

    The weights stay per layer (HF names, LoRA, partition rules and checkpoints unchanged); each
    call stacks a run's ``[layers, ...]`` copy, whose cost is one pass over the weights, and the
    backward slices the stacked gradient back. ``model.remat`` rematerialises the scan's body
    with ``model.remat_policy``, as the unrolled layers are."""

    def body(h: jax.Array, state: nnx.State, graphdef: nnx.GraphDef, run_args: tuple) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, state)(h, *run_args, None, None)[0], None

    per_layer = args if isinstance(args, list) else [args] * len(layers)
    first = 0
    for graphdef, states in _identical_runs(layers):
        layer_args, first = per_layer[first:first + len(states)], first + len(states)
        for _, group in itertools.groupby(zip(layer_args, states), key=lambda pair: id(pair[0])):
            run_args, run_states = zip(*group)
            step: Callable[..., tuple[jax.Array, None]] = functools.partial(body, graphdef=graphdef, run_args=run_args[0])
            if cfg.remat:
                # Inside a scan, CSE across iterations cannot undo the remat: prevent_cse is not needed.
                # A run of one layer (Gemma 3's global layers) is called outside any scan, where XLA
                # merged its recompute with the forward and kept the whole layer's activations to its
                # backward (read from XLA's buffer assignment of Gemma 3 1B compiled for an L4): it needs it.
                step = jax.checkpoint(step, policy=_REMAT_POLICIES[cfg.remat_policy], prevent_cse=len(run_states) == 1)
            if len(run_states) == 1:
                x = step(x, run_states[0])[0]
                continue
            stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *run_states)
            x = jax.lax.scan(step, x, stacked)[0]
    return x


class Decoder(nnx.Module):
    """Decoder-only transformer. Parameter paths mirror HF names (``layers.3.self_attn.q_proj``),
    with ``kernel [in, out]`` for HF's ``weight [out, in]`` and ``embedding`` for the table."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype_of(cfg.compute_dtype),
            param_dtype=dtype_of(cfg.param_dtype),
            embedding_init=normal_init(cfg.initializer_range),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs, i) for i in range(cfg.num_layers)])
        self.norm = _norm(cfg, cfg.hidden_size)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)

    def hidden_states(
        self,
        input_ids: jax.Array,
        positions: Optional[jax.Array] = None,
        attention_mask: Optional[jax.Array] = None,
        kv_cache: Optional[KVCache] = None,
        segment_ids: Optional[jax.Array] = None,
        *,
        unrolled: bool = False,
        empty_cache: bool = False,
    ) -> tuple[jax.Array, Optional[KVCache]]:
        """Final-norm hidden states [B, T, hidden] (compute dtype) and the updated cache.

        ``segment_ids`` int32 [B, T] (packed rows, no cache; 0 = padding): attention stays within
        a segment and positions restart at 0 in each (:func:`segment_positions`). ``unrolled``:
        never :func:`scanned_layers` (for callers that capture what layers sow: a ``lax.scan``
        body's intermediates do not reach the caller). ``empty_cache`` (static): ``kv_cache`` holds
        no token yet (:func:`init_kv_cache`; a prefill), so the call's tokens attend only among
        themselves, with the fused kernel's mask structure, and are written into the cache.

        Without a cache (or with ``empty_cache``) attention takes the mask as structure
        (:class:`~asyncrl.model.attention.SelfAttentionMask`): a row's real tokens are one
        contiguous run (left or right padding), as everywhere in asyncrl."""
        cfg = self.cfg
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), bool)
        attention_mask = attention_mask.astype(bool)
        running = jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1
        if segment_ids is not None and kv_cache is not None:
            raise ValueError("Decoder.hidden_states: segment_ids (packed rows) are for cache-free forwards only")
        mask: Any
        if kv_cache is None or empty_cache:
            if positions is None:
                positions = jnp.maximum(running, 0) if segment_ids is None else segment_positions(segment_ids)
            mask = SelfAttentionMask(attention_mask, segment_ids)
            if kv_cache is not None:  # written from slot 0, as any call writes from write_pos (0 here)
                write_idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
                valid = jnp.zeros_like(kv_cache.valid).at[jnp.arange(b)[:, None], write_idx].set(attention_mask, mode="drop")
            else:
                write_idx = None
        else:
            if positions is None:
                positions = jnp.maximum(kv_cache.lengths[:, None] + running, 0)
            write_idx = kv_cache.write_pos[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            slots = jnp.arange(kv_cache.capacity, dtype=jnp.int32)
            if t == 1:  # a decode step: the same write as a select, which XLA fuses with the mask below (a scatter: a kernel more)
                valid = jnp.where(slots[None, :] == write_idx, attention_mask, kv_cache.valid)
            else:
                valid = kv_cache.valid.at[jnp.arange(b)[:, None], write_idx].set(attention_mask, mode="drop")
            mask = valid[:, None, :] & (slots[None, None, :] <= write_idx[:, :, None])
            query_index, key_index = write_idx, slots
        by_type = {"full_attention": (*rope_cos_sin(cfg, positions), mask)}  # per layer type: cos, sin, mask
        if cfg.layer_types is not None and "sliding_attention" in cfg.layer_types:
            assert cfg.sliding_window is not None  # DecoderConfig checks it
            local = cfg if cfg.rope_local_theta is None else cfg.replace(rope_theta=cfg.rope_local_theta, rope_type="default")
            local_mask = (mask.with_window(cfg.sliding_window) if isinstance(mask, SelfAttentionMask)
                          else sliding_window_mask(mask, query_index, key_index, cfg.sliding_window))
            by_type["sliding_attention"] = (*rope_cos_sin(local, positions), local_mask)
        x = self.embed_tokens(input_ids)
        if cfg.scale_embeddings:  # Gemma: times sqrt(hidden), rounded to the weights' dtype as transformers does
            x = x * jnp.asarray(cfg.hidden_size**0.5, dtype_of(cfg.param_dtype)).astype(x.dtype)
        call = _REMAT_CALLS[cfg.remat_policy] if cfg.remat else _call_layer
        layer_args = [by_type[cfg.layer_type(i)] for i in range(cfg.num_layers)]  # (cos, sin, mask) of each layer
        new_layers = []
        if kv_cache is None and cfg.scan_layers and not unrolled:
            x = scanned_layers(self.layers, x, layer_args, cfg)
        else:
            for i, layer in enumerate(self.layers):
                cos, sin, layer_mask = layer_args[i]
                x, layer_cache = call(layer, x, cos, sin, layer_mask, None if kv_cache is None else kv_cache.layers[i], write_idx)
                new_layers.append(layer_cache)
        x = self.norm(x)
        if kv_cache is None:
            return x, None
        t_idx = jnp.arange(t, dtype=jnp.int32)[None, :]
        last_real = jnp.max(jnp.where(attention_mask, t_idx, -1), axis=1)
        write_pos = (kv_cache.write_pos + last_real + 1).astype(jnp.int32)
        return x, KVCache(tuple(new_layers), valid, write_pos)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., vocab] from final hidden states [..., hidden] (one 2-D matmul
        over the flattened positions, like :func:`_dense`)."""
        lead, flat = hidden.shape[:-1], hidden.reshape(-1, hidden.shape[-1])
        mesh = current_target().mesh  # the trainer's: its head runs vocabulary-parallel
        if self.cfg.tie_word_embeddings:
            table = self.embed_tokens.embedding[...].astype(hidden.dtype)
            flat, table, laid_out = vocab_parallel_head(flat, table, 0, mesh)
            logits = laid_out(jnp.einsum("nh,vh->nv", flat, table, preferred_element_type=jnp.float32))
        else:
            kernel = self.lm_head.kernel[...].astype(hidden.dtype)
            flat, kernel, laid_out = vocab_parallel_head(flat, kernel, 1, mesh)
            logits = laid_out(jnp.einsum("nh,hv->nv", flat, kernel, preferred_element_type=jnp.float32))
        if self.cfg.final_logit_softcap is not None:
            logits = softcap(logits, self.cfg.final_logit_softcap)
        return logits.reshape(*lead, -1)

    def __call__(self, input_ids, positions=None, attention_mask=None, kv_cache=None):
        hidden, new_cache = self.hidden_states(input_ids, positions, attention_mask, kv_cache)
        return self.logits(hidden), new_cache


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """int32 [B, T]: each token's offset from the first token of its segment (rotary positions of
    a packed row restart at 0 in every segment, as each sequence had alone); 0 on padding."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], segment_ids.shape)
    previous = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]), segment_ids[:, :-1]], axis=1)
    starts = jnp.where(segment_ids != previous, idx, 0)
    return jnp.where(segment_ids > 0, idx - jax.lax.cummax(starts, axis=1), 0).astype(jnp.int32)


def init_decoder(cfg: DecoderConfig, seed: int = 0) -> Decoder:
    """A randomly initialised decoder with HF's scheme: weights ~ normal(0, initializer_range),
    zero biases, unit norm weights.

    Values come from numpy's PCG64 seeded by ``(seed, parameter path)``: deterministic
    across jax versions and devices, and free of compilation (jax's threefry initialisers
    take seconds to compile even for a tiny model, eager or jitted).
    """
    model = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    abstract = nnx.to_pure_dict(nnx.state(model))
    dtype = dtype_of(cfg.param_dtype)

    def fill(path, leaf):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if name.endswith("bias"):
            return jnp.zeros(leaf.shape, dtype)
        if name.endswith("norm/weight"):  # unit scale: 1, or 0 where the norm scales by 1 + weight
            return (jnp.zeros if cfg.norm_plus_one else jnp.ones)(leaf.shape, dtype)
        digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        rng = np.random.Generator(np.random.PCG64([seed, digest]))
        values = rng.standard_normal(leaf.shape, dtype=np.float32) * np.float32(cfg.initializer_range)
        return jnp.asarray(values, dtype)

    nnx.update(model, jax.tree_util.tree_map_with_path(fill, abstract))
    return model


# --------------------------------------------------------------------------- functional API


def forward(
    graphdef: nnx.GraphDef,
    params: Any,
    input_ids: jax.Array,
    positions: Optional[jax.Array] = None,
    attention_mask: Optional[jax.Array] = None,
    kv_cache: Optional[KVCache] = None,
) -> tuple[jax.Array, Optional[KVCache]]:
    """Pure forward: ``(logits float32 [B, T, V], new_kv_cache or None)``.

    ``graphdef, params = nnx.split(model)``; ``params`` may be the State or a pure
    dict. ``input_ids`` int32 [B, T]; ``attention_mask`` bool [B, T] (default all
    true); ``positions`` int32 [B, T] (default: derived from the masks, see the module
    docstring). Jit with ``static_argnums=0`` (the graphdef is hashable).
    """
    model = nnx.merge(graphdef, params)
    return model(input_ids, positions, attention_mask, kv_cache)


def hidden_states(graphdef, params, input_ids, positions=None, attention_mask=None, kv_cache=None, *,
                  empty_cache: bool = False):
    """Like :func:`forward`, but returns final hidden states instead of logits. ``empty_cache``
    (static): ``kv_cache`` is fresh from :func:`init_kv_cache` (a prefill; :meth:`Decoder.hidden_states`)."""
    model = nnx.merge(graphdef, params)
    return model.hidden_states(input_ids, positions, attention_mask, kv_cache, empty_cache=empty_cache)


forward_jit = jax.jit(forward, static_argnums=0)
"""``forward`` jitted at module level (graphdef static), shared by every caller."""


def split_params(model: Decoder) -> tuple[nnx.GraphDef, dict]:
    """``(graphdef, params)`` with params a pure dict of ``jax.Array`` (immutable, publishable)."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)
