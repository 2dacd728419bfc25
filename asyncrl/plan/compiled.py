"""XLA's own figures for ``asyncrl plan``: the run's real jitted programs lowered on abstract
arguments (``jax.ShapeDtypeStruct`` with the planned shardings: nothing is allocated) and compiled,
and the per-device bytes of ``compiled.memory_analysis()``.

Each ``lower_*`` function returns the ``Lowered`` of one program on given devices (this
machine's for ``asyncrl plan --xla``; compile-only GPUs or TPUs for ``--target``,
:mod:`asyncrl.plan.targets`), laid out as the run lays it out: the trainer's mesh over
``placement.trainer_devices``, and the engine on the trainer's arrays (one device) or on its own
mesh (:func:`~asyncrl.cluster.placement.engine_mesh`, more than one):

* :func:`lower_train_step`: :func:`asyncrl.trainer.step.train_step` at a batch shape (with a
  critic for ``algo.estimator: gae``: the same one program then also runs the critic);
* :func:`lower_prefill`, :func:`lower_decode_chunk`, :func:`lower_beam_search`: the engine's
  programs (:mod:`asyncrl.engine.jax_programs`) on its serving copy of the weights and its KV page pool;
* :func:`lower_publish`: the largest program of a publish, laying the trainer's arrays out as the
  engine's serving copy (:func:`asyncrl.engine.device_copy.serving_copy`).

:func:`compiled_train_step` and :func:`compiled_decode_chunk` are ``asyncrl plan --xla``'s (this
machine's devices); their figures are this backend's (XLA on CPU plans buffers differently from
XLA on a GPU).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence

from asyncrl.config import Config
from asyncrl.plan.activations import batch_shape
from asyncrl.plan.formulas import Layout, planned_pages, planned_slots


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Bytes per device of one compiled program (``compiled.memory_analysis()``)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    reported_peak: int = 0
    """XLA's own peak (``peak_memory_in_bytes``, from its buffers' live ranges; 0 where the backend
    gives none). libtpu's temporaries hold more than its buffer assignment does (1.07 GiB for the
    Qwen3-1.7B GSM8K step on a v6e-8: 6.42 GiB by :attr:`peak`, 5.19 by this), so both are
    reported; the verdict keeps the larger, :attr:`peak`."""

    @property
    def peak(self) -> int:
        """Arguments, plus outputs not written over a donated argument, plus temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


def compile_lowered(lowered: Any) -> tuple[CompiledMemory, float]:
    """Compile ``lowered``: its :class:`CompiledMemory` and the seconds the compile took here."""
    started = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - started
    stats = compiled.memory_analysis()
    memory = CompiledMemory(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                            int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes),
                            int(getattr(stats, "peak_memory_in_bytes", 0) or 0))
    return memory, seconds


def _compiled_memory(lowered: Any) -> CompiledMemory:
    return compile_lowered(lowered)[0]


def can_compile_here(cfg: Config, layout: Layout) -> Optional[str]:
    """None when this process can compile ``cfg``'s programs for ``layout`` (one process, enough
    local devices); else why not (the plan is then analytic only)."""
    import jax

    if layout.processes != 1:
        return "several processes"
    if layout.devices > jax.local_device_count():
        return f"{layout.devices} devices planned, {jax.local_device_count()} here"
    if cfg.model.lora is not None:
        return "LoRA (analytic only)"
    return None


# --------------------------------------------------------------------------- the trainer


