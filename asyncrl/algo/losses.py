"""The clipped policy-gradient loss, with decoupled weighting, KL and entropy terms.

All arrays are ``[B, L]`` (float32 or float64) unless noted; ``loss_mask`` is bool
``[B, L]`` and already false on padding rows and untrained tokens (see
:func:`asyncrl.algo.advantages.trained_mask`).

Per trained token, with A the advantage, ``anchor`` = pi_prox when weighted (decoupled
PPO or mismatch correction) else pi_behave:

    r    = exp(log pi_theta - log anchor)       (token), or exp(mean_t of it) per row (sequence, GSPO)
    pg   = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    pg   = min(pg, -c A) where A < 0            (dual clip c, when set)
    w    = sg(exp(log pi_prox - log pi_behave)) then truncate (min(w, cap)) or mask (0 outside [1/cap, cap]);
           w = 1 when not weighted
    loss = w pg + kl_coef w k(log pi_theta - log pi_ref) - entropy_coef H

and the tokens' losses are aggregated by :mod:`asyncrl.algo.aggregation`. Log-ratios are
clamped to [-20, 20] before ``exp`` so that a wildly off-policy token cannot overflow to
inf (and NaN gradients).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from asyncrl.algo.aggregation import Denominators, aggregate, segment_totals, token_mean
from asyncrl.algo.kl import k3, kl_penalty
from asyncrl.algo.params import AlgoParams

_LOG_RATIO_CLAMP = 20.0


def token_log_ratio(logprobs: jax.Array, anchor_logprobs: jax.Array, loss_mask: jax.Array,
                    segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """``[B, L]`` log pi_theta - log pi_anchor on trained tokens, 0 elsewhere (``segment_ids``:
    unused, a token's ratio is its own)."""
    return jnp.where(loss_mask, logprobs - anchor_logprobs, 0.0)


def sequence_log_ratio(logprobs: jax.Array, anchor_logprobs: jax.Array, loss_mask: jax.Array,
                       segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """GSPO: ``[B, L]`` each row's mean token log-ratio over its trained tokens, broadcast to them
    (packed rows, ``segment_ids`` ``[B, L]``: each segment's, an original row's)."""
    token = token_log_ratio(logprobs, anchor_logprobs, loss_mask)
    if segment_ids is not None:
        count = jnp.maximum(segment_totals(loss_mask.astype(token.dtype), segment_ids), 1.0)
        return jnp.where(loss_mask, segment_totals(token, segment_ids) / count, 0.0)
    count = jnp.maximum(jnp.sum(loss_mask, axis=-1, keepdims=True), 1).astype(token.dtype)
    return jnp.where(loss_mask, jnp.sum(token, axis=-1, keepdims=True) / count, 0.0)


LOG_RATIOS = {"token": token_log_ratio, "sequence": sequence_log_ratio}
"""``algo.ratio`` value -> ``(logprobs, anchor_logprobs, loss_mask, segment_ids=None) -> log-ratio [B, L]``."""


def clipped_surrogate(ratio: jax.Array, advantages: jax.Array, params: AlgoParams) -> jax.Array:
    """Per-token PPO loss ``[B, L]``: max(-A r, -A clip(r)), with the dual clip for A < 0."""
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - params.clip_low, 1.0 + params.clip_high)
    loss = jnp.maximum(unclipped, clipped)
    if params.dual_clip is not None:
        loss = jnp.where(advantages < 0, jnp.minimum(loss, -params.dual_clip * advantages), loss)
    return loss


def behave_weight(prox_logprobs: jax.Array, behavior_logprobs: jax.Array, loss_mask: jax.Array, params: AlgoParams):
    """(raw w, applied w), both ``[B, L]`` and without gradient: w = pi_prox / pi_behave on trained
    tokens (1 elsewhere), the applied one truncated at or masked outside the cap."""
    log_w = jnp.where(loss_mask, prox_logprobs - behavior_logprobs, 0.0)
    raw = jax.lax.stop_gradient(jnp.exp(jnp.clip(log_w, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)))
    cap = params.behave_weight_cap
    if cap is None:
        return raw, raw
    if params.behave_weight_mode == "truncate":
        return raw, jnp.minimum(raw, cap)
    return raw, jnp.where((raw >= 1.0 / cap) & (raw <= cap), raw, 0.0)


def reference_kl(
    logprobs: jax.Array, ref_logprobs: Optional[jax.Array], loss_mask: jax.Array, params: AlgoParams
) -> jax.Array:
    """``[B, L]`` the KL penalty ``k(log pi_theta - log pi_ref)`` (``params.kl_estimator``) per token."""
    if ref_logprobs is None:
        raise ValueError("policy_loss: algo.kl_coef > 0 needs ref_logprobs")
    # Masked before the estimator: a non-finite value on an untrained token would
    # otherwise turn its zero cotangent into NaN.
    return kl_penalty(jnp.where(loss_mask, logprobs, 0.0), jnp.where(loss_mask, ref_logprobs, 0.0), params.kl_estimator)


@functools.partial(jax.jit, static_argnames=("params",))
def policy_loss(
    logprobs: jax.Array,
    prox_logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    denominators: Denominators,
    params: AlgoParams,
    entropy: Optional[jax.Array] = None,
    ref_logprobs: Optional[jax.Array] = None,
    segment_ids: Optional[jax.Array] = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This micro-batch's share of the mini-batch loss, and its diagnostics.

    Args:
      logprobs: ``[B, L]`` log pi_theta (the differentiated input).
      prox_logprobs: ``[B, L]`` log pi_prox (weights at the step's start); read only when
        ``params.weighted``, and for the ``approx_kl_prox`` / ``behave_weight_*`` diagnostics
        (pass ``behavior_logprobs`` when there is none).
      behavior_logprobs: ``[B, L]`` log pi_behave, from the engine.
      advantages: ``[B]`` (one per row) or ``[B, L]`` (per token).
      loss_mask: bool ``[B, L]``, trained tokens of real rows.
      denominators: from :func:`aggregation_denominators` over the whole mini-batch.
      params: static config.
      entropy: ``[B, L]`` token entropies of pi_theta; required when ``entropy_coef > 0``.
      ref_logprobs: ``[B, L]`` log pi_ref; required when ``kl_coef > 0``.
      segment_ids: int32 ``[B, L]`` when the rows are packed (:mod:`asyncrl.rollout.packing`):
        per-row quantities (GSPO's sequence ratio, ``seq-mean-token-mean``) are per segment.

    Returns ``(loss, diagnostics)``: scalars. Summed over the micro-batches of a mini-batch
    (``_max`` keys: maximum, see :func:`accumulate_diagnostics`) they give the mini-batch's
    loss and means: ``pg_loss``, ``kl_loss``, ``entropy_loss`` (the loss's three terms);
    token means ``clip_low_frac``, ``clip_high_frac``, ``dual_clip_frac``, ``approx_kl_prox``
    and ``approx_kl_behave`` (k3 estimates of KL(pi_prox || pi_theta), KL(pi_behave || pi_theta)),
    ``behave_weight_mean`` (raw w), ``behave_weight_capped_frac`` (tokens whose w was truncated
    or masked), ``entropy`` and ``kl_ref`` when given; and ``behave_weight_max``.
    """
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    advantages = jnp.broadcast_to(advantages, logprobs.shape).astype(logprobs.dtype)
    anchor = prox_logprobs if params.weighted else behavior_logprobs
    log_ratio = LOG_RATIOS[params.ratio](logprobs, anchor, loss_mask, segment_ids)
    ratio = jnp.exp(jnp.clip(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    pg = clipped_surrogate(ratio, advantages, params)

    raw_w, applied_w = behave_weight(prox_logprobs, behavior_logprobs, loss_mask, params)
    weight = applied_w.astype(logprobs.dtype) if params.weighted else jnp.ones_like(logprobs)

    token_loss = weight * pg
    # Per-token statistics of the regularisers, reduced with the others in policy_diagnostics.
    extra_stats: dict[str, jax.Array] = {}
    kl = reference_kl(logprobs, ref_logprobs, loss_mask, params) if params.kl_coef > 0 else jnp.zeros_like(pg)
    if params.kl_coef > 0:
        token_loss = token_loss + params.kl_coef * weight * kl
        extra_stats["kl_ref"] = kl
    if params.entropy_coef > 0:
        if entropy is None:
            raise ValueError("policy_loss: algo.entropy_coef > 0 needs entropy")
        token_loss = token_loss - params.entropy_coef * entropy
    if entropy is not None:
        extra_stats["entropy"] = entropy
    # One aggregation of the summed token loss (it is linear): one reduction to compile.
    loss = aggregate(token_loss, loss_mask, denominators, params, segment_ids=segment_ids)
    diagnostics = policy_diagnostics(
        jax.lax.stop_gradient(ratio), advantages, jax.lax.stop_gradient(logprobs), prox_logprobs, behavior_logprobs,
        raw_w, applied_w, loss_mask, denominators, params, extra_stats=extra_stats, weight=weight, pg=pg, kl=kl,
        entropy=entropy, segment_ids=segment_ids,
    )
    return loss, diagnostics


def policy_diagnostics(
    ratio: jax.Array,
    advantages: jax.Array,
    logprobs: jax.Array,
    prox_logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    raw_w: jax.Array,
    applied_w: jax.Array,
    loss_mask: jax.Array,
    denominators: Denominators,
    params: AlgoParams,
    *,
    extra_stats: dict[str, jax.Array],
    weight: jax.Array,
    pg: jax.Array,
    kl: jax.Array,
    entropy: Optional[jax.Array],
    segment_ids: Optional[jax.Array] = None,
) -> dict[str, jax.Array]:
    """The diagnostics of :func:`policy_loss` (see there), no gradient.

    ``ratio``, ``advantages`` (broadcast), ``logprobs`` (gradient already stopped), the three
    other log-probs and the raw / applied behaviour weights are ``[B, L]``, as in
    :func:`policy_loss`; ``extra_stats`` are further per-token statistics (``kl_ref``,
    ``entropy``); ``weight`` (applied w, or ones), ``pg``, ``kl`` (zeros without KL) and
    ``entropy`` the per-token pieces of the loss ``[B, L]``. Token statistics are token means
    over ``loss_mask``; the loss's terms are aggregated like the loss (shares of the mini-batch's).
    """
    false = jnp.zeros_like(loss_mask)
    token_stats = dict(extra_stats)
    token_stats.update(
        clip_low_frac=(advantages < 0) & (ratio < 1.0 - params.clip_low),
        clip_high_frac=(advantages > 0) & (ratio > 1.0 + params.clip_high),
        dual_clip_frac=(advantages < 0) & (ratio > params.dual_clip) if params.dual_clip is not None else false,
        approx_kl_prox=k3(prox_logprobs, logprobs),
        approx_kl_behave=k3(behavior_logprobs, logprobs),
        # |log pi_behave - log pi_prox|: the engine/trainer mismatch (0 when pi_prox is not recomputed).
        logprob_gap=jnp.abs(prox_logprobs - behavior_logprobs),
        behave_weight_mean=raw_w,
        behave_weight_capped_frac=raw_w != applied_w if params.behave_weight_cap is not None else false,
    )
    # One stacked masked mean compiles to one kernel instead of one per statistic.
    stacked = jnp.stack([jax.lax.stop_gradient(v).astype(logprobs.dtype) for v in token_stats.values()])
    means = token_mean(stacked, loss_mask[None], denominators, axis=(1, 2))
    diagnostics = dict(zip(token_stats, means))
    # The loss's terms, as shares of the mini-batch loss like the loss itself (diagnostics only).
    terms = {"pg_loss": weight * pg}
    terms["kl_loss"] = params.kl_coef * weight * kl
    terms["entropy_loss"] = -params.entropy_coef * entropy if entropy is not None and params.entropy_coef > 0 else jnp.zeros_like(pg)
    stacked_terms = jax.lax.stop_gradient(jnp.stack(list(terms.values())))
    diagnostics.update(zip(terms, aggregate(stacked_terms, loss_mask[None], denominators, params, axis=(1, 2),
                                                  segment_ids=segment_ids)))
    diagnostics["behave_weight_max"] = jnp.max(jnp.where(loss_mask, raw_w, 0.0))
    return diagnostics
