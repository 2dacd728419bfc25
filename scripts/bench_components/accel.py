"""The train step's FLOP utilisation and decode against the memory floor, Qwen2.5-0.5B shape.

On a real-shaped model (Qwen2.5-0.5B's shape, random init, no download):

* ``train``: the jitted GRPO trainer step (:class:`asyncrl.trainer.Trainer`, one update)
  on a fixed ``--rows`` x ``--length`` batch, median of ``--steps`` after a compiling step.
  ``model_flops_per_step`` is the trainer's own count (``perf/flops_per_s`` x
  ``perf/train_time``: matmul FLOPs of forward + backward over every position, the
  proximal/reference forwards when the algorithm runs them). ``mfu`` is achieved FLOP/s over
  the device's peak from the table below (null where the device is not in it);
  ``fraction_of_measured_peak`` is over the matmul peak measured here in the same dtype
  (:func:`bench_common.matmul_peak`).
* ``decode``: :class:`asyncrl.engine.jax_engine.JaxEngine` at ``--batch`` slots, every slot
  decoding ``--new`` tokens after a ``--prompt``-token prompt; ``ms_per_step`` is the
  engine's own ``engine/decode_ms_per_step``. Its floor is
  ``max(bytes read per step / HBM bandwidth, 2 * params * batch / peak FLOP/s)``, where a
  step reads every weight once plus the KV cache up to the mean context; ``vs_floor`` is
  the ratio (1.0 is the floor). Bandwidth and peak come from the table, else from a copy and
  the matmul peak measured here (``peak.source`` says which).

Dtypes: ``--dtype`` sets the parameters' and the compute dtype (default bfloat16 on GPUs and
TPUs, float32 on the CPU, where it is as fast and more accurate). ``--quick``: a 2-layer,
hidden-64 shape of the same layout, for tests on a CPU (seconds).

Usage: python scripts/bench.py accel [--dtype bfloat16] [--rows 8] [--length 512] [--steps 5]
       [--batch 16] [--prompt 128] [--new 128] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Optional

from bench_common import busy_decode, copy_bandwidth, load_avg, load_avg_since, matmul_peak, random_train_batch

# Dense peaks (no sparsity) from the vendors' data sheets: FLOP/s in bfloat16 and in float32
# as XLA runs it by default (TF32 tensor cores on NVIDIA Ampere and later; TPUs: null,
# measured instead), and HBM bytes/s. Matched against jax's ``device_kind`` by substring, in
# this order (so "H100 PCIe" is found before "H100", "v5 lite" before "v5").
PEAKS: list[tuple[str, dict[str, Optional[float]]]] = [
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 378e12, "hbm": 2.0e12}),
    ("H100", {"bfloat16": 989.4e12, "float32": 494.7e12, "hbm": 3.35e12}),
    ("H200", {"bfloat16": 989.4e12, "float32": 494.7e12, "hbm": 4.8e12}),
    ("GH200", {"bfloat16": 989.4e12, "float32": 494.7e12, "hbm": 4.0e12}),
    ("B200", {"bfloat16": 2250e12, "float32": 1100e12, "hbm": 8.0e12}),
    ("A100-SXM4-40GB", {"bfloat16": 312e12, "float32": 156e12, "hbm": 1.555e12}),
    ("A100 80GB PCIe", {"bfloat16": 312e12, "float32": 156e12, "hbm": 1.935e12}),
    ("A100", {"bfloat16": 312e12, "float32": 156e12, "hbm": 2.039e12}),
    ("L4", {"bfloat16": 121e12, "float32": 60e12, "hbm": 0.3e12}),
    ("TPU v4", {"bfloat16": 275e12, "float32": None, "hbm": 1.2e12}),
    ("TPU v5 lite", {"bfloat16": 197e12, "float32": None, "hbm": 0.819e12}),
    ("TPU v5e", {"bfloat16": 197e12, "float32": None, "hbm": 0.819e12}),
    ("TPU v5", {"bfloat16": 459e12, "float32": None, "hbm": 2.765e12}),
    ("TPU v6 lite", {"bfloat16": 918e12, "float32": None, "hbm": 1.64e12}),
    ("TPU v6e", {"bfloat16": 918e12, "float32": None, "hbm": 1.64e12}),
]

QWEN25_05B: dict[str, Any] = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                  num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  max_position_embeddings=32768, tie_word_embeddings=True, qkv_bias=True)
"""Qwen2.5-0.5B(-Instruct)'s config.json, as a :class:`~asyncrl.model.DecoderConfig` (494M parameters)."""
QUICK_SHAPE: dict[str, Any] = dict(QWEN25_05B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16)


def table_peak(device_kind: str, dtype: str) -> tuple[Optional[float], Optional[float]]:
    """(peak FLOP/s in ``dtype``, HBM bytes/s) of a device kind, or None where unknown."""
    for name, peak in PEAKS:
        if name.lower() in device_kind.lower():
            return peak.get(dtype), peak["hbm"]
    return None, None


def model_config(quick: bool, dtype: str) -> Any:
    from asyncrl.model import DecoderConfig

    return DecoderConfig(**(QUICK_SHAPE if quick else QWEN25_05B), param_dtype=dtype, compute_dtype=dtype)


