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
prefill into an empty cache; a prefill chunk after pages a row holds takes the einsum reference over
them) goes through ``model.attention``'s kernel with the mask as structure
(:mod:`asyncrl.model.attention`: ``auto`` is cuDNN's flash attention on GPUs, Pallas' splash
attention on TPUs, XLA's on the CPU), decoding one token over a cache: the contiguous cache by
:func:`cached_attention` (einsum, or the GPU decode kernel), the engine's paged cache by
:func:`~asyncrl.model.paged_attention.paged_attention` (the einsum reference over its pages, or the
platform's paged kernel); they apply the same mask rule and agree to float32 rounding.
Gemma 3's sliding-window layers narrow that mask to the last ``sliding_window`` tokens
(``kv_idx > q_idx - window``, as transformers': :func:`sliding_window_mask` on the dense masks, the
fused kernels' and the paged paths' own window argument elsewhere) and use their own rope base.

KV caches: :mod:`asyncrl.model.kv_cache` (:class:`~asyncrl.model.kv_cache.KVCache`, its slot
protocol, the layouts; :class:`~asyncrl.model.kv_cache.PagedKVCache`, the engine's pages and page
tables). Attention, its kernels and the choice among them: :mod:`asyncrl.model.attention`
(:func:`~asyncrl.model.attention.cached_attention`, :func:`~asyncrl.model.attention.attend`) and,
over pages, :mod:`asyncrl.model.paged_attention`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncrl.model.attention import SelfAttentionMask, attend, cached_attention, current_target
from asyncrl.model.blocks import (
    ACTIVATIONS,
    apply_rope,
    dtype_of,
    linear,
    normal_init,
    rms_norm,
    sliding_window_mask,
    softcap,
)
from asyncrl.model.config import DecoderConfig
from asyncrl.model.kv_cache import KVCache, LayerKV, PagedKVCache, PagedLayerKV
from asyncrl.model.paged_attention import PagedQueries, QKPrologue, paged_attention
from asyncrl.model.sharding import vocab_parallel_head

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
        return rms_norm(x, self.weight[...], self.eps, self.plus_one)


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
        scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
        if isinstance(cache, PagedLayerKV):  # the q/k norms and rope applied there (fused into one step on GPUs)
            norms = (self.q_norm.weight[...], self.k_norm.weight[...]) if cfg.qk_norm else None
            prologue = QKPrologue(cos, sin, norms, cfg.rms_norm_eps, cfg.norm_plus_one)
            out, new_cache = paged_attention(q, k, v, mask, cache, cfg.attention, scale, prologue)
            return _dense(self.o_proj, out.reshape(b, t, cfg.num_heads * cfg.head_dim)), new_cache
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            out, new_cache = cached_attention(q, k, v, mask, cache, write_idx, cfg.attention, scale)
            return _dense(self.o_proj, out.reshape(b, t, cfg.num_heads * cfg.head_dim)), new_cache
        out = attend(q, k, v, mask, cfg.attention, kv_spec="bskd", scale=scale)
        out = out.reshape(b, t, cfg.num_heads * cfg.head_dim)
        return _dense(self.o_proj, out), None


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
        kv_cache: Optional[KVCache | PagedKVCache] = None,
        segment_ids: Optional[jax.Array] = None,
        *,
        unrolled: bool = False,
        empty_cache: bool = False,
    ) -> tuple[jax.Array, Optional[KVCache | PagedKVCache]]:
        """Final-norm hidden states [B, T, hidden] (compute dtype) and the updated cache.

        ``segment_ids`` int32 [B, T] (packed rows, no cache; 0 = padding): attention stays within
        a segment and positions restart at 0 in each (:func:`segment_positions`). ``unrolled``:
        never :func:`scanned_layers` (for callers that capture what layers sow: a ``lax.scan``
        body's intermediates do not reach the caller). ``empty_cache`` (static): ``kv_cache`` holds
        no token yet (:func:`~asyncrl.model.kv_cache.init_kv_cache`; a prefill), so the call's tokens attend only among
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
        if isinstance(kv_cache, PagedKVCache):
            return self._paged(input_ids, positions, attention_mask, kv_cache, empty_cache)
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

    def _paged(self, input_ids: jax.Array, positions: Optional[jax.Array], attention_mask: jax.Array, cache: PagedKVCache,
               fresh: bool) -> tuple[jax.Array, PagedKVCache]:
        """:meth:`hidden_states` over a paged cache (:class:`~asyncrl.model.kv_cache.PagedKVCache`'s
        protocol): each real token lands at its row's next position, which is also its rotary
        position; ``fresh``: the rows hold nothing yet (a prefill)."""
        cfg = self.cfg
        running = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
        written = cache.lengths[:, None] + running  # [B, T]
        positions = written if positions is None else positions
        queries = PagedQueries(written, attention_mask, cache.page_table, cache.flat, None, fresh)
        by_type = {"full_attention": (*rope_cos_sin(cfg, positions), queries)}
        if cfg.layer_types is not None and "sliding_attention" in cfg.layer_types:
            local = cfg if cfg.rope_local_theta is None else cfg.replace(rope_theta=cfg.rope_local_theta, rope_type="default")
            by_type["sliding_attention"] = (*rope_cos_sin(local, positions), queries.with_window(cfg.sliding_window))
        x = self.embed_tokens(input_ids)
        if cfg.scale_embeddings:
            x = x * jnp.asarray(cfg.hidden_size**0.5, dtype_of(cfg.param_dtype)).astype(x.dtype)
        call = _REMAT_CALLS[cfg.remat_policy] if cfg.remat else _call_layer
        new_layers = []
        for i, layer in enumerate(self.layers):
            cos, sin, layer_queries = by_type[cfg.layer_type(i)]
            x, layer_cache = call(layer, x, cos, sin, layer_queries, cache.layers[i], None)
            new_layers.append(layer_cache)
        lengths = (cache.lengths + attention_mask.sum(axis=1)).astype(jnp.int32)
        return self.norm(x), cache._replace(layers=tuple(new_layers), lengths=lengths)

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
    kv_cache: Optional[KVCache | PagedKVCache] = None,
) -> tuple[jax.Array, Any]:
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
    (static): ``kv_cache`` is fresh from :func:`~asyncrl.model.kv_cache.init_kv_cache` (a prefill; :meth:`Decoder.hidden_states`)."""
    model = nnx.merge(graphdef, params)
    return model.hidden_states(input_ids, positions, attention_mask, kv_cache, empty_cache=empty_cache)


forward_jit = jax.jit(forward, static_argnums=0)
"""``forward`` jitted at module level (graphdef static), shared by every caller."""


def split_params(model: Decoder) -> tuple[nnx.GraphDef, dict]:
    """``(graphdef, params)`` with params a pure dict of ``jax.Array`` (immutable, publishable)."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)
