"""The jitted trainer step: step time and FLOP/s against the measured matmul peak.

For each model (``tiny`` and ``bench-40m`` by default) one trainer step on a batch of
``--rows`` x ``--length`` tokens (every token after a ``--prompt``-token prompt trained, 8 by
default), AdamW, one update per step: step time (median of ``--steps`` after a compiling
warm-up step), trained tokens/s, and two FLOP counts with their fractions of the peak FLOP/s
of a large float32 ``jnp.dot`` measured on the same machine just before:

* model FLOPs (``flops_per_step``, ``fraction_of_matmul_peak``): the matmuls the algorithm needs
  (:func:`asyncrl.trainer.step_flops`: forward + backward, the pi_prox / pi_ref forwards when the
  algorithm runs them, the lm head over the scored window only, rematerialisation not counted);
* hardware FLOPs (``hardware_flops_per_step``, ``hardware_fraction_of_peak``): what XLA's cost
  analysis of the compiled step counts, every op included (elementwise work, recomputation).

``fixed_overhead_s`` is the step's time outside the compiled program (host checks and row
permutation, placement, dispatch, the metrics' transfer): ``step_time_s`` minus the
median time of the compiled step alone on already placed arrays.

With ``--lora-rank R`` the trainer trains rank-R LoRA adapters (alpha = 2R, every linear
layer of the decoder) on the frozen model instead of every weight; each model's entry then
also holds the trainable-parameter, optimizer-state and gradient bytes (``memory/*`` of the
trainer, the same keys as for full training) so the two runs compare directly.

Usage: python scripts/bench.py train [--models tiny,bench-40m] [--rows 16] [--length 96] [--steps 5]
       [--prompt 8] [--lora-rank 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench_common import load_avg, load_avg_since, matmul_peak, random_train_batch


def compiled_step_times(trainer, data, steps: int) -> tuple[float, float]:
    """``(hardware FLOPs, median seconds)`` of the compiled step alone on placed arrays: XLA's
    cost analysis, and ``steps`` calls (each on a fresh copy of the donated optimizer state)."""
    import jax

    from asyncrl.trainer.step import train_step

    args, kwargs = trainer._step_arguments(data)
    compiled = train_step.lower(*args, **kwargs).compile()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    times = []
    for _ in range(steps):
        call_args = list(args)
        call_args[2] = jax.tree.map(lambda x: x.copy(), args[2])  # opt_state is donated
        jax.block_until_ready(call_args[2])
        start = time.perf_counter()
        jax.block_until_ready(train_step(*call_args, **kwargs))
        times.append(time.perf_counter() - start)
    return float(cost.get("flops", 0.0)), statistics.median(times)


def bench_model(name: str, rows: int, length: int, steps: int, peak: float, lora_rank: int = 0, prompt: int = 8) -> dict:
    from asyncrl.config import load_config
    from asyncrl.model import bench_40m_config, init_decoder, load_model, split_params
    from asyncrl.trainer import Trainer

    if name == "bench-40m":
        graphdef, params = split_params(init_decoder(bench_40m_config(), seed=0))
    else:
        graphdef, params = load_model(name, with_tokenizer=False).split()
    data: dict[str, Any] = {"rollout": {"group_size": 4, "batch_size": rows // 4}}
    if lora_rank:
        data["model"] = {"lora": {"rank": lora_rank, "alpha": 2 * lora_rank}}
    cfg = load_config(data=data)
    if lora_rank:
        from flax import nnx

        from asyncrl.model.lora import LoraSpec, attach_lora

        lora = attach_lora(nnx.merge(graphdef, params).cfg, params, LoraSpec.from_config(cfg.model.lora))
        trainer = Trainer(cfg, lora.graphdef, lora.adapters, frozen=lora.frozen)
    else:
        trainer = Trainer(cfg, graphdef, params)
    data = random_train_batch(rows, length, trainer.model_cfg.vocab_size, prompt)
    first = trainer.step(data)  # compiles
    runs = [trainer.step(data) for _ in range(steps)]
    step_time = statistics.median(m["perf/train_time"] for m in runs)
    trained = first["train/trained_tokens"]
    flops = [m["perf/flops_per_s"] * m["perf/train_time"] for m in runs][0]
    hardware_flops, compiled_time = compiled_step_times(trainer, data, steps)
    return {
        "params": sum(x.size for x in __import__("jax").tree.leaves(params)),
        "compile_and_first_step_s": round(first["perf/train_time"], 3),
        "step_time_s": round(step_time, 4),
        "trained_tokens_per_s": round(trained / step_time, 1),
        "tokens_per_s": round(rows * length / step_time, 1),
        "flops_per_step": flops,
        "achieved_flops_per_s": round(flops / step_time),
        "fraction_of_matmul_peak": round(flops / step_time / peak, 3),
        "hardware_flops_per_step": hardware_flops,
        "hardware_fraction_of_peak": round(hardware_flops / step_time / peak, 3),
        "compiled_step_s": round(compiled_time, 4),
        "fixed_overhead_s": round(step_time - compiled_time, 4),
        **{key: int(value) for key, value in trainer.memory_metrics.items()},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="tiny,bench-40m")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=96)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=8, help="untrained prompt tokens at the start of every row")
    parser.add_argument("--lora-rank", type=int, default=0, help="train rank-R LoRA adapters instead of every weight")


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    load_start = load_avg()
    peak = matmul_peak()
    result: dict[str, Any] = {
        "rows": args.rows,
        "length": args.length,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "matmul_peak_flops_per_s": round(peak),
        "lora_rank": args.lora_rank,
        "prompt": args.prompt,
    }
    for name in args.models.split(","):
        result[name] = bench_model(name, args.rows, args.length, args.steps, peak, args.lora_rank, args.prompt)
    return {**result, **load_avg_since(load_start)}
