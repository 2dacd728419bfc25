"""PPO with a learned value function: token rewards, GAE, whitening and the clipped value loss.

``algo.estimator: gae`` (with a ``critic`` section) replaces the group-relative advantage of
one number per row by per-token advantages from a value model V (the critic), as in
classic PPO for language models (Ouyang et al. 2022, "Training language models to follow
instructions with human feedback"; Schulman et al. 2016, "High-dimensional continuous
control using generalized advantage estimation"). Formulas: ``docs/algorithms.md``.

Shapes: ``[B, L]`` token arrays (float32 unless noted), ``mask`` bool ``[B, L]`` the trained
tokens (already false on padding rows, prompt and tool/observation tokens:
:func:`asyncrl.algo.advantages.trained_mask`). ``values[b, t]`` is V of the state *before*
token t (its context ``input_ids[b, :t]``), read from the hidden state at ``t - 1`` like the
log-prob of token t. The actions of a row are its trained tokens in order; untrained tokens
in between (a tool's output in a multi-turn episode) are skipped: they are neither actions
nor states, so the TD step goes from one trained token straight to the next, as verl's
multi-turn GAE. After a row's last trained token the episode has ended (next value 0).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from asyncrl.algo.aggregation import Denominators, segment_totals, token_mean


def last_token_mask(mask: jax.Array, segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """bool ``[B, L]``: true at each row's last trained token (nowhere on a row without one);
    with ``segment_ids`` ``[B, L]`` (packed rows), at each segment's."""
    length = mask.shape[1]
    position = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], mask.shape)
    if segment_ids is not None:
        return mask & (position == segment_totals(jnp.where(mask, position, -1), segment_ids, jax.ops.segment_max))
    last = jnp.max(jnp.where(mask, position, -1), axis=1, keepdims=True)
    return mask & (position == last)


