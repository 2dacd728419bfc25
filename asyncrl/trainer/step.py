"""The jitted trainer step: one ``TrainBatch`` in, the next weights out.

One call of :func:`train_step` is one trainer step (docs/design.md "Versions and the publish order"):
it starts from the weights of version ``v``, runs ``algo.ppo_epochs x algo.mini_batches``
optimizer updates and returns the weights of version ``v + 1``. The whole step is one module-level jitted function
whose config is static (the model graphdef, :class:`~asyncrl.algo.AlgoParams`,
:class:`~asyncrl.trainer.optim.OptimParams` and a :class:`StepSpec`), so trainers with equal
configs share one compilation (:func:`compile_count`). It reads top to bottom:

1. trained mask and advantages from ``rewards`` + ``group_index`` (``asyncrl.algo``),
   unless the batch carries its own advantages (:func:`~asyncrl.trainer.losses.batch_targets`);
2. pi_prox log-probs of the step's starting weights, once, on the whole batch, no
   gradient, when ``algo`` needs them recomputed (decoupled with ``prox_logp: recompute``,
   or mismatch correction); reference log-probs (frozen initial weights) only when
   ``algo.kl_coef > 0`` (:func:`~asyncrl.trainer.losses.batch_logprobs`);
2b. with a critic (``algo.estimator: gae``, a static :class:`CriticSpec`): the critic's values at the
   step's start, and from them GAE advantages and returns (:func:`~asyncrl.trainer.losses.critic_targets`);
3. ``lax.scan`` over the updates (:func:`optimizer_update`; with a critic, each policy update is
   followed by one of the critic's, :func:`~asyncrl.trainer.losses.critic_micro_loss`); each accumulates float32
   gradients over ``optim.micro_batches`` (:func:`accumulate_gradients`, a ``lax.scan``) with
   the mini-batch's aggregation denominators, then clips the global norm once and applies the
   optax update. An update whose loss or gradient norm is not finite keeps the old parameters
   and optimizer state (Adam's count and the schedule do not advance): ``optax.apply_if_finite``
   semantics, counted (:func:`apply_if_finite`).

Log-probs everywhere come from :func:`asyncrl.model.per_token_logprobs` at the batch's
temperature (a traced scalar: a new temperature does not recompile).

Row layout. Rows are split over ``data x fsdp`` (S shards); each mini-batch must take
rows from every shard, or most devices would idle. The host therefore permutes the
batch's rows before placing them (``Trainer._device_batch``): logical row
``((i * U + j) * S + s) * b + k`` (mini-batch i, micro-batch j, shard s) goes to shard s, and
:func:`to_chunks` undoes it on the device. Mini-batch i is then the logical rows
``[i * rows / M, (i + 1) * rows / M)`` whatever the mesh, so the result does not depend on
the number of devices. With several processes each process permutes its own rows, and
mini-batch i is the i-th chunk of every process's rows.

Donation. The optimizer state is donated; gradient buffers live inside the one jitted
step (a ``lax.scan`` carry), where XLA reuses them. Parameters are never donated: the
weights the trainer publishes are its own buffers (``device_put`` onto the same sharding
does not copy), so donating them would invalidate the engine's copy. The cost is one extra
copy of the parameters during a step.

Shapes below: ``rows`` the global batch rows, ``L`` the sequence length, ``M`` mini-batches,
``U`` micro-batches per mini-batch, ``S * b`` the rows of one micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from asyncrl.algo import (
    AlgoParams,
    accumulate_diagnostics,
    aggregation_denominators,
    packed_denominators,
    shaped_rewards,
)
from asyncrl.cluster.mesh import ROW_AXES
from asyncrl.engine.constraints import TrieTables, allowed_tokens
from asyncrl.model.attention import compiled_for
from asyncrl.model.blocks import dtype_of
from asyncrl.model.compute_copy import cast_for_compute
from asyncrl.model.critic import critic_shardings, per_token_values
from asyncrl.model.logprobs import per_token_logprobs, take_window, window_starts
from asyncrl.model.sharding import param_shardings
from asyncrl.trainer.losses import batch_logprobs, batch_targets, critic_micro_loss, critic_targets, lora_weights, micro_loss
from asyncrl.trainer.optim import OptimParams, build_optimizer, learning_rate_schedule, opt_state_shardings, update_count
from asyncrl.trainer.packed import packed_shaped_rewards, packed_targets
from asyncrl.trainer.spec import CriticSpec, HashedGraphDef, StepSpec

_TRACE_COUNT = [0]
"""Traces of the train step in this process (:func:`compile_count`)."""


@functools.partial(jax.jit, static_argnames=("optim", "spec"))
def init_opt_state(params: Any, *, optim: OptimParams, spec: StepSpec) -> Any:
    """The optimizer state of ``params``, placed like them (module level: shared compilation)."""
    optimizer = build_optimizer(optim)
    state = optimizer.init(params)
    shardings = opt_state_shardings(optimizer, state, param_shardings(spec.model_cfg, params, spec.mesh), spec.mesh)
    return jax.lax.with_sharding_constraint(state, shardings)


def _abstract_state(params: Any, optim: OptimParams, placed: Any, mesh: Any) -> Any:
    """``optim``'s state for ``params`` as ``jax.ShapeDtypeStruct`` leaves, each with the sharding
    it would have beside parameters placed by ``placed`` (their shardings), allocating nothing."""
    optimizer = build_optimizer(optim)
    state = jax.eval_shape(optimizer.init, params)
    shardings = opt_state_shardings(optimizer, state, placed, mesh)
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        state, shardings)


def abstract_opt_state(params: Any, *, optim: OptimParams, spec: StepSpec) -> Any:
    """What :func:`init_opt_state` would return, as ``jax.ShapeDtypeStruct`` leaves carrying their
    shardings, without allocating it: the template a resume reads the saved optimizer state onto
    (a materialised fresh state would sit beside the restored one until replaced)."""
    return _abstract_state(params, optim, param_shardings(spec.model_cfg, params, spec.mesh), spec.mesh)


def abstract_critic_opt_state(params: Any, *, optim: OptimParams, model_cfg: Any, mesh: Any) -> Any:
    """:func:`init_critic_opt_state` as shapes, dtypes and shardings only (:func:`abstract_opt_state`)."""
    return _abstract_state(params, optim, critic_shardings(model_cfg, params, mesh), mesh)


@functools.partial(jax.jit, static_argnames=("optim", "model_cfg", "mesh"))
def init_critic_opt_state(params: Any, *, optim: OptimParams, model_cfg: Any, mesh: Any) -> Any:
    """The critic's optimizer state (``critic.optim``), placed like its parameters."""
    optimizer = build_optimizer(optim)
    state = optimizer.init(params)
    shardings = opt_state_shardings(optimizer, state, critic_shardings(model_cfg, params, mesh), mesh)
    return jax.lax.with_sharding_constraint(state, shardings)


