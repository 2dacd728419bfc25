"""GAE, token rewards, whitening and the clipped value loss against numpy references written here."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.algo import aggregation_denominators
from asyncrl.algo.value import gae, masked_whiten, token_rewards, value_loss, value_statistics

RTOL, ATOL = 1e-5, 1e-5


def reference_gae(rewards, kl, kl_coef, values, mask, gamma, lam):
    """Row by row with Python loops over the list of trained positions (tool tokens skipped)."""
    rows, length = mask.shape
    advantages = np.zeros((rows, length))
    returns = np.zeros((rows, length))
    for b in range(rows):
        steps = np.flatnonzero(mask[b])
        if steps.size == 0:
            continue
        r = np.array([-kl_coef * kl[b, t] for t in steps], np.float64)
        r[-1] += rewards[b]
        v = np.array([values[b, t] for t in steps], np.float64)
        running = 0.0
        for k in reversed(range(steps.size)):
            next_v = v[k + 1] if k + 1 < steps.size else 0.0
            delta = r[k] + gamma * next_v - v[k]
            running = delta + gamma * lam * running
            advantages[b, steps[k]] = running
            returns[b, steps[k]] = running + v[k]
    return advantages, returns


def batch_data():
    """Right padding, left padding, a padding row, and a multi-turn row whose tool tokens are not trained."""
    rng = np.random.default_rng(0)
    rows, length = 5, 12
    mask = np.zeros((rows, length), bool)
    mask[0, 3:9] = True  # prompt 0-2, completion 3-8, right padding
    mask[1, 6:12] = True  # left-padded: completion to the end
    # row 2: padding row, no trained tokens
    mask[3, 2:5] = True
    mask[3, 7:9] = True  # tool output at 5-6, second turn at 7-8, padding after
    mask[3, 10:11] = True  # a third one-token turn
    mask[4, 4:5] = True  # one-token completion
    values = rng.normal(size=(rows, length)).astype(np.float32)
    kl = rng.normal(size=(rows, length)).astype(np.float32) * 0.1
    rewards = rng.normal(size=rows).astype(np.float32)
    return rewards, kl, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_gae_matches_reference(gamma, lam, kl_coef):
    rewards, kl, values, mask = batch_data()
    r = token_rewards(jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(kl), kl_coef)
    got_adv, got_ret = gae(r, jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam)
    want_adv, want_ret = reference_gae(rewards, kl, kl_coef, values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(got_adv), want_adv, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(got_ret), want_ret, rtol=RTOL, atol=ATOL)
    # Nothing leaks onto untrained tokens (prompt, tool output, padding).
    assert not np.asarray(got_adv)[~mask].any() and not np.asarray(got_ret)[~mask].any()


def test_gamma_lambda_one_is_reward_to_go_minus_value():
    rewards, kl, values, mask = batch_data()
    r = token_rewards(jnp.asarray(rewards), jnp.asarray(mask))
    adv, ret = gae(r, jnp.asarray(values), jnp.asarray(mask), gamma=1.0, lam=1.0)
    # With gamma = lam = 1 and one terminal reward the return of every trained token is the reward.
    np.testing.assert_allclose(np.asarray(ret), np.where(mask, rewards[:, None], 0.0), atol=ATOL)
    np.testing.assert_allclose(np.asarray(adv), np.where(mask, rewards[:, None] - values, 0.0), atol=ATOL)


def test_token_rewards_on_last_trained_token():
    rewards, kl, _, mask = batch_data()
    r = np.asarray(token_rewards(jnp.asarray(rewards), jnp.asarray(mask)))
    assert r[3, 10] == rewards[3] and r[0, 8] == rewards[0] and r[1, 11] == rewards[1]
    assert np.count_nonzero(r) == 4  # one per row with trained tokens; the padding row gets none


def test_whitening_over_trained_tokens():
    rng = np.random.default_rng(1)
    _, _, _, mask = batch_data()
    x = rng.normal(size=mask.shape).astype(np.float32) * 3 + 5
    x_bad = np.where(mask, x, 1e6).astype(np.float32)  # untrained garbage must not count
    got = np.asarray(masked_whiten(jnp.asarray(x_bad), jnp.asarray(mask)))
    sel = x[mask].astype(np.float64)
    want = (sel - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(got[mask], want, rtol=1e-4, atol=1e-5)
    assert not got[~mask].any()


@pytest.mark.parametrize("value_clip", [None, 0.2])
def test_value_loss_matches_reference(value_clip):
    rng = np.random.default_rng(2)
    _, _, _, mask = batch_data()
    old = rng.normal(size=mask.shape).astype(np.float32)
    new = (old + rng.normal(size=mask.shape) * 0.5).astype(np.float32)
    ret = rng.normal(size=mask.shape).astype(np.float32)
    real = mask.any(axis=1)
    den = aggregation_denominators(jnp.asarray(mask), jnp.asarray(real))
    loss, diag = value_loss(jnp.asarray(new), jnp.asarray(old), jnp.asarray(ret), jnp.asarray(mask), den, value_clip)
    n, o, r = (a[mask].astype(np.float64) for a in (new, old, ret))
    unclipped = (n - r) ** 2
    if value_clip is None:
        per_token, frac = 0.5 * unclipped, 0.0
    else:
        clipped = (o + np.clip(n - o, -value_clip, value_clip) - r) ** 2
        per_token, frac = 0.5 * np.maximum(unclipped, clipped), np.mean((np.abs(n - o) > value_clip) & (clipped > unclipped))
        assert 0 < frac < 1  # the test data exercises both branches
    np.testing.assert_allclose(float(loss), per_token.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(diag["value_clip_frac"]), frac, rtol=1e-5)


def test_value_loss_shares_add_up_over_micro_batches():
    rng = np.random.default_rng(3)
    _, _, _, mask = batch_data()
    old, new, ret = (rng.normal(size=mask.shape).astype(np.float32) for _ in range(3))
    den = aggregation_denominators(jnp.asarray(mask), jnp.asarray(mask.any(axis=1)))
    whole, _ = value_loss(jnp.asarray(new), jnp.asarray(old), jnp.asarray(ret), jnp.asarray(mask), den, 0.1)
    parts = [value_loss(jnp.asarray(new[s]), jnp.asarray(old[s]), jnp.asarray(ret[s]), jnp.asarray(mask[s]), den, 0.1)[0]
             for s in (slice(0, 2), slice(2, 5))]
    np.testing.assert_allclose(float(sum(parts)), float(whole), rtol=1e-6)


def test_value_statistics():
    rng = np.random.default_rng(4)
    _, _, _, mask = batch_data()
    old, ret = (rng.normal(size=mask.shape).astype(np.float32) for _ in range(2))
    got = value_statistics(jnp.asarray(old), jnp.asarray(ret), jnp.asarray(mask))
    o, r = old[mask].astype(np.float64), ret[mask].astype(np.float64)
    np.testing.assert_allclose(float(got["value_mean"]), o.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(got["return_mean"]), r.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(got["explained_variance"]), 1 - np.var(r - o) / np.var(r), rtol=1e-4)
    constant = value_statistics(jnp.asarray(old), jnp.ones_like(jnp.asarray(ret)), jnp.asarray(mask))
    assert float(constant["explained_variance"]) == 0.0


def test_the_module_and_the_estimator_have_distinct_names():
    """``asyncrl.algo.gae`` is the estimator function (its config name); its module is
    ``asyncrl.algo.value``, so importing the module by path never yields the function."""
    import importlib

    import asyncrl.algo
    import asyncrl.algo.value as module

    assert callable(asyncrl.algo.gae) and asyncrl.algo.gae is module.gae
    assert importlib.import_module("asyncrl.algo.value") is module
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("asyncrl.algo.gae")
