"""Sequence packing: the real rows of a TrainBatch packed into fewer rows of the same length.

A padded TrainBatch pads every row to the batch's longest (rounded to ``rollout.length_bucket``);
with GSM8K-like completion lengths most of its positions are padding. :func:`pack_train_batch`
places the rows one after another into rows of the same length ``L`` (first-fit decreasing,
:func:`first_fit_decreasing`), each original row a *segment* with its own id. The model's forward
then keeps attention within a segment and restarts positions in each
(:class:`asyncrl.model.attention.SelfAttentionMask`, :func:`~asyncrl.model.transformer.segment_positions`),
and :func:`~asyncrl.model.logprobs.per_token_logprobs` gives a segment's first token 0, so every
token's log-prob is the one its unpacked row gives (docs/performance.md "Sequence packing").

Mini-batches. Each mini-batch is packed on its own: packed mini-batch ``i`` holds exactly the
original rows of unpacked mini-batch ``i`` (logical rows ``[i * B / M, (i + 1) * B / M)``), so
every optimizer update consumes the same rows as unpacked and the aggregation denominators
(docs/algorithms.md "Aggregation", computed over the mini-batch) are the same numbers. Micro-batches
split a packed mini-batch by whole packed rows; a segment never spans two rows, so per-row
quantities (seq-mean, GSPO's sequence ratio) stay within one micro-batch. Padding rows
(``group_index == -1``) hold no token and are not packed. A row's own fields (reward, group,
truncation) ride on its segment's first token (:data:`ROW_FACTS`), so a packed batch is token
arrays only and splits over processes by whole packed rows like any batch.

Pure and deterministic: ties in length keep row order, so a resumed run packs bitwise alike.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import numpy as np

_FILL = {"versions": -1, "constraint_nodes": -1}
"""Padding value of a packed token field where it is not 0 (as in an unpacked batch)."""


def first_fit_decreasing(lengths: Sequence[int], capacity: int, max_items: Optional[int] = None) -> list[list[int]]:
    """Bins of item indices: items by decreasing length (ties: lower index first), each into the
    first bin with room (and, with ``max_items``, fewer than that many items), else a new one.
    Every length must be in ``[0, capacity]``."""
    if any(n > capacity or n < 0 for n in lengths):
        raise ValueError(f"first_fit_decreasing: a length outside [0, {capacity}] in {list(lengths)}")
    if max_items is not None and max_items < 1:
        raise ValueError(f"first_fit_decreasing: max_items must be at least 1 (given {max_items})")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for k, free in enumerate(room):
            if lengths[i] <= free and (max_items is None or len(bins[k]) < max_items):
                bins[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


ROW_FACTS = {"row_rewards": ("rewards", 0.0), "row_group_index": ("group_index", -1), "row_truncated": ("truncated", False)}
"""Packed per-token arrays that carry a row's fields: ``row_<field>`` holds the original row's
``<field>`` at its segment's first token and the fill value (a padding row's) everywhere else."""


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """A TrainBatch's real rows packed into ``P`` rows of its length ``L``.

    ``tokens`` holds the packed per-token fields ``[P, L]``, padded as an unpacked batch is, and
    the :data:`ROW_FACTS` (each row's reward, group and truncation at its first token, so a packed
    batch is rows of tokens only and splits over processes like any batch); ``segment_ids`` int32
    ``[P, L]`` numbers the segments of each packed row from 1 (0: padding); ``token_row`` int32
    ``[P, L]`` is each token's original row (-1: padding; for checks, the step does not read it)."""

    tokens: dict[str, np.ndarray]
    segment_ids: np.ndarray
    token_row: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.segment_ids.shape[0])


SHAPES_PER_LENGTH = 8
"""At most this many packed row counts per batch shape: the count is rounded up to a multiple of
1/8 of the unpacked rows, so a run compiles a bounded number of packed steps (at most 1/8 of the
rows padding on top of first-fit's)."""


