"""Per-token KL estimators to a frozen reference (John Schulman, "Approximating KL divergence", 2020).

With delta = log pi(y) - log pi_ref(y) for a token y sampled from pi (shapes ``[B, L]``):

- ``k1`` = delta: unbiased for KL(pi || ref); its expected gradient on-policy is 0
  (E_pi[grad log pi] = 0), so as a loss term it does nothing in expectation;
- ``k2`` = delta^2 / 2: expected gradient on-policy is grad KL(pi || ref);
- ``k3`` = exp(-delta) - 1 + delta, clamped to [-10, 10] (delta itself clamped to
  [-20, 20] first so exp cannot overflow): unbiased for KL(pi || ref) as a value, but its
  expected gradient on-policy is grad KL(ref || pi).

"Expected gradient on-policy" is sum_y sg(pi(y)) grad k(y); ``tests/algo/test_algo_kl.py``
checks all three by exact enumeration over a categorical policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    return logprobs - ref_logprobs


def k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    delta = logprobs - ref_logprobs
    return 0.5 * delta * delta


def k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    delta = jnp.clip(logprobs - ref_logprobs, -20.0, 20.0)
    return jnp.clip(jnp.exp(-delta) - 1.0 + delta, -10.0, 10.0)


KL_ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3}
"""``algo.kl_estimator`` value -> per-token estimator ``(logprobs, ref_logprobs) -> [B, L]``."""


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str) -> jax.Array:
    """Per-token KL estimate ``[B, L]`` of the named estimator (``k1``, ``k2`` or ``k3``)."""
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)
