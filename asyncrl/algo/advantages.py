"""Advantage estimators and the reward shaping applied before them.

Shapes: ``rewards`` float32 ``[B]``, ``group_index`` int32 ``[B]`` (the group of each row,
in ``[0, B)``; ``-1`` marks a padding row), advantages float32 ``[B]`` (0 on padding rows).
Every function is pure and jittable; group statistics are segment sums, so groups may be
any size and in any order.

An estimator is any ``fn(rewards[B], group_index[B], **kwargs) -> advantages[B]`` that
gives padding rows 0; the built-ins register under their config names
(``algo.estimator``). Conventions of the built-ins:

- the group standard deviation is the unbiased one (divisor n - 1), as in TRL and verl
  (``torch.std``); ``eps`` (default 1e-6, as verl) is added to the std, not the variance,
  so a group whose rewards are all equal gets advantage exactly 0;
- means and deviations are taken relative to the group's smallest reward ``m_g``:
  ``r - mean_g = (r - m_g) - mean_g(r - m_g)``. For a group whose rewards are all equal
  every ``r - m_g`` is exactly 0, so its deviation, std and advantage are exactly 0 in
  float32 for any reward value (a plain float32 mean of e.g. eight 0.7s is not 0.7, and
  ``grpo`` would divide that rounding error by a std of the same size). The shift also
  keeps float32 accurate for rewards with a large common offset.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from asyncrl.algo.params import AlgoParams
from asyncrl.registry import register, resolve


def _group_moments(rewards: jax.Array, group_index: jax.Array):
    """Per row: (row is real, size n of its group, deviation r - mean_g, sum of squared deviations of its group).

    The deviation is computed from rewards shifted by their group's minimum, so a group of
    equal rewards has deviation exactly 0 (see the module docstring).
    """
    rows = rewards.shape[0]
    real = group_index >= 0
    # Padding rows go to an extra segment (index `rows`) that nothing reads.
    segment = jnp.where(real, group_index, rows)
    rewards = jnp.where(real, rewards, 0.0)
    count = jax.ops.segment_sum(real.astype(jnp.float32), segment, rows + 1)
    low = jax.ops.segment_min(rewards, segment, rows + 1)
    shifted = rewards - low[segment]  # [B], exactly 0 on every row of a constant group
    total = jax.ops.segment_sum(shifted, segment, rows + 1)
    mean = total / jnp.maximum(count, 1.0)
    deviation = jnp.where(real, shifted - mean[segment], 0.0)
    squares = jax.ops.segment_sum(deviation * deviation, segment, rows + 1)
    return real, count[segment], deviation, squares[segment]


@register("estimator", "grpo")
def grpo(rewards: jax.Array, group_index: jax.Array, eps: float = 1e-6) -> jax.Array:
    """GRPO (DeepSeekMath): (r - mean_g) / (std_g + eps), std unbiased (n - 1)."""
    real, count, deviation, squares = _group_moments(rewards, group_index)
    std = jnp.sqrt(squares / jnp.maximum(count - 1.0, 1.0))
    return jnp.where(real, deviation / (std + eps), 0.0)


@register("estimator", "dr_grpo")
def dr_grpo(rewards: jax.Array, group_index: jax.Array) -> jax.Array:
    """Dr. GRPO: r - mean_g (no division by the group std)."""
    real, _, deviation, _ = _group_moments(rewards, group_index)
    return jnp.where(real, deviation, 0.0)


@register("estimator", "rloo")
def rloo(rewards: jax.Array, group_index: jax.Array) -> jax.Array:
    """RLOO: r_i - mean of the other rewards of the group = n/(n-1) (r_i - mean_g); 0 in a group of one."""
    real, count, deviation, _ = _group_moments(rewards, group_index)
    scale = jnp.where(count > 1, count / jnp.maximum(count - 1.0, 1.0), 0.0)
    return jnp.where(real, scale * deviation, 0.0)


@register("estimator", "batch")
def batch(rewards: jax.Array, group_index: jax.Array, eps: float = 1e-6) -> jax.Array:
    """(r - mean) / (std + eps) over all real rows of the batch, std unbiased (REINFORCE++-style)."""
    # Every real row in one group: the same moments as grpo with a single group.
    return grpo(rewards, jnp.where(group_index >= 0, 0, -1), eps=eps)


def overlong_penalty(completion_lengths: jax.Array, max_length: int, buffer: int, penalty: float) -> jax.Array:
    """DAPO's soft overlong punishment ``[B]``: 0 up to max_length - buffer, then linear down to
    -penalty at max_length (and below, for anything longer)."""
    excess = (completion_lengths.astype(jnp.float32) - (max_length - buffer)) / buffer
    return -penalty * jnp.clip(excess, 0.0, 1.0)


def shaped_rewards(rewards: jax.Array, completion_lengths: jax.Array, params: AlgoParams) -> jax.Array:
    """``reward_scale * (r + overlong penalty if truncated: penalty) + reward_bias``, ``[B]`` float32."""
    rewards = rewards.astype(jnp.float32)
    if params.truncated == "penalty":
        rewards = rewards + overlong_penalty(
            completion_lengths, params.max_new_tokens, params.overlong_buffer, params.overlong_penalty
        )
    return params.reward_scale * rewards + params.reward_bias


@functools.partial(jax.jit, static_argnames=("params",))
def compute_advantages(
    rewards: jax.Array, group_index: jax.Array, completion_lengths: jax.Array, params: AlgoParams
) -> jax.Array:
    """Advantages ``[B]`` of the configured estimator, 0 on padding rows.

    ``completion_lengths`` ``[B]`` is the number of generated tokens per row
    (``loss_mask.sum(-1)`` for single-turn data); only ``truncated: penalty`` reads it.
    """
    estimator = resolve("estimator", params.estimator, where="algo.estimator")
    advantages = estimator(shaped_rewards(rewards, completion_lengths, params), group_index, **dict(params.estimator_kwargs))
    return jnp.where(group_index >= 0, advantages, 0.0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("params",))
def trained_mask(loss_mask: jax.Array, group_index: jax.Array, truncated: jax.Array, params: AlgoParams) -> jax.Array:
    """The tokens the loss trains on, bool ``[B, L]``: ``loss_mask`` on real rows, minus truncated
    rows when ``algo.truncated: mask`` (DAPO's overlong filtering; the rows still count in their
    group's statistics and as rows of ``seq-mean-token-sum-norm``)."""
    keep = group_index >= 0
    if params.truncated == "mask":
        keep = keep & ~truncated
    return loss_mask & keep[:, None]
