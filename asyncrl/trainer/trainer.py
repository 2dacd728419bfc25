"""The trainer: one jitted step per ``TrainBatch`` on a ``(data, fsdp, tensor)`` mesh.

One call of :meth:`Trainer.step` is one trainer step of DESIGN's "Versions": it starts
from the weights of version ``v`` (:attr:`Trainer.version`, the number of completed
steps), runs ``algo.ppo_epochs x algo.mini_batches`` optimizer updates, and leaves the
weights of version ``v + 1`` for :meth:`Trainer.params_for_publish`. Everything of a step
runs inside one module-level jitted function, :func:`train_step` (static config: the
model graphdef, :class:`~asyncrl.algo.AlgoParams`, :class:`~asyncrl.trainer.optim.OptimParams`
and a :class:`StepSpec`), so trainers with equal configs share one compilation:

1. trained mask and advantages from ``rewards`` + ``group_index`` (``asyncrl.algo``),
   unless the batch carries its own advantages;
2. pi_prox log-probs of the step's starting weights, once, on the whole batch, no
   gradient, when ``algo`` needs them recomputed (decoupled with ``prox_logp: recompute``,
   or mismatch correction); reference log-probs (frozen initial weights) only when
   ``algo.kl_coef > 0``;
3. ``lax.scan`` over the updates; each accumulates float32 gradients over
   ``optim.micro_batches`` (``lax.scan``) with the mini-batch's aggregation denominators,
   then clips the global norm once and applies the optax update. An update whose loss or
   gradient norm is not finite keeps the old parameters and optimizer state (Adam's count
   and the schedule do not advance): ``optax.apply_if_finite`` semantics, counted.

Log-probs everywhere come from :func:`asyncrl.model.per_token_logprobs` at the batch's
temperature (a traced scalar: a new temperature does not recompile).

Row layout. Rows are split over ``data x fsdp`` (S shards); each mini-batch must take
rows from every shard, or most devices would idle. The host therefore permutes the
batch's rows before placing them: logical row ``((i * U + j) * S + s) * b + k`` (mini-batch
i, micro-batch j, shard s) goes to shard s. Mini-batch i is then the logical rows
``[i * rows / M, (i + 1) * rows / M)`` whatever the mesh, so the result does not depend on
the number of devices. With several processes each process permutes its own rows, and
mini-batch i is the i-th chunk of every process's rows.

Donation. The optimizer state is donated; gradient buffers live inside the one jitted
step (a ``lax.scan`` carry), where XLA reuses them. Parameters are never donated: the
weights handed out by :meth:`Trainer.params_for_publish` are the trainer's own buffers
(``device_put`` onto the same sharding does not copy), so donating them would invalidate
the engine's copy. The cost is one extra copy of the parameters during a step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from asyncrl.algo import (
    AlgoParams,
    accumulate_diagnostics,
    aggregation_denominators,
    compute_advantages,
    token_mean,
    policy_loss,
    trained_mask,
)
from asyncrl.errors import TrainerError
from asyncrl.pytree import TreeError, fill, keyed_leaves, to_host, tree_to_host
from asyncrl.model.logprobs import per_token_logprobs
from asyncrl.model.sharding import param_shardings
from asyncrl.trainer.mesh import (
    ROW_AXES,
    build_mesh,
    initialize_distributed,
    local_row_shards,
    row_shards,
    row_sharding,
)
from asyncrl.trainer.optim import OptimParams, build_optimizer, dotted_path, learning_rate_schedule, update_count

log = logging.getLogger(__name__)

_TRACE_COUNT = [0]
"""Traces of the train step in this process (fallback for :func:`compile_count`)."""


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static shape of a step: the mesh, the model config, and the update structure."""

    mesh: Any
    """``jax.sharding.Mesh`` (hashable)."""
    model_cfg: Any
    """``asyncrl.model.DecoderConfig`` (for the partition rules)."""
    ppo_epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    objective: str = "rl"
    """``rl``: the policy loss of ``asyncrl.algo``; ``sft``: cross-entropy on trained tokens
    (one optimizer update per step: ``ppo_epochs == mini_batches == 1``)."""
    lora_dropout: float = 0.0
    """LoRA adapter-input dropout of the gradient passes (0: none; see :mod:`asyncrl.model.lora`)."""

    @property
    def row_shards(self) -> int:
        return row_shards(self.mesh)


BATCH_FIELDS = ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "rewards", "group_index", "truncated")
"""TrainBatch fields the jitted step reads (plus ``advantages`` when present)."""


