"""The policy loss against a numpy reference written here: values (float32), gradients (central
differences in float64), diagnostics, and the decoupled-PPO identities."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.algo import AlgoParams, aggregation_denominators, policy_loss
from tests.helpers import FAST_COMPILE

# --------------------------------------------------------------------------- reference


def reference_kl(logp, ref, estimator):
    log_ratio = ref - logp  # log(pi_ref / pi)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return min(np.expm1(log_ratio) - log_ratio, 10.0)


def reference_aggregate(token_loss, mask, real, p):
    """Loops over rows; only real rows and trained tokens count."""
    rows = [b for b in range(mask.shape[0]) if real[b]]
    if p.aggregation == "token-mean":
        count = sum(mask[b].sum() for b in rows)
        return sum(token_loss[b][mask[b]].sum() for b in rows) / max(count, 1)
    if p.aggregation == "seq-mean-token-mean":
        means = [token_loss[b][mask[b]].mean() for b in rows if mask[b].any()]
        return sum(means) / max(len(means), 1)
    return sum(token_loss[b][mask[b]].sum() for b in rows) / (len(rows) * p.loss_norm_tokens)


def reference_weight(prox, behave, p):
    w = np.exp(prox - behave)
    if p.behave_weight_cap is None:
        return w
    if p.behave_weight_mode == "truncate":
        return min(w, p.behave_weight_cap)
    return w if 1.0 / p.behave_weight_cap <= w <= p.behave_weight_cap else 0.0


def reference_loss(d, p, logp=None, entropy=None):
    logp = d["logp"] if logp is None else logp
    entropy = d["entropy"] if entropy is None else entropy
    mask, adv = d["mask"], d["adv"]
    weighted = p.decoupled or p.mismatch_correction
    anchor = d["prox"] if weighted else d["behave"]
    token_loss = np.zeros(logp.shape)
    for b in range(logp.shape[0]):
        trained = np.flatnonzero(mask[b])
        if trained.size and p.ratio == "sequence":
            seq_ratio = np.exp(np.mean(logp[b, trained] - anchor[b, trained]))
        for t in trained:
            r = seq_ratio if p.ratio == "sequence" else np.exp(logp[b, t] - anchor[b, t])
            a = adv[b]
            objective = min(r * a, np.clip(r, 1 - p.clip_low, 1 + p.clip_high) * a)
            if p.dual_clip is not None and a < 0:
                objective = max(objective, p.dual_clip * a)
            w = reference_weight(d["prox"][b, t], d["behave"][b, t], p) if weighted else 1.0
            loss = -w * objective
            if p.kl_coef > 0:
                loss += p.kl_coef * w * reference_kl(logp[b, t], d["ref"][b, t], p.kl_estimator)
            loss -= p.entropy_coef * entropy[b, t]
            token_loss[b, t] = loss
    return reference_aggregate(token_loss, mask, d["real"], p)


def reference_diagnostics(d, p):
    mask, logp = d["mask"], d["logp"]
    tokens = [(b, t) for b, t in zip(*np.nonzero(mask))]
    anchor = d["prox"] if (p.decoupled or p.mismatch_correction) else d["behave"]
    out = {k: 0.0 for k in ("clip_low_frac", "clip_high_frac", "dual_clip_frac", "approx_kl_prox", "approx_kl_behave",
                            "behave_weight_mean", "entropy")}
    for b, t in tokens:
        r = np.exp(logp[b, t] - anchor[b, t])  # token ratio (tests use the token ratio for these)
        a = d["adv"][b]
        out["clip_low_frac"] += a < 0 and r < 1 - p.clip_low
        out["clip_high_frac"] += a > 0 and r > 1 + p.clip_high
        out["dual_clip_frac"] += p.dual_clip is not None and a < 0 and r > p.dual_clip
        for key, other in (("approx_kl_prox", "prox"), ("approx_kl_behave", "behave")):
            ratio = np.exp(logp[b, t] - d[other][b, t])  # pi_theta / pi_other, sample from pi_other
            out[key] += (ratio - 1) - np.log(ratio)
        out["behave_weight_mean"] += np.exp(d["prox"][b, t] - d["behave"][b, t])
        out["entropy"] += d["entropy"][b, t]
    out = {k: v / len(tokens) for k, v in out.items()}
    out["behave_weight_max"] = max(np.exp(d["prox"][b, t] - d["behave"][b, t]) for b, t in tokens)
    return out


# --------------------------------------------------------------------------- data


def make_data(seed=0, rows=5, length=7):
    """Rows: several trained tokens (A > 0), one trained token (A < 0), fully masked (real),
    several (A < 0, one token far off-policy for the dual clip), and a padding row whose
    log-probs are garbage (NaN / inf) that must not leak into the loss or gradients."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, length), bool)
    mask[0, 1:5] = True
    mask[1, 3] = True
    mask[3, 2:] = True
    real = np.array([True, True, True, True, False])
    logp = -rng.gamma(2.0, 0.5, size=(rows, length))
    behave = logp + 0.5 * rng.normal(size=logp.shape)
    prox = behave + 0.4 * rng.normal(size=logp.shape)
    behave[3, 4] = prox[3, 4] = logp[3, 4] - 1.5  # ratio ~4.5 > dual clip 3 with A < 0
    ref = logp + 0.4 * rng.normal(size=logp.shape)
    adv = np.array([0.8, -1.1, 0.5, -0.6, 0.0])
    entropy = rng.gamma(2.0, 0.5, size=logp.shape)
    behave[4], prox[4], ref[4] = np.nan, np.inf, -np.inf
    return dict(logp=logp, behave=behave, prox=prox, ref=ref, adv=adv, entropy=entropy, mask=mask, real=real)