def _placed(tree: Any, shardings: Any) -> Any:
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def lower_train_step(cfg: Config, model_cfg: Any, devices: Sequence[Any], shape: tuple[int, int, int], sft: bool = False,
                     hosts: int = 1) -> Any:
    """The ``Lowered`` of :func:`asyncrl.trainer.step.train_step` for one step of ``cfg`` on the
    trainer's mesh over ``devices`` (``placement.trainer_devices``), for a batch of ``shape``
    ``(rows, L, window)`` (global rows: every host's; ``rollout.pack``: the packed fields). With
    ``algo.estimator: gae`` the critic (a copy of the policy with a value head, as the trainer
    builds it without ``critic.path``) is part of the same program."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from asyncrl.algo import AlgoParams
    from asyncrl.cluster.mesh import build_mesh, row_shards
    from asyncrl.model.sharding import param_shardings
    from asyncrl.model.transformer import Decoder, split_params
    from asyncrl.trainer.optim import OptimParams
    from asyncrl.trainer.step import HashedGraphDef, StepSpec, abstract_opt_state, train_step

    del hosts  # the rows are global already; the mesh spans every host's devices
    mesh = build_mesh(cfg.mesh, devices=list(devices))
    graphdef, shapes = split_params(nnx.eval_shape(lambda: Decoder(model_cfg, nnx.Rngs(0))))
    frozen = dropout_key = None
    lora_dropout = 0.0
    if cfg.model.lora is not None:  # the trainer's LoRA: adapters trained, the base (and dropout keys) frozen
        graphdef, adapters, frozen, lora_dropout = _abstract_lora(cfg, model_cfg, shapes)
        frozen = _placed(frozen, param_shardings(model_cfg, frozen, mesh))
        if lora_dropout > 0:
            dropout_key = jax.eval_shape(lambda: jax.random.key(0))
        shapes = adapters
    params = _placed(shapes, param_shardings(model_cfg, shapes, mesh))
    algo = None if sft else AlgoParams.from_config(cfg)
    optim = OptimParams.from_config(cfg, updates_per_step=1 if sft else None)
    rows, length, window = shape
    minis = 1 if sft else cfg.algo.mini_batches
    packed = cfg.packs and not sft
    spec = StepSpec(mesh=mesh, model_cfg=model_cfg, ppo_epochs=1 if sft else cfg.algo.ppo_epochs,
                    mini_batches=minis, micro_batches=step_micro_batches(cfg, rows, length, minis, row_shards(mesh), sft),
                    objective="sft" if sft else "rl", entropy=cfg.algo.log_entropy or (not sft and cfg.algo.entropy_coef > 0),
                    lora_dropout=lora_dropout, packed_segments=cfg.rollout.pack_max_segments if packed else 0)
    opt_state = abstract_opt_state(params, optim=optim, spec=spec)
    row_sharding = lambda ndim: NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))  # noqa: E731
    fields = {"input_ids": ((rows, length), np.int32), "attention_mask": ((rows, length), np.bool_),
              "loss_mask": ((rows, length), np.bool_), "behavior_logprobs": ((rows, length), np.float32),
              "rewards": ((rows,), np.float32), "group_index": ((rows,), np.int32), "truncated": ((rows,), np.bool_)}
    batch = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=row_sharding(len(shape))) for name, (shape, dtype) in fields.items()}
    if packed:  # asyncrl.trainer.packed: token arrays only (segments, the row facts at first tokens)
        for name, dtype in (("segment_ids", np.int32), ("row_rewards", np.float32), ("row_group_index", np.int32),
                            ("row_truncated", np.bool_)):
            batch[name] = jax.ShapeDtypeStruct((rows, length), dtype, sharding=row_sharding(2))
        for name in ("rewards", "group_index", "truncated"):
            del batch[name]
    ref = params if (algo is not None and algo.needs_reference) else None
    critic: dict[str, Any] = {}
    if algo is not None and algo.uses_critic:
        critic = _abstract_critic(cfg, model_cfg, shapes, mesh)
    return train_step.lower(HashedGraphDef(graphdef), params, opt_state, ref, batch, np.float32(1.0), frozen, dropout_key,
                            critic_params=critic.get("params"), critic_opt_state=critic.get("opt_state"),
                            algo=algo, optim=optim, spec=spec, window=None if window == length else window,
                            critic=critic.get("spec"))


def rows_per_micro_batch(cfg: Config, sft: bool, length: int) -> int:
    """What a step's rows per device are a multiple of, per mini-batch: ``optim.micro_batches``, or
    by a token budget the packed rows of one micro-batch, ``micro_batch_tokens // length`` (with
    ``micro_batches: auto`` not yet chosen, one)."""
    if sft or not cfg.optim.by_tokens:
        return cfg.optim.micro_batch_count
    return max((cfg.optim.micro_batch_tokens or length) // length, 1)


def step_micro_batches(cfg: Config, rows: int, length: int, minis: int, row_shards: int, sft: bool = False) -> int:
    """The micro-batches per mini-batch of a step of ``rows`` (global) rows of ``length``:
    ``optim.micro_batches``, or by a token budget as many as the rows need at
    :func:`rows_per_micro_batch` rows per device each (:func:`train_shape` pads the rows to them)."""
    if sft or not cfg.optim.by_tokens:
        return cfg.optim.micro_batch_count
    return max(rows // (minis * row_shards * rows_per_micro_batch(cfg, sft, length)), 1)


def _abstract_lora(cfg: Config, model_cfg: Any, base: dict) -> tuple[Any, dict, dict, float]:
    """``(graphdef, adapters, frozen, dropout)`` of ``model.lora`` on the base shapes ``base``, as
    :func:`~asyncrl.model.lora.attach_lora` makes them (adapters in the base's dtype; ``frozen``
    the base and the dropout keys), abstract."""
    import jax
    from flax import nnx

    from asyncrl.model.lora import LoraSpec, _lora_decoder, combine_params, partition_params

    spec = LoraSpec.from_config(cfg.model.lora)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: _lora_decoder(model_cfg, spec)))
    _, adapter_shapes, key_shapes = partition_params(nnx.to_pure_dict(state))
    dtype = jax.tree.leaves(base)[0].dtype
    adapters = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), adapter_shapes)
    return graphdef, adapters, combine_params(base, key_shapes), spec.dropout


def _abstract_critic(cfg: Config, model_cfg: Any, policy_shapes: dict, mesh: Any) -> dict[str, Any]:
    """The critic the trainer builds without ``critic.path`` (the policy's decoder, tied, and a
    zero value head), as placed abstract arrays, its optimizer state and its static spec."""
    import jax

    from asyncrl.model.critic import _graphdef, critic_config, critic_shardings, zero_value_head
    from asyncrl.trainer.optim import OptimParams
    from asyncrl.trainer.step import CriticSpec, HashedGraphDef, abstract_critic_opt_state

    section = cfg.critic
    assert section is not None  # load_config: algo.estimator gae needs a critic section
    critic_cfg = critic_config(model_cfg)
    decoder = {k: v for k, v in policy_shapes.items() if k != "lm_head"}
    shapes = {"decoder": decoder, "value_head": jax.eval_shape(lambda: zero_value_head(critic_cfg.hidden_size))}
    params = _placed(shapes, critic_shardings(critic_cfg, shapes, mesh))
    optim = OptimParams.from_config(cfg.model_copy(update={"optim": section.optim}))
    spec = CriticSpec(graphdef=HashedGraphDef(_graphdef(critic_cfg)), model_cfg=critic_cfg, optim=optim,
                      value_clip=section.value_clip, loss_coef=section.loss_coef)
    opt_state = abstract_critic_opt_state(params, optim=optim, model_cfg=critic_cfg, mesh=mesh)
    return {"params": params, "opt_state": opt_state, "spec": spec}


def compiled_train_step(cfg: Config, model_cfg: Any, layout: Layout, sft: bool = False,
                        devices: Optional[Sequence[Any]] = None) -> CompiledMemory:
    """XLA's memory analysis of the real jitted train step (:func:`asyncrl.trainer.step.train_step`)
    lowered on abstract arguments for one step of ``cfg`` at the plan's batch shape
    (:func:`~asyncrl.plan.formulas.batch_shape`, rows padded to the trainer's multiple) on
    ``devices`` (default: the local ones) arranged as ``layout``."""
    import jax

    rows, length, window = batch_shape(cfg, sft)
    multiple = layout.row_shards * (1 if sft else cfg.algo.mini_batches) * rows_per_micro_batch(cfg, sft, length)
    rows = -(-rows // multiple) * multiple
    chosen = list(devices) if devices is not None else jax.devices()[: layout.devices]
    return _compiled_memory(lower_train_step(cfg, model_cfg, chosen, (rows, length, window), sft))


# --------------------------------------------------------------------------- the engine


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """The engine's abstract arguments as a run places them (:class:`~asyncrl.engine.jax_engine.JaxEngine`)."""

    graphdef: Any
    params: Any
    """In ``model.param_dtype``, as published to the engine."""
    serving: Any
    """The serving copy the programs run on (compute dtype)."""
    pool: Any
    """The KV page pool (every replica's pages)."""
    layout: Any
    """The pool's shardings on the engine's own mesh (a static argument), or None on the trainer's arrays."""
    slots: int
    sampler: str
    inner_steps: int = 1
    """Decode steps per iteration of a chunk's loop (``engine.decode_inner_steps`` on the platform)."""
    kernel: Any = None
    """The attention kernels' target (``JaxEngine.kernel``: the engine's mesh, or its devices' platform and count)."""
    cache_layout: str = "bksd"
    """A beam search's own cache layout (:func:`~asyncrl.engine.layouts.kv_cache_layout`)."""
    replicas: int = 1
    """The engine's replicas (each prefills its own prompts and decodes its share of the slots)."""
    page_size: int = 16
    pages_per_replica: int = 1
    pages_per_seq: int = 1
    flat_sizes: tuple[int, ...] = ()
    """The CPU decode attention's size classes (empty where attention reads page tables: GPUs, TPUs)."""


def engine_args(cfg: Config, model_cfg: Any, placement: Any, platform: str, mesh: Any = None) -> EngineArgs:
    """The engine of ``cfg`` on ``placement``'s devices, abstract: on the trainer's arrays (the
    default placement of one process: parameters sharded by the trainer's mesh, the pool
    replicated over it) or on its own mesh (parameters by the partition rules, the pool by
    :func:`~asyncrl.engine.jax_programs.pool_shardings`). ``platform``: the sampler's, the page
    layout's and size's. ``mesh``: the trainer's mesh when already built (else built from
    ``placement.trainer_devices``)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from asyncrl.cluster.mesh import build_mesh
    from asyncrl.cluster.placement import engine_mesh, slots_for_replicas
    from asyncrl.engine.attention_buckets import attention_buckets
    from asyncrl.engine.jax_programs import init_pool, pool_shardings
    from asyncrl.engine.layouts import kv_cache_layout, kv_page_layout, page_size_for, serving_formats
    from asyncrl.engine.platform import resolve_inner_steps, resolve_sampler
    from asyncrl.model.attention import KernelTarget
    from asyncrl.model.compute_copy import cast_for_compute
    from asyncrl.model.sharding import param_shardings
    from asyncrl.model.transformer import Decoder, split_params

    graphdef, shapes = split_params(nnx.eval_shape(lambda: Decoder(model_cfg, nnx.Rngs(0))))
    slots = planned_slots(cfg)
    replicas = 1 if placement.shares_trainer_arrays else placement.engine_replicas
    if not placement.shares_trainer_arrays:  # a multiple of the replicas, as the run rounds it
        slots = slots_for_replicas(slots, replicas)
    page_size = page_size_for(cfg.engine.page_size, platform, cfg.engine.kv_capacity)
    pages_per_seq = cfg.engine.kv_capacity // page_size
    pages = planned_pages(cfg, page_size, slots // replicas)
    page_layout = kv_page_layout(platform)
    pool_shapes = jax.eval_shape(lambda: init_pool(model_cfg, pages * replicas, page_size, page_layout))
    if placement.shares_trainer_arrays:
        mesh = mesh if mesh is not None else build_mesh(cfg.mesh, devices=list(placement.trainer_devices))
        layout = None
        state_shardings: Any = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), pool_shapes)
    else:
        mesh = engine_mesh(placement)
        layout = pool_shardings(model_cfg, mesh, page_layout)
        state_shardings = layout
    shardings = param_shardings(model_cfg, shapes, mesh)
    params = _placed(shapes, shardings)
    kernel = KernelTarget(platform, mesh=mesh) if layout is not None else KernelTarget(platform, devices=mesh.size)
    sampler = resolve_sampler(cfg.engine.sampler, platform)
    inner = resolve_inner_steps(cfg.engine.decode_inner_steps, platform)
    replicated = NamedSharding(mesh, PartitionSpec())
    formats = serving_formats(model_cfg, shardings, layout if layout is not None else replicated, slots=slots,
                              pages=pages * replicas, page_size=page_size, capacity=cfg.engine.kv_capacity,
                              platform=platform, decode={"sampler": sampler, "inner": inner, "kernel": kernel},
                              max_stop_ids=cfg.engine.max_stop_ids, layout=layout)
    serving = _placed(jax.eval_shape(lambda p: cast_for_compute(p, model_cfg.compute_dtype), shapes),
                      shardings if formats is None else formats)
    flat_sizes = attention_buckets(slots // replicas * pages_per_seq, cfg.engine.attention_buckets) if platform == "cpu" else ()
    return EngineArgs(graphdef, params, serving, _placed(pool_shapes, state_shardings), layout, slots, sampler, inner,
                      kernel, kv_cache_layout(platform), replicas, page_size, pages, pages_per_seq, flat_sizes)


def _replicated_like(engine: EngineArgs, tree: Any) -> Any:
    """``tree``'s arrays as abstract arguments replicated over the engine's devices (the host
    uploads of a program call: controls, prefill plans)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.tree.leaves(engine.serving)[0].sharding.mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=replicated), tree)


