"""Rollouts on a GPU against the memory floor: one command, one JSON line per part.

    python scripts/bench.py gpu --model-config configs/models/qwen2.5-0.5b/config.json
    python scripts/bench.py gpu --quick          # a tiny shape of the same layout (CPU, seconds)

Random weights of ``--model-config``'s shape (nothing downloaded), in ``--dtype`` (default
bfloat16 on GPUs, float32 on the CPU). Each part prints its own line as it ends (a run cut
short keeps the parts before), then the command prints a summary line:

* ``device``: backend, device kind, the XLA flags in effect (:mod:`asyncrl.engine.platform`
  adds command buffers over while loops on GPUs), ``copy_bytes_per_s`` (a jitted elementwise
  pass, read + write) and ``matmul_flops_per_s`` (a jitted square ``jnp.dot`` in the dtype):
  both measured here, the floor's denominators.
* ``decode``: per slot count in ``--slots`` (every slot busy: ``--prompt``-token prompts,
  exactly ``--new`` new tokens, EOS ignored), the engine's ``ms_per_step``
  (``engine/decode_ms_per_step``: chunk wall time over steps, host work included) and
  ``tokens_per_s``, against ``floor_ms_per_step = max((weight bytes + KV bytes at the mean
  context) / copy_bytes_per_s, 2 x params x slots / matmul_flops_per_s)``; ``vs_floor`` is the
  ratio (1.0 is the floor). ``prefill_tokens_per_s``: the engine's prefills of the same prompts
  sent together once more, each for one token (compiled already: no compile in the figure). The
  engine runs with ``--sampler`` and ``--attention-buckets`` (``engine.sampler``,
  ``engine.attention_buckets``).
* ``decode_baseline``: the same at ``--baseline-slots`` with the plain paths
  (``sampler: inverse_cdf``, ``attention_buckets: 1``; the latter acts on the CPU only), and
  ``fast_over_baseline`` per slot count (> 1: the chosen paths are faster). On a GPU also ``decode_without_command_buffers``: the
  same in a child process with ``ASYNCRL_XLA_PLATFORM_FLAGS=0`` (XLA reads its flags once per
  process).
* ``hf_generate``: transformers' ``generate`` (torch, same device, same dtype, same lengths,
  sampling at T = 1, ``min_new_tokens = max_new_tokens``) at ``--hf-slots`` sequences, its
  new tokens/s, and ``engine_over_hf`` (the engine's tokens/s at that slot count over it).
* ``loop``: the GSM8K recipe (``configs/gsm8k_grpo_qwen2.5_0.5b.yaml``) for ``--loop-steps``
  steps on a random-init model of the shape with the project's offline BPE tokenizer (eval and
  checkpoints off): ``time_to_first_step_s`` (from the start of ``train`` to the end of the
  first trainer step: loading, engine start, rollouts and every compile),
  ``step_time_s``/``train_time_s``/``gen_tokens_per_s`` (medians of the steps after the first:
  ``perf/step_time``, ``perf/train_time``, ``perf/gen_tokens_per_s``),
  ``peak_device_bytes`` (``memory_stats()['peak_bytes_in_use']``; on the CPU, which reports
  none, the process's peak resident memory, ``peak_source`` says which) next to ``asyncrl
  plan``'s ``plan_total_bytes`` for the same config.
* ``profile`` (with ``--profile DIR``): a ``jax.profiler`` trace of one decode round at the
  largest slot count, and per decode step the device events (kernels on a GPU) and the ten
  costliest event names (:func:`summarise_trace`).

``--parts`` picks parts (default all). ``--quick``: the tiny shape, 1 and 4 slots, short
lengths, one loop step after the first (the tested CPU form).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Optional

from bench_common import busy_decode, copy_bandwidth, load_avg, load_avg_since, matmul_peak

from bench_components.accel import decode_floor

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN_CONFIG = REPO_ROOT / "configs" / "models" / "qwen2.5-0.5b" / "config.json"
RECIPE = REPO_ROOT / "configs" / "gsm8k_grpo_qwen2.5_0.5b.yaml"
SHARED_DATA = Path(os.environ.get("ASYNCRL_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")
PARTS = ("device", "decode", "decode_baseline", "hf_generate", "loop", "profile")
QUICK_DIMS: dict[str, Any] = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
"""``--quick``: the model config's layout at a tiny size (vocabulary above the quick tokenizer's 512)."""


# --------------------------------------------------------------------------- model


def decoder_config(path: Path, quick: bool, dtype: str) -> Any:
    """The DecoderConfig of ``path`` (a config.json) in ``dtype`` (weights and compute), at the
    tiny :data:`QUICK_DIMS` with ``quick``."""
    from asyncrl.model import from_hf_config
    from asyncrl.model.config import hf_config_from_dict

    cfg = from_hf_config(hf_config_from_dict(json.loads(path.read_text()), source=str(path)), source=str(path),
                         param_dtype=dtype, compute_dtype=dtype)
    return dataclasses.replace(cfg, **QUICK_DIMS) if quick else cfg


# --------------------------------------------------------------------------- parts


def part_device(dtype: str, quick: bool) -> dict:
    import jax

    device = jax.devices()[0]
    matmul_n, copy_mib = (256, 8) if quick else (1024, 64) if device.platform == "cpu" else (8192, 2048)
    return {"backend": device.platform, "device_kind": device.device_kind, "jax": jax.__version__, "dtype": dtype,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "copy_bytes_per_s": round(copy_bandwidth(copy_mib)), "matmul_flops_per_s": round(matmul_peak(matmul_n, dtype))}


def decode_at(graphdef: Any, params: Any, slots: int, args: argparse.Namespace, sampler: str, buckets: int,
              profile: Optional[Path] = None) -> dict:
    """The engine's decode ms/step and prefill tokens/s with ``slots`` busy slots."""
    import numpy as np

    from asyncrl.config import EngineConfig
    from asyncrl.engine.jax_engine import JaxEngine

    cfg = EngineConfig.model_validate(dict(slots=slots, kv_capacity=args.prompt + args.new, prefill_buckets=[args.prompt],
                                           decode_chunk=args.decode_chunk, sampler=sampler, attention_buckets=buckets))
    vocab = int(params["embed_tokens"]["embedding"].shape[0])
    rng = np.random.default_rng(slots)
    prompts = [[int(t) for t in rng.integers(0, vocab, args.prompt)] for _ in range(slots)]
    with JaxEngine(graphdef, params, stop_token_ids=(), config=cfg) as engine:
        seconds, ms_per_step = busy_decode(engine, prompts, args.new, args.repeats)
        out = {"slots": slots, "ms_per_step": round(ms_per_step, 3), "tokens_per_s": round(slots * args.new / seconds),
               "prefill_tokens_per_s": round(prefill_rate(engine, prompts)), "sampler": engine.sampler,
               "flat_sizes": list(engine.flat_sizes), "compiles": int(engine.metrics()["engine/compiles"])}
        if profile is not None:
            out["profile"] = profile_round(engine, prompts, args.new, profile)
    return out


