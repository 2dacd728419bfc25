"""Turning per-token losses into the scalar one optimizer update minimises.

The denominators of every mode are computed once over the whole mini-batch an update
consumes (all micro-batches, all processes: under ``jit`` a sum over a sharded array is
global) and passed to each micro-batch. Each micro-batch's :func:`aggregate` is then an
exact share of the mini-batch loss: the shares sum to it, so gradients accumulated over
1, 2 or 4 micro-batches are the same. Only trained tokens (``loss_mask``, already false on
padding rows) and real rows (``group_index >= 0``) count.

Modes (``algo.aggregation``), with m the loss mask and l the token loss:

- ``token-mean``: sum(m*l) / sum(m)  (every trained token of the mini-batch weighs the same)
- ``seq-mean-token-mean``: mean over rows with >= 1 trained token of sum_t(m*l) / sum_t(m)
- ``seq-mean-token-sum-norm``: sum(m*l) / (real rows * ``algo.loss_norm_tokens``) (Dr. GRPO)

A denominator of 0 (nothing trained) is treated as 1, so the loss is 0, not NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from asyncrl.algo.params import AlgoParams


class Denominators(NamedTuple):
    """Mini-batch totals, float32 scalars (a pytree: pass it through jit as an array argument)."""

    tokens: jax.Array
    """Trained tokens in the mini-batch."""
    rows_with_tokens: jax.Array
    """Rows with at least one trained token."""
    rows: jax.Array
    """Real rows (``group_index >= 0``), trained tokens or not."""


@jax.jit
def aggregation_denominators(loss_mask: jax.Array, row_is_real: jax.Array) -> Denominators:
    """Denominators of a whole mini-batch: ``loss_mask`` bool ``[B, L]``, ``row_is_real`` bool ``[B]``."""
    per_row = jnp.sum(loss_mask & row_is_real[:, None], axis=-1)
    return Denominators(
        tokens=jnp.sum(per_row).astype(jnp.float32),
        rows_with_tokens=jnp.sum(per_row > 0).astype(jnp.float32),
        rows=jnp.sum(row_is_real).astype(jnp.float32),
    )


def segment_totals(values: jax.Array, segment_ids: jax.Array, reduce=jax.ops.segment_sum) -> jax.Array:
    """``[B, L]``: at each token, the sum (or another ``jax.ops.segment_*`` reduction) of ``values``
    ``[B, L]`` over the tokens of its packed segment (same row, same ``segment_ids`` ``[B, L]``;
    docs/performance.md "Sequence packing"). A segment is one original row, so this is that
    row's sum, broadcast to its tokens."""
    rows, length = segment_ids.shape
    flat = (jnp.arange(rows, dtype=jnp.int32)[:, None] * (length + 1) + segment_ids).reshape(-1)
    sums = reduce(values.reshape(-1), flat, rows * (length + 1))
    return sums[flat].reshape(rows, length)


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """bool ``[B, L]``: the first token of each segment of packed rows (0 = padding is none)."""
    previous = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]), segment_ids[:, :-1]], axis=1)
    return (segment_ids > 0) & (segment_ids != previous)


@jax.jit
def packed_denominators(loss_mask: jax.Array, segment_ids: jax.Array) -> Denominators:
    """:func:`aggregation_denominators` of a packed mini-batch: ``loss_mask`` bool ``[P, L]`` (already
    false outside real rows), ``segment_ids`` int32 ``[P, L]``. Each segment is one real original
    row (padding rows are not packed), so the counts equal the unpacked mini-batch's."""
    starts = segment_starts(segment_ids)
    row_tokens = segment_totals(loss_mask.astype(jnp.float32), segment_ids)
    return Denominators(
        tokens=jnp.sum(loss_mask).astype(jnp.float32),
        rows_with_tokens=jnp.sum(starts & (row_tokens > 0)).astype(jnp.float32),
        rows=jnp.sum(starts).astype(jnp.float32),
    )


def aggregate(
    values: jax.Array, loss_mask: jax.Array, denominators: Denominators, params: AlgoParams, axis=None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """This micro-batch's share of the mini-batch loss under ``params.aggregation``.

    ``values`` float ``[B, L]`` per-token losses; ``loss_mask`` bool ``[B, L]``. Masked entries
    are ignored even when they are not finite. ``axis`` (default: all) names the ``(row, token)``
    axes when ``values`` stacks several ``[B, L]`` arrays, e.g. ``[K, B, L]`` with ``axis=(1, 2)``
    and a broadcastable ``loss_mask[None]``: then the result is ``[K]``. ``segment_ids`` ``[B, L]``:
    the rows are packed (:mod:`asyncrl.rollout.packing`) and a row of ``seq-mean-token-mean`` is a
    segment, whose mean weighs each of its tokens by 1 / its trained tokens.
    """
    row_axis, token_axis = axis if axis is not None else (-2, -1)
    masked = jnp.where(loss_mask, values, 0.0)
    if params.aggregation == "token-mean":
        return jnp.sum(masked, axis=axis) / jnp.maximum(denominators.tokens, 1.0)
    if params.aggregation == "seq-mean-token-mean" and segment_ids is not None:
        mask_2d = loss_mask.reshape(loss_mask.shape[-2:])  # [B, L] (a stacked call passes loss_mask[None])
        row_tokens = segment_totals(mask_2d.astype(values.dtype), segment_ids)
        return jnp.sum(masked / jnp.maximum(row_tokens, 1.0), axis=axis) / jnp.maximum(denominators.rows_with_tokens, 1.0)
    if params.aggregation == "seq-mean-token-mean":
        row_tokens = jnp.sum(loss_mask, axis=token_axis).astype(values.dtype)
        row_means = jnp.sum(masked, axis=token_axis) / jnp.maximum(row_tokens, 1.0)
        return jnp.sum(row_means, axis=row_axis if axis is not None else None) / jnp.maximum(
            denominators.rows_with_tokens, 1.0
        )
    if params.aggregation == "seq-mean-token-sum-norm":
        return jnp.sum(masked, axis=axis) / jnp.maximum(denominators.rows * params.loss_norm_tokens, 1.0)
    raise ValueError(f"algo.aggregation: unknown mode {params.aggregation!r}")


def token_mean(values: jax.Array, loss_mask: jax.Array, denominators: Denominators, axis=None) -> jax.Array:
    """This micro-batch's share of the mini-batch token mean of ``values`` (for diagnostics);
    ``axis`` as in :func:`aggregate`."""
    return jnp.sum(jnp.where(loss_mask, values, 0.0), axis=axis) / jnp.maximum(denominators.tokens, 1.0)


def accumulate_diagnostics(total: dict, new: dict) -> dict:
    """Combine two micro-batches' diagnostics: keys ending in ``_max`` by maximum, the rest by sum
    (they are shares of mini-batch means, like the loss)."""
    return {k: jnp.maximum(total[k], new[k]) if k.endswith("_max") else total[k] + new[k] for k in total}

