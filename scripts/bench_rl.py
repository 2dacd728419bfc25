"""Benchmark the whole RL loop (``asyncrl train`` in a subprocess); prints one JSON line.

Each entry is one real ``python -m asyncrl.cli train`` run of ``--steps`` RL steps on a fixed
synthetic task (the built-in ``copy`` dataset: 3-digit prompts, random-init model) for one
model and one ``rollout.max_staleness``. The parent timestamps the run's per-step console
lines and reads its ``metrics.jsonl`` afterwards. Figures are over the steady window
from the end of step 1 to the end of the last step (steps 2..N; step 1 includes the
compiles), and ``ttfs_s`` is the time from the subprocess start to step 1's line (import,
model load, compile or cache load, the step-0 eval when eval is on, the first batch and the
first train step).

Fields of an entry: ``trained_tokens_per_s`` (loss-mask tokens trained per wall second),
``generated_tokens_per_s`` (tokens the engine decoded, eval included), ``step_time_median_s``
and ``train_time_median_s``, and ``share``: the fraction of the window's wall time spent in
``training`` (``perf/train_time``), ``batch_wait`` (``rollout/wait_s``), ``publishing``
(``perf/publish_time``; null when this asyncrl does not report it), ``eval``
(``perf/eval_time``), ``checkpoint`` (``perf/checkpoint_time``) and ``other`` (the rest of
the main thread: metrics, logging, host work). Those add up to 1. ``generation`` (the
engine's prefill + decode time) runs in its own thread beside them, so it overlaps the rest
and is not part of the sum.

Per model, unless ``--no-prime``, a one-step run in an empty compilation cache comes first:
its ``ttfs_s`` is ``ttfs_cold_s``; the measured runs then find the cache warm.
``--quickstart`` also times ``asyncrl train configs/quickstart.yaml`` to its first step twice
in an empty cache (``quickstart_ttfs_s``: [first run, second run]).

Usage: PYTHONPATH=. python scripts/bench_rl.py [--models tiny,bench-40m] [--staleness 0 2] [--steps 12]
       [--quickstart] [--quick]
``--quick``: ``tiny``, ``max_staleness`` 0, 4 steps, no priming, and the compilation cache of
``$JAX_COMPILATION_CACHE_DIR`` if set (the tests').
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import load_avg  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"(?:\[\w+\] )?step (\d+)/(\d+)")

# The work of a step per model: (groups, group size, new tokens, engine slots, KV capacity).
SHAPES = {
    "tiny": {"batch_size": 8, "group_size": 8, "max_new_tokens": 8, "kv_capacity": 32},
    "bench-40m": {"batch_size": 8, "group_size": 4, "max_new_tokens": 64, "kv_capacity": 96},
}


# --------------------------------------------------------------------------- the model directories


def bench_40m_dir(out: Path) -> Path:
    """A random-init ``bench-40m``-shaped model (hidden 512, 8 layers, 8/4 heads, intermediate 1536,
    vocab 32000, tied) as a llama-layout Hugging Face directory, with a character tokenizer padded
    to 32000 entries (``tiny``'s characters and chat template, then filler tokens ``<w{i}>``), so
    that ``transformers`` (TRL) and asyncrl load the same weights and tokenize alike."""
    from asyncrl.model import bench_40m_config, export_hf, init_decoder

    if (out / "config.json").is_file():
        return out
    cfg = bench_40m_config()
    tokenizer = _padded_char_tokenizer(cfg.vocab_size)
    cfg = dataclasses.replace(cfg, model_type="llama", qkv_bias=False, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    export_hf(init_decoder(cfg, seed=0), tokenizer, out, exist_ok=True)
    return out


def _padded_char_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from asyncrl.model.tiny import ASSISTANT, END, PAD, SYSTEM, TINY_CHAT_TEMPLATE, UNK, USER, tiny_vocab

    vocab = dict(tiny_vocab())
    for i in range(vocab_size - len(vocab)):
        vocab[f"<w{i}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, pad_token=PAD, eos_token=END,
                                   additional_special_tokens=[SYSTEM, USER, ASSISTANT], chat_template=TINY_CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False, model_max_length=1 << 30)


# --------------------------------------------------------------------------- one run


def run_config(model_path: str, shape: dict, staleness: int, steps: int, out: Path, every: int) -> dict:
    """The YAML of one benchmark run (RL only, the copy task, eval and checkpoint every ``every`` steps)."""
    slots = shape["batch_size"] * shape["group_size"]
    return {
        "run": {"name": "bench-rl", "output_dir": str(out), "total_steps": steps, "seed": 0},
        "model": {"path": model_path},
        "data": {"dataset": {"target": "copy", "kwargs": {"train_size": 2048, "eval_size": 16, "min_digits": 3,
                                                          "max_digits": 3}},
                 "max_prompt_tokens": 16},
        "rollout": {"batch_size": shape["batch_size"], "group_size": shape["group_size"], "max_staleness": staleness,
                    "max_new_tokens": shape["max_new_tokens"], "temperature": 1.0, "max_concurrent": 2 * shape["batch_size"]},
        "engine": {"slots": slots, "kv_capacity": shape["kv_capacity"], "prefill_buckets": [16], "decode_chunk": 8},
        "optim": {"lr": 1.0e-5},
        "eval": {"every_steps": every, "max_prompts": 16},
        "checkpoint": {"every_steps": every, "keep": 1},
        "logging": {"dump_every_steps": 0},
    }


def timed_train(argv: list[str], env: dict[str, str], timeout: float) -> tuple[dict[int, float], str]:
    """Run ``python -m asyncrl.cli`` + ``argv``; returns {step: seconds since start at its console
    line} and the output. A failed run, or one still running after ``timeout`` s (killed), raises
    with its output's tail."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT)
    seen: dict[int, float] = {}
    lines: list[str] = []

    def read() -> None:  # timestamps each line as it comes; ends when the child closes its output
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            match = STEP_LINE.match(line)
            if match:
                seen.setdefault(int(match.group(1)), time.perf_counter() - start)

    reader = threading.Thread(target=read, name="bench-rl-reader", daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=60)
        raise TimeoutError(f"asyncrl {' '.join(argv)} ran over {timeout} s:\n{''.join(lines)[-3000:]}") from None
    reader.join(timeout=60)
    output = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"asyncrl {' '.join(argv)} exited {proc.returncode}:\n{output[-3000:]}")
    return seen, output