def lower_decode_chunk(cfg: Config, engine: EngineArgs) -> Any:
    """The ``Lowered`` of the engine's plain decode chunk (``decode_chunk_jit``: ``engine.decode_chunk``
    steps, no top-k/top-p, no trie); on the CPU over its largest view (every slot's longest context)."""
    import numpy as np

    from asyncrl.engine.jax_programs import decode_chunk_jit, idle_controls

    controls = _replicated_like(engine, idle_controls(engine.slots, cfg.engine.max_stop_ids, engine.pages_per_seq,
                                                      engine.pages_per_replica))
    key = _replicated_like(engine, np.zeros(2, np.uint32))
    return decode_chunk_jit.lower(engine.graphdef, engine.serving, engine.pool, controls, None, key, cfg.engine.decode_chunk,
                                  False, engine.layout, sampler=engine.sampler, inner=engine.inner_steps,
                                  kernel=engine.kernel, view_pages=engine.pages_per_seq if engine.flat_sizes else 0)


def lower_prefill(cfg: Config, engine: EngineArgs, bucket: int, fresh: bool = True) -> Any:
    """The ``Lowered`` of the engine's prefill of one bucket (``prefill_rows`` rows: first chunks, or
    with ``fresh`` false chunks after what the rows' pages hold)."""
    from asyncrl.engine.jax_programs import PrefillPlan, prefill_jit, prefill_rows

    plan = _replicated_like(engine, PrefillPlan.empty(prefill_rows(engine.slots, engine.replicas), bucket,
                                                      engine.pages_per_seq, engine.pages_per_replica))
    return prefill_jit.lower(engine.graphdef, engine.serving, engine.pool, plan, engine.layout, engine.kernel, fresh)


