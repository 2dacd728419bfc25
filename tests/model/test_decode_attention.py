"""The decode attention kernels (asyncrl.model.decode_attention) against the paths they replace on
GPUs, run by Pallas' interpreter on the CPU. The contiguous cache's (a beam search's): the shapes
it takes (grouped KV heads of 7 and 2 query heads, one KV head per query head, 16 to 1024 slots),
masks of valid slots, causality and Gemma 3's sliding window, idle (fully masked) rows and writes
past the attended prefix (dropped), float32 and bfloat16: the same output and the same updated
cache. The paged one's, through scattered page tables: the einsum over each row's gathered pages
and the same pool after its write; and those paths (and the CPU's flat one), in both page layouts,
against JAX's own ``ref_ragged_paged_attention``."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.model.attention import _decode_kernel, _scatter_and_attend
from asyncrl.model.blocks import sliding_window_mask
from asyncrl.model.decode_attention import kernel_block, pallas_decode_attention


def _inputs(rows, heads, kv_heads, slots, dim, dtype, seed=0, window=None):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    q, k_new, v_new = normal(rows, 1, heads, dim), normal(rows, 1, kv_heads, dim), normal(rows, 1, kv_heads, dim)
    k, v = normal(rows, kv_heads, slots, dim), normal(rows, kv_heads, slots, dim)
    write = rng.integers(0, slots, size=rows)  # each row's new token position
    valid = (np.arange(slots)[None] <= write[:, None]) & (rng.random((rows, slots)) < 0.9)
    valid[np.arange(rows), write] = True
    valid[-1] = False  # an idle slot: nothing valid (uniform weights on the einsum path), its write past the prefix
    write[-1] = slots + 3
    mask = jnp.asarray(valid)[:, None, :]
    if window is not None:
        mask = sliding_window_mask(mask, jnp.asarray(write)[:, None], jnp.arange(slots), window)
    return q, k_new, v_new, k, v, jnp.asarray(write, jnp.int32), mask


@functools.partial(jax.jit, static_argnums=(7,))
def _both(q, k_new, v_new, k, v, write, mask, scale):
    ref = _scatter_and_attend(q, k_new, v_new, k, v, write, mask, scale=scale)
    out, k_out, v_out = pallas_decode_attention(q[:, 0], k_new[:, 0], v_new[:, 0], k, v, write, mask[:, 0], scale,
                                                interpret=True)
    return ref, (out[:, None], k_out, v_out)


def _check(ref, got, atol):
    ref_out, ref_k, ref_v = (np.asarray(x, np.float32) for x in ref)
    out, k, v = (np.asarray(x, np.float32) for x in got)
    np.testing.assert_array_equal(k, ref_k)  # the cache writes are exact
    np.testing.assert_array_equal(v, ref_v)
    np.testing.assert_allclose(out[:-1], ref_out[:-1], atol=atol, rtol=0)  # the idle row's output is never used


@pytest.mark.parametrize("heads, kv_heads, slots, dim, window", [
    (14, 2, 128, 64, 32),  # Qwen2.5-0.5B's heads at its smallest attention bucket, with a sliding window (the one in the default run)
    pytest.param(14, 2, 1024, 64, None, marks=pytest.mark.slow),  # its whole 1024-slot cache
    pytest.param(4, 2, 96, 16, None, marks=pytest.mark.slow),  # tiny (engine tests): 96 slots, blocks of 32
    pytest.param(4, 4, 48, 16, 8, marks=pytest.mark.slow),  # one KV head per query head, blocks of 16
])
def test_kernel_equals_einsum_float32(heads, kv_heads, slots, dim, window):
    args = _inputs(3, heads, kv_heads, slots, dim, jnp.float32, window=window)
    _check(*_both(*args, dim**-0.5), atol=2e-6)


@pytest.mark.slow
def test_kernel_equals_einsum_bfloat16():
    """bf16 operands (the GPU recipes' compute dtype): within bf16 rounding of the output."""
    args = _inputs(3, 14, 2, 256, 64, jnp.bfloat16, seed=1)
    _check(*_both(*args, 0.125), atol=2e-2)


def test_kernel_blocks_and_platform_choice():
    assert kernel_block(1024) == 128 and kernel_block(96) == 32 and kernel_block(48) == 16
    assert kernel_block(1024, head_dim=256) == 32  # Gemma 3: a smaller block of its wider heads
    assert kernel_block(40) is None  # no block of 16 or more: the einsum path
    from asyncrl.model.decode_attention import pages_per_block

    assert [pages_per_block(size) for size in (16, 32, 64, 256)] == [8, 4, 2, 1]  # 128 positions a step, whole pages
    reference = functools.partial(_scatter_and_attend, scale=0.25)
    # On the CPU the kernel's entry is the scatter-and-einsum path itself (bitwise).
    for slots in (40, 48):
        q, k_new, v_new, k, v, write, mask = _inputs(2, 4, 2, slots, 16, jnp.float32)
        got = jax.jit(lambda *a: _decode_kernel(*a[:6], a[6], 0.25, reference))(q, k_new, v_new, k, v, write, mask)
        want = jax.jit(reference)(q, k_new, v_new, k, v, write, mask)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------- over pages


def _paged_inputs(layout: str, window=None, seed=0):
    """Three rows over a pool of 12 pages of 16 (one idle, its table empty), scattered pages, the
    new tokens at positions 35, 70 and 5; GQA of 4 query heads on 2 KV heads."""
    from asyncrl.model.kv_cache import PagedLayerKV, write_pages
    from asyncrl.model.paged_attention import PagedQueries

    rng = np.random.default_rng(seed)
    b, heads, kv_heads, d, pool, size, per_seq = 3, 4, 2, 16, 12, 16, 5
    shape = (2, kv_heads, pool, size, d) if layout == "2kpsd" else (pool, size, 2 * kv_heads, d)
    layer = PagedLayerKV(jnp.asarray(rng.normal(size=shape), jnp.float32), layout)
    table = np.full((b, per_seq), pool, np.int32)
    table[0, :3], table[1, :5], table[2, :1] = [4, 1, 7], [0, 2, 3, 5, 6], [9]
    positions, real = np.array([[35], [70], [5]], np.int32), np.array([[True], [True], [False]])
    q = jnp.asarray(rng.normal(size=(b, 1, heads, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, 1, kv_heads, d)), jnp.float32) for _ in range(2))
    queries = PagedQueries(jnp.asarray(positions), jnp.asarray(real), jnp.asarray(table), None, window)
    written = write_pages(layer, k, v, queries.page_table, queries.positions, queries.real)
    return q, k, v, layer, written, queries


