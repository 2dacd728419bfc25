"""The :class:`Trainer`: the moving parts around the jitted step of :mod:`asyncrl.trainer.step`.

It holds the policy's parameters and optimizer state on a ``(data, fsdp, tensor)`` mesh, checks
each ``TrainBatch`` and permutes its rows into device order (the row layout of
:mod:`asyncrl.trainer.step`), calls :func:`~asyncrl.trainer.step.train_step`, counts skipped
updates, names the step's metrics, hands out weights to publish, and saves/restores its state.
One call of :meth:`Trainer.step` is one trainer step (docs/design.md "Versions and the publish order"):
from the weights of version :attr:`Trainer.version` to those of the next, read by :meth:`Trainer.params_for_publish`.
It stays one file: every method reads or replaces the same placed state (parameters, optimizer
state, reference weights, critic), and the step, the publish and the checkpoint must agree on its
layout.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import jax
import numpy as np

from asyncrl.algo import AlgoParams
from asyncrl.cluster.distributed import initialize_distributed
from asyncrl.cluster.mesh import build_mesh, local_row_shards, row_sharding
from asyncrl.errors import TrainerError
from asyncrl.model.sharding import param_shardings
from asyncrl.pytree import TreeError, fill, keyed_leaves, to_host, tree_to_host
from asyncrl.trainer.flops import critic_step_flops, matmul_params, step_flops
from asyncrl.trainer.optim import OptimParams, update_count
from asyncrl.trainer.packed import packed_fields
from asyncrl.trainer.precompile import Precompile, abstract_batch
from asyncrl.trainer.step import (
    CriticSpec,
    HashedGraphDef,
    StepSpec,
    abstract_critic_opt_state,
    abstract_opt_state,
    compile_count,
    init_critic_opt_state,
    init_opt_state,
    loss_window,
    nll_sums,
    token_logprobs_jit,
    train_step,
)

log = logging.getLogger(__name__)

BATCH_FIELDS = ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "rewards", "group_index", "truncated")
"""TrainBatch fields the jitted step reads (plus ``advantages`` when present)."""


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


def _place(tree: Any, shardings: Any) -> Any:
    """Put host/jax values (identical on every process) onto ``shardings``."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, sharding):
        host = to_host(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def _lora_spec(cfg: Any, frozen: Any) -> Any:
    """The LoRA spec of a trainer given ``frozen`` base weights (None: full-weight training)."""
    if frozen is None:
        return None
    if cfg.model.lora is None:
        raise TrainerError("Trainer: frozen base weights were given but model.lora is null; set model.lora or pass no frozen")
    from asyncrl.model.lora import LoraSpec

    return LoraSpec.from_config(cfg.model.lora)


def load_critic_of(cfg: Any, policy_cfg: Any) -> Any:
    """The :class:`~asyncrl.model.critic.CriticModel` of ``critic.path`` (None: no critic, or a copy of
    the policy to be made by the trainer), in the policy's runtime dtypes."""
    if cfg.critic is None or cfg.critic.path is None:
        return None
    from asyncrl.model.critic import load_critic
    from asyncrl.model.loading import runtime_options

    return load_critic(cfg.critic.path, vocab_size=policy_cfg.vocab_size, runtime=runtime_options(cfg.model))


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
    token-mean cross-entropy of ``batch.loss_mask`` tokens at temperature 1 (:func:`~asyncrl.trainer.losses.sft_loss`),
    one optimizer update per step (``algo`` is not read); batches come from
    :class:`asyncrl.run.sft.SFTData`.

    LoRA (``model.lora``): ``Trainer(cfg, lora.graphdef, lora.adapters, frozen=lora.frozen)``
    with ``lora = asyncrl.model.lora.attach_lora(...)`` (or :meth:`from_config`). Only the
    adapters are trained, hold optimizer state and are checkpointed (:meth:`state_dict`); the
    base weights are placed once and never change; the KL reference is the stage's starting
    adapters on the same base (for a first stage: the base model, adapters off);
    :meth:`params_for_publish` merges ``W + (alpha / r) * A @ B`` for the engine, and
    :meth:`trainable_params` hands the adapters to the next stage.

    ``state_from_checkpoint=True`` (a resume): the optimizer states are only described
    (``jax.ShapeDtypeStruct`` leaves with their shardings, :func:`~asyncrl.trainer.step.abstract_opt_state`),
    never initialised, so the restored state is the only one the process holds;
    :meth:`load_state_dict` must fill them before :meth:`step` or :meth:`state_dict`.
    """

    OBJECTIVES = ("rl", "sft")

    def __init__(
        self, cfg: Any, graphdef: Any, params: Any, *, mesh: Any = None, version: int = 0, objective: str = "rl",
        frozen: Any = None, constraint: Any = None, critic: Any = None, state_from_checkpoint: bool = False,
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
        self._step_graphdef = HashedGraphDef(graphdef)  # train_step's static argument, hashed once
        self.algo = AlgoParams.from_config(cfg)
        self.optim = OptimParams.from_config(cfg, updates_per_step=1 if sft else None)
        self.mesh = mesh if mesh is not None else build_mesh(cfg.mesh)
        if constraint is None and cfg.rollout.decoding.constraint and not sft:
            from asyncrl.engine.constraints import load_trie

            constraint = load_trie(cfg.rollout.decoding.constraint)
        self.constraint = constraint
        """The :class:`~asyncrl.engine.constraints.TokenTrie` rollouts are decoded under (the
        ``constraint`` argument, else ``rollout.decoding.constraint``), or None: batches whose
        tokens carry its nodes are scored under its mask (docs/decoding.md)."""
        self._trie: Any = None
        if constraint is not None:
            from asyncrl.engine.constraints import TriePool

            pool = TriePool()
            pool.rebuild([constraint])
            self._trie = jax.device_put(pool.tables, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        self.pack = cfg.packs
        """Pack each step's rows (``rollout.pack``, :mod:`asyncrl.trainer.packed`); evaluation
        (:meth:`nll`, :meth:`logprobs`) stays unpacked (the same numbers)."""
        self.micro_batch_tokens: Optional[int] = None
        """Micro-batches by a token budget (``optim.micro_batch_tokens``; a run chooses it for
        ``optim.micro_batches: auto`` from its devices' memory before it builds the trainer,
        :func:`asyncrl.run.auto_slots.resolve_auto_micro_batches`): each holds at most this many
        tokens per device."""
        if cfg.optim.by_tokens:  # micro_batches: auto not chosen by the run (run/auto_slots.py): its least, one row
            self.micro_batch_tokens = cfg.optim.micro_batch_tokens or cfg.longest_row
        self.spec = StepSpec(
            mesh=self.mesh, model_cfg=self.model_cfg, ppo_epochs=1 if sft else cfg.algo.ppo_epochs,
            mini_batches=1 if sft else cfg.algo.mini_batches, micro_batches=cfg.optim.micro_batch_count,
            objective=objective, lora_dropout=self.lora.dropout if self.lora is not None else 0.0,
            entropy=cfg.algo.log_entropy or (not sft and cfg.algo.entropy_coef > 0),
            trie_branch=0 if constraint is None else pool.max_branch,
            packed_segments=cfg.rollout.pack_max_segments if self.pack else 0,
        )
        self.frozen = None if frozen is None else _place(frozen, param_shardings(self.model_cfg, frozen, self.mesh))
        self.param_shardings = param_shardings(self.model_cfg, params, self.mesh)
        self.params = _place(params, self.param_shardings)
        # The reference is the initial weights (never donated, like every parameter).
        self.ref_params = self.params if (self.algo.needs_reference and not sft) else None
        self.state_from_checkpoint = state_from_checkpoint
        """True until :meth:`load_state_dict` fills the optimizer states this trainer only described."""
        init = abstract_opt_state if state_from_checkpoint else init_opt_state
        self.opt_state = init(self.params, optim=self.optim, spec=self.spec)
        self.version = int(version)
        """Completed trainer steps: the version of :attr:`params` (docs/design.md "Versions and the publish order"). A later
        stage of a multi-stage run starts at the steps its predecessors completed."""
        self.skipped_updates_total = 0
        self.consecutive_nonfinite = 0
        self.precompile: Optional[Precompile] = None
        """The first step's background compile (:meth:`start_precompile`), until that step settles it."""
        self.precompile_hit: Optional[bool] = None
        """Whether that compile had the first batch's shape (None: none ran)."""
        self._init_critic(critic if self.algo.uses_critic and not sft else None, params)
        self._matmul_params = matmul_params(self.base_params if self.lora is not None else params, self.model_cfg)
        self.memory_metrics = self._memory_metrics()
        """Bytes of the trainable and frozen parameters, the optimizer state and the float32
        gradient accumulator (``memory/*``, reported with every step)."""

    def _init_critic(self, critic: Any, params: Any) -> None:
        """The critic of ``algo.estimator: gae`` (else nothing): ``critic`` an
        :class:`~asyncrl.model.critic.CriticModel`, or None for a copy of the policy's weights
        (``params``, or the LoRA base) with a zero value head; ``critic.lora`` attaches adapters."""
        self.critic_spec: Optional[CriticSpec] = None
        self.critic_params: Any = None
        self.critic_opt_state: Any = None
        self.critic_frozen: Any = None
        self.critic_graphdef: Any = None
        if not (self.algo.uses_critic and self.objective == "rl"):
            return
        from asyncrl.model.critic import critic_from_policy, critic_shardings

        section = self.cfg.critic
        if section is None:
            raise TrainerError("Trainer: algo.estimator gae needs a critic section (critic: {})")
        if critic is None:
            critic = critic_from_policy(self.model_cfg, self.base_params if self.lora is not None else params)
        graphdef, trainable, lora_dropout = critic.graphdef, critic.params, 0.0
        if section.lora is not None:
            from asyncrl.model.lora import LoraSpec, attach_lora

            spec = LoraSpec.from_config(section.lora)
            lora = attach_lora(critic.config, critic.params["decoder"], spec, seed=self.cfg.run.seed + 1)
            graphdef, lora_dropout = lora.graphdef, spec.dropout
            trainable = {"decoder": lora.adapters, "value_head": critic.params["value_head"]}
            self.critic_frozen = _place(lora.frozen, param_shardings(critic.config, lora.frozen, self.mesh))
        optim = OptimParams.from_config(self.cfg.model_copy(update={"optim": section.optim}))
        self.critic_graphdef = graphdef
        self.critic_spec = CriticSpec(graphdef=HashedGraphDef(graphdef), model_cfg=critic.config, optim=optim,
                                      value_clip=section.value_clip, loss_coef=section.loss_coef,
                                      lora_dropout=lora_dropout)
        self.critic_params = _place(trainable, critic_shardings(critic.config, trainable, self.mesh))
        init = abstract_critic_opt_state if self.state_from_checkpoint else init_critic_opt_state
        self.critic_opt_state = init(self.critic_params, optim=optim, model_cfg=critic.config, mesh=self.mesh)
        # The critic's decoder is tied and never runs its head: no vocab x hidden matmul to count.
        self._critic_matmul_params = matmul_params(critic.params["decoder"], critic.config) - critic.config.vocab_size * critic.config.hidden_size

    def critic_params_for_export(self) -> Optional[dict]:
        """The critic's ``{decoder, value_head}`` with LoRA adapters merged into the decoder (None without a critic)."""
        if self.critic_spec is None:
            return None
        if self.critic_frozen is None:
            return jax.tree.map(lambda x: x, self.critic_params)
        from asyncrl.model.lora import merge_lora, partition_params

        spec = self.cfg.critic.lora
        decoder = merge_lora(partition_params(self.critic_frozen)[0], self.critic_params["decoder"], spec.alpha / spec.rank)
        return {"decoder": decoder, "value_head": self.critic_params["value_head"]}

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
            **({} if self.critic_spec is None else {
                "memory/critic_param_bytes": float(tree_bytes(self.critic_params) + tree_bytes(self.critic_frozen)),
                "memory/critic_opt_state_bytes": float(tree_bytes(self.critic_opt_state)),
            }),
        }

    @classmethod
    def from_config(cls, cfg: Any, *, mesh: Any = None, objective: str = "rl") -> "Trainer":
        """Load ``cfg.model`` and build the trainer on its initial weights (fresh adapters
        on the frozen model with ``model.lora``)."""
        initialize_distributed(cfg.mesh)
        from asyncrl.model import load_model

        loaded = load_model(cfg.model, with_tokenizer=False)
        graphdef, params = loaded.split()
        critic = load_critic_of(cfg, loaded.config) if objective == "rl" else None
        if cfg.model.lora is not None:
            from asyncrl.model.lora import LoraSpec, attach_lora

            lora = attach_lora(loaded.config, params, LoraSpec.from_config(cfg.model.lora), seed=cfg.run.seed)
            return cls(cfg, lora.graphdef, lora.adapters, mesh=mesh, objective=objective, frozen=lora.frozen, critic=critic)
        return cls(cfg, graphdef, params, mesh=mesh, objective=objective, critic=critic)

    @property
    def _step_algo(self) -> Optional[AlgoParams]:
        """The static ``algo`` of the jitted step (None for SFT: not read, so no recompiles)."""
        return None if self.objective == "sft" else self.algo

    # ------------------------------------------------------------------ batches

    @property
    def row_multiple(self) -> int:
        """This process's rows must be a multiple of this (``prepare_batch(row_multiple=...)``); by a
        token budget the micro-batches follow each step's packing and do not enter it."""
        return local_row_shards(self.mesh) * self.spec.mini_batches * self.spec.micro_batches

    def _device_batch(self, batch: Any, pack: bool = False) -> tuple[dict[str, jax.Array], float, Optional[int], int]:
        """Check the batch, permute its rows into device order and place them on the mesh.
        Returns ``(arrays, temperature, window, micro_batches)``: ``window`` the step's static lm-head
        window (:func:`~asyncrl.trainer.step.loss_window`), ``micro_batches`` per mini-batch. ``pack``:
        its real rows packed first (:mod:`asyncrl.trainer.packed`; window None, packed rows are scored
        whole); by a token budget each micro-batch then takes ``micro_batch_tokens // L`` packed rows
        per device and the mini-batch as many micro-batches as its packed rows fill."""
        fields = {name: np.asarray(getattr(batch, name)) for name in BATCH_FIELDS}
        if batch.advantages is not None and self.critic_spec is not None:
            raise TrainerError("Trainer.step: the batch carries its own advantages, but algo.estimator gae computes "
                               "them from the critic; drop TrainBatch.advantages or use another estimator")
        if batch.advantages is not None:
            fields["advantages"] = np.asarray(batch.advantages)
        rows, length = fields["input_ids"].shape
        nodes = getattr(batch, "constraint_nodes", None)
        if nodes is not None and np.any(np.asarray(nodes) >= 0):
            fingerprint = self.constraint.fingerprint if self.constraint is not None else None
            if batch.constraint != fingerprint:
                raise TrainerError(
                    f"Trainer.step: the batch was decoded under trie {batch.constraint}, but the trainer's constraint is "
                    f"{fingerprint if fingerprint else 'none'}: set rollout.decoding.constraint to the file the rollouts used")
        if self._trie is not None:  # always sent with a constraint, so the step compiles once
            fields["constraint_nodes"] = (np.full((rows, length), -1, np.int32) if nodes is None
                                          else np.asarray(nodes, np.int32))
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
        s, m, u = local_row_shards(self.mesh), self.spec.mini_batches, self.spec.micro_batches

        def device_order(x: np.ndarray) -> np.ndarray:
            if s == 1 or m * u == 1:  # the permutation is the identity
                return x
            rows, rest = x.shape[0], x.shape[1:]
            return np.ascontiguousarray(
                np.moveaxis(x.reshape(m, u, s, rows // (s * m * u), *rest), 2, 0).reshape(rows, *rest)
            )

        if jax.process_count() > 1:
            # Groups of different processes must not share an index: offset by this process's rows.
            gi = fields["group_index"]
            fields["group_index"] = np.where(gi >= 0, gi + jax.process_index() * rows, -1).astype(np.int32)
        if pack:  # token arrays only from here on, [packed rows, L], split and placed like any rows
            # Packed rows per device and micro-batch (the budget is at least the longest row: Config checks it).
            per_micro = u if self.micro_batch_tokens is None else max(self.micro_batch_tokens // length, 1)
            fields = packed_fields(fields, mini_batches=m, row_multiple=s * per_micro,
                                   max_segments=self.cfg.rollout.pack_max_segments)
            self._check_segments(fields["segment_ids"])
            rows = fields["input_ids"].shape[0]
            if self.micro_batch_tokens is not None:
                u = rows // (m * s * per_micro)
        ordered = {name: device_order(value) for name, value in fields.items()}
        shardings = {name: row_sharding(self.mesh, value.ndim) for name, value in ordered.items()}
        if jax.process_count() == 1:  # one batched transfer (part of the tiny step's fixed cost)
            placed = jax.device_put(ordered, shardings)
        else:
            placed = {
                name: jax.make_array_from_process_local_data(shardings[name], value, (rows * jax.process_count(), *value.shape[1:]))
                for name, value in ordered.items()
            }
        if pack:  # a packed row is scored whole
            return placed, temperature, None, u
        window = loss_window(fields["loss_mask"], self.cfg.rollout.length_bucket)
        if jax.process_count() > 1:  # one static window for every process's program
            from jax.experimental import multihost_utils

            window = int(np.max(multihost_utils.process_allgather(np.int32(window))))
        return placed, temperature, window, u

    def _check_segments(self, segment_ids: np.ndarray) -> None:
        """A packed row of more sequences than ``rollout.pack_max_segments`` would lose the rest in
        cuDNN's packed layout (its static bound): refused, naming the field."""
        most = int(segment_ids.max(initial=0))
        if most > self.cfg.rollout.pack_max_segments:
            raise TrainerError(f"Trainer.step: a packed row holds {most} sequences, over rollout.pack_max_segments = "
                               f"{self.cfg.rollout.pack_max_segments} (cuDNN's packed layout's static bound)")

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
        ``train/trained_tokens``, ``train/version`` (by a token budget also ``train/micro_batches``, this
        step's count); ``perf/train_time`` (this call's compute: the
        loop's ``perf/step_time`` is the whole step), ``perf/train_tokens_per_train_s`` (trained
        tokens over ``perf/train_time``), ``perf/compile_count``, ``perf/flops_per_s`` (model FLOPs,
        :func:`step_flops`, plus :func:`critic_step_flops` with a critic), ``memory/*``.
        With a critic (``algo.estimator: gae``) also ``loss/value``, ``train/value_mean``, ``train/return_mean``,
        ``train/explained_variance``, ``train/value_clip_frac``, ``train/critic_grad_norm``,
        ``train/critic_update_norm``, ``train/critic_lr`` and ``train/critic_skipped_updates``.
        Raises :class:`TrainerError` after ``optim.max_consecutive_nonfinite`` skipped updates in a row.

        With ``objective="sft"`` the loss is ``loss/sft`` (token-mean negative log-likelihood
        of the trained tokens, at temperature 1 whatever ``batch.temperature``; no ``loss/total``)
        (and ``train/entropy`` with ``algo.log_entropy``), with the same optimizer, norm, count and perf metrics.
        """
        self._check_state_loaded("step")
        start = time.perf_counter()
        args, kwargs = self._step_arguments(batch)
        if self.precompile is not None:  # the first step: use the background compile when it fits
            shape = (int(batch.input_ids.shape[0]), int(batch.input_ids.shape[1]), int(kwargs["window"]))
            self.precompile_hit = self.precompile.settle(shape, timeout_s=self.cfg.rollout.batch_timeout_s)
            self.precompile = None
        if self.critic_spec is None:
            self.opt_state, self.params, out = train_step(*args, **kwargs)
        else:
            self.opt_state, self.params, out, self.critic_opt_state, self.critic_params = train_step(*args, **kwargs)
        if self.objective == "sft":
            out.pop("loss")  # the same number as sft_loss
        out = tree_to_host(out)  # one transfer for every metric
        elapsed = time.perf_counter() - start

        finite = out.pop("finite")
        critic_finite = out.pop("critic_finite", None)
        skipped = int(np.sum(~finite))
        critic_skipped = 0 if critic_finite is None else int(np.sum(~critic_finite))
        self.skipped_updates_total += skipped
        if critic_finite is not None:  # an update counts as failed when the policy's or the critic's was skipped
            finite = finite & critic_finite
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
        rows, length = args[4]["input_ids"].shape  # every process's rows (packed: the packed rows)
        flops = step_flops(self._matmul_params, self.model_cfg, self._step_algo, self.spec.ppo_epochs,
                           rows, length, train_passes=2 if self.lora is not None else 3,
                           window=kwargs["window"])
        if self.critic_spec is not None:
            flops += critic_step_flops(self._critic_matmul_params, self.critic_spec.model_cfg, self.spec.ppo_epochs,
                                       rows, length,
                                       train_passes=2 if self.critic_frozen is not None else 3)
        metrics = {step_metric_name(k): float(v) for k, v in out.items()}
        if critic_finite is not None:
            metrics["train/critic_skipped_updates"] = float(critic_skipped)
        if self.micro_batch_tokens is not None:  # this step's, from its packing
            metrics["train/micro_batches"] = float(kwargs["spec"].micro_batches)
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

    def start_precompile(self, shape: tuple[int, int, int]) -> Precompile:
        """Compile the step for batches of ``shape`` = ``(rows, length, window)`` (this process's rows)
        in a background thread (:mod:`asyncrl.trainer.precompile`); :meth:`step` waits for it
        before its first call when the batch has that shape."""
        self._check_state_loaded("start_precompile")
        rows, length, window = shape
        extra = ("constraint_nodes",) if self._trie is not None else ()
        arrays = abstract_batch(self.mesh, rows, length, extra)
        args, kwargs = self._arguments_for(arrays, self.cfg.rollout.temperature, window)
        # Lowering reads only shapes, dtypes and shardings: described, the first step may donate
        # the optimizer state while the thread still runs.
        args = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, args)
        self.precompile = Precompile(shape, lambda: train_step.lower(*args, **kwargs))
        return self.precompile

    def _check_state_loaded(self, what: str) -> None:
        if self.state_from_checkpoint:
            raise TrainerError(f"Trainer.{what}: the trainer was made with state_from_checkpoint=True and its optimizer "
                               "state is still only described; call load_state_dict with the checkpoint's trees first")

    def _step_arguments(self, batch: Any) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of :func:`~asyncrl.trainer.step.train_step` for ``batch`` (also what
        ``train_step.lower(*args, **kwargs)`` takes, e.g. for the compiled step's cost analysis)."""
        arrays, temperature, window, micro_batches = self._device_batch(batch, pack=self.pack)
        return self._arguments_for(arrays, temperature, window, micro_batches)

    def _arguments_for(self, arrays: dict[str, Any], temperature: float, window: Optional[int],
                       micro_batches: Optional[int] = None) -> tuple[tuple, dict]:
        """:meth:`_step_arguments` from placed (or abstract) batch arrays (``micro_batches``: this
        step's, where a token budget sets them)."""
        if self.objective == "sft":
            temperature = 1.0  # cross-entropy of the model's own distribution
        # A numpy scalar travels with the arguments; jnp.float32(...) would dispatch a program of its own.
        args: tuple = (self._step_graphdef, self.params, self.opt_state, self.ref_params, arrays,
                       np.float32(temperature), self.frozen, self._dropout_key(), self._trie)
        spec = self.spec
        if micro_batches is not None and micro_batches != spec.micro_batches:
            spec = dataclasses.replace(spec, micro_batches=micro_batches)
        kwargs: dict[str, Any] = dict(algo=self._step_algo, optim=self.optim, spec=spec, window=window)
        if self.critic_spec is not None:
            args += (self.critic_params, self.critic_opt_state, self.critic_frozen, self._critic_dropout_key())
            kwargs["critic"] = self.critic_spec
        return args, kwargs

    def _critic_dropout_key(self) -> Optional[jax.Array]:
        """The critic's LoRA dropout key of this step (a function of ``run.seed`` and the version, like the policy's)."""
        if self.critic_spec is None or self.critic_spec.lora_dropout == 0:
            return None
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.run.seed), self.version), 1)

    def _dropout_key(self) -> Optional[jax.Array]:
        """The LoRA dropout key of this step: a function of ``run.seed`` and the version only,
        so a resumed run drops exactly what the uninterrupted one did."""
        if self.lora is None or self.lora.dropout == 0:
            return None
        return jax.random.fold_in(jax.random.key(self.cfg.run.seed), self.version)

    def nll(self, batch: Any) -> tuple[float, int]:
        """``(sum of -log p, trained tokens)`` of ``batch`` under the current weights at T = 1,
        no update (SFT eval loss; rows as for :meth:`step`)."""
        arrays, _, _, _ = self._device_batch(batch)
        total, count = nll_sums(self.graphdef, self.params, arrays, self.frozen)
        return float(to_host(total)), int(to_host(count))

    def logprobs(self, batch: Any) -> np.ndarray:
        """float32 ``[rows, L]``: each token's log-prob under the current weights at the batch's
        temperature, as the step computes pi_prox (constrained tokens under the trie's mask; 0 at
        position 0 and on padding). Rows in the batch's order."""
        self._device_batch(batch)  # the same checks as a step
        nodes = getattr(batch, "constraint_nodes", None)
        trie = self._trie if nodes is not None else None
        out = token_logprobs_jit(self._step_graphdef, self.params, self.frozen, np.asarray(batch.input_ids),
                                 np.asarray(batch.attention_mask), np.float32(batch.temperature), trie,
                                 None if trie is None else np.asarray(nodes, np.int32), trie_branch=self.spec.trie_branch)
        return np.asarray(to_host(out))

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
        self._check_state_loaded("update_count")
        return int(to_host(update_count(self.opt_state)))

    CRITIC_TREES = ("critic_params", "critic_opt_state")
    """The array trees :meth:`state_dict` adds with a critic (its trainable weights and optimizer state)."""

    def state_dict(self) -> dict:
        """``{params, opt_state, step, skipped_updates_total, consecutive_nonfinite, update_count}``
        (with a critic also :data:`CRITIC_TREES`): ``params`` and ``opt_state`` are the live trees (the optax state's namedtuples included)
        with numpy leaves, gathered to this host; :func:`asyncrl.pytree.flatten` keys them for a
        checkpoint. The reference model is not included: it is the initial weights, rebuilt from the model."""
        self._check_state_loaded("state_dict")
        critic = {}
        if self.critic_spec is not None:
            critic = {"critic_params": tree_to_host(self.critic_params), "critic_opt_state": tree_to_host(self.critic_opt_state)}
        return {
            **critic,
            "params": tree_to_host(self.params),
            "opt_state": tree_to_host(self.opt_state),
            **self.counters(),
        }

    def counters(self) -> dict:
        """``{step, skipped_updates_total, consecutive_nonfinite, update_count}``: the state
        beside the arrays (a checkpoint stores the arrays themselves, shard by shard)."""
        return {
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
            critic = {}
            if self.critic_spec is not None:
                missing = [name for name in self.CRITIC_TREES if name not in state]
                if missing:
                    raise TrainerError(f"Trainer.load_state_dict: no {', '.join(missing)} in the state, but algo.estimator "
                                       "is gae (was the run saved without a critic?)")
                critic = {name: fill(getattr(self, name), keyed_leaves(state[name], name), where=name)
                          for name in self.CRITIC_TREES}
        except TreeError as err:
            raise TrainerError(f"Trainer.load_state_dict: {err} (model or optimizer config changed?)") from None
        for name, tree in critic.items():
            setattr(self, name, tree)
        self.opt_state = opt_state
        self.params = params
        self.state_from_checkpoint = False
        self.version = int(state["step"])
        self.skipped_updates_total = int(state["skipped_updates_total"])
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])
        if self.update_count != int(state["update_count"]):
            raise TrainerError(
                f"Trainer.load_state_dict: update_count {state['update_count']} disagrees with the optimizer state's "
                f"schedule count {self.update_count}"
            )