def packed_rows_needed(row_lengths: np.ndarray, real: np.ndarray, length: int, mini_batches: int,
                       row_multiple: int, max_segments: Optional[int] = None) -> tuple[list[list[list[int]]], int]:
    """``(bins of each mini-batch, packed rows per mini-batch)``: the first-fit-decreasing bins of
    each mini-batch's real rows (original row indices; at most ``max_segments`` per bin), and the
    most of any mini-batch rounded up to a multiple of ``row_multiple`` and of
    1/:data:`SHAPES_PER_LENGTH` of its unpacked rows (the same for every mini-batch: the step's
    chunks are equal)."""
    rows = row_lengths.shape[0]
    if rows % mini_batches:
        raise ValueError(f"pack_train_batch: {rows} rows do not split into {mini_batches} mini-batches")
    per_mini = rows // mini_batches
    bins_of_mini = []
    for i in range(mini_batches):
        members = [r for r in range(i * per_mini, (i + 1) * per_mini) if real[r]]
        bins = first_fit_decreasing([int(row_lengths[r]) for r in members], length, max_segments)
        bins_of_mini.append([[members[j] for j in b] for b in bins])
    most = max([len(b) for b in bins_of_mini] + [1])
    step = -(-per_mini // SHAPES_PER_LENGTH)
    step = -(-step // row_multiple) * row_multiple
    return bins_of_mini, min(-(-most // step) * step, -(-per_mini // row_multiple) * row_multiple)


def pack_train_batch(arrays: Mapping[str, np.ndarray], *, mini_batches: int = 1, row_multiple: int = 1,
                     rows_per_mini: Optional[int] = None, max_segments: Optional[int] = None) -> PackedBatch:
    """Pack a TrainBatch's arrays (``arrays``: field name -> array, rows in logical order; every
    ``[B, L]`` entry is a per-token field and is packed; ``rewards`` / ``group_index`` /
    ``truncated`` ``[B]`` become the :data:`ROW_FACTS`) mini-batch by mini-batch.

    ``row_multiple``: each mini-batch's packed rows are a multiple of this (the trainer's row
    shards x micro-batches), padded with empty rows; ``rows_per_mini`` (at least what
    :func:`packed_rows_needed` gives) sets their count, so that every process packs to one shape;
    ``max_segments``: the most original rows one packed row holds (cuDNN's packed layout's static
    bound, ``rollout.pack_max_segments``). Real rows are those with ``group_index >= 0``; their tokens are the first
    ``attention_mask.sum()`` positions (a TrainBatch is right-padded)."""
    attention = np.asarray(arrays["attention_mask"], bool)
    rows, length = attention.shape
    row_lengths = attention.sum(axis=1)
    real = np.asarray(arrays["group_index"]) >= 0
    bins_of_mini, per_mini = packed_rows_needed(row_lengths, real, length, mini_batches, row_multiple, max_segments)
    if rows_per_mini is not None:
        if rows_per_mini < per_mini or rows_per_mini % row_multiple:
            raise ValueError(f"pack_train_batch: rows_per_mini {rows_per_mini} is below the {per_mini} needed or "
                             f"not a multiple of {row_multiple}")
        per_mini = rows_per_mini

    fields = {name: np.asarray(value) for name, value in arrays.items() if np.ndim(value) == 2}
    packed_rows = per_mini * mini_batches
    tokens = {name: np.full((packed_rows, length), _FILL.get(name, 0), value.dtype) for name, value in fields.items()}
    facts = {name: (np.asarray(arrays[field]), fill) for name, (field, fill) in ROW_FACTS.items()}
    for name, (value, fill) in facts.items():
        tokens[name] = np.full((packed_rows, length), fill, value.dtype)
    segment_ids = np.zeros((packed_rows, length), np.int32)
    token_row = np.full((packed_rows, length), -1, np.int32)
    for i, bins in enumerate(bins_of_mini):
        for k, members in enumerate(bins):
            p, at = i * per_mini + k, 0
            for segment, r in enumerate(members, start=1):
                n = int(row_lengths[r])
                for name, value in fields.items():
                    tokens[name][p, at:at + n] = value[r, :n]
                for name, (value, _) in facts.items():
                    tokens[name][p, at] = value[r]
                segment_ids[p, at:at + n] = segment
                token_row[p, at:at + n] = r
                at += n
    return PackedBatch(tokens=tokens, segment_ids=segment_ids, token_row=token_row)


def packed_shape(row_lengths: Sequence[int], length: int, mini_batches: int = 1, row_multiple: int = 1,
                 max_segments: Optional[int] = None) -> tuple[int, int]:
    """``(packed rows, L)`` of a batch whose real rows have ``row_lengths`` (for ``asyncrl plan``)."""
    lengths = np.asarray(row_lengths, np.int64)
    rows = -(-len(lengths) // mini_batches) * mini_batches
    lengths = np.concatenate([lengths, np.zeros(rows - len(lengths), np.int64)])
    real = np.arange(rows) < len(row_lengths)
    _, per_mini = packed_rows_needed(lengths, real, length, mini_batches, row_multiple, max_segments)
    return per_mini * mini_batches, length