def opt_state_shardings(optimizer: optax.GradientTransformation, opt_state: Any, p_shardings: Any, mesh: Any) -> Any:
    """Shardings of an optax state: per-parameter leaves follow their parameter, the rest replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, opt_state, p_shardings, transform_non_params=lambda _: replicated
    )


@functools.partial(jax.jit, static_argnames=("optim", "spec"))
def init_opt_state(params: Any, *, optim: OptimParams, spec: StepSpec) -> Any:
    """The optimizer state of ``params``, placed like them (module level: shared compilation)."""
    optimizer = build_optimizer(optim)
    state = optimizer.init(params)
    shardings = opt_state_shardings(optimizer, state, param_shardings(spec.model_cfg, params, spec.mesh), spec.mesh)
    return jax.lax.with_sharding_constraint(state, shardings)


def _to_chunks(x: jax.Array, spec: StepSpec) -> jax.Array:
    """``[rows, ...]`` in device order -> ``[M, U, S * b, ...]`` (mini, micro, rows of that micro-batch)."""
    s, m, u = spec.row_shards, spec.mini_batches, spec.micro_batches
    rows, rest = x.shape[0], x.shape[1:]
    b = rows // (s * m * u)
    x = x.reshape(s, m, u, b, *rest)
    x = jnp.moveaxis(x, 0, 2).reshape(m, u, s * b, *rest)
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(spec.mesh, PartitionSpec(None, None, ROW_AXES, *([None] * len(rest))))
    )


def sft_loss(logprobs: jax.Array, entropy: jax.Array, mask: jax.Array, denominators: Any) -> tuple[jax.Array, dict]:
    """This micro-batch's share of the mini-batch's token-mean negative log-likelihood.

    ``logprobs``/``entropy`` float32 ``[b, L]`` (from :func:`per_token_logprobs` at T = 1),
    ``mask`` bool ``[b, L]`` the trained tokens; ``denominators`` are the whole mini-batch's
    (:func:`~asyncrl.algo.aggregation_denominators`), so the shares of the micro-batches add up
    to the mini-batch loss exactly. Masked positions never reach the value or the gradient.
    Returns ``(loss, {"sft_loss", "entropy"})`` (diagnostics are shares too)."""
    nll = token_mean(-logprobs, mask, denominators)
    return nll, {"sft_loss": nll, "entropy": token_mean(entropy, mask, denominators)}


def _train_step_impl(
    graphdef: Any,
    params: Any,
    opt_state: Any,
    ref_params: Optional[Any],
    batch: dict[str, jax.Array],
    temperature: jax.Array,
    frozen: Optional[Any] = None,
    dropout_key: Optional[jax.Array] = None,
    *,
    algo: AlgoParams,
    optim: OptimParams,
    spec: StepSpec,
):
    """One trainer step. ``batch``: the TrainBatch fields, ``[rows, L]`` / ``[rows]``, rows in
    device order (see the module docstring). Returns ``(params, opt_state, metrics)``; metrics
    hold scalars plus ``finite [updates]`` (whether each update was applied, in order).

    LoRA: ``params`` (and ``ref_params``) are the adapters, ``frozen`` the base weights that
    every forward combines them with (no gradient, no optimizer state); ``dropout_key`` seeds
    the adapter dropout of the gradient passes when ``spec.lora_dropout > 0``."""
    _TRACE_COUNT[0] += 1
    mesh = spec.mesh
    m_count, u_count = spec.mini_batches, spec.micro_batches
    n_updates = spec.ppo_epochs * m_count
    optimizer = build_optimizer(optim)
    schedule = learning_rate_schedule(optim)
    p_shardings = param_shardings(spec.model_cfg, params, mesh)
    o_shardings = opt_state_shardings(optimizer, opt_state, p_shardings, mesh)
    length = batch["input_ids"].shape[1]
    sft = spec.objective == "sft"

    # 1. Whole-batch quantities: the trained mask and the advantages (group statistics are global).
    if sft:
        # Cross-entropy needs neither advantages nor pi_prox / pi_ref: train exactly loss_mask on real rows.
        mask = batch["loss_mask"] & (batch["group_index"] >= 0)[:, None]
    else:
        mask = trained_mask(batch["loss_mask"], batch["group_index"], batch["truncated"], algo)
    if sft:
        advantages = jnp.zeros(batch["rewards"].shape, jnp.float32)  # unused
    elif "advantages" in batch:
        advantages = batch["advantages"].astype(jnp.float32)  # [rows, L], the workflow's own
    else:
        advantages = compute_advantages(
            batch["rewards"], batch["group_index"], jnp.sum(batch["loss_mask"], axis=-1), algo
        )  # [rows]
    chunks = {
        "input_ids": _to_chunks(batch["input_ids"], spec),
        "attention_mask": _to_chunks(batch["attention_mask"], spec),
        "mask": _to_chunks(mask, spec),
        "behavior_logprobs": _to_chunks(batch["behavior_logprobs"].astype(jnp.float32), spec),
        "advantages": _to_chunks(advantages, spec),
        "real": _to_chunks(batch["group_index"] >= 0, spec),
    }

    weights_of = functools.partial(_lora_weights, frozen, spec.lora_dropout)

    # 2. pi_prox and pi_ref, once per step on the whole batch (micro-batch by micro-batch), no gradient.
    def all_logprobs(weights):
        flat = lambda x: x.reshape(m_count * u_count, *x.shape[2:])
        one = lambda a: per_token_logprobs(graphdef, weights_of(weights), a[0], a[1], temperature)[0]
        out = jax.lax.map(one, (flat(chunks["input_ids"]), flat(chunks["attention_mask"])))
        return jax.lax.stop_gradient(out.reshape(m_count, u_count, *out.shape[1:]))

    if not sft:
        chunks["prox_logprobs"] = all_logprobs(params) if algo.needs_prox_recompute else chunks["behavior_logprobs"]
        if algo.needs_reference:
            chunks["ref_logprobs"] = all_logprobs(ref_params)

    # 3. The optimizer updates.
    def micro_loss(theta, x, denominators, key):
        logprobs, entropy = per_token_logprobs(
            graphdef, weights_of(theta, key), x["input_ids"], x["attention_mask"], temperature
        )
        if sft:
            return sft_loss(logprobs, entropy, x["mask"], denominators)
        return policy_loss(
            logprobs, x["prox_logprobs"], x["behavior_logprobs"], x["advantages"], x["mask"], denominators, algo,
            entropy=entropy, ref_logprobs=x.get("ref_logprobs"),
        )

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def one_update(carry, update_index):
        theta, state = carry
        mini = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, update_index % m_count, 0, False), chunks)
        denominators = aggregation_denominators(
            mini["mask"].reshape(-1, length), mini["real"].reshape(-1)
        )  # over the whole mini-batch, passed to every micro-batch
        first = jax.tree.map(lambda x: x[0], mini)
        update_key = None if dropout_key is None else jax.random.fold_in(dropout_key, update_index)
        micro_key = lambda j: None if update_key is None else jax.random.fold_in(update_key, j)
        (_, diag_shape), _ = jax.eval_shape(grad_fn, theta, first, denominators, micro_key(0))
        zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), theta)
        zero_diag = {k: jnp.full(v.shape, -jnp.inf if k.endswith("_max") else 0.0, v.dtype)
                     for k, v in diag_shape.items()}

        def one_micro(acc, x_and_index):
            x, j = x_and_index
            grads, loss, diag = acc
            (micro_loss_value, micro_diag), g = grad_fn(theta, x, denominators, micro_key(j))
            # float32 sum (not mean): each micro-batch's loss is its share of the mini-batch loss
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
            grads = jax.lax.with_sharding_constraint(grads, p_shardings)
            return (grads, loss + micro_loss_value, accumulate_diagnostics(diag, micro_diag)), None

        (grads, loss, diag), _ = jax.lax.scan(
            one_micro, (zero_grads, jnp.zeros((), jnp.float32), zero_diag), (mini, jnp.arange(u_count))
        )
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        lr = schedule(update_count(state))
        updates, new_state = optimizer.update(grads, state, theta)
        new_theta = optax.apply_updates(theta, updates)
        # Old values where not finite; dtypes kept (bfloat16 params/moments with float32 gradients).
        keep = lambda new, old: jnp.where(finite, new, old).astype(old.dtype)
        theta = jax.lax.with_sharding_constraint(jax.tree.map(keep, new_theta, theta), p_shardings)
        state = jax.lax.with_sharding_constraint(jax.tree.map(keep, new_state, state), o_shardings)
        out = dict(diag, loss=loss, grad_norm=grad_norm, lr=lr, finite=finite,
                   update_norm=jnp.where(finite, optax.tree.norm(updates), 0.0))
        return (theta, state), out

    (params, opt_state), per_update = jax.lax.scan(one_update, (params, opt_state), jnp.arange(n_updates))

    # Means over the applied updates (NaN when none was), maxima for ``_max`` keys.
    finite = per_update.pop("finite")
    applied = jnp.sum(finite)
    metrics = {}
    for key, values in per_update.items():
        if key.endswith("_max"):
            metrics[key] = jnp.max(jnp.where(finite, values, -jnp.inf))
        else:
            metrics[key] = jnp.sum(jnp.where(finite, values, 0.0)) / applied
    metrics["lr"] = per_update["lr"][-1]
    metrics["trained_tokens"] = jnp.sum(mask)
    metrics["finite"] = finite
    return params, opt_state, metrics


def step_metric_name(key: str) -> str:
    """The logged name of a value of the jitted step: the loss and its terms under ``loss/``
    (``loss`` -> ``loss/total``, ``pg_loss`` -> ``loss/pg``, ``sft_loss`` -> ``loss/sft``), the
    behaviour/proximal log-prob gap as ``engine/logprob_gap``, everything else under ``train/``."""
    if key == "loss":
        return "loss/total"
    if key.endswith("_loss"):
        return "loss/" + key[: -len("_loss")]
    if key == "logprob_gap":
        return "engine/logprob_gap"
    return f"train/{key}"


def _lora_weights(frozen: Optional[Any], dropout: float, theta: Any, key: Optional[jax.Array] = None) -> Any:
    """The forward's params: ``theta`` alone (full training), or the frozen base + adapters
    ``theta`` (+ fresh dropout keys for a gradient pass with LoRA dropout)."""
    if frozen is None:
        return theta
    from asyncrl.model.lora import combine_params, dropout_keys, partition_params

    keys = dropout_keys(partition_params(frozen)[2], key) if (key is not None and dropout > 0) else None
    return combine_params(frozen, theta, keys)


train_step = jax.jit(
    _train_step_impl, static_argnames=("graphdef", "algo", "optim", "spec"), donate_argnames=("opt_state",)
)
"""The jitted step. Donates the optimizer state; never the parameters (they may have been
published: the engine may hold the very same buffers)."""


@functools.partial(jax.jit, static_argnames=("graphdef",))
def nll_sums(graphdef: Any, params: Any, batch: dict[str, jax.Array], frozen: Optional[Any] = None) -> tuple[jax.Array, jax.Array]:
    """``(sum of -log p, token count)`` over the trained tokens of real rows, at temperature 1
    (no gradient): SFT's eval loss is ``sum / count`` accumulated over batches. With LoRA,
    ``params`` are the adapters and ``frozen`` the base."""
    logprobs, _ = per_token_logprobs(graphdef, _lora_weights(frozen, 0.0, params), batch["input_ids"],
                                     batch["attention_mask"], 1.0)
    mask = batch["loss_mask"] & (batch["group_index"] >= 0)[:, None]
    return jnp.sum(jnp.where(mask, -logprobs, 0.0)), jnp.sum(mask)


def compile_count() -> int:
    """Compilations of :func:`train_step` in this process, all trainers together."""
    size = getattr(train_step, "_cache_size", None)
    return int(size()) if callable(size) else _TRACE_COUNT[0]


# --------------------------------------------------------------------------- host side


def _place(tree: Any, shardings: Any) -> Any:
    """Put host/jax values (identical on every process) onto ``shardings``."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, sharding):
        host = to_host(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def matmul_params(params: Any, model_cfg: Any) -> int:
    """Parameters that take part in matmuls (every matrix but the embedding table, plus the lm head)."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if leaf.ndim == 2 and "embed_tokens" not in dotted_path(path):
            total += int(np.prod(leaf.shape))
    if model_cfg.tie_word_embeddings:
        total += model_cfg.vocab_size * model_cfg.hidden_size
    return total


def step_flops(n_matmul_params: int, model_cfg: Any, algo: Optional[AlgoParams], epochs: int, rows: int, length: int,
               train_passes: int = 3) -> float:
    """Model FLOPs of one step (rematerialisation not counted), on every position of the padded batch.

    A forward pass costs ``2 * n_matmul_params + 4 * layers * L * heads * head_dim`` per token
    (:func:`matmul_params`; the attention is computed over all L positions); a training pass
    (forward + backward) three forwards; pi_prox and pi_ref one forward each when computed
    (``algo=None``: an SFT step, training passes only). With LoRA a training pass is
    ``train_passes=2`` forwards: the frozen weights need no weight gradients (the adapters'
    own matmuls are not counted).
    """
    per_token = 2 * n_matmul_params + 4 * model_cfg.num_layers * length * model_cfg.num_heads * model_cfg.head_dim
    passes = train_passes * epochs
    if algo is not None:
        passes += int(algo.needs_prox_recompute) + int(algo.needs_reference)
    return float(per_token) * rows * length * passes


def _lora_spec(cfg: Any, frozen: Any) -> Any:
    """The LoRA spec of a trainer given ``frozen`` base weights (None: full-weight training)."""
    if frozen is None:
        return None
    if cfg.model.lora is None:
        raise TrainerError("Trainer: frozen base weights were given but model.lora is null; set model.lora or pass no frozen")
    from asyncrl.model.lora import LoraSpec

    return LoraSpec.from_config(cfg.model.lora)


class Trainer:
    """Holds the policy's parameters and optimizer state on the mesh and runs trainer steps.

    ``Trainer(cfg, graphdef, params)`` with ``graphdef, params = split_params(model)``
    (``params`` a pure dict, e.g. of the initial weights, which the engine may serve), or :meth:`from_config`. Then per step::

        metrics = trainer.step(batch)                       # TrainBatch of this process's rows
        engine.update_weights(trainer.params_for_publish(), trainer.version)

    With ``mesh.distributed.enabled`` every process constructs the trainer and calls
    :meth:`step` with a batch of its own whole groups (the same number of rows everywhere).

    ``objective="sft"`` makes the same machinery (optax chain, mesh placement, micro-batching,
    non-finite guard, metrics, state) train supervised: :meth:`step` then minimises the
    token-mean cross-entropy of ``batch.loss_mask`` tokens at temperature 1 (:func:`sft_loss`),
    one optimizer update per step (``algo`` is not read); batches come from
    :class:`asyncrl.sft.SFTData`.

    LoRA (``model.lora``): ``Trainer(cfg, lora.graphdef, lora.adapters, frozen=lora.frozen)``
    with ``lora = asyncrl.model.lora.attach_lora(...)`` (or :meth:`from_config`). Only the
    adapters are trained, hold optimizer state and are checkpointed (:meth:`state_dict`); the
    base weights are placed once and never change; the KL reference is the stage's starting
    adapters on the same base (for a first stage: the base model, adapters off);
    :meth:`params_for_publish` merges ``W + (alpha / r) * A @ B`` for the engine, and
    :meth:`trainable_params` hands the adapters to the next stage.
    """

    OBJECTIVES = ("rl", "sft")

    def __init__(
        self, cfg: Any, graphdef: Any, params: Any, *, mesh: Any = None, version: int = 0, objective: str = "rl",
        frozen: Any = None,
    ):
        from flax import nnx

        if objective not in self.OBJECTIVES:
            raise TrainerError(f"Trainer: objective must be one of {', '.join(self.OBJECTIVES)} (given {objective!r})")
        initialize_distributed(cfg.mesh)
        self.cfg = cfg
        self.objective = objective
        sft = objective == "sft"
        self.lora = _lora_spec(cfg, frozen)
        """The :class:`~asyncrl.model.lora.LoraSpec` when training adapters (``params`` are then the
        adapters, ``frozen`` the base weights + zero dropout keys, ``graphdef`` the LoRA model's)."""
        if self.lora is not None:
            from asyncrl.model.lora import combine_params

            self.model_cfg = nnx.merge(graphdef, combine_params(frozen, params)).cfg
        else:
            self.model_cfg = nnx.merge(graphdef, params).cfg
        self.graphdef = graphdef
        self.algo = AlgoParams.from_config(cfg)
        self.optim = OptimParams.from_config(cfg, updates_per_step=1 if sft else None)
        self.mesh = mesh if mesh is not None else build_mesh(cfg.mesh)
        self.spec = StepSpec(
            mesh=self.mesh, model_cfg=self.model_cfg, ppo_epochs=1 if sft else cfg.algo.ppo_epochs,
            mini_batches=1 if sft else cfg.algo.mini_batches, micro_batches=cfg.optim.micro_batches,
            objective=objective, lora_dropout=self.lora.dropout if self.lora is not None else 0.0,
        )
        self.frozen = None if frozen is None else _place(frozen, param_shardings(self.model_cfg, frozen, self.mesh))
        self.param_shardings = param_shardings(self.model_cfg, params, self.mesh)
        self.params = _place(params, self.param_shardings)
        # The reference is the initial weights (never donated, like every parameter).
        self.ref_params = self.params if (self.algo.needs_reference and not sft) else None
        self.opt_state = init_opt_state(self.params, optim=self.optim, spec=self.spec)
        self.version = int(version)
        """Completed trainer steps: the version of :attr:`params` (DESIGN "Versions"). A later
        stage of a multi-stage run starts at the steps its predecessors completed."""
        self.skipped_updates_total = 0
        self.consecutive_nonfinite = 0
        self._matmul_params = matmul_params(self.base_params if self.lora is not None else params, self.model_cfg)
        self.memory_metrics = self._memory_metrics()
        """Bytes of the trainable and frozen parameters, the optimizer state and the float32
        gradient accumulator (``memory/*``, reported with every step)."""

    @property
    def base_params(self) -> Any:
        """The frozen base weights (LoRA; the base model's tree, without dropout keys), else None."""
        if self.frozen is None:
            return None
        from asyncrl.model.lora import partition_params

        return partition_params(self.frozen)[0]

    def _memory_metrics(self) -> dict[str, float]:
        from asyncrl.model.lora import tree_bytes

        trainable = tree_bytes(self.params)
        return {
            "memory/trainable_param_bytes": float(trainable),
            "memory/frozen_param_bytes": float(tree_bytes(self.frozen) if self.frozen is not None else 0),
            "memory/opt_state_bytes": float(tree_bytes(self.opt_state)),
            "memory/grad_bytes": float(sum(4 * x.size for x in jax.tree.leaves(self.params))),  # float32 accumulator
        }

    @classmethod
    def from_config(cls, cfg: Any, *, mesh: Any = None, objective: str = "rl") -> "Trainer":
        """Load ``cfg.model`` and build the trainer on its initial weights (fresh adapters
        on the frozen model with ``model.lora``)."""
        initialize_distributed(cfg.mesh)
        from asyncrl.model import load_model

        loaded = load_model(cfg.model, with_tokenizer=False)
        graphdef, params = loaded.split()
        if cfg.model.lora is not None:
            from asyncrl.model.lora import LoraSpec, attach_lora

            lora = attach_lora(loaded.config, params, LoraSpec.from_config(cfg.model.lora), seed=cfg.run.seed)
            return cls(cfg, lora.graphdef, lora.adapters, mesh=mesh, objective=objective, frozen=lora.frozen)
        return cls(cfg, graphdef, params, mesh=mesh, objective=objective)

    @property
    def _step_algo(self) -> Optional[AlgoParams]:
        """The static ``algo`` of the jitted step (None for SFT: not read, so no recompiles)."""
        return None if self.objective == "sft" else self.algo

    # ------------------------------------------------------------------ batches

    @property
    def row_multiple(self) -> int:
        """This process's rows must be a multiple of this (``prepare_batch(row_multiple=...)``)."""
        return local_row_shards(self.mesh) * self.spec.mini_batches * self.spec.micro_batches

    def _device_batch(self, batch: Any) -> tuple[dict[str, jax.Array], float]:
        """Check the batch, permute its rows into device order and place them on the mesh."""
        fields = {name: np.asarray(getattr(batch, name)) for name in BATCH_FIELDS}
        if batch.advantages is not None:
            fields["advantages"] = np.asarray(batch.advantages)
        rows, length = fields["input_ids"].shape
        for name, value in fields.items():
            expected = (rows, length) if name not in ("rewards", "group_index", "truncated") else (rows,)
            if value.shape != expected:
                raise TrainerError(f"Trainer.step: TrainBatch.{name} has shape {value.shape}, expected {expected}")
        multiple = self.row_multiple
        if rows == 0 or rows % multiple:
            local = local_row_shards(self.mesh)
            raise TrainerError(
                f"Trainer.step: the batch has {rows} rows, not a multiple of {multiple} = row shards of this process "
                f"({local}, mesh data x fsdp) x algo.mini_batches ({self.spec.mini_batches}) x optim.micro_batches "
                f"({self.spec.micro_batches}); build it with prepare_batch(..., row_multiple=trainer.row_multiple)"
            )
        temperature = float(batch.temperature)
        if not temperature > 0:
            raise TrainerError(f"Trainer.step: TrainBatch.temperature must be > 0 (given {temperature})")
        if self.objective == "rl" and self.algo.decoupled and self.cfg.algo.prox_logp == "behave":
            stale = fields["loss_mask"] & (np.asarray(batch.versions) != self.version)
            if stale.any():
                row, pos = np.argwhere(stale)[0]
                raise TrainerError(
                    f"Trainer.step: algo.prox_logp 'behave' needs every trained token at the step's version "
                    f"{self.version}, but row {row} position {pos} has version {int(batch.versions[row, pos])}; "
                    "use algo.prox_logp: recompute (or max_staleness 0)"
                )
        if jax.process_count() > 1:
            # Groups of different processes must not share an index: offset by this process's rows.
            gi = fields["group_index"]
            fields["group_index"] = np.where(gi >= 0, gi + jax.process_index() * rows, -1).astype(np.int32)
        s, m, u = local_row_shards(self.mesh), self.spec.mini_batches, self.spec.micro_batches
        b = rows // (s * m * u)

        def device_order(x: np.ndarray) -> np.ndarray:
            rest = x.shape[1:]
            return np.ascontiguousarray(
                np.moveaxis(x.reshape(m, u, s, b, *rest), 2, 0).reshape(rows, *rest)
            )

        placed = {}
        for name, value in fields.items():
            ordered = device_order(value)
            global_shape = (rows * jax.process_count(), *ordered.shape[1:])
            placed[name] = jax.make_array_from_process_local_data(row_sharding(self.mesh, ordered.ndim), ordered, global_shape)
        return placed, temperature

    # ------------------------------------------------------------------ the step

    def step(self, batch: Any) -> dict[str, float]:
        """Run one trainer step on ``batch`` (a ``TrainBatch``); returns its metrics under the
        names the run logs them by (:func:`step_metric_name`; nothing renames them later).

        Metrics (floats, means over the applied updates): ``loss/total`` and the loss's terms of
        :func:`asyncrl.algo.policy_loss` as ``loss/pg``, ``loss/kl``, ``loss/entropy``; its other
        diagnostics under ``train/`` (``train/kl_ref``, ``train/behave_weight_mean``...), except the
        behaviour/proximal log-prob gap on trained tokens, ``engine/logprob_gap`` (the engine's
        mismatch with the trainer); ``train/grad_norm`` (before clipping), ``train/update_norm``,
        ``train/lr``, ``train/skipped_updates`` (this step), ``train/skipped_updates_total``,
        ``train/trained_tokens``, ``train/version``; ``perf/train_time`` (this call's compute: the
        loop's ``perf/step_time`` is the whole step), ``perf/train_tokens_per_train_s`` (trained
        tokens over ``perf/train_time``), ``perf/compile_count``, ``perf/flops_per_s`` (model FLOPs,
        :func:`step_flops`), ``memory/*``.
        Raises :class:`TrainerError` after ``optim.max_consecutive_nonfinite`` skipped updates in a row.

        With ``objective="sft"`` the loss is ``loss/sft`` (token-mean negative log-likelihood
        of the trained tokens, at temperature 1 whatever ``batch.temperature``; no ``loss/total``)
        and ``train/entropy``, with the same optimizer, norm, count and perf metrics.
        """
        start = time.perf_counter()
        arrays, temperature = self._device_batch(batch)
        if self.objective == "sft":
            temperature = 1.0  # cross-entropy of the model's own distribution
        self.params, self.opt_state, out = train_step(
            self.graphdef, self.params, self.opt_state, self.ref_params, arrays, jnp.float32(temperature),
            self.frozen, self._dropout_key(), algo=self._step_algo, optim=self.optim, spec=self.spec,
        )
        if self.objective == "sft":
            out.pop("loss")  # the same number as sft_loss
        out = tree_to_host(out)
        elapsed = time.perf_counter() - start

        finite = out.pop("finite")
        skipped = int(np.sum(~finite))
        self.skipped_updates_total += skipped
        for ok in finite:
            self.consecutive_nonfinite = 0 if ok else self.consecutive_nonfinite + 1
            if self.consecutive_nonfinite >= self.cfg.optim.max_consecutive_nonfinite:
                raise TrainerError(
                    f"Trainer.step: {self.consecutive_nonfinite} optimizer updates in a row had a non-finite loss or "
                    f"gradient (optim.max_consecutive_nonfinite = {self.cfg.optim.max_consecutive_nonfinite}) at "
                    f"step {self.version}; check rewards, advantages and behavior_logprobs for NaN/inf, or lower optim.lr"
                )
        if skipped:
            log.warning("trainer step %d: skipped %d of %d updates (non-finite loss or gradient)",
                        self.version, skipped, finite.size)
        self.version += 1
        rows, length = batch.input_ids.shape
        flops = step_flops(self._matmul_params, self.model_cfg, self._step_algo, self.spec.ppo_epochs,
                           rows * jax.process_count(), length, train_passes=2 if self.lora is not None else 3)
        metrics = {step_metric_name(k): float(v) for k, v in out.items()}
        metrics.update({
            "train/skipped_updates": float(skipped),
            "train/skipped_updates_total": float(self.skipped_updates_total),
            "train/version": float(self.version),
            "perf/train_time": elapsed,
            "perf/train_tokens_per_train_s": float(out["trained_tokens"]) / elapsed,
            "perf/compile_count": float(compile_count()),
            "perf/flops_per_s": flops / elapsed,
            **self.memory_metrics,
        })
        return metrics

    def _dropout_key(self) -> Optional[jax.Array]:
        """The LoRA dropout key of this step: a function of ``run.seed`` and the version only,
        so a resumed run drops exactly what the uninterrupted one did."""
        if self.lora is None or self.lora.dropout == 0:
            return None
        return jax.random.fold_in(jax.random.key(self.cfg.run.seed), self.version)

    def nll(self, batch: Any) -> tuple[float, int]:
        """``(sum of -log p, trained tokens)`` of ``batch`` under the current weights at T = 1,
        no update (SFT eval loss; rows as for :meth:`step`)."""
        arrays, _ = self._device_batch(batch)
        total, count = nll_sums(self.graphdef, self.params, arrays, self.frozen)
        return float(to_host(total)), int(to_host(count))

    # ------------------------------------------------------------------ publishing and state

    def params_for_publish(self) -> dict:
        """The current weights (version :attr:`version`) as a fresh pure dict of immutable
        ``jax.Array`` s, for ``engine.update_weights``. They stay valid after later steps: the
        trainer never donates weights it has handed out.

        With LoRA: the merged weights ``W + (alpha / r) * A @ B`` in the base model's structure
        (:func:`~asyncrl.model.lora.merge_lora_jit`, sharded like the base), so the engine serves
        a plain model."""
        if self.lora is not None:
            from asyncrl.model.lora import merge_lora_jit

            return merge_lora_jit(self.base_params, self.params, scale=self.lora.scale, model_cfg=self.model_cfg,
                                  mesh=self.mesh)
        return jax.tree.map(lambda x: x, self.params)

    def trainable_params(self) -> dict:
        """What this trainer trains (all weights, or the LoRA adapters), as a fresh pure dict:
        the next stage of a run starts from it."""
        return jax.tree.map(lambda x: x, self.params)

    @property
    def update_count(self) -> int:
        """Optimizer updates applied so far (the schedule's count)."""
        return int(to_host(update_count(self.opt_state)))

    def state_dict(self) -> dict:
        """``{params, opt_state, step, skipped_updates_total, consecutive_nonfinite, update_count}``:
        ``params`` and ``opt_state`` are the live trees (the optax state's namedtuples included)
        with numpy leaves, gathered to this host; :func:`asyncrl.pytree.flatten` keys them for a
        checkpoint. The reference model is not included: it is the initial weights, rebuilt from the model."""
        return {
            "params": tree_to_host(self.params),
            "opt_state": tree_to_host(self.opt_state),
            "step": self.version,
            "skipped_updates_total": self.skipped_updates_total,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "update_count": self.update_count,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (or a checkpoint's trees, filled into this
        trainer's own ``params`` / ``opt_state`` as templates: same keys, shapes and dtypes,
        placed on this trainer's shardings)."""
        try:
            params = fill(self.params, keyed_leaves(state["params"], "params"), where="params")
            opt_state = fill(self.opt_state, keyed_leaves(state["opt_state"], "opt_state"), where="opt_state")
        except TreeError as err:
            raise TrainerError(f"Trainer.load_state_dict: {err} (model or optimizer config changed?)") from None
        self.opt_state = opt_state
        self.params = params
        self.version = int(state["step"])
        self.skipped_updates_total = int(state["skipped_updates_total"])
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])
        if self.update_count != int(state["update_count"]):
            raise TrainerError(
                f"Trainer.load_state_dict: update_count {state['update_count']} disagrees with the optimizer state's "
                f"schedule count {self.update_count}"
            )
