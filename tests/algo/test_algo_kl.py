"""KL estimators: values against numpy, and their expected gradients by exact enumeration."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.algo import kl_penalty


def reference_kl(logp, ref, estimator):
    logp, ref = np.asarray(logp, np.float64), np.asarray(ref, np.float64)
    ratio = np.exp(ref - logp)  # pi_ref / pi for a sample from pi
    if estimator == "k1":
        return -np.log(ratio)
    if estimator == "k2":
        return 0.5 * np.log(ratio) ** 2
    return np.minimum((ratio - 1.0) - np.log(ratio), 10.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_values_match_reference(estimator):
    rng = np.random.default_rng(1)
    logp = -rng.gamma(2.0, 1.0, size=(3, 7)).astype(np.float32)
    ref = -rng.gamma(2.0, 1.0, size=(3, 7)).astype(np.float32)
    got = np.asarray(kl_penalty(jnp.asarray(logp), jnp.asarray(ref), estimator))
    np.testing.assert_allclose(got, reference_kl(logp, ref, estimator), rtol=1e-5, atol=1e-6)


def test_k3_is_clamped_and_keeps_finite_gradients():
    logp = jnp.array([-30.0, 0.0, -0.1])
    ref = jnp.array([0.0, -30.0, -0.1])
    value, grad = jax.value_and_grad(lambda x: kl_penalty(x, ref, "k3").sum())(logp)
    assert float(kl_penalty(logp, ref, "k3")[0]) == 10.0
    assert np.isfinite(np.asarray(value)) and np.all(np.isfinite(np.asarray(grad)))


def test_expected_gradients_by_exact_enumeration():
    """On a 5-way categorical policy pi = softmax(theta), sum_y sg(pi(y)) grad k(y) equals:
    0 for k1, grad KL(pi || ref) for k2, grad KL(ref || pi) for k3."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(2)
        # Moderate logits: the identities hold while no k3 value reaches its clamp at 10
        # (pi_ref / pi < ~12), where the clamp deliberately zeroes the gradient.
        theta = 0.5 * rng.normal(size=5)
        ref_logits = 0.5 * rng.normal(size=5)
        assert np.all(np.asarray(kl_penalty(jnp.asarray(theta - np.log(np.exp(theta).sum())),
                                            jnp.asarray(ref_logits - np.log(np.exp(ref_logits).sum())), "k3")) < 10)
        pi = np.exp(theta - theta.max())
        pi /= pi.sum()
        ref = np.exp(ref_logits - ref_logits.max())
        ref /= ref.sum()
        log_pi, log_ref = np.log(pi), np.log(ref)
        # Analytic gradients with respect to the logits, written out by hand.
        kl_pi_ref = np.sum(pi * (log_pi - log_ref))
        grad_kl_pi_ref = pi * ((log_pi - log_ref) - kl_pi_ref)
        grad_kl_ref_pi = pi - ref
        expected = {"k1": np.zeros(5), "k2": grad_kl_pi_ref, "k3": grad_kl_ref_pi}

        def expected_value(logits, estimator):
            logp = jax.nn.log_softmax(logits)
            weights = jax.lax.stop_gradient(jnp.exp(logp))  # the sampling distribution is not differentiated
            return jnp.sum(weights * kl_penalty(logp, jnp.asarray(log_ref), estimator))

        for estimator, want in expected.items():
            got = jax.grad(expected_value)(jnp.asarray(theta), estimator)
            assert got.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-12, err_msg=estimator)
        # k1 and k3 are unbiased for KL(pi || ref) as values; k2 is not in general.
        for estimator in ("k1", "k3"):
            np.testing.assert_allclose(float(expected_value(jnp.asarray(theta), estimator)), kl_pi_ref, rtol=1e-10)