def lower_beam_search(cfg: Config, engine: EngineArgs, bucket: int) -> Any:
    """The ``Lowered`` of one beam search (``eval.decoding``'s width, ``rollout.max_new_tokens``
    new tokens) for a prompt of ``bucket`` tokens, as the engine calls it for eval's beams."""
    import numpy as np

    from asyncrl.engine.beam_search import beam_search_jit

    decoding = cfg.eval.decoding
    max_new = cfg.rollout.max_new_tokens
    vocab = engine.serving["embed_tokens"]["embedding"].shape[0]
    args = _replicated_like(engine, (np.zeros(bucket, np.int32), np.zeros(bucket, bool), np.int32(0), np.zeros(vocab, bool),
                                     np.float32(decoding.length_penalty)))
    return beam_search_jit.lower(engine.graphdef, engine.serving, *args, None, k=decoding.beam_width, max_new=max_new,
                                 capacity=bucket + max_new, max_branch=0, kernel=engine.kernel,
                                 cache_layout=engine.cache_layout)


def lower_publish(cfg: Config, model_cfg: Any, placement: Any, engine: EngineArgs) -> Optional[tuple[Any, str]]:
    """The ``Lowered`` of a publish's largest program (the group of leaves one program lays out:
    :func:`~asyncrl.engine.device_copy.publish_groups`, from the trainer's shardings onto the
    engine's serving copy; on one device the cast to the compute dtype) and what it holds; None
    where a publish runs none (one device, weights stored in the compute dtype: the engine serves
    the trainer's arrays)."""
    import jax
    import numpy as np

    from asyncrl.cluster.mesh import build_mesh
    from asyncrl.engine.device_copy import publish_groups
    from asyncrl.model.sharding import param_shardings

    trainer_mesh = build_mesh(cfg.mesh, devices=list(placement.trainer_devices))
    trained = _placed(engine.params, param_shardings(model_cfg, engine.params, trainer_mesh))
    serving = jax.tree.map(lambda x: getattr(x, "format", None) or x.sharding, engine.serving)
    shardings = jax.tree.map(lambda x: x.sharding, engine.serving)
    formats = serving if any(getattr(x, "format", None) is not None for x in jax.tree.leaves(engine.serving)) else None
    _, _, groups = publish_groups(trained, shardings, model_cfg.compute_dtype, formats)
    if not groups:
        return None
    leaves = jax.tree.leaves(trained)
    size = lambda group: sum(int(np.prod(leaves[i].shape)) * np.dtype(leaves[i].dtype).itemsize for i in group.indices)  # noqa: E731
    group = max(groups, key=size)
    what = f"the largest of {len(groups)} layout programs: {len(group.indices)} leaves, {size(group) / 2**20:.0f} MiB as trained"
    return group.program.lower([leaves[i] for i in group.indices]), what