def prefill_rate(engine: Any, prompts: list[list[int]]) -> float:
    """Prompt tokens/s of the engine's prefills for ``prompts`` sent together, each for one new token
    (programs already compiled by the decode rounds, so no compile is in the figure)."""
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.engine.protocol import GenerationRequest

    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=1, stop_token_ids=[], sample_id=10**6 + i)
                for i, p in enumerate(prompts)]
    before = engine.metrics()
    with ThreadPoolExecutor(len(requests)) as pool:
        list(pool.map(engine.generate, requests))
    after = engine.metrics()
    seconds = after["engine/prefill_s"] - before["engine/prefill_s"]
    return (after["engine/prefill_tokens"] - before["engine/prefill_tokens"]) / seconds if seconds else 0.0


def part_decode(graphdef: Any, params: Any, cfg: Any, device: dict, args: argparse.Namespace, slot_counts: list[int],
                sampler: str, buckets: int) -> dict:
    import jax

    leaves = jax.tree.leaves(params)
    n_params, param_bytes = sum(x.size for x in leaves), sum(x.nbytes for x in leaves)
    rows = []
    for slots in slot_counts:
        row = decode_at(graphdef, params, slots, args, sampler, buckets)
        # bench.py accel's floor, on the bandwidth and matmul peak measured in this run
        floor = decode_floor(cfg, n_params, param_bytes, {"batch": slots, "prompt": args.prompt, "new": args.new,
                                                          "ms_per_step": row["ms_per_step"]},
                             device["matmul_flops_per_s"], device["copy_bytes_per_s"])
        rows.append({**row, **floor})
    return {"prompt": args.prompt, "new": args.new, "decode_chunk": args.decode_chunk, "params": int(n_params),
            "param_bytes": int(param_bytes), "slots": rows}


