"""Accelerator paths of the model change memory or kernels, not results (float32, CPU):
attention through ``jax.nn.dot_product_attention`` equals the einsum reference (GQA, causal,
left/right padding, KV-cache prefill), the automatically chunked lm head equals the unchunked
one, and ``compute_dtype: auto`` is float32 on CPU. (Parity of the default path with
transformers, qk-norm included, is tests/model/test_model.py's.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.model import init_decoder, init_kv_cache, split_params
from asyncrl.model.attention import attention_kernel
from asyncrl.model.loading import auto_compute_dtype
from asyncrl.model.logprobs import auto_chunk_size, per_token_logprobs_jit
from asyncrl.model.tiny import TinySpec, tiny_decoder_config
from asyncrl.model.transformer import forward

SEQ = 12


def padded_batch(vocab: int):
    """ids [3, SEQ]: a full row, a left-padded row (4 pads), a right-padded row (5 pads)."""
    rng = np.random.default_rng(0)
    mask = np.ones((3, SEQ), bool)
    mask[1, :4] = False
    mask[2, -5:] = False
    ids = np.where(mask, rng.integers(6, vocab, size=(3, SEQ)), 0).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(mask)


@functools.partial(jax.jit, static_argnums=0)
def logits_both_ways(graphdef, params, ids, mask):
    """Logits of a plain forward and of a prefill into an empty KV cache (more than one token)."""
    plain, _ = forward(graphdef, params, ids, None, mask)
    cfg = params_cfg(graphdef, params)
    cached, _ = forward(graphdef, params, ids, None, mask, init_kv_cache(cfg, ids.shape[0], SEQ + 4))
    return plain, cached


def params_cfg(graphdef, params):
    from flax import nnx

    return nnx.merge(graphdef, params).cfg


def test_dot_product_attention_equals_the_reference_path():
    base = tiny_decoder_config(TinySpec(layers=1))  # 4 query heads on 2 kv heads (GQA)
    assert base.num_kv_heads < base.num_heads and attention_kernel("auto", jnp.float32, 64) == "xla"
    out = {}
    for attention in ("reference", "xla"):
        graphdef, params = split_params(init_decoder(base.replace(attention=attention), seed=3))
        ids, mask = padded_batch(base.vocab_size)
        out[attention] = [np.asarray(x) for x in logits_both_ways(graphdef, params, ids, mask)]
    real = np.asarray(mask)
    for got, want in zip(out["xla"], out["reference"]):
        np.testing.assert_allclose(got[real], want[real], atol=1e-5)
    np.testing.assert_allclose(out["xla"][0][real], out["xla"][1][real], atol=1e-5)  # prefill == plain


def test_automatic_chunking_equals_the_unchunked_head():
    """Values here; chunked gradients equal plain ones in tests/model/test_model.py (explicit chunk size)."""
    base = tiny_decoder_config(TinySpec(layers=1))
    rows, vocab = 3, base.vocab_size
    budget = rows * 5 * vocab * 4 / 2**20  # five positions of [rows, positions, vocab] float32 logits
    assert auto_chunk_size(rows, SEQ, vocab, budget) == 5
    assert auto_chunk_size(rows, SEQ, vocab, 1024.0) is None and auto_chunk_size(rows, SEQ, vocab, 0) is None
    results = []
    for cfg in (base.replace(logprob_chunk_budget_mb=0), base.replace(logprob_chunk_budget_mb=budget)):
        graphdef, params = split_params(init_decoder(cfg, seed=4))
        ids, mask = padded_batch(vocab)
        results.append(jax.device_get(per_token_logprobs_jit(graphdef, params, ids, mask, 0.7)))
    for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_auto_compute_dtype_is_float32_on_cpu_and_bfloat16_on_accelerators():
    from asyncrl.config import load_config
    from asyncrl.model.loading import runtime_options

    assert auto_compute_dtype("cpu") == "float32"
    assert auto_compute_dtype("gpu") == auto_compute_dtype("tpu") == "bfloat16"
    section = load_config(data={"model": {"path": "tiny"}}).model
    assert section.compute_dtype == "auto" and section.param_dtype == "float32"  # float32 master weights
    runtime = runtime_options(section)  # what load_model(section) builds the DecoderConfig with
    assert runtime["compute_dtype"] == auto_compute_dtype() == "float32"
    assert tiny_decoder_config(TinySpec()).replace(**runtime).compute_dtype == "float32"
