"""The algorithm library: advantages, the clipped policy loss, KL estimators, aggregation, GAE.

Small pure ``jnp`` functions, each named by the config value that selects it
(``algo.estimator``, ``algo.ratio``, ``algo.kl_estimator``, ``algo.aggregation``), every
one checked against an independent numpy reference in ``tests/algo/``. PPO with a
critic (``algo.estimator: gae``): token rewards, GAE and the clipped value loss of
:mod:`asyncrl.algo.value`. Formulas,
defaults and sources: ``docs/algorithms.md``. Static configuration is an
:class:`AlgoParams` (frozen, hashable: a ``static_argnames`` argument), built once with
``AlgoParams.from_config(cfg)``.

How a trainer step uses it (inside one jitted step; arrays as in ``TrainBatch``)::

    params = AlgoParams.from_config(cfg)                                 # once, outside jit
    # whole batch [B, L], once per step, no gradient:
    mask = trained_mask(batch.loss_mask, batch.group_index, batch.truncated, params)
    advantages = batch.advantages if given else compute_advantages(                 # [B]
        batch.rewards, batch.group_index, batch.loss_mask.sum(-1), params)
    prox = per_token_logprobs(params_v, ...) if params.needs_prox_recompute else batch.behavior_logprobs
    ref = per_token_logprobs(ref_params, ...) if params.needs_reference else None
    for epoch in range(cfg.algo.ppo_epochs):
        for mini in split(rows, cfg.algo.mini_batches):                  # one optimizer update each
            den = aggregation_denominators(mask[mini], batch.group_index[mini] >= 0)
            grads, diag = 0, None
            for micro in split(mini, micro_batches):                       # gradient accumulation
                def loss_fn(theta):
                    logp, ent = per_token_logprobs(theta, ...)             # [b, L]
                    return policy_loss(logp, prox[micro], batch.behavior_logprobs[micro],
                                       advantages[micro], mask[micro], den, params,
                                       entropy=ent, ref_logprobs=ref[micro] if ref else None)
                (loss, d), g = jax.value_and_grad(loss_fn, has_aux=True)(theta)
                grads += g                                                 # float32; sum, not mean:
                diag = d if diag is None else accumulate_diagnostics(diag, d)  # shares add up
            apply clipping once, then the optimizer update, with grads

The completion lengths for ``truncated: penalty`` are the generated tokens per row: pass
``batch.loss_mask.sum(-1)`` (before :func:`trained_mask` removes truncated rows). With
``prox_logp: behave`` under ``decoupled`` the trainer must first check that every trained
token's version equals the step's version. Do not pass the micro-batch's own denominators:
the loss shares only add up to the mini-batch loss with the mini-batch's denominators.
"""

from asyncrl.algo.advantages import (
    batch,
    compute_advantages,
    dr_grpo,
    grpo,
    overlong_penalty,
    rloo,
    shaped_rewards,
    trained_mask,
)
from asyncrl.algo.aggregation import (
    Denominators,
    accumulate_diagnostics,
    aggregate,
    aggregation_denominators,
    packed_denominators,
    segment_totals,
    token_mean,
)
from asyncrl.algo.kl import KL_ESTIMATORS, k1, k2, k3, kl_penalty
from asyncrl.algo.losses import (
    LOG_RATIOS,
    behave_weight,
    clipped_surrogate,
    policy_loss,
    sequence_log_ratio,
    token_log_ratio,
)
from asyncrl.algo.params import AlgoParams
from asyncrl.algo.value import gae, last_token_mask, masked_whiten, token_rewards, value_loss, value_statistics

ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "batch": batch}
"""The built-in advantage estimators by ``algo.estimator`` name (also in the registry)."""

__all__ = [
    "AlgoParams",
    "Denominators",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOG_RATIOS",
    "accumulate_diagnostics",
    "aggregate",
    "aggregation_denominators",
    "batch",
    "behave_weight",
    "clipped_surrogate",
    "compute_advantages",
    "dr_grpo",
    "gae",
    "grpo",
    "k1",
    "k2",
    "k3",
    "kl_penalty",
    "last_token_mask",
    "masked_whiten",
    "overlong_penalty",
    "packed_denominators",
    "policy_loss",
    "rloo",
    "segment_totals",
    "sequence_log_ratio",
    "shaped_rewards",
    "token_log_ratio",
    "token_mean",
    "token_rewards",
    "trained_mask",
    "value_loss",
    "value_statistics",
]