def part_decode_without_command_buffers(args: argparse.Namespace) -> dict:
    """``decode`` at ``--baseline-slots`` in a child process whose XLA flags asyncrl leaves alone."""
    argv = [sys.executable, str(Path(__file__).resolve().parents[1] / "bench.py"), "gpu", "--parts", "decode",
            "--slots", ",".join(map(str, args.baseline_slots)), "--model-config", str(args.model_config),
            "--prompt", str(args.prompt), "--new", str(args.new), "--repeats", str(args.repeats),
            "--sampler", args.sampler, "--attention-buckets", str(args.attention_buckets)] + (["--quick"] if args.quick else [])
    env = {**os.environ, "ASYNCRL_XLA_PLATFORM_FLAGS": "0",
           "XLA_FLAGS": without_gpu_defaults(os.environ.get("XLA_FLAGS", "")),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}  # this tree
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"decode_without_command_buffers: the child exited {done.returncode}:\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    decode = next(line for line in lines if line.get("part") == "decode")
    return {"xla_flags": env.get("XLA_FLAGS", ""), "slots": decode["slots"]}


def without_gpu_defaults(xla_flags: str) -> str:
    """``xla_flags`` (this process's ``XLA_FLAGS``, which :func:`apply_platform_xla_flags` extended)
    without the flags asyncrl adds on GPUs: what the child of the comparison runs with."""
    from asyncrl.engine.platform import xla_flags_for

    added = set(xla_flags_for("gpu"))
    return " ".join(flag for flag in xla_flags.split() if flag not in added)


def part_hf_generate(cfg: Any, args: argparse.Namespace, engine_rows: list[dict]) -> dict:
    """transformers' generate on a random model of the same shape, dtype and device."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.model import to_hf_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # OpenMP threads beside XLA's collapse on a small shared CPU (bench.py engine: 1 thread too)
        torch.set_num_threads(1)
    dtype = getattr(torch, cfg.compute_dtype)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(to_hf_config(cfg), dtype=dtype).to(device).eval()
    engine_tps = {row["slots"]: row["tokens_per_s"] for row in engine_rows}
    rows = []
    for slots in args.hf_slots:
        ids = torch.randint(0, cfg.vocab_size, (slots, args.prompt), device=device)

        def generate(ids: Any = ids) -> None:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                                     temperature=1.0, max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0)
            assert out.shape[1] == args.prompt + args.new
            if device == "cuda":
                torch.cuda.synchronize()

        generate()  # warm-up (kernels, allocator)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            generate()
            times.append(time.perf_counter() - start)
        tps = slots * args.new / statistics.median(times)
        row = {"slots": slots, "tokens_per_s": round(tps)}
        if slots in engine_tps:
            row["engine_over_hf"] = round(engine_tps[slots] / tps, 2)
        rows.append(row)
    return {"torch": torch.__version__, "device": device, "dtype": cfg.compute_dtype, "slots": rows}


# --------------------------------------------------------------------------- the GSM8K loop


def write_model_dir(cfg: Any, out: Path, tokenizer_vocab: int, corpus: Path) -> Path:
    """A random-init HF directory of ``cfg``'s shape with the offline BPE tokenizer (eos/pad ids its own)."""
    from asyncrl.model import export_hf, init_decoder
    from asyncrl.model.tiny_qwen3 import ENDOFTEXT, IM_END, TinyQwen3Spec, build_tokenizer

    tokenizer = build_tokenizer(TinyQwen3Spec(vocab=tokenizer_vocab, max_positions=cfg.max_position_embeddings), corpus)
    cfg = dataclasses.replace(cfg, eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
                              pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT))
    return export_hf(init_decoder(cfg, seed=0), tokenizer, out)


def loop_overrides(args: argparse.Namespace, model_dir: Path, run_dir: Path, dtype: str) -> list[str]:
    data = args.data
    out = [f"model.path={model_dir}", f"model.compute_dtype={dtype}", f"run.total_steps={args.loop_steps}",
           f"run.output_dir={run_dir}", f"data.dataset.kwargs.path={data / 'train.jsonl'}",
           f"data.dataset.kwargs.eval_path={data / 'test.jsonl'}", "data.dataset.kwargs.eval_split=null",
           "eval.every_steps=0", "checkpoint.every_steps=0",
           "logging.trackers=[]", "logging.dump_every_steps=0"]
    if args.quick:  # the recipe's structure at a size a CPU steps through in seconds
        out += ["model.param_dtype=float32", "model.remat=false", "rollout.batch_size=2", "rollout.group_size=2",
                "rollout.max_concurrent=2", "rollout.max_new_tokens=16", "engine.slots=4", "engine.kv_capacity=400",
                "algo.mini_batches=1", "optim.micro_batches=1", "optim.warmup_steps=0"]
    return out


