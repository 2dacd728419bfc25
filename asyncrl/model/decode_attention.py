"""The GPU decode-attention kernels: one new token per row attending over its KV (a decode step),
over a contiguous cache or through page tables.

:func:`pallas_decode_attention` (Pallas, lowered through Triton) computes the scores, the softmax
and the weighted values of one query token in one kernel, instead of XLA's five (the scores GEMM,
two softmax reductions, the normalisation, the values GEMM), over a contiguous cache (beam search's,
:mod:`asyncrl.model.kv_cache`). When it runs is decided in one place,
:func:`asyncrl.model.attention.cached_attention` (on CUDA lowerings, for the shapes it takes; the
einsum path, :func:`asyncrl.model.attention.einsum_attention`, everywhere else and as its reference).

The kernel runs one program per (row, KV head): the query heads of the group (padded to 16, the
smallest ``tl.dot`` tile) against the row's keys and values in blocks of up to 128 cache slots, with
an online softmax in float32 (running maximum and sum, the normalisation once at the end). The mask
``[B, S]`` carries everything position-dependent: the valid slots, causality and Gemma 3's sliding
windows, so the kernel needs no window argument; masked scores get the same finite ``-1e30`` as the
einsum path, so a fully masked row (an idle one) averages its values uniformly there too, never NaN.
The models asyncrl loads have no attention-logit soft-capping (Gemma 3 has none; its final-logit cap
is outside attention).

:func:`pallas_paged_decode_attention` is the engine's: the same online softmax per (row, KV head),
walking the row's page table :func:`pages_per_block` pages (:data:`BLOCK_POSITIONS` positions) at a
time up to the new token's position (within Gemma 3's window), the new key and value written into
the pool in place. :mod:`asyncrl.model.paged_attention` decides when it runs (CUDA lowerings, the
GPU's page layout, shapes of whole ``tl.dot`` tiles; elsewhere
:func:`~asyncrl.model.paged_attention.paged_decode_attention`, its reference).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

_MASKED = -1e30  # as asyncrl.model.attention's: finite, so fully masked rows never give NaN
_GROUP_TILE = 16  # query heads per program, padded: the smallest dot tile Triton takes
_BLOCK = 128  # cache slots per step of the kernel's loop (fewer when S is smaller)
def kernel_block(slots: int, head_dim: int = 64) -> Optional[int]:
    """Cache slots per step of the kernel's loop for a cache prefix of ``slots``: the largest power
    of two dividing it, at least 16 (a dot tile), at most 128 and at most ``8192 / head_dim`` (a
    block of keys and one of values, 32 KiB in bf16 each, twice for the pipeline, stay well inside
    an H100's shared memory; Gemma 3's 256-wide heads take 32); None when there is none (the
    einsum path)."""
    block = max(16, min(_BLOCK, 8192 // head_dim))
    while block >= 16:
        if slots % block == 0:
            return block
        block //= 2
    return None


def _kernel(q_ref, k_new_ref, v_new_ref, pos_ref, new_valid_ref, k_ref, v_ref, mask_ref, o_ref, k_out_ref, v_out_ref,
            *, scale: float, block: int, slots: int):
    q = q_ref[...].astype(jnp.float32) * scale  # [G, D]
    k_new = k_new_ref[...]  # [D]: the new token's key and value (rounded to q's dtype), written to the cache at `pos` below
    v_new = v_new_ref[...]
    pos = pos_ref[0]
    # The new token enters the online softmax first, from registers: the cache read below still
    # holds the old slot at `pos` (its write lands in the same buffer), so that slot is skipped there.
    first = jnp.sum(q * k_new.astype(jnp.float32)[None, :], axis=1)  # [G]
    first = jnp.where(new_valid_ref[0] != 0, first, _MASKED)

    def step(i, carry):
        top, total, acc = carry
        span = pl_ds(i * block, block)
        k = k_ref[span, :].astype(jnp.float32)  # [block, D]
        v = v_ref[span, :]
        keep = mask_ref[span] != 0  # [block]
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())))  # [G, block]
        scores = jnp.where(keep[None, :], scores, _MASKED)
        new_top = jnp.maximum(top, jnp.max(scores, axis=1))
        rescale = jnp.exp(top - new_top)
        p = jnp.exp(scores - new_top[:, None])
        p = jnp.where((i * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0) == pos)[None, :], 0.0, p)
        total = total * rescale + jnp.sum(p, axis=1)
        acc = acc * rescale[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return new_top, total, acc

    heads, dim = q.shape
    init = (first, jnp.ones((heads,), jnp.float32), jnp.broadcast_to(v_new.astype(jnp.float32)[None, :], (heads, dim)))
    _, total, acc = jax.lax.fori_loop(0, slots // block, step, init)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)

    @pl_when(pos < slots)
    def _write():
        k_out_ref[pl_ds(pos, 1), :] = k_new[None, :].astype(k_out_ref.dtype)
        v_out_ref[pl_ds(pos, 1), :] = v_new[None, :].astype(v_out_ref.dtype)


def pl_ds(start, size):
    from jax.experimental import pallas as pl

    return pl.ds(start, size)


def pl_when(condition):
    from jax.experimental import pallas as pl

    return pl.when(condition)


def pallas_decode_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k: jax.Array, v: jax.Array,
                            write_pos: jax.Array, mask: jax.Array, scale: float,
                            interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel: ``q [B, heads, D]`` (one token per row) and its ``k_new, v_new [B, kv_heads, D]``,
    written into the cache's ``k, v [B, kv_heads, S, D]`` at ``write_pos`` int32 [B] (dropped when
    ``>= S``) in place (the outputs alias ``k`` and ``v``), then attended with the cache under
    ``mask`` bool ``[B, S]``. Returns ``(out [B, heads, D] in q's dtype, k, v)``. ``S`` must have a
    :func:`kernel_block`. ``interpret``: run it with Pallas' interpreter (any platform, for tests)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    b, heads, d = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block = kernel_block(slots, d)
    assert block is not None, f"decode attention kernel: {slots} cache slots have no block of 16 or more"
    tile = max(_GROUP_TILE, 1 << (group - 1).bit_length())
    in_range = write_pos < slots
    new_valid = jnp.take_along_axis(mask, jnp.where(in_range, write_pos, 0)[:, None], axis=1)[:, 0] & in_range
    # The group's query heads as a block of ``tile`` rows over an array of ``group``: the rows past
    # the array are not loaded meaningfully nor stored (Pallas masks a block's out-of-bounds part),
    # so no padded copy of q goes in and no slice of the output comes out (each would be a kernel).
    kernel = functools.partial(_kernel, scale=scale, block=block, slots=slots)
    row = lambda i, h: (i, 0)
    cache_spec = pl.BlockSpec((None, None, slots, d), lambda i, h: (i, h, 0, 0))
    # One array of each KV head's query heads, then its new key and value, [B, kv_heads, group + 2, D]:
    # XLA computes it in one fusion (bias, rope, concatenation) where three separate operands took three.
    new = jnp.concatenate([q.reshape(b, kv_heads, group, d), k_new.astype(q.dtype)[:, :, None],
                           v_new.astype(q.dtype)[:, :, None]], axis=2)
    out, k, v = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, kv_heads, group, d), q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(b, kv_heads),
        in_specs=[
            pl.BlockSpec((None, None, tile, d), lambda i, h: (i, h, 0, 0)),  # rows past the group: unused
            pl.BlockSpec((None, None, None, d), lambda i, h: (i, h, group, 0)),
            pl.BlockSpec((None, None, None, d), lambda i, h: (i, h, group + 1, 0)),
            pl.BlockSpec((None, 1), row),
            pl.BlockSpec((None, 1), row),
            cache_spec,
            cache_spec,
            pl.BlockSpec((None, slots), row),
        ],
        out_specs=(pl.BlockSpec((None, None, tile, d), lambda i, h: (i, h, 0, 0)), cache_spec, cache_spec),
        input_output_aliases={5: 1, 6: 2},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # Triton, not Mosaic GPU (jax's default)
        name="decode_attention",
    )(new, new, new, write_pos[:, None].astype(jnp.int32), new_valid[:, None].astype(jnp.int32), k, v,
      mask.astype(jnp.int32))
    return out.reshape(b, heads, d), k, v


# --------------------------------------------------------------------------- through page tables

BLOCK_POSITIONS = 128
"""Positions a step of the paged kernel's loop reads: whole pages, 8 of 16 positions, 4 of 32, 2 of
64 (a block of keys and one of values stay inside an H100's shared memory whatever the page size)."""


def pages_per_block(page_size: int) -> int:
    """Pages a step of the paged kernel's loop reads: :data:`BLOCK_POSITIONS` of them, at least one."""
    return max(1, BLOCK_POSITIONS // page_size)


def _paged_kernel(q_ref, k_new_ref, v_new_ref, row_ref, table_ref, kv_ref, o_ref, kv_out_ref, *, scale: float,
                  pages: int, window: Optional[int]):
    q = q_ref[...].astype(jnp.float32) * scale  # [G, D]
    k_new = k_new_ref[...]  # [D]: the new token's key and value, written at (row_ref's page, offset) below
    v_new = v_new_ref[...]
    position, page, offset, real = row_ref[0], row_ref[1], row_ref[2], row_ref[3] != 0
    page_size = kv_ref.shape[2]
    span = pages * page_size
    # The new token enters the online softmax first, from registers (its page is written in place below).
    first = jnp.where(real, jnp.sum(q * k_new.astype(jnp.float32)[None, :], axis=1), _MASKED)  # [G]

    def step(i, carry):
        top, total, acc = carry
        listed = table_ref[pl_ds(i * pages, pages)]  # [pages]: this block's pages of the row
        k = kv_ref[0, listed].reshape(span, -1).astype(jnp.float32)  # [pages * page_size, D]
        v = kv_ref[1, listed].reshape(span, -1)
        keys = i * span + jax.lax.broadcasted_iota(jnp.int32, (span,), 0)
        keep = keys < position  # the positions before the new token's (its own came from registers)
        if window is not None:
            keep = keep & (keys > position - window)
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())))  # [G, span]
        scores = jnp.where(keep[None, :], scores, _MASKED)
        new_top = jnp.maximum(top, jnp.max(scores, axis=1))
        rescale = jnp.exp(top - new_top)
        p = jnp.where(keep[None, :], jnp.exp(scores - new_top[:, None]), 0.0)
        total = total * rescale + jnp.sum(p, axis=1)
        acc = acc * rescale[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return new_top, total, acc

    heads, dim = q.shape
    start = 0 if window is None else jnp.maximum(position - window + 1, 0) // span
    stop = position // span + 1  # the block holding the new token's position
    init = (first, jnp.ones((heads,), jnp.float32), jnp.broadcast_to(v_new.astype(jnp.float32)[None, :], (heads, dim)))
    _, total, acc = jax.lax.fori_loop(start, stop, step, init)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)

    @pl_when(real)
    def _write():
        kv_out_ref[0, page, pl_ds(offset, 1), :] = k_new[None, :].astype(kv_out_ref.dtype)
        kv_out_ref[1, page, pl_ds(offset, 1), :] = v_new[None, :].astype(kv_out_ref.dtype)


