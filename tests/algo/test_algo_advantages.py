"""Advantage estimators, reward shaping and the trained mask against numpy references written here."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.algo import AlgoParams, compute_advantages, overlong_penalty, trained_mask
from asyncrl.errors import ConfigError
from asyncrl.registry import resolve

RTOL, ATOL = 1e-5, 1e-6


def reference_advantages(rewards, group_index, estimator, eps=1e-6):
    """Group by group with Python loops; padding rows (-1) get 0."""
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    real = group_index >= 0
    if estimator == "batch":
        r = rewards[real]
        std = np.std(r, ddof=1) if r.size > 1 else 0.0
        out[real] = (r - r.mean()) / (std + eps)
        return out
    for g in np.unique(group_index[real]):
        rows = np.flatnonzero(group_index == g)
        r = rewards[rows]
        n = len(rows)
        if estimator == "grpo":
            std = np.std(r, ddof=1) if n > 1 else 0.0
            out[rows] = (r - r.mean()) / (std + eps)
        elif estimator == "dr_grpo":
            out[rows] = r - r.mean()
        elif estimator == "rloo":
            for i, row in enumerate(rows):
                others = np.delete(r, i)
                out[row] = r[i] - others.mean() if n > 1 else 0.0
    return out


def batch_data():
    rng = np.random.default_rng(0)
    # Groups of size 4, 2 and 3 in shuffled order, one all-equal group, and padding rows.
    group_index = np.array([0, 1, 0, 2, 0, 1, 2, 0, 2, 3, 3, 3, -1, -1], np.int32)
    rewards = rng.normal(size=group_index.size).astype(np.float32) + 3.0
    rewards[group_index == 3] = 0.5  # all equal
    rewards[group_index == -1] = 100.0  # padding garbage must not leak into any statistic
    return rewards, group_index


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "batch"])
def test_estimators_match_reference(estimator):
    rewards, group_index = batch_data()
    params = AlgoParams(estimator=estimator)
    got = np.asarray(compute_advantages(rewards, group_index, np.zeros_like(group_index), params))
    want = reference_advantages(rewards, group_index, estimator)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert np.all(got[group_index == -1] == 0)
    if estimator != "batch":
        assert np.all(got[group_index == 3] == 0), "all-equal rewards give exactly zero advantage"


def test_group_size_two_and_eps_kwarg():
    rewards = np.array([1.0, 0.0, 0.25, 0.75], np.float32)
    group_index = np.array([0, 0, 1, 1], np.int32)
    params = AlgoParams(estimator="grpo", estimator_kwargs=(("eps", 1e-2),))
    got = np.asarray(compute_advantages(rewards, group_index, np.zeros(4), params))
    np.testing.assert_allclose(got, reference_advantages(rewards, group_index, "grpo", eps=1e-2), rtol=RTOL, atol=ATOL)
    # group of two: unbiased std of {a, b} is |a - b| / sqrt(2), so A = ±1/sqrt(2) (before eps)
    rloo = np.asarray(compute_advantages(rewards, group_index, np.zeros(4), AlgoParams(estimator="rloo")))
    np.testing.assert_allclose(rloo, [1.0, -1.0, -0.5, 0.5], rtol=RTOL, atol=ATOL)


def test_reward_scale_bias_and_overlong_penalty():
    max_len, buffer, factor = 10, 4, 0.5
    lengths = np.array([3, 6, 7, 9, 10, 10, 2, 8], np.int32)
    rewards = np.array([1, 0, 1, 1, 0, 1, 0, 1], np.float32)
    group_index = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)

    def dapo(length):  # DAPO eq. (13): R_length
        if length <= max_len - buffer:
            return 0.0
        if length <= max_len:
            return ((max_len - buffer) - length) / buffer
        return -1.0

    np.testing.assert_allclose(
        overlong_penalty(jnp.asarray(lengths), max_len, buffer, factor), [factor * dapo(n) for n in lengths], atol=ATOL
    )
    params = AlgoParams(
        estimator="dr_grpo", reward_scale=2.0, reward_bias=-1.0, truncated="penalty",
        max_new_tokens=max_len, overlong_buffer=buffer, overlong_penalty=factor,
    )
    shaped = 2.0 * (rewards + np.array([factor * dapo(n) for n in lengths])) - 1.0
    got = compute_advantages(rewards, group_index, lengths, params)
    np.testing.assert_allclose(got, reference_advantages(shaped, group_index, "dr_grpo"), rtol=RTOL, atol=ATOL)
    # keep: no penalty, lengths ignored
    keep = compute_advantages(rewards, group_index, lengths, AlgoParams(estimator="dr_grpo"))
    np.testing.assert_allclose(keep, reference_advantages(rewards, group_index, "dr_grpo"), rtol=RTOL, atol=ATOL)


def test_trained_mask_drops_padding_and_masked_truncated_rows():
    loss_mask = np.ones((4, 3), bool)
    loss_mask[:, 0] = False
    group_index = np.array([0, 0, 1, -1], np.int32)
    truncated = np.array([False, True, False, False])
    keep = np.asarray(trained_mask(loss_mask, group_index, truncated, AlgoParams(truncated="keep")))
    assert keep[:3].tolist() == loss_mask[:3].tolist() and not keep[3].any()
    masked = np.asarray(trained_mask(loss_mask, group_index, truncated, AlgoParams(truncated="mask")))
    assert not masked[1].any() and not masked[3].any() and masked[0].tolist() == loss_mask[0].tolist()


def test_estimators_are_registered_and_unknown_ones_are_config_errors():
    for name in ("grpo", "dr_grpo", "rloo", "batch"):
        assert callable(resolve("estimator", name))
    with pytest.raises(ConfigError, match="algo.estimator: unknown estimator 'grop'.*did you mean 'grpo'"):
        compute_advantages(np.zeros(2, np.float32), np.zeros(2, np.int32), np.zeros(2), AlgoParams(estimator="grop"))


def test_custom_estimator_by_import_path():
    params = AlgoParams(estimator="tests.algo.test_algo_advantages:_scaled_rewards", estimator_kwargs=(("scale", 3.0),))
    got = compute_advantages(np.array([1.0, 2.0, 5.0], np.float32), np.array([0, 0, -1], np.int32), np.zeros(3), params)
    np.testing.assert_allclose(got, [3.0, 6.0, 0.0])


def _scaled_rewards(rewards, group_index, scale=1.0):
    return scale * rewards


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "batch"])
def test_constant_groups_give_exactly_zero_for_any_value_and_size(estimator):
    """Groups of sizes 2..64 whose rewards are all equal (non-dyadic values such as 0.7, and
    0/1 rewards shifted by reward_bias 0.1) get advantage exactly 0 in float32, through the
    jitted compute_advantages the trainer's step calls; a plain float32 mean leaves rounding
    error that grpo divides by a std of the same size."""
    rng = np.random.default_rng(1)
    sizes = np.arange(2, 65)
    values = np.concatenate([[0.7, 1.1, 0.1, 1 / 3, -0.3], rng.uniform(-5, 5, size=len(sizes) - 5)]).astype(np.float32)
    group_index = np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)
    rewards = np.repeat(values, sizes)
    for params in (AlgoParams(estimator=estimator), AlgoParams(estimator=estimator, reward_bias=0.1),
                   AlgoParams(estimator=estimator, reward_scale=0.3, reward_bias=-0.7)):
        lengths = np.zeros_like(group_index)
        got = np.asarray(compute_advantages(rewards, group_index, lengths, params))
        if estimator == "batch":  # one group: constant only when the whole batch is
            got = np.asarray(compute_advantages(np.full_like(rewards, 0.7), group_index, lengths, params))
        assert got.dtype == np.float32
        assert np.all(got == 0.0), (params, got[got != 0][:5])
    # The same shift leaves non-constant groups as the numpy reference has them.
    mixed = rewards + rng.normal(size=rewards.size).astype(np.float32) * (group_index % 2)
    got = np.asarray(compute_advantages(mixed, group_index, np.zeros_like(group_index), AlgoParams(estimator=estimator)))
    want = reference_advantages(mixed, group_index, estimator)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.all(got[(group_index % 2 == 0)] == 0.0) or estimator == "batch"