def part_loop(cfg: Any, dtype: str, args: argparse.Namespace, work: Path) -> dict:
    import jax
    from runlib import read_metrics

    from asyncrl.config import load_config
    from asyncrl.plan.formulas import plan_config
    from asyncrl.run.loop import train
    from asyncrl.trainer import Trainer

    model_dir = write_model_dir(cfg, work / "model", 512 if args.quick else 8192, args.data / "train.jsonl")
    run_cfg = load_config(str(RECIPE), loop_overrides(args, model_dir, work / "run", dtype))
    plan_total = plan_config(run_cfg).total_bytes
    first_step_end: list[float] = []
    original = Trainer.step

    def timed_step(self: Trainer, batch: Any) -> dict:
        metrics = original(self, batch)
        if not first_step_end:
            first_step_end.append(time.perf_counter())
        return metrics

    start = time.perf_counter()
    Trainer.step = timed_step  # type: ignore[method-assign]
    try:
        train(run_cfg, console=sys.stderr)  # stdout carries the JSON lines
    finally:
        Trainer.step = original  # type: ignore[method-assign]
    steps = [row for row in read_metrics(work / "run") if "perf/step_time" in row]
    later = steps[1:] or steps
    median = lambda key: round(statistics.median(row[key] for row in later), 3)
    stats = jax.devices()[0].memory_stats() or {}
    peak, source = stats.get("peak_bytes_in_use"), "device"
    if peak is None:
        from bench_common import rss_bytes

        peak, source = rss_bytes("VmHWM"), "host_rss"
    return {"config": str(RECIPE.relative_to(REPO_ROOT)), "steps": len(steps),
            "rows": run_cfg.rollout.batch_size * run_cfg.rollout.group_size, "max_new_tokens": run_cfg.rollout.max_new_tokens,
            "time_to_first_step_s": round(first_step_end[0] - start, 1), "step_time_s": median("perf/step_time"),
            "train_time_s": median("perf/train_time"), "gen_tokens_per_s": median("perf/gen_tokens_per_s"),
            "peak_device_bytes": int(peak), "peak_source": source, "plan_total_bytes": int(plan_total),
            "peak_over_plan": round(peak / plan_total, 3)}


# --------------------------------------------------------------------------- profile


def profile_round(engine: Any, prompts: list[list[int]], new: int, out: Path) -> dict:
    """One busy decode round under ``jax.profiler.trace(out)``; its events summarised per decode step."""
    import jax

    before = engine.metrics()["engine/decode_steps"]
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        busy_decode(engine, prompts, new, repeats=1)  # its programs are compiled: three rounds
    steps = int(engine.metrics()["engine/decode_steps"] - before)
    traces = sorted(out.rglob("*.trace.json.gz"))
    if not traces:
        return {"dir": str(out), "decode_steps": steps, "summary": None}
    return {"dir": str(out), "trace": str(traces[-1]), "decode_steps": steps, **summarise_trace(traces[-1], steps)}


