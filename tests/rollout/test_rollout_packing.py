"""The sequence packer (asyncrl/rollout/packing.py): first-fit decreasing against a textbook
reference, and packed batches that keep each mini-batch's rows, every token, and each row's
reward, group and truncation at its segment's first token."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.rollout.packing import first_fit_decreasing, pack_train_batch, packed_shape
from tests.trainer_fixtures import mixed_length_batch


def reference_first_fit_decreasing(lengths, capacity):
    """First-fit decreasing written the textbook way (a stable sort, a scan of open bins)."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    bins, loads = [], []
    for i in order:
        fits = [k for k in range(len(bins)) if loads[k] + lengths[i] <= capacity]
        if fits:
            bins[fits[0]].append(int(i))
            loads[fits[0]] += lengths[i]
        else:
            bins.append([int(i)])
            loads.append(lengths[i])
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_first_fit_decreasing_matches_the_reference(seed):
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(1, 65, size=40)]
    bins = first_fit_decreasing(lengths, 64)
    assert bins == reference_first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    with pytest.raises(ValueError, match="outside"):
        first_fit_decreasing([65], 64)


def test_pack_train_batch_keeps_each_mini_batch_s_rows_and_every_token():
    batch = mixed_length_batch(rows=16, padding_rows=2)
    fields = {name: getattr(batch, name) for name in ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs",
                                                       "versions", "rewards", "group_index", "truncated")}
    packed = pack_train_batch(fields, mini_batches=2, row_multiple=2)
    per_mini = packed.rows // 2
    assert packed.rows % 4 == 0 and packed.rows < 16
    for p in range(packed.rows):
        rows_here = set(packed.token_row[p][packed.token_row[p] >= 0].tolist())
        assert all(r // 8 == p // per_mini for r in rows_here)  # mini-batch i holds rows [8i, 8i + 8)
    for r in range(14):  # every real row's tokens, contiguous, once
        where = np.argwhere(packed.token_row == r)
        n = batch.attention_mask[r].sum()
        assert len(where) == n and len(set(where[:, 0])) == 1
        p, cols = where[0, 0], where[:, 1]
        for name in ("input_ids", "loss_mask", "behavior_logprobs", "versions"):
            np.testing.assert_array_equal(packed.tokens[name][p, cols], getattr(batch, name)[r, :n])
        assert (packed.segment_ids[p, cols] == packed.segment_ids[p, cols[0]]).all()
    assert not (packed.token_row >= 14).any()  # padding rows are not packed
    # Each row's reward, group and truncation at its segment's first token only.
    firsts = packed.tokens["row_group_index"] >= 0
    assert firsts.sum() == 14 and (packed.token_row[firsts] >= 0).all()
    np.testing.assert_array_equal(packed.tokens["row_group_index"][firsts], batch.group_index[packed.token_row[firsts]])
    np.testing.assert_array_equal(packed.tokens["row_rewards"][firsts], batch.rewards[packed.token_row[firsts]])
    assert (packed.tokens["row_rewards"][~firsts] == 0).all()
    assert (packed.tokens["versions"][packed.segment_ids == 0] == -1).all()
    assert packed_shape(batch.attention_mask[:14].sum(1), 32, 2, 2) == (packed.rows, 32)


def test_packed_row_counts_come_in_eighths_of_the_rows():
    """However the lengths fall, a mini-batch of 64 rows packs into a multiple of 8 rows (at most 8
    shapes to compile per length), never more than 64, and at least what first-fit needs."""
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(30):
        lengths = rng.integers(1, 129, size=64)
        rows, _ = packed_shape(lengths, 128, mini_batches=1, row_multiple=2)
        assert rows % 8 == 0 and len(first_fit_decreasing(list(lengths), 128)) <= rows <= 64
        seen.add(rows)
    assert len(seen) > 1
