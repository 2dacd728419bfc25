"""Aggregation: values against a numpy reference, and exact gradient accumulation over micro-batches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.algo import AlgoParams, accumulate_diagnostics, aggregate, aggregation_denominators, policy_loss
from tests.helpers import FAST_COMPILE

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# Every term of the loss on: decoupled weighting (some w truncated), KL, entropy, dual clip, clip-higher.
FULL = AlgoParams(
    loss_norm_tokens=10, decoupled=True, behave_weight_cap=1.2, kl_coef=0.1, entropy_coef=0.01,
    dual_clip=3.0, clip_high=0.28,
)


def reference_aggregate(values, mask, real, mode, norm_tokens):
    rows = [b for b in range(len(real)) if real[b]]
    if mode == "token-mean":
        return sum(values[b, t] for b in rows for t in range(mask.shape[1]) if mask[b, t]) / max(mask[rows].sum(), 1)
    if mode == "seq-mean-token-mean":
        means = [np.mean(values[b][mask[b]]) for b in rows if mask[b].any()]
        return np.sum(means) / max(len(means), 1)
    return sum(values[b][mask[b]].sum() for b in rows) / (len(rows) * norm_tokens)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_reference(mode):
    rng = np.random.default_rng(3)
    values = rng.normal(size=(5, 6)).astype(np.float32)
    mask = rng.random((5, 6)) < 0.5
    mask[1] = False  # fully masked real row
    mask[2] = False
    mask[2, 4] = True  # one trained token
    real = np.array([True, True, True, True, False])
    mask[4] = False
    values[4] = np.nan  # a padding row's garbage is ignored
    params = AlgoParams(aggregation=mode, loss_norm_tokens=9)
    den = aggregation_denominators(jnp.asarray(mask), jnp.asarray(real))
    got = aggregate(jnp.asarray(values), jnp.asarray(mask), den, params)
    np.testing.assert_allclose(float(got), reference_aggregate(values, mask, real, mode, 9), rtol=1e-5, atol=1e-6)
    # nothing trained at all: 0, not NaN
    none = np.zeros_like(mask)
    den0 = aggregation_denominators(jnp.asarray(none), jnp.asarray(real))
    assert float(aggregate(jnp.asarray(np.nan_to_num(values)), jnp.asarray(none), den0, params)) == 0.0


# --------------------------------------------------------------------------- micro-batch accumulation

FEATURES, VOCAB, ROWS, CONTENT = 4, 6, 16, 8


def tiny_policy(weights, features, tokens):
    """A linear softmax policy: log-probs and entropies ``[B, L]`` of ``tokens`` under ``features @ W``."""
    logits = features @ weights
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.sum(jax.nn.one_hot(tokens, VOCAB, dtype=logp_all.dtype) * logp_all, axis=-1)
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def micro_batch_loss(weights, batch, den, params):
    logp, entropy = tiny_policy(weights, batch["features"], batch["tokens"])
    return policy_loss(
        logp, batch["prox"], batch["behave"], batch["adv"], batch["mask"], den, params,
        entropy=entropy, ref_logprobs=batch["ref"],
    )


@functools.partial(jax.jit, static_argnames=("all_params",), compiler_options=FAST_COMPILE)
def accumulated(weights, batch, real, all_params):
    """For each params and each micro-batch count k in (1, 2, 4): (loss, gradient) accumulated
    the way a trainer does, with the denominators computed once over the whole mini-batch.
    All in one compilation (compiling is most of this test's time); diagnostics are checked
    separately, since their reductions cost more to compile than the gradient."""
    den = aggregation_denominators(batch["mask"], real)
    grad_fn = jax.value_and_grad(lambda w, mb, p: micro_batch_loss(w, mb, den, p)[0])
    results = []
    for params in all_params:
        for count in (1, 2, 4):
            micro = jax.tree.map(lambda x, count=count: x.reshape(count, ROWS // count, *x.shape[1:]), batch)
            # lax.map traces the micro-batch body once per shape (cheaper to compile).
            losses, grads = jax.lax.map(lambda mb, params=params: grad_fn(weights, mb, params), micro)
            loss, grad = losses[0], grads[0]
            for i in range(1, count):  # sequential float32 accumulation, as in a trainer
                loss, grad = loss + losses[i], grad + grads[i]
            results.append((loss, grad))
    return results


@functools.partial(jax.jit, static_argnames=("params", "count"), compiler_options=FAST_COMPILE)
def accumulated_diagnostics(weights, batch, real, params, count):
    den = aggregation_denominators(batch["mask"], real)
    micro = jax.tree.map(lambda x: x.reshape(count, ROWS // count, *x.shape[1:]), batch)
    diagnostics = jax.lax.map(lambda mb: micro_batch_loss(weights, mb, den, params)[1], micro)
    total = {k: v[0] for k, v in diagnostics.items()}
    for i in range(1, count):
        total = accumulate_diagnostics(total, {k: v[i] for k, v in diagnostics.items()})
    return total


def make_batch(padding_rows: int, length: int):
    """ROWS rows of CONTENT positions (varied trained spans, a fully masked row, one-token rows),
    the last ``padding_rows`` of them padding, right-padded with zeros out to ``length``."""
    rng = np.random.default_rng(4)
    weights = rng.normal(size=(FEATURES, VOCAB)).astype(np.float32)
    features = rng.normal(size=(ROWS, CONTENT, FEATURES)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, size=(ROWS, CONTENT)).astype(np.int32)
    mask = np.zeros((ROWS, CONTENT), bool)
    for b in range(ROWS):
        start = int(rng.integers(1, 4))
        mask[b, start : int(rng.integers(start, CONTENT + 1))] = True
    mask[2] = False
    mask[5] = False
    mask[5, 7] = True
    real = np.arange(ROWS) < ROWS - padding_rows
    mask &= real[:, None]
    base_logp, _ = tiny_policy(jnp.asarray(weights), jnp.asarray(features), jnp.asarray(tokens))
    prox = np.asarray(base_logp) + 0.1 * rng.normal(size=mask.shape).astype(np.float32)
    behave = prox + 0.2 * rng.normal(size=mask.shape).astype(np.float32)
    ref = prox + 0.3 * rng.normal(size=mask.shape).astype(np.float32)
    adv = np.where(real, rng.normal(size=ROWS), 0.0).astype(np.float32)
    pad = lambda x: np.pad(x, [(0, 0), (0, length - CONTENT)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    batch = dict(features=pad(features), tokens=pad(tokens), mask=pad(mask), prox=pad(prox), behave=pad(behave),
                 ref=pad(ref), adv=adv)
    return jnp.asarray(weights + 0.05), {k: jnp.asarray(v) for k, v in batch.items()}, jnp.asarray(real)


def test_micro_batches_accumulate_to_the_same_gradient():
    """For each aggregation mode, 1, 2 and 4 micro-batches give the same gradient and loss, with
    and without padding rows (with them, the last micro-batch of 4 is all padding), at two bucket
    lengths; and the same data at both bucket lengths agrees too."""
    all_params = tuple(FULL.replace(aggregation=mode) for mode in MODES)
    by_bucket = {}
    for padding_rows in (0, 4):
        for length in (CONTENT, CONTENT + 4):
            weights, batch, real = make_batch(padding_rows, length)
            results = jax.device_get(accumulated(weights, batch, real, all_params))
            for m, mode in enumerate(MODES):
                (loss1, grad1), *others = results[3 * m : 3 * m + 3]
                assert np.abs(grad1).max() > 1e-3
                for micro_batches, (loss, grad) in zip((2, 4), others):
                    where = (mode, padding_rows, length, micro_batches)
                    assert np.abs(grad - grad1).max() <= 1e-6 + 1e-5 * np.abs(grad1).max(), where
                    np.testing.assert_allclose(loss, loss1, rtol=1e-5, atol=1e-7, err_msg=str(where))
                by_bucket.setdefault((mode, padding_rows), []).append(grad1)
    # The same data at two bucket lengths: the extra right-padding changes nothing.
    for where, (short, long) in by_bucket.items():
        assert np.abs(short - long).max() <= 1e-6 + 1e-5 * np.abs(short).max(), where


def test_micro_batch_diagnostics_accumulate_to_the_mini_batch_values():
    weights, batch, real = make_batch(4, CONTENT)
    params = FULL.replace(aggregation="seq-mean-token-mean")
    whole = jax.device_get(accumulated_diagnostics(weights, batch, real, params, 1))
    assert whole["clip_high_frac"] + whole["clip_low_frac"] > 0 and whole["behave_weight_capped_frac"] > 0
    for count in (2, 4):
        split = jax.device_get(accumulated_diagnostics(weights, batch, real, params, count))
        for key in whole:
            np.testing.assert_allclose(split[key], whole[key], rtol=1e-5, atol=1e-7, err_msg=f"{key} {count}")