# --------------------------------------------------------------------------- pure pieces of the step


def to_chunks(x: jax.Array, spec: StepSpec) -> jax.Array:
    """``[rows, ...]`` in device order -> ``[M, U, S * b, ...]`` (mini, micro, rows of that micro-batch)."""
    s, m, u = spec.row_shards, spec.mini_batches, spec.micro_batches
    rows, rest = x.shape[0], x.shape[1:]
    b = rows // (s * m * u)
    x = x.reshape(s, m, u, b, *rest)
    x = jnp.moveaxis(x, 0, 2).reshape(m, u, s * b, *rest)
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(spec.mesh, PartitionSpec(None, None, ROW_AXES, *([None] * len(rest))))
    )


def accumulate_gradients(grad_fn: Callable, theta: Any, mini: dict[str, jax.Array], update_key: Optional[jax.Array],
                         p_shardings: Any, compute_dtype: Optional[str] = None) -> tuple[Any, jax.Array, dict]:
    """``(grads, loss, diagnostics)`` of one mini-batch (``mini``: ``[U, S * b, ...]``), summed
    over its micro-batches in float32 (each micro-batch's loss is its share of the mini-batch
    loss, so the sum is the mini-batch's; ``_max`` diagnostics take the maximum).

    ``compute_dtype`` (a name; None: no copy): the micro-batches run on one copy of ``theta`` in
    that dtype, cast once here instead of in each micro-batch's forward
    (:func:`asyncrl.model.compute_copy.cast_for_compute`); the gradients, taken with respect to
    the copy, are the same numbers the cast inside the model would give."""
    length = mini["mask"].shape[-1]
    # Over the whole mini-batch, passed to every micro-batch (packed: counted over its segments).
    if "segment_ids" in mini:
        denominators = packed_denominators(mini["mask"].reshape(-1, length), mini["segment_ids"].reshape(-1, length))
    else:
        denominators = aggregation_denominators(mini["mask"].reshape(-1, length), mini["real"].reshape(-1))
    micro_key = lambda j: None if update_key is None else jax.random.fold_in(update_key, j)
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), theta)
    if compute_dtype is not None:
        theta = cast_for_compute(theta, dtype_of(compute_dtype))
    first = jax.tree.map(lambda x: x[0], mini)
    (_, diag_shape), _ = jax.eval_shape(grad_fn, theta, first, denominators, micro_key(0))
    zero_diag = {k: jnp.full(v.shape, -jnp.inf if k.endswith("_max") else 0.0, v.dtype) for k, v in diag_shape.items()}

    def one_micro(acc, x_and_index):
        x, j = x_and_index
        grads, loss, diag = acc
        (micro_loss_value, micro_diag), g = grad_fn(theta, x, denominators, micro_key(j))
        grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
        grads = jax.lax.with_sharding_constraint(grads, p_shardings)
        return (grads, loss + micro_loss_value, accumulate_diagnostics(diag, micro_diag)), None

    u_count = mini["mask"].shape[0]
    (grads, loss, diag), _ = jax.lax.scan(
        one_micro, (zero_grads, jnp.zeros((), jnp.float32), zero_diag), (mini, jnp.arange(u_count))
    )
    return grads, loss, diag


