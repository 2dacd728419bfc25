"""Sequence packing in the trainer: a TrainBatch's rows packed before placement, and the step's
targets of a packed batch (docs/performance.md "Sequence packing"; the packer is
:mod:`asyncrl.rollout.packing`).

A packed step gets token arrays only, ``[P, L]``: the TrainBatch's, packed, plus ``segment_ids``
and the row facts (``row_rewards``, ``row_group_index``, ``row_truncated``: each original row's
fields at its segment's first token). They are permuted into device order and placed like any
batch's rows, so with several processes each process packs its own rows (whole packed rows
each) and the packed row count is agreed between them. Advantages and the truncation rule are
computed on the segments' first tokens, which are the original rows (group statistics are
segment sums over ``group_index``, whatever the order of the rows), then spread over each
segment's tokens.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.algo import AlgoParams, compute_advantages, segment_totals, shaped_rewards, trained_mask
from asyncrl.rollout.packing import pack_train_batch, packed_rows_needed


def packed_fields(fields: dict[str, np.ndarray], *, mini_batches: int, row_multiple: int,
                  max_segments: Optional[int] = None) -> dict[str, np.ndarray]:
    """The token arrays ``[P, L]`` of ``fields`` (a checked TrainBatch's arrays, rows in logical
    order, group indices already unique over processes) packed mini-batch by mini-batch, at most
    ``max_segments`` rows in a packed row, each mini-batch's packed rows a multiple of
    ``row_multiple`` (row shards of this process x micro-batches, or x packed rows per micro-batch
    with a token budget) and, with several processes, as many as the most any process needs."""
    rows_per_mini = None
    if jax.process_count() > 1:  # one shape for every process's program
        from jax.experimental import multihost_utils

        _, needed = packed_rows_needed(np.asarray(fields["attention_mask"]).sum(axis=1), fields["group_index"] >= 0,
                                       fields["attention_mask"].shape[1], mini_batches, row_multiple, max_segments)
        rows_per_mini = int(np.max(multihost_utils.process_allgather(np.int32(needed))))
    packed = pack_train_batch(fields, mini_batches=mini_batches, row_multiple=row_multiple, rows_per_mini=rows_per_mini,
                              max_segments=max_segments)
    return dict(packed.tokens, segment_ids=packed.segment_ids)


def packed_targets(batch: dict[str, jax.Array], algo: Optional[AlgoParams], sft: bool) -> tuple[jax.Array, jax.Array]:
    """:func:`~asyncrl.trainer.losses.batch_targets` of a packed batch: ``(mask, advantages)`` bool /
    float32 ``[P, L]``. The estimator sees one entry per token, real only at segments' first tokens
    (``row_group_index >= 0``; every other entry is a padding row to it), so its group statistics
    are the original rows'; a segment's tokens then share its first token's advantage and keep."""
    segment_ids = batch["segment_ids"]
    in_segment = segment_ids > 0
    if sft:
        return batch["loss_mask"] & in_segment, jnp.zeros(segment_ids.shape, jnp.float32)
    assert algo is not None
    flat = lambda x: x.reshape(-1)  # noqa: E731 - [P, L] -> [P * L] "rows" for the row-level functions
    spread = lambda x: segment_totals(x.reshape(segment_ids.shape), segment_ids)  # noqa: E731 - first token's value to its segment
    group_index = flat(batch["row_group_index"])
    # The unpacked rule on the original rows (a [rows, 1] all-true mask: which rows train), per token.
    keep = trained_mask(jnp.ones((group_index.shape[0], 1), bool), group_index, flat(batch["row_truncated"]), algo)[:, 0]
    mask = batch["loss_mask"] & in_segment & (spread(keep.astype(jnp.float32)) > 0)
    if "advantages" in batch:
        return mask, batch["advantages"].astype(jnp.float32)
    if algo.uses_critic:  # GAE's per-token advantages need the critic's values (losses.critic_targets)
        return mask, jnp.zeros(segment_ids.shape, jnp.float32)
    advantages = compute_advantages(flat(batch["row_rewards"]), group_index, _completion_lengths(batch), algo)  # 0 off first tokens
    return mask, jnp.where(in_segment, spread(advantages), 0.0)


def _completion_lengths(batch: dict[str, jax.Array]) -> jax.Array:
    """int32 ``[P * L]``: each segment's trained-token count at its first token, 0 elsewhere."""
    first = batch["row_group_index"].reshape(-1) >= 0
    return jnp.where(first, segment_totals(batch["loss_mask"].astype(jnp.int32), batch["segment_ids"]).reshape(-1), 0)


def packed_shaped_rewards(batch: dict[str, jax.Array], algo: AlgoParams) -> jax.Array:
    """float32 ``[P, L]``: each token's original row's shaped reward
    (:func:`~asyncrl.algo.shaped_rewards`, as unpacked), 0 on padding (the critic's GAE reads it at
    each segment's last trained token)."""
    first = batch["row_group_index"].reshape(-1) >= 0
    shaped = jnp.where(first, shaped_rewards(batch["row_rewards"].reshape(-1), _completion_lengths(batch), algo), 0.0)
    return segment_totals(shaped.reshape(batch["segment_ids"].shape), batch["segment_ids"])