def summarise_trace(path: Path, steps: int, top: int = 10) -> dict:
    """Per decode step: the complete events on device tracks (process names with ``GPU`` or
    ``TPU``: kernels and copies; on the CPU, which has none, the host's events but Python's frames) and
    the ``top`` event names by total time, from a Chrome-format trace (``*.trace.json.gz``)."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", [])
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in names.items() if "GPU" in name or "TPU" in name}
    on_device = bool(device_pids)
    # Python's own frames ("$file:line name", jax.profiler's Python tracer) are host bookkeeping, not XLA's work.
    chosen = [e for e in events if e.get("ph") == "X" and (e.get("pid") in device_pids if on_device
                                                            else not str(e.get("name", "")).startswith("$"))]
    total_us: dict[str, float] = defaultdict(float)
    counts: Counter = Counter()
    for e in chosen:
        total_us[e.get("name", "?")] += float(e.get("dur", 0))
        counts[e.get("name", "?")] += 1
    per_step = max(steps, 1)
    ranked = sorted(total_us, key=total_us.__getitem__, reverse=True)[:top]
    return {"events_on": "device" if on_device else "host", "events_per_step": round(len(chosen) / per_step, 1),
            "event_us_per_step": round(sum(total_us.values()) / per_step, 1),
            "top": [{"name": name[:120], "per_step": round(counts[name] / per_step, 2),
                     "us_per_step": round(total_us[name] / per_step, 1)} for name in ranked]}


# --------------------------------------------------------------------------- command


def slot_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config", type=Path, default=QWEN_CONFIG, help="a config.json (default: Qwen2.5-0.5B's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="weights and compute (default: bfloat16 on accelerators, float32 on the CPU)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--slots", type=slot_list, default=[1, 16, 128, 256], help="decode slot counts")
    parser.add_argument("--baseline-slots", type=slot_list, default=[1, 128], help="slot counts of decode_baseline")
    parser.add_argument("--hf-slots", type=slot_list, default=[16, 128], help="batch sizes of hf_generate")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--decode-chunk", type=int, default=16, help="engine.decode_chunk (the recipe's)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds per figure (after an untimed one)")
    parser.add_argument("--sampler", default="auto", choices=["auto", "inverse_cdf", "gumbel"], help="engine.sampler")
    parser.add_argument("--attention-buckets", type=int, default=4, help="engine.attention_buckets")
    parser.add_argument("--loop-steps", type=int, default=3, help="GSM8K recipe steps (the first holds the compiles)")
    parser.add_argument("--data", type=Path, default=SHARED_DATA / "gsm8k", help="GSM8K's train.jsonl and test.jsonl")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR", help="write a jax.profiler trace of decode here")
    parser.add_argument("--quick", action="store_true", help="tiny shape, 1 and 4 slots, short lengths (the CPU test)")


def emit(part: str, fields: dict) -> dict:
    line = {"bench": "gpu", "part": part, **fields}
    print(json.dumps(line), flush=True)
    return line


def run(args: argparse.Namespace) -> dict:
    from asyncrl.engine.platform import apply_platform_xla_flags

    apply_platform_xla_flags()  # before the backend starts
    if args.quick and args.parts == "decode":  # decode_without_command_buffers' child: its slots as given
        args.prompt, args.new, args.repeats, args.decode_chunk = 16, 32, 1, 8
    elif args.quick:
        args.slots, args.baseline_slots, args.hf_slots = [1, 4], [4], [4]
        args.prompt, args.new, args.repeats, args.loop_steps, args.decode_chunk = 16, 32, 1, 2, 8
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown} (known: {', '.join(PARTS)})")
    if "profile" in parts and args.profile is None:
        if args.parts != ",".join(PARTS):
            raise SystemExit("--parts profile: give --profile DIR (where the trace is written)")
        parts.remove("profile")  # all parts by default: the profile only where a directory is given

    import jax

    from asyncrl.model import init_decoder, split_params

    load_start = load_avg()
    platform = jax.devices()[0].platform
    dtype = args.dtype or ("float32" if platform == "cpu" else "bfloat16")
    cfg = decoder_config(args.model_config, args.quick, dtype)
    graphdef, params = split_params(init_decoder(cfg, seed=0))
    device = part_device(dtype, args.quick)
    summary: dict[str, Any] = {"shape": "quick" if args.quick else str(args.model_config), "parts": parts}
    if "device" in parts:
        emit("device", device)
    decode_rows: list[dict] = []
    if "decode" in parts:
        decode = emit("decode", part_decode(graphdef, params, cfg, device, args, args.slots, args.sampler,
                                            args.attention_buckets))
        decode_rows = decode["slots"]
        summary["vs_floor"] = {row["slots"]: row["vs_floor"] for row in decode_rows}
    if "decode_baseline" in parts:
        base = part_decode(graphdef, params, cfg, device, args, args.baseline_slots, "inverse_cdf", 1)
        fast = {row["slots"]: row["ms_per_step"] for row in decode_rows}
        base["fast_over_baseline"] = {row["slots"]: round(row["ms_per_step"] / fast[row["slots"]], 3)
                                      for row in base["slots"] if row["slots"] in fast}
        summary["fast_over_baseline"] = emit("decode_baseline", base)["fast_over_baseline"]
        if platform == "gpu":
            emit("decode_without_command_buffers", part_decode_without_command_buffers(args))
    if "hf_generate" in parts:
        hf = emit("hf_generate", part_hf_generate(cfg, args, decode_rows))
        summary["engine_over_hf"] = {row["slots"]: row.get("engine_over_hf") for row in hf["slots"]}
    if "profile" in parts:
        emit("profile", decode_at(graphdef, params, max(args.slots), args, args.sampler, args.attention_buckets,
                                  profile=args.profile))
    if "loop" in parts:
        with tempfile.TemporaryDirectory(prefix="bench-gpu-loop-") as tmp:
            loop = emit("loop", part_loop(cfg, dtype, args, Path(tmp)))
        summary["loop"] = {k: loop[k] for k in ("time_to_first_step_s", "step_time_s", "peak_over_plan")}
    return {"part": "summary", **summary, **load_avg_since(load_start)}