def apply_if_finite(theta: Any, state: Any, grads: Any, loss: jax.Array, *, optim: OptimParams,
                    p_shardings: Any, o_shardings: Any) -> tuple[Any, Any, dict]:
    """One optax update of ``(theta, state)`` with ``grads``, kept only when the loss and the
    gradient norm are finite. Returns ``(theta, state, {grad_norm, lr, finite, update_norm})``."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    lr = learning_rate_schedule(optim)(update_count(state))

    def apply(state_theta):
        state, theta = state_theta
        updates, new_state = build_optimizer(optim).update(grads, state, theta)
        new_theta = optax.apply_updates(theta, updates)
        cast = lambda new, old: new.astype(old.dtype)  # dtypes kept (bfloat16 params/moments, float32 grads)
        return (jax.tree.map(cast, new_state, state), jax.tree.map(cast, new_theta, theta)), optax.tree.norm(updates)

    def keep(state_theta):
        return state_theta, jnp.zeros((), jnp.float32)

    # A branch rather than a select of new and old values: a select reads the old optimizer
    # state after the update has written it, so XLA copied the donated state whole.
    (state, theta), update_norm = jax.lax.cond(finite, apply, keep, (state, theta))
    theta = jax.lax.with_sharding_constraint(theta, p_shardings)
    state = jax.lax.with_sharding_constraint(state, o_shardings)
    stats = dict(grad_norm=grad_norm, lr=lr, finite=finite, update_norm=update_norm)
    return theta, state, stats


@dataclasses.dataclass(frozen=True)
class CriticUpdate:
    """What the scan over updates needs to train the critic beside the policy (None: no critic)."""

    grad_fn: Callable
    dropout_key: Optional[jax.Array]
    optim: OptimParams
    p_shardings: Any
    o_shardings: Any


def optimizer_update(carry: tuple, update_index: jax.Array, *, chunks: dict[str, jax.Array],
                     grad_fn: Callable, dropout_key: Optional[jax.Array], optim: OptimParams, p_shardings: Any,
                     o_shardings: Any, critic: Optional[CriticUpdate] = None,
                     compute_dtype: Optional[str] = None) -> tuple[tuple, dict]:
    """The body of the scan over updates: update ``update_index`` trains mini-batch
    ``update_index % M`` (epochs cycle over the mini-batches in order). ``carry`` is
    ``(theta, state)``, or ``(theta, state, critic_theta, critic_state)`` with a critic, which then
    takes one update of its own on the same mini-batch (kept only when finite, like the policy's).
    ``compute_dtype``: the policy's micro-batches run on one copy of ``theta`` in it
    (:func:`accumulate_gradients`)."""
    theta, state = carry[:2]
    m_count = chunks["mask"].shape[0]
    mini = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, update_index % m_count, 0, False), chunks)
    update_key = None if dropout_key is None else jax.random.fold_in(dropout_key, update_index)
    grads, loss, diag = accumulate_gradients(grad_fn, theta, mini, update_key, p_shardings, compute_dtype)
    theta, state, stats = apply_if_finite(theta, state, grads, loss, optim=optim, p_shardings=p_shardings,
                                          o_shardings=o_shardings)
    if critic is None:
        return (theta, state), dict(diag, loss=loss, **stats)
    c_theta, c_state = carry[2:]
    c_key = None if critic.dropout_key is None else jax.random.fold_in(critic.dropout_key, update_index)
    c_grads, c_loss, c_diag = accumulate_gradients(critic.grad_fn, c_theta, mini, c_key, critic.p_shardings)
    c_theta, c_state, c_stats = apply_if_finite(c_theta, c_state, c_grads, c_loss, optim=critic.optim,
                                                p_shardings=critic.p_shardings, o_shardings=critic.o_shardings)
    c_stats = {"critic_" + k: v for k, v in c_stats.items()}
    return (theta, state, c_theta, c_state), dict(diag, loss=loss, **stats, **c_diag, **c_stats)


def step_metrics(per_update: dict[str, jax.Array], mask: jax.Array) -> dict[str, jax.Array]:
    """The step's metrics from ``per_update`` values ``[updates]``: means over the applied
    updates (NaN when none was), maxima for ``_max`` keys, the last learning rate, the trained
    tokens of ``mask`` ``[rows, L]``, and ``finite [updates]``."""
    finite = per_update.pop("finite")
    critic_finite = per_update.pop("critic_finite", None)
    applied = jnp.sum(finite)
    metrics = {}
    for key, values in per_update.items():
        if critic_finite is not None and key.startswith(("critic_", "value_")):  # the critic's own guard
            metrics[key] = jnp.sum(jnp.where(critic_finite, values, 0.0)) / jnp.sum(critic_finite)
            continue
        if key.endswith("_max"):
            metrics[key] = jnp.max(jnp.where(finite, values, -jnp.inf))
        else:
            metrics[key] = jnp.sum(jnp.where(finite, values, 0.0)) / applied
    metrics["lr"] = per_update["lr"][-1]
    metrics["trained_tokens"] = jnp.sum(mask)
    metrics["finite"] = finite
    if critic_finite is not None:
        metrics["critic_lr"] = per_update["critic_lr"][-1]
        metrics["critic_finite"] = critic_finite
    return metrics


# --------------------------------------------------------------------------- the step


def _train_step_impl(
    graphdef: Any,
    params: Any,
    opt_state: Any,
    ref_params: Optional[Any],
    batch: dict[str, jax.Array],
    temperature: jax.Array,
    frozen: Optional[Any] = None,
    dropout_key: Optional[jax.Array] = None,
    trie: Optional[TrieTables] = None,
    critic_params: Optional[Any] = None,
    critic_opt_state: Optional[Any] = None,
    critic_frozen: Optional[Any] = None,
    critic_dropout_key: Optional[jax.Array] = None,
    *,
    algo: Optional[AlgoParams],
    optim: OptimParams,
    spec: StepSpec,
    window: Optional[int] = None,
    critic: Optional[CriticSpec] = None,
):
    """One trainer step. ``batch``: the TrainBatch fields, ``[rows, L]`` / ``[rows]``, rows in
    device order (see the module docstring). Returns ``(opt_state, params, metrics)``; metrics
    hold scalars plus ``finite [updates]`` (whether each update was applied, in order).

    ``window`` (static; None: ``L``): every row's ``loss_mask`` lies within ``window``
    consecutive positions (:func:`loss_window`). Only those positions go through the lm head,
    log-softmax and loss (:func:`~asyncrl.model.logprobs.per_token_logprobs` with a window):
    the result equals the full-sequence computation, with less work when prompts are long.

    ``algo`` is None for SFT (``spec.objective == "sft"``). LoRA: ``params`` (and ``ref_params``)
    are the adapters, ``frozen`` the base weights that every forward combines them with (no
    gradient, no optimizer state); ``dropout_key`` seeds the adapter dropout of the gradient
    passes when ``spec.lora_dropout > 0``.

    ``trie``: the run's decoding constraint (:class:`~asyncrl.engine.constraints.TrieTables`,
    ``spec.trie_branch`` wide) when the batch carries ``constraint_nodes`` ``[rows, L]``: tokens
    with a node >= 0 are scored under the distribution masked to that node's allowed tokens,
    which is what the engine sampled from (docs/decoding.md), so the ratio is 1 on-policy.

    ``critic`` (static; ``algo.estimator: gae``): the critic's ``critic_params`` / ``critic_opt_state``
    (``critic_frozen``: its LoRA base, ``critic_dropout_key`` its adapter dropout). Its values at the
    step's start give the GAE advantages and returns (:func:`~asyncrl.trainer.losses.critic_targets`); each optimizer update
    of the policy is followed by one of the critic on the same mini-batch. The step then returns
    ``(opt_state, params, metrics, critic_opt_state, critic_params)``."""
    _TRACE_COUNT[0] += 1
    if isinstance(graphdef, HashedGraphDef):
        graphdef = graphdef.graphdef
    sft = spec.objective == "sft"
    # The float32 weights in the compute dtype once per update (or, under LoRA, the frozen base
    # once per step), not once per micro-batch's forward: docs/performance.md "The train step".
    model_cfg = spec.model_cfg
    cast_once = model_cfg.compute_dtype if model_cfg.param_dtype != model_cfg.compute_dtype else None
    if frozen is not None and cast_once is not None:
        frozen = cast_for_compute(frozen, dtype_of(cast_once))
    p_shardings = param_shardings(spec.model_cfg, params, spec.mesh)
    o_shardings = opt_state_shardings(build_optimizer(optim), opt_state, p_shardings, spec.mesh)

    length = batch["input_ids"].shape[1]
    window = length if window is None else min(window, length)

    # The policy's forward at this step's temperature, over the window:
    # (theta, ids, attention, starts, key) -> (logprobs, entropy) [b, W].
    def forward(theta, input_ids, attention_mask, starts, key=None, with_entropy=spec.entropy, nodes=None, segments=None,
                with_router=False):
        weights = lora_weights(frozen, spec.lora_dropout, theta, key)
        allowed = None if trie is None or nodes is None else allowed_tokens(jnp, trie, nodes, spec.trie_branch)
        return per_token_logprobs(graphdef, weights, input_ids, attention_mask, temperature, with_entropy=with_entropy,
                                  window=None if window == length else window, window_start=starts, allowed=allowed,
                                  segment_ids=segments, with_router=with_router)

    # 1. Whole-batch quantities, token ones cut to the window, then the batch cut into
    # [M, U, S * b, ...] chunks.
    packed = "segment_ids" in batch  # rows packed (asyncrl.rollout.packing): whole rows, no window
    if packed and window != length:
        raise ValueError("train_step: a packed batch is scored over whole rows (window None)")
    starts = window_starts(batch["loss_mask"], window)
    cut = (lambda x: x) if window == length else (lambda x: take_window(x, starts, window))
    mask, advantages = packed_targets(batch, algo, sft) if packed else batch_targets(batch, algo, sft)
    if window < length:  # positions past L (only when window > the row's room) are never trained
        mask = take_window(mask, starts, window) & ((starts[:, None] + jnp.arange(window)[None, :]) < length)
        advantages = cut(advantages) if advantages.ndim == 2 else advantages
    chunks = {
        "input_ids": to_chunks(batch["input_ids"], spec),
        "attention_mask": to_chunks(batch["attention_mask"], spec),
        "window_start": to_chunks(starts, spec),
        "mask": to_chunks(mask, spec),
        "behavior_logprobs": to_chunks(cut(batch["behavior_logprobs"].astype(jnp.float32)), spec),
        "advantages": to_chunks(advantages, spec),
        # Packed: a packed row is real if it holds a segment (its rows are counted by packed_denominators).
        "real": to_chunks(jnp.any(batch["segment_ids"] > 0, axis=1) if packed else batch["group_index"] >= 0, spec),
    }
    if packed:
        chunks["segment_ids"] = to_chunks(batch["segment_ids"], spec)
    if trie is not None and "constraint_nodes" in batch:  # whole rows, like input_ids (forward cuts the window)
        chunks["constraint_nodes"] = to_chunks(batch["constraint_nodes"], spec)

    # 2. pi_prox and pi_ref, once per step on the whole batch, from the step's starting weights.
    if not sft:
        assert algo is not None
        recompute = algo.needs_prox_recompute
        chunks["prox_logprobs"] = batch_logprobs(forward, params, chunks) if recompute else chunks["behavior_logprobs"]
        if algo.needs_reference:
            chunks["ref_logprobs"] = batch_logprobs(forward, ref_params, chunks)

    # 2b. The critic's values at the step's start, and from them GAE advantages and returns.
    critic_update: Optional[CriticUpdate] = None
    value_stats: dict[str, jax.Array] = {}
    if critic is not None:
        assert algo is not None and critic_params is not None
        c_graphdef = critic.graphdef.graphdef if isinstance(critic.graphdef, HashedGraphDef) else critic.graphdef

        def values_forward(c_theta, input_ids, attention_mask, starts, key=None, with_entropy=False, segments=None):
            decoder = lora_weights(critic_frozen, critic.lora_dropout, c_theta["decoder"], key)
            return per_token_values(c_graphdef, decoder, c_theta["value_head"], input_ids, attention_mask,
                                    window=None if window == length else window, window_start=starts, segment_ids=segments)

        old_values = batch_logprobs(
            lambda w, i, a, st, with_entropy, nodes=None, segments=None: (values_forward(w, i, a, st, segments=segments),),
            critic_params, chunks)
        if packed:
            rewards = packed_shaped_rewards(batch, algo)  # [P, L]
        else:
            rewards = shaped_rewards(batch["rewards"], jnp.sum(batch["loss_mask"], axis=-1), algo)
        targets, value_stats = critic_targets(chunks, to_chunks(rewards, spec), old_values, algo)
        chunks.update(targets)
        c_p_shardings = critic_shardings(critic.model_cfg, critic_params, spec.mesh)
        c_loss_fn = functools.partial(critic_micro_loss, forward=values_forward, critic=critic)
        critic_update = CriticUpdate(
            grad_fn=jax.value_and_grad(c_loss_fn, has_aux=True), dropout_key=critic_dropout_key, optim=critic.optim,
            p_shardings=c_p_shardings,
            o_shardings=opt_state_shardings(build_optimizer(critic.optim), critic_opt_state, c_p_shardings, spec.mesh),
        )

    # 3. The optimizer updates: epochs x mini-batches, each over its micro-batches.
    router_top_k = spec.model_cfg.num_experts_per_tok if getattr(spec.model_cfg, "num_experts", 0) else 0
    loss_fn = functools.partial(micro_loss, forward=forward, algo=None if sft else algo, router_top_k=router_top_k)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    update = functools.partial(optimizer_update, chunks=chunks, grad_fn=grad_fn, dropout_key=dropout_key,
                               optim=optim, p_shardings=p_shardings, o_shardings=o_shardings, critic=critic_update,
                               compute_dtype=cast_once if frozen is None else None)
    n_updates = spec.ppo_epochs * spec.mini_batches
    carry: tuple = (params, opt_state) if critic is None else (params, opt_state, critic_params, critic_opt_state)
    carry, per_update = jax.lax.scan(update, carry, jnp.arange(n_updates))
    params, opt_state = carry[:2]
    metrics = dict(step_metrics(per_update, mask), **value_stats)
    # The optimizer state comes first: jit aliases each donated input to the first output of
    # its shape, so with the parameters first every donated moment buffer went to a parameter
    # output and XLA copied the whole state in and out of the step (twice its bytes).
    if critic is None:
        return opt_state, params, metrics
    return opt_state, params, metrics, carry[3], carry[2]


@functools.wraps(_train_step_impl)
def _train_step_for_mesh(*args: Any, spec: StepSpec, **kwargs: Any) -> Any:
    """:func:`_train_step_impl` traced for the devices of ``spec.mesh``: ``model.attention: auto``
    picks their platform's kernel (:func:`asyncrl.model.attention.compiled_for`), whatever this
    process's default backend (a compile-only target included), and packed rows reach cuDNN's
    packed layout with ``spec.packed_segments`` sequences per row at most."""
    with compiled_for(spec.mesh, segments=spec.packed_segments):
        return _train_step_impl(*args, spec=spec, **kwargs)


train_step = jax.jit(
    _train_step_for_mesh, static_argnames=("graphdef", "algo", "optim", "spec", "window", "critic"),
    donate_argnames=("opt_state", "critic_opt_state"),
)
"""The jitted step: ``(opt_state, params, metrics)`` (with a critic ``+ (critic_opt_state,
critic_params)``). Donates the optimizer states (updated in place); never the policy's
parameters (they may have been published: the engine may hold the very same buffers)."""


def compile_count() -> int:
    """Compilations of :func:`train_step` in this process, all trainers together: its traces
    (each new trace is compiled). Not jit's dispatch-cache size, which also grows when only an
    argument's sharding is spelled differently (``P()`` vs ``P(None, None)``: one program)."""
    return _TRACE_COUNT[0]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def nll_sums(graphdef: Any, params: Any, batch: dict[str, jax.Array], frozen: Optional[Any] = None) -> tuple[jax.Array, jax.Array]:
    """``(sum of -log p, token count)`` over the trained tokens of real rows, at temperature 1
    (no gradient): SFT's eval loss is ``sum / count`` accumulated over batches. With LoRA,
    ``params`` are the adapters and ``frozen`` the base."""
    logprobs, _ = per_token_logprobs(graphdef, lora_weights(frozen, 0.0, params), batch["input_ids"],
                                     batch["attention_mask"], 1.0, with_entropy=False)
    mask = batch["loss_mask"] & (batch["group_index"] >= 0)[:, None]
    return jnp.sum(jnp.where(mask, -logprobs, 0.0)), jnp.sum(mask)


