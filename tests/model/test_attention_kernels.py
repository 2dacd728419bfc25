"""``model.attention``'s kernels take the mask as structure and change no result (asyncrl/model/attention.py):
``auto`` picks the kernel of the platform the program is compiled for; the mask's structure
(causal, padding, packing's segment ids, a sliding window) gives the einsum reference's attention
through cuDNN's lengths form (run here by XLA's implementation of the same call) and through
splash attention (Pallas' interpret mode on the CPU); the model's log-probs and gradients with
splash equal the reference's. Compiled for the ``h100`` / ``v6e-8`` targets:
tests/model/test_attention_targets.py."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.model import attention as attention_module
from asyncrl.model import init_decoder, split_params
from asyncrl.model.attention import (
    KernelTarget,
    SelfAttentionMask,
    attention_kernel,
    compiled_for,
    current_target,
    einsum_attention,
)
from asyncrl.model.logprobs import per_token_logprobs
from asyncrl.model.tiny import TinySpec, tiny_decoder_config


def masks() -> tuple[np.ndarray, np.ndarray]:
    """``key_valid`` and ``segment_ids`` [3, 20]: a right-padded row, a left-padded row, and a
    packed row of two segments then padding."""
    valid = np.ones((3, 20), bool)
    valid[0, -6:] = False
    valid[1, :3] = False
    segments = np.zeros((3, 20), np.int32)
    segments[2, :8], segments[2, 8:15] = 1, 2
    valid[2] = segments[2] > 0
    return valid, segments


def qkv(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    shapes = ((3, 20, 4, 16), (3, 20, 2, 16), (3, 20, 2, 16))  # 4 query heads on 2 kv heads (GQA)
    return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]


def test_auto_picks_the_kernel_of_the_target_platform(caplog):
    gpu, tpu, cpu = KernelTarget("gpu"), KernelTarget("tpu", mesh=object()), KernelTarget("cpu")
    assert attention_kernel("auto", jnp.bfloat16, 64, target=gpu) == "cudnn"
    assert attention_kernel("auto", jnp.bfloat16, 128, target=tpu) == "splash"
    assert attention_kernel("auto", jnp.float32, 64, target=cpu) == "xla"
    assert attention_kernel("xla", jnp.bfloat16, 64, target=gpu) == "xla"  # explicit choices stay
    with caplog.at_level(logging.WARNING, logger="asyncrl.model.attention"):
        assert attention_kernel("auto", jnp.float32, 64, target=gpu) == "xla"
        assert attention_kernel("auto", jnp.bfloat16, 260, target=gpu) == "xla"
    assert any("float32" in line for line in caplog.messages) and any("260" in line for line in caplog.messages)
    with pytest.raises(ValueError, match="model.attention 'cudnn' needs bfloat16"):
        attention_kernel("cudnn", jnp.float32, 64, target=gpu)
    # Without a mesh to shard_map over, splash serves one device only: the count is the target's
    # (8 chips compiled for from a CPU process with one device), not this process's.
    assert attention_kernel("auto", jnp.bfloat16, 128, target=KernelTarget("tpu", devices=1)) == "splash"
    assert attention_kernel("auto", jnp.bfloat16, 128, target=KernelTarget("tpu", devices=8)) == "xla"
    # The devices the program is compiled for decide, not only this process's backend.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with compiled_for(mesh):
        assert current_target() == KernelTarget("cpu", mesh)
    assert current_target().mesh is None


@pytest.mark.parametrize("window", [None, 5])
def test_cudnn_lengths_form_gives_the_reference_attention(monkeypatch, window):
    """cuDNN's call (causal, per-row lengths, a left window), run by XLA's implementation of the
    same arguments, equals the einsum reference on every real query of right-padded rows (every
    row asyncrl builds: real tokens first) of two lengths."""
    real_attention = jax.nn.dot_product_attention
    calls = []

    def as_xla(*args, implementation=None, **kwargs):
        calls.append((implementation, kwargs.get("is_causal"), kwargs.get("mask") is None))
        return real_attention(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(attention_module.jax.nn, "dot_product_attention", as_xla)
    valid = np.ones((2, 20), bool)
    valid[0, -6:] = False
    valid[1, -2:] = False
    q, k, v = (x[:2] for x in qkv())
    mask = SelfAttentionMask(jnp.asarray(valid), None, window)
    got = attention_module.cudnn_attention(q, k, v, mask, scale=0.3)
    want = einsum_attention(q, k, v, mask.dense(), "bskd", 0.3)
    assert calls == [("cudnn", True, True)]  # the lengths form: no mask operand
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5)


@functools.partial(jax.jit, static_argnames=("window",))
def splash_and_reference(q, k, v, valid, segments, window):
    """Splash attention (interpret mode) and the einsum reference on one mask: causal, padding,
    packed segments and a sliding window at once (one compile)."""
    mask = SelfAttentionMask(valid, segments, window)
    return attention_module.splash_attention(q, k, v, mask, 0.25, interpret=True), einsum_attention(
        q, k, v, mask.dense(), "bskd", 0.25)


def test_splash_masks_give_the_reference_attention():
    """One interpret-mode call (the sequence padded to the kernel's 128-token block): every real
    query of a right-padded, a left-padded and a packed row, within a window of 6."""
    valid, segments = masks()
    segments = np.where(segments > 0, segments, valid.astype(np.int32))  # unpacked rows: real 1 / padding 0
    got, want = splash_and_reference(*qkv(), jnp.asarray(valid), jnp.asarray(segments), 6)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def loss_and_grad(graphdef, params, ids, valid, segments):
    def loss(p):
        lp, _ = per_token_logprobs(graphdef, p, ids, valid, 1.0, segment_ids=segments)
        return lp.sum(), lp

    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.mark.slow  # interpret-mode backward: about 30 s here
@pytest.mark.parametrize("packed", [False, True])
def test_model_log_probs_and_gradients_with_splash_equal_the_reference(packed):
    """The whole model (2 layers, float32) with ``model.attention: splash`` (interpret mode) against
    ``reference``: per-token log-probs and every gradient, padded or packed rows."""
    valid, segments = masks()
    segments = np.where(segments > 0, segments, valid.astype(np.int32))  # 0 exactly on padding, as packing gives
    if not packed:
        valid, segments = valid[:2], None
    base = tiny_decoder_config(TinySpec(layers=2))
    ids = jnp.asarray(np.where(valid, np.random.default_rng(1).integers(6, base.vocab_size, valid.shape), 0), jnp.int32)
    out = {}
    for choice in ("reference", "splash"):
        graphdef, params = split_params(init_decoder(base.replace(attention=choice), seed=5))
        (_, lp), grads = loss_and_grad(graphdef, params, ids, jnp.asarray(valid),
                                       None if segments is None else jnp.asarray(segments))
        out[choice] = (np.asarray(lp), jax.tree.map(np.asarray, grads))
    np.testing.assert_allclose(out["splash"][0], out["reference"][0], atol=2e-5)
    for got, want in zip(jax.tree.leaves(out["splash"][1]), jax.tree.leaves(out["reference"][1])):
        np.testing.assert_allclose(got, want, atol=2e-5)
