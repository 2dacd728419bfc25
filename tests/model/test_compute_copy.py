"""Weights cast once to the compute dtype (asyncrl/model/compute_copy.py): what the engine serves
and what the train step's micro-batches run on give the numbers the model's own casts give."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.model import init_decoder, per_token_logprobs, split_params
from asyncrl.model.compute_copy import cast_for_compute
from asyncrl.model.config import DecoderConfig

IDS = jnp.asarray(np.random.default_rng(0).integers(3, 60, (3, 10)), jnp.int32)
MASK = jnp.asarray(np.arange(10)[None] < np.array([10, 7, 4])[:, None])


def _bf16_model(**fields):
    cfg = DecoderConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, compute_dtype="bfloat16", **fields)
    return split_params(init_decoder(cfg, seed=2))


def test_gradients_through_the_cast_copy_are_the_models_own():
    """The train step differentiates with respect to the bfloat16 copy and accumulates in float32:
    the same numbers as differentiating the float32 weights the model casts inside (the cast's
    gradient is a cast back)."""
    graphdef, params = _bf16_model()

    def loss(p):
        logprobs, entropy = per_token_logprobs(graphdef, p, IDS, MASK, 0.8)
        return logprobs.sum() + 0.1 * entropy.sum()

    own = jax.jit(jax.grad(loss))(params)
    copy = cast_for_compute(params, jnp.bfloat16)
    through_copy = jax.jit(jax.grad(loss))(copy)
    kinds = set()
    for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(own), jax.tree.leaves(through_copy),
                               jax.tree.leaves(copy)):
        kinds.add(str(c.dtype))
        np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(a), err_msg=jax.tree_util.keystr(path))
    assert kinds == {"bfloat16", "float32"}  # matrices cast, norm weights left as they are


def test_a_router_kernel_stays_float32():
    graphdef, params = _bf16_model(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    copy = cast_for_compute(params, jnp.bfloat16)
    layer = copy["layers"][0]["mlp"]
    assert layer["gate"]["kernel"].dtype == jnp.float32  # the router: read in float32
    assert layer["experts"]["gate_proj"].dtype == jnp.bfloat16  # the experts: used in the compute dtype