def _token_logprobs(graphdef: Any, params: Any, frozen: Optional[Any], input_ids: jax.Array, attention_mask: jax.Array,
                    temperature: jax.Array, trie: Optional[TrieTables], nodes: Optional[jax.Array], *,
                    trie_branch: int) -> jax.Array:
    """float32 ``[rows, L]``: :func:`~asyncrl.model.logprobs.per_token_logprobs` as the step's
    forward computes it (LoRA combined, no dropout; tokens with a trie node scored under its mask)."""
    if isinstance(graphdef, HashedGraphDef):
        graphdef = graphdef.graphdef
    allowed = None if trie is None or nodes is None else allowed_tokens(jnp, trie, nodes, trie_branch)
    return per_token_logprobs(graphdef, lora_weights(frozen, 0.0, params), input_ids, attention_mask, temperature,
                              with_entropy=False, allowed=allowed)[0]


token_logprobs_jit = jax.jit(_token_logprobs, static_argnames=("graphdef", "trie_branch"))


def loss_window(loss_mask: np.ndarray, multiple: int) -> int:
    """The static ``window`` of :func:`train_step` for a host ``loss_mask`` bool ``[rows, L]``: the
    widest span from a row's first to its last trained position, rounded up to ``multiple``
    (``rollout.length_bucket``, so a run compiles one window per bucket) and capped at ``L``."""
    rows, length = loss_mask.shape
    any_true = loss_mask.any(axis=1)
    if not any_true.any():
        return min(length, multiple)
    first = np.argmax(loss_mask, axis=1)
    last = length - 1 - np.argmax(loss_mask[:, ::-1], axis=1)
    span = int(np.max(np.where(any_true, last - first + 1, 0)))
    return min(length, -(-span // multiple) * multiple)