@functools.partial(jax.jit, static_argnames=("params",), compiler_options=FAST_COMPILE)
def evaluate(logp, prox, behave, adv, mask, real, entropy, ref, params):
    """(loss, diagnostics, d loss/d logp, d loss/d entropy) in one compiled program."""

    def loss_fn(logp, entropy):
        den = aggregation_denominators(mask, real)
        return policy_loss(logp, prox, behave, adv, mask, den, params, entropy=entropy, ref_logprobs=ref)

    (loss, diagnostics), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(logp, entropy)
    return loss, diagnostics, *grads


def call(d, p, dtype, logp=None, entropy=None):
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return evaluate(
        cast(d["logp"] if logp is None else logp), cast(d["prox"]), cast(d["behave"]), cast(d["adv"]),
        jnp.asarray(d["mask"]), jnp.asarray(d["real"]),
        cast(d["entropy"] if entropy is None else entropy), cast(d["ref"]), p,
    )


CONFIGS = {
    "grpo-default": AlgoParams(),
    "clip-higher-dual-seqmean-entropy": AlgoParams(
        clip_high=0.28, dual_clip=3.0, aggregation="seq-mean-token-mean", entropy_coef=0.01
    ),
    "decoupled-truncate-k3-sumnorm": AlgoParams(
        decoupled=True, behave_weight_cap=1.25, kl_coef=0.1, kl_estimator="k3",
        aggregation="seq-mean-token-sum-norm", loss_norm_tokens=8,
    ),
    "decoupled-mask-k2": AlgoParams(
        decoupled=True, behave_weight_cap=1.25, behave_weight_mode="mask", kl_coef=0.05, kl_estimator="k2"
    ),
    "decoupled-nocap": AlgoParams(decoupled=True, behave_weight_cap=None, dual_clip=3.0),
    "mismatch-k1-entropy": AlgoParams(mismatch_correction=True, behave_weight_cap=2.0, kl_coef=0.1,
                                      kl_estimator="k1", entropy_coef=0.02),
    "gspo-sequence": AlgoParams(ratio="sequence", clip_low=0.1, clip_high=0.1, aggregation="seq-mean-token-mean"),
}


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_value_matches_reference_in_float32(name):
    p, d = CONFIGS[name], make_data()
    loss, *_ = call(d, p, jnp.float32)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), reference_loss(d, p), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_match_central_differences_in_float64(name):
    p, d = CONFIGS[name], make_data(seed=1)
    with jax.enable_x64(True):
        _, _, grad_logp, grad_entropy = call(d, p, jnp.float64)
        assert grad_logp.dtype == jnp.float64
    step = 1e-6
    for array, got in (("logp", grad_logp), ("entropy", grad_entropy)):
        want = np.zeros(d[array].shape)
        for index in np.ndindex(*d[array].shape):
            plus, minus = d[array].copy(), d[array].copy()
            plus[index] += step
            minus[index] -= step
            want[index] = (reference_loss(d, p, **{array: plus}) - reference_loss(d, p, **{array: minus})) / (2 * step)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-9, err_msg=array)
    assert np.any(np.asarray(grad_logp) != 0)


