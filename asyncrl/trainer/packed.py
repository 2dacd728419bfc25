"""Sequence packing in the trainer: a TrainBatch's rows packed before placement, and the step's
targets of a packed batch (docs/performance.md "Sequence packing"; the packer is
:mod:`asyncrl.rollout.packing`).

A packed step gets per-token arrays ``[P, L]`` (the TrainBatch's, packed, plus ``segment_ids`` and
``token_row``) in device order like any batch's rows, and the original rows' ``rewards`` /
``group_index`` / ``truncated`` ``[B]`` replicated: advantages and the truncation rule are computed
on those rows exactly as unpacked, then read per token through ``token_row``. One process only
(``rollout.pack`` with ``mesh.distributed.enabled`` is refused by the config).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from asyncrl.algo import AlgoParams, compute_advantages, trained_mask
from asyncrl.cluster.mesh import row_sharding
from asyncrl.rollout.packing import pack_train_batch

ROW_FIELDS = ("rewards", "group_index", "truncated")
"""The original rows' fields ``[B]`` a packed step reads (replicated, not packed)."""


def packed_targets(batch: dict[str, jax.Array], algo: Optional[AlgoParams], sft: bool) -> tuple[jax.Array, jax.Array]:
    """:func:`batch_targets` of a packed batch (:mod:`asyncrl.rollout.packing`): ``(mask, advantages)``
    bool / float32 ``[P, L]``. Row-level facts are the original rows' (``rewards``, ``group_index``,
    ``truncated`` ``[B]``), computed exactly as unpacked and brought to each token through
    ``token_row`` ``[P, L]`` (the token's original row, -1 on padding)."""
    token_row = batch["token_row"]
    on_row = token_row >= 0
    row = jnp.maximum(token_row, 0)
    if sft:
        return batch["loss_mask"] & on_row, jnp.zeros(token_row.shape, jnp.float32)
    assert algo is not None
    rows = batch["rewards"].shape[0]
    # The unpacked rule on the original rows (a [B, 1] all-true mask: which rows train), per token.
    keep = trained_mask(jnp.ones((rows, 1), bool), batch["group_index"], batch["truncated"], algo)[:, 0]
    mask = batch["loss_mask"] & on_row & keep[row]
    if "advantages" in batch:
        return mask, batch["advantages"].astype(jnp.float32)
    completion_lengths = jax.ops.segment_sum(batch["loss_mask"].reshape(-1).astype(jnp.int32),
                                             jnp.where(on_row, token_row, rows).reshape(-1), rows + 1)[:rows]
    advantages = compute_advantages(batch["rewards"], batch["group_index"], completion_lengths, algo)  # [B]
    return mask, jnp.where(on_row, advantages[row], 0.0)



def place_packed(fields: dict[str, np.ndarray], mesh: Any, *, mini_batches: int, local_shards: int, micro_batches: int,
                 device_order: Callable[[np.ndarray], np.ndarray]) -> tuple[dict[str, jax.Array], int]:
    """Pack ``fields`` (the checked TrainBatch arrays, rows in logical order) and place them:
    ``(arrays, packed rows)``. Packed rows per mini-batch are a multiple of ``local_shards x
    micro_batches``; ``device_order`` permutes packed rows as :meth:`Trainer._device_batch` does
    any batch's rows."""
    packed = pack_train_batch(fields, mini_batches=mini_batches, row_multiple=local_shards * micro_batches)
    tokens = dict(packed.tokens, segment_ids=packed.segment_ids, token_row=packed.token_row)
    ordered = {name: device_order(value) for name, value in tokens.items()}
    shardings = {name: row_sharding(mesh, value.ndim) for name, value in ordered.items()}
    replicated = NamedSharding(mesh, PartitionSpec())
    rows = {"rewards": packed.rewards, "group_index": packed.group_index, "truncated": packed.truncated}
    placed = jax.device_put({**ordered, **rows}, {**shardings, **{name: replicated for name in rows}})
    return placed, packed.rows