def child_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env.pop("ASYNCRL_COMPILE_CACHE", None)
    return env


def bench_run(model: str, model_path: str, staleness: int, steps: int, work: Path, env: dict[str, str],
              every: int) -> dict:
    """One run's entry (see the module docstring)."""
    import yaml

    out = work / f"{model}-s{staleness}-n{steps}"
    config = work / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(run_config(model_path, SHAPES[model], staleness, steps, out, every)))
    times, _ = timed_train(["train", str(config), "--set", "run.overwrite=true"], env, timeout=3600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"model": model, "max_staleness": staleness, "steps": steps, "ttfs_s": round(times[1], 2),
            **summarise(rows, times, steps)}


def summarise(rows: list[dict], times: dict[int, float], steps: int) -> dict:
    """The window's throughput and time shares from the run's metrics rows and step times."""
    by_step = {row["step"]: row for row in rows if row["step"] > 0}
    window = [by_step[s] for s in range(2, steps + 1)]
    wall = times[steps] - times[1]

    def total(name: str) -> float:
        return sum(row.get(name) or 0.0 for row in window)

    def engine_busy(row: dict) -> float:
        rate = row.get("engine/prefill_tokens_per_s") or 0.0
        prefill = row.get("engine/prefill_tokens", 0.0) / rate if rate else 0.0
        return row.get("engine/decode_s", 0.0) + prefill

    first, last = by_step[1], by_step[steps]
    trained = sum(row["perf/trained_tokens_per_s"] * row["perf/step_time"] for row in window)
    publish = total("perf/publish_time") if any("perf/publish_time" in row for row in window) else None
    serial = {"training": total("perf/train_time"), "batch_wait": total("rollout/wait_s"), "publishing": publish,
              "eval": total("perf/eval_time"), "checkpoint": total("perf/checkpoint_time")}
    share: dict[str, Optional[float]] = {k: (None if v is None else round(v / wall, 4)) for k, v in serial.items()}
    share["other"] = round(1.0 - sum(v for v in share.values() if v is not None), 4)
    share["generation"] = round((engine_busy(last) - engine_busy(first)) / wall, 4)
    return {
        "wall_s": round(wall, 3),
        "trained_tokens_per_s": round(trained / wall, 1),
        "generated_tokens_per_s": round((last["engine/decode_tokens"] - first["engine/decode_tokens"]) / wall, 1),
        "step_time_median_s": round(statistics.median(row["perf/step_time"] for row in window), 4),
        "train_time_median_s": round(statistics.median(row["perf/train_time"] for row in window), 4),
        "share": share,
        "lag_max": max(row.get("rollout/lag_max", 0.0) for row in window),
        "engine_compiles": last.get("engine/compiles"),
    }