@pytest.mark.parametrize("window", [20, pytest.param(None, marks=pytest.mark.slow)])
def test_paged_kernel_equals_the_reference(window):
    """The GPU's paged decode kernel (Pallas' interpreter here) against the einsum over each row's
    gathered pages: the same output, and the same pool after its in-place write."""
    from asyncrl.model.decode_attention import pallas_paged_decode_attention
    from asyncrl.model.paged_attention import reference_paged_attention

    q, k, v, layer, written, queries = _paged_inputs("2kpsd", window)
    want = reference_paged_attention(q, written, queries, 0.25)
    out, kv = pallas_paged_decode_attention(q[:, 0], k[:, 0], v[:, 0], layer.kv, queries.page_table,
                                            queries.positions[:, 0], queries.real[:, 0], 0.25, window, interpret=True)
    np.testing.assert_array_equal(np.asarray(kv), np.asarray(written.kv))
    np.testing.assert_allclose(np.asarray(out)[:2], np.asarray(want)[:2, 0], atol=1e-6, rtol=0)  # the idle row: unused


@pytest.mark.parametrize("plus_one", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_paged_kernel_over_projections_with_norms_and_rope_equals_the_reference(plus_one):
    """The GPU path's one fusion before the kernel (q/k norms and rotation over the projections in
    their own order, the values passed through) and the kernel reading that layout (Pallas'
    interpreter here), against the attention module's own order: norms, rope, write, reference."""
    from asyncrl.model.decode_attention import paged_decode_kernel, projections_fit
    from asyncrl.model.kv_cache import write_pages
    from asyncrl.model.paged_attention import QKPrologue, _prologue_in_projection_order, reference_paged_attention

    q, k, v, layer, _, queries = _paged_inputs("2kpsd", 20)
    rng = np.random.default_rng(1)
    cos, sin = (jnp.asarray(rng.normal(size=(3, 1, 16)), jnp.float32) for _ in range(2))
    norms = tuple(jnp.asarray(rng.normal(size=(16,)), jnp.float32) for _ in range(2))
    prologue = QKPrologue(cos, sin, norms, 1e-6, plus_one)
    assert projections_fit(4, 2)
    q_turned, k_turned = prologue.apply(q, k)
    written = write_pages(layer, k_turned, v, queries.page_table, queries.positions, queries.real)
    want = reference_paged_attention(q_turned, written, queries, 0.25)
    new = _prologue_in_projection_order(q[:, 0], k[:, 0], v[:, 0], prologue)
    out, kv = paged_decode_kernel(new, layer.kv, queries.page_table, queries.positions[:, 0], queries.real[:, 0], 0.25, 20,
                                  interpret=True, projections=True)
    np.testing.assert_array_equal(np.asarray(kv), np.asarray(written.kv))
    np.testing.assert_allclose(np.asarray(out)[:2], np.asarray(want)[:2, 0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["2kpsd", pytest.param("ps2kd", marks=pytest.mark.slow)])
def test_paged_attention_paths_equal_jax_ragged_paged_attention_reference(layout):
    """The reference over gathered pages and the CPU's flat path, in both page layouts, against
    JAX's own ``ref_ragged_paged_attention`` (the TPU kernel's reference, on the ``ps2kd`` pool:
    each row one query at its position)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    from asyncrl.model.kv_cache import FlatPages, gather_view
    from asyncrl.model.paged_attention import flat_paged_attention, reference_paged_attention

    q, _, _, _, written, queries = _paged_inputs(layout, seed=1)
    combined = written.kv  # ps2kd is the kernel's layout; 2kpsd [2, kv, pages, size, d] -> [pages, size, 2 * kv, d]
    if layout == "2kpsd":
        combined = jnp.transpose(written.kv, (2, 3, 1, 0, 4)).reshape(12, 16, 4, 16)
    table = jnp.where(queries.page_table < 12, queries.page_table, 0)
    want = ref_ragged_paged_attention(q[:2, 0], combined, queries.positions[:2, 0] + 1, table[:2], jnp.arange(3, dtype=jnp.int32),
                                      jnp.array([2], jnp.int32), sm_scale=0.25)
    got = reference_paged_attention(q, written, queries, 0.25)
    np.testing.assert_allclose(np.asarray(got)[:2, 0], np.asarray(want), atol=1e-5, rtol=0)
    pages = [(row, i) for row, count in ((0, 3), (1, 5)) for i in range(count)]
    flat = FlatPages(jnp.asarray([int(queries.page_table[r, i]) for r, i in pages] + [0], jnp.int32),
                     jnp.asarray([r for r, _ in pages] + [3], jnp.int32), jnp.asarray([16 * i for _, i in pages] + [0], jnp.int32),
                     jnp.asarray([0, 3, 8], jnp.int32))
    flat_queries = dataclasses.replace(queries, flat=flat)
    view = gather_view(written, queries.page_table, 0, flat)
    flat_out = flat_paged_attention(q, view[0], view[1], flat_queries, 0.25)
    np.testing.assert_allclose(np.asarray(flat_out)[:2], np.asarray(got)[:2], atol=1e-6, rtol=0)