def bench_train(graphdef: Any, params: Any, rows: int, length: int, steps: int) -> dict:
    """Median step time and the trainer's model FLOPs of one GRPO step on a random batch."""
    from asyncrl.config import load_config
    from asyncrl.trainer import Trainer

    group = 4 if rows % 4 == 0 else 1
    trainer = Trainer(load_config(data={"rollout": {"group_size": group, "batch_size": rows // group}}), graphdef, params)
    # the first quarter of every row is the prompt
    batch = random_train_batch(rows, length, trainer.model_cfg.vocab_size, prompt=length // 4, group_size=group)
    first = trainer.step(batch)
    runs = [trainer.step(batch) for _ in range(steps)]
    step_time = statistics.median(m["perf/train_time"] for m in runs)
    flops = runs[0]["perf/flops_per_s"] * runs[0]["perf/train_time"]
    return {"rows": rows, "length": length, "compile_and_first_step_s": round(first["perf/train_time"], 3),
            "step_time_s": round(step_time, 4), "model_flops_per_step": flops,
            "achieved_flops_per_s": round(flops / step_time)}


def bench_decode(graphdef: Any, params: Any, batch: int, prompt: int, new: int, repeats: int) -> dict:
    """The engine's ms per decode step with every slot busy (EOS ignored)."""
    import numpy as np

    from asyncrl.config import EngineConfig
    from asyncrl.engine.jax_engine import JaxEngine

    cfg = EngineConfig(slots=batch, kv_capacity=prompt + new, prefill_buckets=[prompt], decode_chunk=8)
    rng = np.random.default_rng(0)
    vocab = int(params["embed_tokens"]["embedding"].shape[0])
    prompts = [[int(t) for t in rng.integers(0, vocab, prompt)] for _ in range(batch)]
    with JaxEngine(graphdef, params, stop_token_ids=(), config=cfg, warmup=True) as engine:
        _, ms_per_step = busy_decode(engine, prompts, new, repeats)
    return {"batch": batch, "prompt": prompt, "new": new, "ms_per_step": round(ms_per_step, 3)}


def decode_floor(cfg: Any, n_params: int, param_bytes: int, decode: dict, flops: float, bandwidth: float) -> dict:
    """The decode step's floor: its bytes (every weight, the KV cache to the mean context) over
    the bandwidth, or its matmul FLOPs over the peak, whichever is longer."""
    import numpy as np

    context = decode["prompt"] + decode["new"] / 2
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.compute_dtype).itemsize * context
    read = param_bytes + decode["batch"] * kv_bytes
    memory_s, compute_s = read / bandwidth, 2.0 * n_params * decode["batch"] / flops
    floor_ms = 1e3 * max(memory_s, compute_s)
    return {"bytes_per_step": int(read), "floor_ms_per_step": round(floor_ms, 3),
            "floor_bound": "memory" if memory_s >= compute_s else "compute",
            "vs_floor": round(decode["ms_per_step"] / floor_ms, 3)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="parameter and compute dtype (default: bfloat16 on GPU/TPU, float32 on CPU)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="decode slots")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="timed decode rounds")
    parser.add_argument("--quick", action="store_true", help="a tiny shape of the same layout, small sizes (CPU tests)")


def run(args: argparse.Namespace) -> dict:
    if args.quick:
        args.rows, args.length, args.steps, args.batch, args.prompt, args.new, args.repeats = 4, 32, 2, 4, 8, 16, 1

    import jax

    from asyncrl.model import init_decoder, split_params

    load_start = load_avg()
    device = jax.devices()[0]
    dtype = args.dtype or ("float32" if device.platform == "cpu" else "bfloat16")
    cfg = model_config(args.quick, dtype)
    graphdef, params = split_params(init_decoder(cfg, seed=0))
    leaves = jax.tree.leaves(params)
    n_params, param_bytes = sum(x.size for x in leaves), sum(x.nbytes for x in leaves)

    # Sizes that saturate the device: 8192 / 2 GiB on an accelerator, 1024 / 64 MiB on a CPU;
    # the quick form only checks the script.
    matmul_n, copy_mib = (256, 8) if args.quick else (1024, 64) if device.platform == "cpu" else (8192, 2048)
    measured = {"matmul_flops_per_s": round(matmul_peak(matmul_n, dtype)),
                "copy_bytes_per_s": round(copy_bandwidth(copy_mib))}
    peak_flops, hbm = table_peak(device.device_kind, dtype)
    source = "table" if peak_flops and hbm else "measured"
    flops = peak_flops or measured["matmul_flops_per_s"]
    bandwidth = hbm or measured["copy_bytes_per_s"]

    train = bench_train(graphdef, params, args.rows, args.length, args.steps)
    achieved = train["achieved_flops_per_s"]
    train.update(mfu=round(achieved / peak_flops, 4) if peak_flops else None,
                 fraction_of_measured_peak=round(achieved / measured["matmul_flops_per_s"], 4))
    decode = bench_decode(graphdef, params, args.batch, args.prompt, args.new, args.repeats)
    decode.update(decode_floor(cfg, n_params, param_bytes, decode, flops, bandwidth))

    return {
        "jax": jax.__version__, "backend": device.platform, "device_kind": device.device_kind,
        "device_count": jax.device_count(), "shape": "quick" if args.quick else "qwen2.5-0.5b", "params": int(n_params),
        "dtype": dtype, "peak": {"flops_per_s": flops, "hbm_bytes_per_s": bandwidth, "source": source},
        "measured": measured, "train": train, "decode": decode, **load_avg_since(load_start),
    }