def token_rewards(rewards: jax.Array, mask: jax.Array, kl: Optional[jax.Array] = None, kl_coef: float = 0.0,
                  segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """``[B, L]`` r_t: the sequence reward ``rewards [B]`` on each row's last trained token, minus
    ``kl_coef * kl`` on every trained token (``kl [B, L]``: log pi_old - log pi_ref, Ouyang et al.'s
    per-token KL penalty; None or ``kl_coef`` 0: none); 0 on untrained tokens. Packed rows
    (``segment_ids`` ``[B, L]``): ``rewards`` is ``[B, L]``, each token's own row's, and lands on each
    segment's last trained token."""
    if segment_ids is not None:
        out = jnp.where(last_token_mask(mask, segment_ids), rewards.astype(jnp.float32), 0.0)
    else:
        out = jnp.where(last_token_mask(mask), rewards.astype(jnp.float32)[:, None], 0.0)
    if kl is not None and kl_coef > 0:
        out = out - kl_coef * jnp.where(mask, kl.astype(jnp.float32), 0.0)
    return out


@functools.partial(jax.jit, static_argnames=("gamma", "lam"))
def gae(token_reward: jax.Array, values: jax.Array, mask: jax.Array, gamma: float, lam: float,
        segment_ids: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """``(advantages, returns)`` ``[B, L]``, 0 on untrained tokens. Packed rows (``segment_ids``
    ``[B, L]``): each segment is an episode of its own (the recursion restarts at its last trained token).

    Over the trained tokens t_1 < t_2 < ... < t_n of a row (V(t_{n+1}) = 0)::

        delta_k = r_{t_k} + gamma V(t_{k+1}) - V(t_k)
        A_k     = delta_k + gamma lam A_{k+1}          (A_{n+1} = 0)
        R_k     = A_k + V(t_k)                          (the value target)

    A reverse ``lax.scan`` over positions; an untrained position passes the carry through.
    """
    values = jnp.where(mask, values.astype(jnp.float32), 0.0)
    token_reward = token_reward.astype(jnp.float32)
    # Where an episode ends, V(t_{n+1}) = A_{n+1} = 0 (unpacked the carry is 0 there already).
    ends = jnp.zeros_like(mask) if segment_ids is None else last_token_mask(mask, segment_ids)

    def back(carry, x):
        next_value, next_advantage = carry
        r, v, m, end = x
        next_value, next_advantage = jnp.where(end, 0.0, next_value), jnp.where(end, 0.0, next_advantage)
        advantage = r + gamma * next_value - v + gamma * lam * next_advantage
        carry = (jnp.where(m, v, next_value), jnp.where(m, advantage, next_advantage))
        return carry, jnp.where(m, advantage, 0.0)

    rows = mask.shape[0]
    zeros = jnp.zeros((rows,), jnp.float32)
    _, advantages = jax.lax.scan(back, (zeros, zeros), (token_reward.T, values.T, mask.T, ends.T), reverse=True)
    advantages = advantages.T
    return advantages, jnp.where(mask, advantages + values, 0.0)


def masked_whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased variance over the true entries of
    ``mask`` (the batch's trained tokens); 0 elsewhere."""
    count = jnp.sum(mask).astype(jnp.float32)
    mean = jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(count, 1.0)
    centred = jnp.where(mask, x - mean, 0.0)
    var = jnp.sum(centred * centred) / jnp.maximum(count - 1.0, 1.0)
    return jnp.where(mask, centred * jax.lax.rsqrt(var + eps), 0.0)


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array,
               denominators: Denominators, value_clip: Optional[float]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This micro-batch's share of the mini-batch's clipped value loss, and its diagnostics.

    Per trained token, with V the critic being trained, V_old its values at the step's start
    and R the return::

        V_clip = V_old + clip(V - V_old, -c, c)
        loss   = 1/2 max((V - R)^2, (V_clip - R)^2)      (1/2 (V - R)^2 when c is None)

    token-averaged over the mini-batch (``denominators`` are the mini-batch's, so the shares of
    its micro-batches add up to its loss). Diagnostics (shares too): ``value_loss`` and
    ``value_clip_frac`` (tokens where V moved more than c from V_old and the clipped term was the larger).
    """
    values = values.astype(jnp.float32)
    unclipped = jnp.square(values - returns)
    if value_clip is None:
        per_token, clipped_frac = 0.5 * unclipped, jnp.zeros_like(unclipped)
    else:
        clipped = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
        clipped_sq = jnp.square(clipped - returns)
        per_token = 0.5 * jnp.maximum(unclipped, clipped_sq)
        # Only where V left the trust region: inside it V_clip is V up to rounding.
        clipped_frac = ((jnp.abs(values - old_values) > value_clip) & (clipped_sq > unclipped)).astype(jnp.float32)
    loss = token_mean(per_token, mask, denominators)
    diagnostics = {
        "value_loss": jax.lax.stop_gradient(loss),
        "value_clip_frac": token_mean(clipped_frac, mask, denominators),
    }
    return loss, diagnostics


def value_statistics(old_values: jax.Array, returns: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Whole-batch scalars over the trained tokens: ``value_mean`` (V_old), ``return_mean`` (R) and
    ``explained_variance`` = 1 - Var(R - V_old) / Var(R) (1: V predicts the returns; 0: no better
    than their mean; NaN-free: 0 when Var(R) is 0)."""
    count = jnp.maximum(jnp.sum(mask).astype(jnp.float32), 1.0)
    mean = lambda x: jnp.sum(jnp.where(mask, x, 0.0)) / count
    var = lambda x: mean(jnp.square(x - mean(x)))
    var_returns = var(returns)
    explained = jnp.where(var_returns > 0, 1.0 - var(returns - old_values) / jnp.where(var_returns > 0, var_returns, 1.0), 0.0)
    return {"value_mean": mean(old_values), "return_mean": mean(returns), "explained_variance": explained}