@pytest.mark.parametrize("name", ["clip-higher-dual-seqmean-entropy", "decoupled-truncate-k3-sumnorm"])
def test_diagnostics_match_reference(name):
    p, d = CONFIGS[name], make_data()
    _, diagnostics, *_ = call(d, p, jnp.float32)
    want = reference_diagnostics(d, p)
    for key, value in want.items():
        np.testing.assert_allclose(float(diagnostics[key]), value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert float(diagnostics["dual_clip_frac"]) > 0 if p.dual_clip else True
    assert float(diagnostics["clip_low_frac"]) + float(diagnostics["clip_high_frac"]) > 0
    # The loss is the sum of its reported terms.
    loss, *_ = call(d, p, jnp.float32)
    total = diagnostics["pg_loss"] + diagnostics["kl_loss"] + diagnostics["entropy_loss"]
    np.testing.assert_allclose(float(loss), float(total), rtol=1e-6)


def test_capped_fraction_counts_truncated_and_masked_tokens():
    d = make_data()
    w = np.exp(d["prox"] - d["behave"])[d["mask"]]
    for mode, outside in (("truncate", w > 1.25), ("mask", (w > 1.25) | (w < 1 / 1.25))):
        p = AlgoParams(decoupled=True, behave_weight_cap=1.25, behave_weight_mode=mode)
        _, diagnostics, *_ = call(d, p, jnp.float32)
        assert outside.any()
        np.testing.assert_allclose(float(diagnostics["behave_weight_capped_frac"]), outside.mean(), rtol=1e-6)


def test_on_policy_decoupled_loss_equals_plain_ppo():
    """pi_theta = pi_prox = pi_behave: w = 1 and both ratios are 1, so loss and gradient agree."""
    d = make_data()
    d["prox"] = d["behave"] = d["logp"].copy()
    d["ref"] = d["logp"] - 0.1
    token = AlgoParams(dual_clip=3.0, kl_coef=0.1)
    sequence = AlgoParams(ratio="sequence", aggregation="seq-mean-token-mean")
    cases = {
        token: [dict(decoupled=True), dict(mismatch_correction=True)],
        sequence: [dict(decoupled=True, behave_weight_mode="mask")],
    }
    for base, variants in cases.items():
        plain = call(d, base, jnp.float32)
        for weighted in variants:
            coupled = base.replace(**weighted)
            decoupled = call(d, coupled, jnp.float32)
            np.testing.assert_allclose(float(decoupled[0]), float(plain[0]), rtol=1e-6)
            np.testing.assert_allclose(np.asarray(decoupled[2]), np.asarray(plain[2]), rtol=1e-6, atol=1e-8)


def test_stale_data_applies_w_exactly_once():
    """With pi_theta = pi_prox != pi_behave (stale tokens) every token's ratio is 1, so the loss is
    -sum(w A)/N and its gradient -w A/N per token: w to the first power, in the loss and in the
    KL term alike, whether it came through decoupling or the mismatch correction."""
    d = make_data()
    d["prox"] = d["logp"].copy()
    d["ref"] = d["logp"].copy()  # k2 has zero value and gradient here
    mask = d["mask"] & d["real"][:, None]
    count = mask.sum()
    w = np.exp(d["prox"] - d["behave"])
    for flags in (dict(decoupled=True), dict(mismatch_correction=True)):
        p = AlgoParams(behave_weight_cap=None, kl_coef=0.5, kl_estimator="k1", **flags)
        loss, _, grad, _ = call(d, p, jnp.float32)
        adv = np.broadcast_to(d["adv"][:, None], mask.shape)
        np.testing.assert_allclose(float(loss), -(w * adv)[mask].sum() / count, rtol=1e-5, atol=1e-6)
        want = np.where(mask, (-w * adv + 0.5 * w) / count, 0.0)  # d(k1)/dlogp = 1, times w once
        np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-6)


def test_missing_inputs_for_enabled_terms_are_errors():
    d = make_data()
    den = aggregation_denominators(jnp.asarray(d["mask"]), jnp.asarray(d["real"]))
    args = [jnp.asarray(d[k], jnp.float32) for k in ("logp", "prox", "behave", "adv")]
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(*args, jnp.asarray(d["mask"]), den, AlgoParams(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(*args, jnp.asarray(d["mask"]), den, AlgoParams(entropy_coef=0.1))
