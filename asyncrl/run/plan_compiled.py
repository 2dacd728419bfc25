"""XLA's own figures for ``asyncrl plan``: the run's real jitted programs lowered on abstract
arguments (``jax.ShapeDtypeStruct`` with the planned shardings: nothing is allocated) and compiled,
and the per-device bytes of ``compiled.memory_analysis()``.

:func:`compiled_train_step` and :func:`compiled_decode_chunk` compile where this machine can compile
the planned layout (``asyncrl plan --xla``); their figures are this backend's (XLA on CPU plans
buffers differently from XLA on a GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from asyncrl.config import Config
from asyncrl.run.plan_formulas import Layout, batch_shape, planned_slots


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Bytes per device of one compiled program (``compiled.memory_analysis()``)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @property
    def peak(self) -> int:
        """Arguments, plus outputs not written over a donated argument, plus temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


def _compiled_memory(lowered: Any) -> CompiledMemory:
    stats = lowered.compile().memory_analysis()
    return CompiledMemory(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                          int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes))


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


def compiled_train_step(cfg: Config, model_cfg: Any, layout: Layout, sft: bool = False) -> CompiledMemory:
    """XLA's memory analysis of the real jitted train step (:func:`asyncrl.trainer.step.train_step`)
    lowered on abstract arguments (``jax.ShapeDtypeStruct`` with the planned shardings: nothing is
    allocated) for one step of ``cfg`` on the local devices arranged as ``layout``."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from asyncrl.algo import AlgoParams
    from asyncrl.cluster.mesh import build_mesh
    from asyncrl.model.sharding import param_shardings
    from asyncrl.model.transformer import Decoder, split_params
    from asyncrl.trainer.optim import OptimParams
    from asyncrl.trainer.step import HashedGraphDef, StepSpec, init_opt_state, train_step

    mesh = build_mesh(cfg.mesh, devices=jax.devices()[: layout.devices])
    graphdef, shapes = split_params(nnx.eval_shape(lambda: Decoder(model_cfg, nnx.Rngs(0))))
    shardings = param_shardings(model_cfg, shapes, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    algo = None if sft else AlgoParams.from_config(cfg)
    optim = OptimParams.from_config(cfg, updates_per_step=1 if sft else None)
    spec = StepSpec(mesh=mesh, model_cfg=model_cfg, ppo_epochs=1 if sft else cfg.algo.ppo_epochs,
                    mini_batches=1 if sft else cfg.algo.mini_batches, micro_batches=cfg.optim.micro_batches,
                    objective="sft" if sft else "rl", entropy=cfg.algo.log_entropy or (not sft and cfg.algo.entropy_coef > 0))
    opt_state = jax.eval_shape(lambda p: init_opt_state(p, optim=optim, spec=spec), params)
    rows, length, window = batch_shape(cfg, sft)
    multiple = layout.row_shards * spec.mini_batches * spec.micro_batches
    rows = -(-rows // multiple) * multiple
    row_sharding = lambda ndim: NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))  # noqa: E731
    fields = {"input_ids": ((rows, length), np.int32), "attention_mask": ((rows, length), np.bool_),
              "loss_mask": ((rows, length), np.bool_), "behavior_logprobs": ((rows, length), np.float32),
              "rewards": ((rows,), np.float32), "group_index": ((rows,), np.int32), "truncated": ((rows,), np.bool_)}
    batch = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=row_sharding(len(shape))) for name, (shape, dtype) in fields.items()}
    if cfg.rollout.pack:  # asyncrl.trainer.packed: token arrays only (segments, the row facts at first tokens)
        for name, dtype in (("segment_ids", np.int32), ("row_rewards", np.float32), ("row_group_index", np.int32),
                            ("row_truncated", np.bool_)):
            batch[name] = jax.ShapeDtypeStruct((rows, length), dtype, sharding=row_sharding(2))
        for name in ("rewards", "group_index", "truncated"):
            del batch[name]
    ref = params if (algo is not None and algo.needs_reference) else None
    lowered = train_step.lower(HashedGraphDef(graphdef), params, opt_state, ref, batch, np.float32(1.0), None, None,
                               algo=algo, optim=optim, spec=spec, window=None if window == length else window)
    return _compiled_memory(lowered)


def compiled_decode_chunk(cfg: Config, model_cfg: Any) -> CompiledMemory:
    """XLA's memory analysis of the engine's decode program (``decode_chunk``) for ``engine.slots`` x
    ``engine.kv_capacity`` on one local device, on abstract arguments."""
    import jax
    import numpy as np
    from flax import nnx

    from asyncrl.engine.jax_programs import decode_chunk_jit, idle_controls, init_slot_state
    from asyncrl.model.transformer import Decoder, split_params

    graphdef, params = split_params(nnx.eval_shape(lambda: Decoder(model_cfg, nnx.Rngs(0))))
    engine, slots = cfg.engine, planned_slots(cfg)
    state = jax.eval_shape(lambda: init_slot_state(model_cfg, slots, engine.kv_capacity))
    controls = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                            idle_controls(slots, engine.max_stop_ids))
    lowered = decode_chunk_jit.lower(graphdef, params, state, controls, engine.decode_chunk, False)
    return _compiled_memory(lowered)