def lower_host_publish(cfg: Config, model_cfg: Any, placement: Any) -> tuple[Any, str]:
    """The ``Lowered`` of the largest program of a publish to every host's engine (a multi-host
    target: :func:`~asyncrl.engine.device_copy.host_publish_groups`, one collective over the
    trainer's devices laying the weights out on each host's engine mesh, as process 0 of the run
    builds it on its devices) and what it holds."""
    import jax
    import numpy as np
    from flax import nnx

    from asyncrl.cluster.mesh import build_mesh
    from asyncrl.cluster.placement import engine_mesh
    from asyncrl.engine.device_copy import host_publish_groups
    from asyncrl.model.sharding import param_shardings
    from asyncrl.model.transformer import Decoder, split_params

    _, shapes = split_params(nnx.eval_shape(lambda: Decoder(model_cfg, nnx.Rngs(0))))
    trainer_mesh = build_mesh(cfg.mesh, devices=list(placement.trainer_devices))
    leaves = jax.tree.leaves(_placed(shapes, param_shardings(model_cfg, shapes, trainer_mesh)))
    targets = jax.tree.leaves(param_shardings(model_cfg, shapes, engine_mesh(placement)),
                              is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    groups = host_publish_groups(leaves, targets, model_cfg.compute_dtype)
    size = lambda group: sum(int(np.prod(leaves[i].shape)) * np.dtype(leaves[i].dtype).itemsize for i in group.indices)  # noqa: E731
    group = max(groups, key=size)
    what = (f"the largest of {len(groups)} collective layout programs onto every host's engine: {len(group.indices)} "
            f"leaves, {size(group) / 2**20:.0f} MiB as trained")
    return group.program.lower([leaves[i] for i in group.indices]), what


def compiled_decode_chunk(cfg: Config, model_cfg: Any, layout: Any = None) -> CompiledMemory:
    """XLA's memory analysis of the engine's decode program (``decode_chunk``) for ``engine.slots`` x
    ``engine.kv_capacity``, on abstract arguments (the serving copy, the sampler of this machine's
    platform), placed as the run places it on this machine's first ``layout.devices`` devices
    (None: one)."""
    import jax

    from asyncrl.cluster.placement import resolve_placement

    devices = jax.devices()[: layout.devices if layout is not None else 1]
    placement = resolve_placement(cfg, devices, 1)
    engine = engine_args(cfg, model_cfg, placement, devices[0].platform)
    return _compiled_memory(lower_decode_chunk(cfg, engine))


def train_shape(cfg: Config, sft: bool, row_shards: int, hosts: int) -> tuple[int, int, int]:
    """``(global rows, L, window)`` of the stage's first train step: the precompile's prediction
    (:func:`~asyncrl.trainer.precompile.expected_first_shape`, per host, times the hosts); with
    ``rollout.pack`` (and for SFT) the plan's worst case (:func:`~asyncrl.plan.formulas.batch_shape`),
    rows padded to the trainer's multiple."""
    mini = 1 if sft else cfg.algo.mini_batches
    if sft or cfg.packs:
        rows, length, window = batch_shape(cfg, sft)
        multiple = row_shards * mini * rows_per_micro_batch(cfg, sft, length)
        return -(-rows // multiple) * multiple, length, window
    multiple = row_shards * mini * cfg.optim.micro_batch_count
    from asyncrl.trainer.precompile import expected_first_shape

    local_rows = -(-cfg.rollout.batch_size * cfg.rollout.group_size // hosts)
    rows, length, window = expected_first_shape(cfg, local_rows, max(multiple // hosts, 1))
    return rows * hosts, length, window
