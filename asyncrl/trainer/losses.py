"""The train step's losses, one micro-batch at a time: what :func:`asyncrl.trainer.step.train_step`
differentiates (:func:`micro_loss`, :func:`critic_micro_loss`) and the whole-batch targets it
computes once before its updates (:func:`batch_targets`, :func:`batch_logprobs`,
:func:`critic_targets`). Pure functions of arrays; the step's layout (chunks ``[M, U, S * b, ...]``)
is described in :mod:`asyncrl.trainer.step`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from asyncrl.algo import (
    AlgoParams,
    compute_advantages,
    gae,
    masked_whiten,
    policy_loss,
    token_mean,
    token_rewards,
    trained_mask,
    value_loss,
    value_statistics,
)
from asyncrl.trainer.spec import CriticSpec


def lora_weights(frozen: Optional[Any], dropout: float, theta: Any, key: Optional[jax.Array] = None) -> Any:
    """The forward's params: ``theta`` alone (full training), or the frozen base + adapters
    ``theta`` (+ fresh dropout keys for a gradient pass with LoRA dropout)."""
    if frozen is None:
        return theta
    from asyncrl.model.lora import combine_params, dropout_keys, partition_params

    keys = dropout_keys(partition_params(frozen)[2], key) if (key is not None and dropout > 0) else None
    return combine_params(frozen, theta, keys)


def sft_loss(logprobs: jax.Array, entropy: Optional[jax.Array], mask: jax.Array, denominators: Any) -> tuple[jax.Array, dict]:
    """This micro-batch's share of the mini-batch's token-mean negative log-likelihood.

    ``logprobs``/``entropy`` float32 ``[b, L]`` (from :func:`per_token_logprobs` at T = 1;
    ``entropy`` None: not computed, no ``entropy`` diagnostic),
    ``mask`` bool ``[b, L]`` the trained tokens; ``denominators`` are the whole mini-batch's
    (:func:`~asyncrl.algo.aggregation_denominators`), so the shares of the micro-batches add up
    to the mini-batch loss exactly. Masked positions never reach the value or the gradient.
    Returns ``(loss, {"sft_loss", "entropy"})`` (diagnostics are shares too)."""
    nll = token_mean(-logprobs, mask, denominators)
    diagnostics = {"sft_loss": nll}
    if entropy is not None:
        diagnostics["entropy"] = token_mean(jax.lax.stop_gradient(entropy), mask, denominators)
    return nll, diagnostics


def batch_targets(batch: dict[str, jax.Array], algo: Optional[AlgoParams], sft: bool) -> tuple[jax.Array, jax.Array]:
    """``(mask, advantages)`` of the whole batch: bool ``[rows, L]`` the trained tokens, and float32
    ``[rows]`` (computed: group statistics are global, so never per micro-batch) or ``[rows, L]``
    (the workflow's own, when the batch carries them). SFT trains exactly ``loss_mask`` on real
    rows and needs no advantages (zeros, unused); so does ``gae`` here (its per-token advantages
    need the critic's values: :func:`critic_targets`)."""
    if sft:
        mask = batch["loss_mask"] & (batch["group_index"] >= 0)[:, None]
        return mask, jnp.zeros(batch["rewards"].shape, jnp.float32)
    assert algo is not None
    mask = trained_mask(batch["loss_mask"], batch["group_index"], batch["truncated"], algo)
    if "advantages" in batch:
        return mask, batch["advantages"].astype(jnp.float32)
    if algo.uses_critic:
        return mask, jnp.zeros(batch["rewards"].shape, jnp.float32)
    return mask, compute_advantages(batch["rewards"], batch["group_index"], jnp.sum(batch["loss_mask"], axis=-1), algo)


def batch_logprobs(forward: Callable, weights: Any, chunks: dict[str, jax.Array]) -> jax.Array:
    """``[M, U, S * b, W]`` log-probs (``W`` the step's window) of every chunk under ``weights``, no gradient (pi_prox or
    pi_ref). One micro-batch at a time (``lax.map``): the memory of one forward, like training."""
    m_count, u_count = chunks["input_ids"].shape[:2]
    flat = lambda x: None if x is None else x.reshape(m_count * u_count, *x.shape[2:])
    one = lambda a: forward(weights, a[0], a[1], a[2], with_entropy=False, nodes=a[3], segments=a[4])[0]
    out = jax.lax.map(one, (flat(chunks["input_ids"]), flat(chunks["attention_mask"]), flat(chunks["window_start"]),
                            flat(chunks.get("constraint_nodes")), flat(chunks.get("segment_ids"))))
    return jax.lax.stop_gradient(out.reshape(m_count, u_count, *out.shape[1:]))


def critic_targets(chunks: dict[str, jax.Array], rewards: jax.Array, old_values: jax.Array,
                   algo: AlgoParams) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """GAE on the chunked batch: ``{advantages, returns, old_values}`` ``[M, U, S * b, W]`` and the
    whole-batch value statistics. ``rewards`` ``[M, U, S * b]`` shaped sequence rewards (packed:
    ``[M, U, S * b, L]``, each token's row's), ``old_values`` the critic's values at the step's start.
    GAE runs per row (packed: per segment), so the chunk layout does not matter; the advantages
    are whitened over every trained token of the batch."""
    shape = chunks["mask"].shape
    flat = lambda x: x.reshape(-1, shape[-1])
    mask = flat(chunks["mask"])
    segments = flat(chunks["segment_ids"]) if "segment_ids" in chunks else None
    kl = None
    if algo.reward_kl_coef > 0:  # log pi_old - log pi_ref (pi_old: pi_prox, or the behaviour policy)
        kl = flat(chunks["prox_logprobs"]) - flat(chunks["ref_logprobs"])
    reward = token_rewards(rewards.reshape(-1) if segments is None else flat(rewards), mask, kl, algo.reward_kl_coef,
                           segment_ids=segments)
    values = flat(old_values)
    advantages, returns = gae(reward, values, mask, gamma=algo.gamma, lam=algo.lam, segment_ids=segments)
    stats = value_statistics(values, returns, mask)
    out = {"advantages": masked_whiten(advantages, mask), "returns": returns, "old_values": jnp.where(mask, values, 0.0)}
    return {k: v.reshape(shape) for k, v in out.items()}, stats


def critic_micro_loss(theta: Any, x: dict[str, jax.Array], denominators: Any, key: Optional[jax.Array], *,
                      forward: Callable, critic: CriticSpec) -> tuple[jax.Array, dict]:
    """One micro-batch's share of its mini-batch's value loss (times ``critic.loss_coef``),
    differentiated in the critic's ``theta``; chunks as in :func:`micro_loss`."""
    values = forward(theta, x["input_ids"], x["attention_mask"], x["window_start"], key, segments=x.get("segment_ids"))
    loss, diagnostics = value_loss(values, x["old_values"], x["returns"], x["mask"], denominators, critic.value_clip)
    return critic.loss_coef * loss, diagnostics


def micro_loss(theta: Any, x: dict[str, jax.Array], denominators: Any, key: Optional[jax.Array], *,
               forward: Callable, algo: Optional[AlgoParams], router_top_k: int = 0) -> tuple[jax.Array, dict]:
    """One micro-batch's share of its mini-batch's loss, and the diagnostics; differentiated
    in ``theta``. ``x``: the micro-batch's chunks, ``[S * b, L]`` / ``[S * b]``; ``algo`` None
    for SFT; ``key`` the micro-batch's LoRA dropout key (or None). Token arrays other than
    ``input_ids`` / ``attention_mask`` are ``[S * b, W]`` windows (``window_start``).
    ``router_top_k`` (a mixture-of-experts policy's top-k, 0 otherwise): add the router terms
    (:func:`router_terms`)."""
    segments = x.get("segment_ids")  # packed rows: [S * b, L]
    router = {"with_router": True} if router_top_k else {}
    outputs = forward(theta, x["input_ids"], x["attention_mask"], x["window_start"], key,
                      nodes=x.get("constraint_nodes"), segments=segments, **router)
    logprobs, entropy = outputs[:2]
    if algo is None:
        loss, diagnostics = sft_loss(logprobs, entropy, x["mask"], denominators)
    else:
        loss, diagnostics = policy_loss(
            logprobs, x["prox_logprobs"], x["behavior_logprobs"], x["advantages"], x["mask"], denominators, algo,
            entropy=entropy, ref_logprobs=x.get("ref_logprobs"), segment_ids=segments,
        )
    if not router_top_k:
        return loss, diagnostics
    coef = 0.0 if algo is None else algo.router_aux_loss_coef
    aux_share, stats = router_terms(outputs[2], x["attention_mask"], x["real"], denominators, router_top_k, segments)
    return loss + coef * aux_share, dict(diagnostics, **stats)


def router_terms(router_logits: list[jax.Array], attention_mask: jax.Array, real: jax.Array, denominators: Any,
                 top_k: int, segment_ids: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
    """A mixture-of-experts micro-batch's load-balancing loss, as its share of the mini-batch's
    (weighted by its real rows, like a row mean), and its routing statistics: ``router_aux_loss``
    (logged ``loss/router_aux``) and ``expert_load_max`` (``train/expert_load_max``, maximised over
    micro-batches; :func:`asyncrl.model.moe.expert_load_max`). ``router_logits`` float32
    ``[rows * L, E]`` per MoE layer; ``attention_mask`` ``[rows, L]`` and ``real`` ``[rows]`` pick
    the real tokens. Packed (``segment_ids [rows, L]``), the micro-batch's rows are its segments:
    the loss is over the same tokens, grouped into micro-batches as packing groups them. The
    experts drop no token (no capacity limit), so there is no drop count."""
    from asyncrl.model.moe import expert_load_max, load_balancing_loss

    tokens = (attention_mask & real[:, None]).reshape(-1)  # [rows * L]
    aux = load_balancing_loss(router_logits, top_k, tokens)
    if segment_ids is None:
        rows_here = jnp.sum(real).astype(jnp.float32)
    else:  # a segment starts where the id changes to a non-zero one
        previous = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]), segment_ids[:, :-1]], axis=1)
        rows_here = jnp.sum((segment_ids > 0) & (segment_ids != previous)).astype(jnp.float32)
    share = aux * rows_here / jnp.maximum(denominators.rows, 1.0)
    stats = {"router_aux_loss": share, "expert_load_max": expert_load_max(router_logits, top_k, tokens)}
    return share, jax.tree.map(jax.lax.stop_gradient, stats)
