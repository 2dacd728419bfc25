"""The train step's performance-critical structure: the chosen-token log-prob's own
gradient equals automatic differentiation of ``log_softmax``, and the donated optimizer state is
updated in place (the compiled step copies none of it)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.model import token_logprobs_from_logits
from asyncrl.trainer import Trainer
from asyncrl.trainer.step import train_step
from tests.trainer_fixtures import make_batch, tiny_model, trainer_config


def _reference_logprobs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array) -> jax.Array:
    """log_softmax(logits / T)[tokens] by plain autodiff-able ops."""
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


_ours_grad = jax.jit(jax.grad(
    lambda logits, temperature, tokens, weights: jnp.sum(
        token_logprobs_from_logits(logits, tokens, temperature, with_entropy=False)[0] * weights),
    argnums=(0, 1)))
_reference_grad = jax.jit(jax.grad(
    lambda logits, temperature, tokens, weights: jnp.sum(_reference_logprobs(logits, tokens, temperature) * weights),
    argnums=(0, 1)))


@pytest.mark.parametrize("temperature", [1.0, pytest.param(0.7, marks=pytest.mark.slow)])
def test_chosen_logprob_gradient_equals_autodiff_of_log_softmax(temperature):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 37)) * 3, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 37, size=(3, 5)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    t = jnp.float32(temperature)
    ours, _ = token_logprobs_from_logits(logits, tokens, t, with_entropy=False)
    np.testing.assert_allclose(ours, _reference_logprobs(logits, tokens, t), rtol=1e-6, atol=1e-6)
    (d_logits, d_t), (ref_logits, ref_t) = _ours_grad(logits, t, tokens, weights), _reference_grad(logits, t, tokens, weights)
    np.testing.assert_allclose(d_logits, ref_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d_t, ref_t, rtol=1e-5)


def test_per_row_temperature_and_negative_token_ids_keep_exact_gradients():
    """A broadcast temperature [rows, 1, 1] takes plain autodiff; a negative token id reads the
    vocabulary from its end in the value and in the gradient alike (as take_along_axis does)."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(3, 5, 37)) * 3, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 37, size=(3, 5)), jnp.int32).at[0, 0].set(-1)
    weights = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    for t in (jnp.asarray([0.5, 1.0, 1.5], jnp.float32)[:, None, None], jnp.float32(0.8)):
        wrapped = jnp.where(tokens < 0, tokens + 37, tokens)
        (d_logits, d_t), (ref_logits, ref_t) = (_ours_grad(logits, t, tokens, weights),
                                                 _reference_grad(logits, t, wrapped, weights))
        np.testing.assert_allclose(d_logits, ref_logits, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(d_t, ref_t, rtol=1e-5, atol=1e-6)


def test_compiled_step_copies_no_optimizer_state():
    """jit pairs each donated input with the first output of its shape: the step must return the
    optimizer state first, and must not read the old state after updating it, or XLA copies it."""
    graphdef, params = tiny_model(layers=1)
    trainer = Trainer(trainer_config(), graphdef, params)
    args, kwargs = trainer._step_arguments(make_batch(seed=1))
    text = train_step.lower(*args, **kwargs).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    copied = re.findall(r"= \S+ copy\(%(opt_state\S*)\)", entry)
    assert "opt_state" in entry and not copied, copied[:5]