def grouped_new_tokens(q: jax.Array, k_new: jax.Array, v_new: jax.Array) -> jax.Array:
    """The paged kernel's one input of new tokens: each KV head's query heads, then its new key and
    value, ``[B, kv_heads, group + 2, D]`` in ``q``'s dtype, from ``q [B, heads, D]`` and ``k_new,
    v_new [B, kv_heads, D]``. XLA computes it in one fusion with what produces them (bias, rope,
    the q/k norms) where three separate operands took a fusion each."""
    b, heads, d = q.shape
    kv_heads = k_new.shape[1]
    return jnp.concatenate([q.reshape(b, kv_heads, heads // kv_heads, d), k_new.astype(q.dtype)[:, :, None],
                            v_new.astype(q.dtype)[:, :, None]], axis=2)


def projections_fit(heads: int, kv_heads: int) -> bool:
    """Whether :func:`paged_decode_kernel` can read the new tokens in the projections' order: each
    KV head's query heads one row of ``group`` and the keys and values whole rows of it too."""
    group = heads // kv_heads
    return (2 * kv_heads) % group == 0


def pallas_paged_decode_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, kv: jax.Array, page_table: jax.Array,
                                  positions: jax.Array, real: jax.Array, scale: float, window: Optional[int] = None,
                                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The paged kernel: ``q [B, heads, D]`` (one token per row) and its ``k_new, v_new [B, kv_heads,
    D]``, written into the pool ``kv [2, kv_heads, pages, page_size, D]`` (keys at 0, values at 1:
    the ``2kpsd`` layout) at ``positions`` int32 [B] through ``page_table`` int32 ``[B, P]`` where
    ``real`` (bool [B]), in place (the output aliases ``kv``), then attended over the row's positions
    up to its own (within Gemma 3's ``window``). Returns ``(out [B, heads, D] in q's dtype, kv)``.
    One program per (row, KV head) walks the row's pages :func:`pages_per_block` at a time up to its
    position, with an online softmax in float32. ``interpret``: Pallas' interpreter (tests)."""
    return paged_decode_kernel(grouped_new_tokens(q, k_new, v_new), kv, page_table, positions, real, scale, window,
                               interpret)


def paged_decode_kernel(new: jax.Array, kv: jax.Array, page_table: jax.Array, positions: jax.Array, real: jax.Array,
                        scale: float, window: Optional[int] = None, interpret: bool = False,
                        projections: bool = False) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_paged_decode_attention` over the new tokens laid out by
    :func:`grouped_new_tokens` (``new [B, kv_heads, group + 2, D]``), or with ``projections`` in the
    projections' own order, every query head, then every key, then every value, as ``[B, (heads +
    2 kv_heads) / group, group, D]`` (see :func:`projections_fit`). Returns ``(out [B, heads, D] in
    new's dtype, kv)``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    b, rows, per_row, d = new.shape
    _, kv_heads, pool, page_size, _ = kv.shape
    group = per_row if projections else per_row - 2
    heads = kv_heads * group
    if projections:  # key h is row heads + h of the projections, value h row heads + kv_heads + h
        key_at = lambda i, h: (i, (heads + h) // group, (heads + h) % group, 0)
        value_at = lambda i, h: (i, (heads + kv_heads + h) // group, (heads + kv_heads + h) % group, 0)
    else:
        key_at = lambda i, h: (i, h, group, 0)
        value_at = lambda i, h: (i, h, group + 1, 0)
    pages = min(pages_per_block(page_size), page_table.shape[1])
    width = -(-page_table.shape[1] // pages) * pages
    # past a row's own pages its table holds the pool's size ("none"): read page 0 there instead (masked)
    table = jnp.where(page_table < pool, page_table, 0)
    table = jnp.pad(table, ((0, 0), (0, width - table.shape[1]))).astype(jnp.int32)
    slot = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, slot[:, None], axis=1)[:, 0]
    real = real & (page < pool) & (positions < page_table.shape[1] * page_size)
    row = jnp.stack([positions, jnp.where(real, page, 0), positions % page_size, real.astype(jnp.int32)], axis=1)
    tile = max(_GROUP_TILE, 1 << (group - 1).bit_length())
    kernel = functools.partial(_paged_kernel, scale=scale, pages=pages, window=window)
    pool_spec = pl.BlockSpec((2, None, pool, page_size, d), lambda i, h: (0, h, 0, 0, 0))
    out, kv = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, kv_heads, group, d), new.dtype), jax.ShapeDtypeStruct(kv.shape, kv.dtype)),
        grid=(b, kv_heads),
        in_specs=[
            pl.BlockSpec((None, None, tile, d), lambda i, h: (i, h, 0, 0)),  # rows past the group: unused
            pl.BlockSpec((None, None, None, d), key_at),
            pl.BlockSpec((None, None, None, d), value_at),
            pl.BlockSpec((None, 4), lambda i, h: (i, 0)),
            pl.BlockSpec((None, width), lambda i, h: (i, 0)),
            pool_spec,
        ],
        out_specs=(pl.BlockSpec((None, None, tile, d), lambda i, h: (i, h, 0, 0)), pool_spec),
        input_output_aliases={5: 1},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        name="paged_decode_attention",
    )(new, new, new, row, table, kv)
    return out.reshape(b, heads, d), kv