def quickstart_ttfs(work: Path) -> list[float]:
    """Seconds to the quickstart's first step, twice in one empty compilation cache."""
    env = child_env(work / "quickstart-jax-cache")
    out = []
    for attempt in range(2):
        argv = ["train", "configs/quickstart.yaml", "--set", f"run.output_dir={work / f'quickstart-{attempt}'}",
                "--set", "stages.0.total_steps=1", "--set", "stages.1.total_steps=1"]
        times, _ = timed_train(argv, env, timeout=600)
        out.append(round(times[1], 2))
    return out


# --------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,bench-40m", help="comma-separated: tiny, bench-40m")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2], help="rollout.max_staleness values")
    parser.add_argument("--steps", type=int, default=12, help="RL steps per run (the window is steps 2..N)")
    parser.add_argument("--every", type=int, default=4, help="eval and checkpoint every this many steps")
    parser.add_argument("--no-prime", action="store_true", help="skip the one-step cold-cache run per model")
    parser.add_argument("--quickstart", action="store_true", help="also time the quickstart's first step, cold and warm")
    parser.add_argument("--quick", action="store_true", help="tiny, max_staleness 0, 4 steps, no priming (for tests)")
    parser.add_argument("--work-dir", default=None, help="where runs and the compilation cache go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.staleness, args.steps, args.every, args.no_prime = "tiny", [0], 4, 2, True
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the window is steps 2..N)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(SHAPES))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {sorted(SHAPES)}")

    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        inherited = os.environ.get("JAX_COMPILATION_CACHE_DIR") if args.quick else None
        env = child_env(Path(inherited) if inherited else work / "jax-cache")
        result: dict[str, Any] = {"bench": "rl", "load_avg_start": load_avg()}
        entries, cold = [], {}
        for model in models:
            path = str(bench_40m_dir(work / "bench-40m-hf")) if model == "bench-40m" else model
            if not args.no_prime:
                times, _ = timed_train(["train", str(_prime_config(work, model, path)), "--set", "run.overwrite=true"],
                                       env, timeout=1800)
                cold[model] = round(times[1], 2)
            for staleness in args.staleness:
                entries.append(bench_run(model, path, staleness, args.steps, work, env, args.every))
        result["ttfs_cold_s"] = cold or None
        result["entries"] = entries
        if args.quickstart:
            result["quickstart_ttfs_s"] = quickstart_ttfs(work)
    import jax

    result.update({"load_avg_end": load_avg(), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                   "cpu_count": os.cpu_count()})
    print(json.dumps(result), flush=True)
    return result


def _prime_config(work: Path, model: str, path: str) -> Path:
    import yaml

    out = work / f"{model}-prime"
    cfg = run_config(path, SHAPES[model], 0, 1, out, every=0)
    config = work / f"{model}-prime.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


if __name__ == "__main__":
    main()
