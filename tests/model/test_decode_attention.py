"""The decode attention kernel (asyncrl.model.decode_attention) against the scatter-and-einsum path it
replaces on GPUs, run by Pallas' interpreter on the CPU: the shapes the engine uses (grouped KV heads
of 7 and 2 query heads, one KV head per query head, attention buckets of 16 to 1024 slots), masks of
valid slots, causality and Gemma 3's sliding window, idle (fully masked) rows and writes past the
attended prefix (dropped), float32 and bfloat16: the same output and the same updated cache."""

from __future__ import annotations

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
    reference = functools.partial(_scatter_and_attend, scale=0.25)
    # On the CPU the kernel's entry is the scatter-and-einsum path itself (bitwise).
    for slots in (40, 48):
        q, k_new, v_new, k, v, write, mask = _inputs(2, 4, 2, slots, 16, jnp.float32)
        got = jax.jit(lambda *a: _decode_kernel(*a[:6], a[6], 0.25, reference))(q, k_new, v_new, k, v, write, mask)
        want = jax.jit(reference)(q, k_new, v_new, k, v, write, mask)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
