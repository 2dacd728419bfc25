"""Attention of one new token per row over a filled KV cache (a decode step), in one kernel on GPUs.

:func:`decode_attention` is the one entry: on a CUDA lowering it is a Pallas kernel
(:func:`pallas_decode_attention`, lowered through Triton) that computes the scores, the softmax and
the weighted values of one query token in one kernel, instead of XLA's five (the scores GEMM, two
softmax reductions, the normalisation, the values GEMM); on every other platform, and for shapes
the kernel does not take, the einsum path (:func:`asyncrl.model.transformer._einsum_attention`), which
stays the reference. ``jax.lax.platform_dependent`` picks the path when the program is lowered, so a
program compiled for an H100 on a CPU-only machine (``asyncrl plan --target``) gets the kernel.

The kernel runs one program per (row, KV head): the query heads of the group (padded to 16, the
smallest ``tl.dot`` tile) against the row's keys and values in blocks of up to 128 cache slots, with
an online softmax in float32 (running maximum and sum, the normalisation once at the end). The mask
``[B, S]`` carries everything position-dependent: the valid slots, causality, Gemma 3's sliding
windows and the attention bucket (``S`` is the attended prefix), so the kernel needs no window or
bucket arguments; masked scores get the same finite ``-1e30`` as the einsum path, so a fully masked
row (an idle slot) averages its values uniformly there too, never NaN. The models asyncrl loads
have no attention-logit soft-capping (Gemma 3 has none; its final-logit cap is outside attention).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

_MASKED = -1e30  # as asyncrl.model.transformer's: finite, so fully masked rows never give NaN
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


def decode_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k: jax.Array, v: jax.Array,
                     write_pos: jax.Array, mask: jax.Array, scale: Optional[float], reference, choice: str = "auto"):
    """One query token per row: ``q [B, 1, heads, D]`` and its ``k_new, v_new [B, 1, kv_heads, D]``
    written into a layer's cache ``k, v [B, kv_heads, S, D]`` at ``write_pos`` int32 [B] (dropped
    past ``S``), then attended under ``mask`` bool ``[B, 1, S]``. Returns ``(out [B, 1, heads, D], k, v)``.
    ``reference`` (same arguments and result) is the scatter-and-einsum path: the CPU's, TPUs', and
    the kernel's reference; ``scale`` None is ``head_dim ** -0.5``. ``choice`` is ``model.attention``:
    ``xla`` and ``reference`` take the einsum path everywhere; otherwise the Pallas kernel runs on
    CUDA lowerings whose ``S`` has a :func:`kernel_block`. Under a mesh
    (:func:`~asyncrl.model.attention.compiled_for`: the engine's own) the kernel runs per device in a
    ``shard_map``, rows over ``data x fsdp`` and KV heads (with their query heads) over ``tensor``:
    XLA does not partition a Pallas call, it would gather the whole cache around it."""
    from asyncrl.model.attention import current_target

    heads, d = q.shape[2], q.shape[3]
    kv_heads = k.shape[1]
    if choice in ("xla", "reference") or kernel_block(k.shape[2], d) is None or heads % kv_heads:
        return reference(q, k_new, v_new, k, v, write_pos, mask)
    scale = d**-0.5 if scale is None else scale

    def kernel(q, k_new, v_new, k, v, write_pos, mask):
        out, k, v = pallas_decode_attention(q[:, 0], k_new[:, 0], v_new[:, 0], k, v, write_pos, mask[:, 0], scale)
        return out[:, None], k, v

    mesh = current_target().mesh
    if mesh is not None and mesh.size > 1:
        split = _split_specs(mesh, q.shape[0], heads, kv_heads)
        if split is None:
            return reference(q, k_new, v_new, k, v, write_pos, mask)
        tokens, cache, rows, row_mask = split
        kernel = jax.shard_map(kernel, mesh=mesh, in_specs=(tokens, tokens, tokens, cache, cache, rows, row_mask),
                               out_specs=(tokens, cache, cache), check_vma=False)
    return jax.lax.platform_dependent(q, k_new, v_new, k, v, write_pos, mask, cuda=kernel, default=reference)


def _split_specs(mesh, rows: int, heads: int, kv_heads: int):
    """The kernel's ``shard_map`` specs on ``mesh``: (the new tokens' ``[B, 1, heads, D]``, the cache's
    ``[B, kv_heads, S, D]``, the write positions' ``[B]``, the mask's ``[B, 1, S]``); None when the
    rows or the heads do not split evenly (the einsum path then)."""
    from jax.sharding import PartitionSpec as P

    replicas = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    tensor = mesh.shape.get("tensor", 1)
    if rows % replicas or heads % tensor or kv_heads % tensor:
        return None
    row = ("data", "fsdp") if replicas > 1 else None
    head = "tensor" if tensor > 1 else None
    return P(row, None, head, None), P(row, head, None, None), P(row), P(row, None, None)
