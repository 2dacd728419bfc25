"""``asyncrl plan`` against measurement: the plan's trainer and engine figures next to the memory a
real trainer step and a real engine take on this machine. Prints one JSON line.

Measured on CPU from the process's resident memory (``/proc/self/status``): the trainer's figure
is its state (the bytes of the parameters and optimizer state it holds) plus the step's own peak
above the resident memory just before the step (the high-water mark is reset with
``/proc/self/clear_refs`` after compiling, so the compiler's memory is not counted); the
engine's is the bytes of its slot state as the engine creates it (the KV cache: zeros, which the OS
maps lazily, so resident memory would count only the pages written) plus one decode chunk's
resident growth above it. Where the backend reports device memory
(``device.memory_stats()``: GPU, TPU) its peak is used instead.

    python scripts/bench.py plan --model bench-40m
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from bench_common import load_avg, load_avg_since, random_train_batch, reset_peak_rss, rss_bytes


def device_peak() -> Optional[int]:
    import jax

    stats = jax.devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def measure_trainer(cfg: Any, graphdef: Any, params: Any) -> dict:
    import jax

    from asyncrl.trainer import Trainer
    from asyncrl.trainer.step import train_step

    trainer = Trainer(cfg, graphdef, params)
    rows = cfg.rollout.batch_size * cfg.rollout.group_size
    from asyncrl.plan.activations import batch_shape

    _, length, window = batch_shape(cfg, sft=False)
    data = random_train_batch(rows, length, trainer.model_cfg.vocab_size, length - window, cfg.rollout.group_size)
    args, kwargs = trainer._step_arguments(data)
    compiled = train_step.lower(*args, **kwargs).compile()
    state = sum(trainer.memory_metrics[k] for k in ("memory/trainable_param_bytes", "memory/opt_state_bytes"))
    jax.block_until_ready(args)
    before = rss_bytes()
    reset_peak_rss()
    out = compiled(*args[1:])  # the graphdef is static
    jax.block_until_ready(out)
    peak = rss_bytes("VmHWM")
    on_device = device_peak()
    return {"trainer_state": int(state), "trainer_step_peak_above_state": peak - before,
            "trainer_measured": int(on_device if on_device is not None else state + peak - before)}


def measure_engine(cfg: Any, graphdef: Any, params: Any) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from asyncrl.engine.jax_programs import decode_chunk_jit, idle_controls, init_pool
    from asyncrl.engine.layouts import page_size_for

    model_cfg = nnx.merge(graphdef, params).cfg
    engine = cfg.engine
    page_size = page_size_for(engine.page_size, "cpu", engine.kv_capacity)
    per_slot = engine.kv_capacity // page_size
    pages = engine.kv_pages if isinstance(engine.kv_pages, int) else engine.slots * per_slot
    controls = idle_controls(engine.slots, engine.max_stop_ids, per_slot, pages)
    controls.active[:] = True
    controls.max_new_tokens[:] = engine.decode_chunk
    controls.refill_free[...] = engine.slots + 1
    controls.page_table[:] = np.arange(engine.slots * per_slot).reshape(engine.slots, per_slot) % pages
    key = np.zeros(2, np.uint32)
    state = init_pool(model_cfg, pages, page_size)  # compile the pool's creation first
    compiled = decode_chunk_jit.lower(graphdef, params, state, controls, None, key, engine.decode_chunk, False).compile()
    del state
    state = jax.block_until_ready(init_pool(model_cfg, pages, page_size))
    # The pool is zeros: pages the OS maps lazily, resident only once written. Count its
    # allocated bytes (what a device allocates) and the decode step's resident growth above it.
    allocated = sum(x.nbytes for x in jax.tree.leaves(state))
    before = rss_bytes()
    reset_peak_rss()
    out = jax.block_until_ready(compiled(params, state, controls, None, key))
    peak = rss_bytes("VmHWM")
    del out
    return {"engine_state": allocated, "engine_measured": allocated + peak - before}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bench-40m", help="tiny, bench-40m, or a model directory (random init from its config.json)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="config override (the default config otherwise)")


def run(args: argparse.Namespace) -> dict:
    start = load_avg()

    from asyncrl.config import load_config
    from asyncrl.model import bench_40m_config, init_decoder, split_params
    from asyncrl.plan.formulas import plan_config, read_decoder_config, stage_decoder_config

    cfg = load_config(data={"model": {"path": "tiny" if args.model == "bench-40m" else args.model}}, overrides=args.overrides)
    model_cfg = bench_40m_config() if args.model == "bench-40m" else read_decoder_config(args.model)
    plan = plan_config(cfg, model_cfg=model_cfg)
    graphdef, params = split_params(init_decoder(stage_decoder_config(cfg, model_cfg), seed=0))
    result = {"model": args.model, "overrides": args.overrides, "params": plan.params,
              "plan_trainer": plan.part_bytes("trainer"), "plan_engine": plan.part_bytes("engine")}
    result.update(measure_trainer(cfg, graphdef, params))
    result.update(measure_engine(cfg, graphdef, params))
    result["trainer_ratio"] = round(result["trainer_measured"] / result["plan_trainer"], 3)
    result["engine_ratio"] = round(result["engine_measured"] / result["plan_engine"], 3)
    return {**result, **load_avg_since(start)}
