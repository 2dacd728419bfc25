"""What the benchmark scripts share: a median timer, the machine's measured matmul peak and copy
speed (what their figures are compared against), the load average that every JSON line
carries (other work on a shared machine moves every figure), a random train batch, and the
``bench-40m`` model directory that asyncrl and transformers (TRL) both load."""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional


def run_times(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Wall seconds of each of ``repeats`` calls of ``fn()``, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls, after one untimed warm-up call."""
    return statistics.median(run_times(fn, repeats))


def matmul_peak(n: int = 2048, dtype: str = "float32", repeats: int = 10) -> float:
    """The machine's matmul peak: FLOP/s of a jitted ``n x n`` ``jnp.dot`` in ``dtype``, best of
    ``repeats`` (after one compiling call). Every figure compared against "the matmul peak" uses this."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    dot = jax.jit(jnp.dot)
    return 2.0 * n**3 / min(run_times(lambda: dot(a, b).block_until_ready(), repeats))


def busy_decode(engine: Any, prompts: list[list[int]], new: int, repeats: int) -> tuple[float, float]:
    """``(seconds, decode ms per step)`` of one round of ``prompts``, each sent from its own thread
    as one request for exactly ``new`` tokens (EOS ignored: every slot stays busy to the end).
    Seconds: the median of ``repeats`` rounds after two untimed ones; ms per step: the engine's
    own decode time over its decode steps in those rounds (its host work included)."""
    rounds = itertools.count()

    def one_round() -> None:
        busy_round(engine, prompts, new, next(rounds) * len(prompts))  # sample ids unique across rounds

    one_round()  # compiles
    before = engine.metrics()
    seconds = median_time(one_round, repeats)
    after = engine.metrics()
    steps = after["engine/decode_steps"] - before["engine/decode_steps"]
    return seconds, 1e3 * (after["engine/decode_s"] - before["engine/decode_s"]) / steps


def busy_round(engine: Any, prompts: list[list[int]], new: int, first_sample_id: int) -> tuple[float, float, float]:
    """One round of :func:`busy_decode`: ``prompts``, each sent from its own thread as one request
    for exactly ``new`` tokens (sample ids from ``first_sample_id`` on). Returns ``(wall seconds,
    the engine's decode seconds, its decode steps)`` of the round."""
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.engine.protocol import GenerationRequest

    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=new, stop_token_ids=[], sample_id=first_sample_id + i)
                for i, p in enumerate(prompts)]
    before, started = engine.metrics(), time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        assert all(len(r[0].output_ids) == new for r in pool.map(engine.generate, requests))
    seconds, after = time.perf_counter() - started, engine.metrics()
    return (seconds, after["engine/decode_s"] - before["engine/decode_s"],
            after["engine/decode_steps"] - before["engine/decode_steps"])


def copy_bandwidth(mib: int = 256) -> float:
    """Bytes/s of a jitted elementwise pass over ``mib`` MiB of float32 (read + write counted; median of 5)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib * 1024 * 1024 // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001 + 1.0)
    return 2 * x.nbytes / median_time(lambda: f(x).block_until_ready(), 5)


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak since the last
    :func:`reset_peak_rss` (``VmHWM``), from ``/proc/self/status`` (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Reset the peak resident memory (``VmHWM``) to the current one (``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def load_avg() -> Optional[list[float]]:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def load_avg_since(start: Optional[list[float]]) -> dict[str, Any]:
    """``{"load_avg": {"start": start, "end": <now>}}``: the one load-average field of every
    benchmark's JSON line (``start``: :func:`load_avg` when the measuring began)."""
    return {"load_avg": {"start": start, "end": load_avg()}}


def machine() -> dict[str, Any]:
    """What the figures were measured on: the CPU model (``/proc/cpuinfo``; None elsewhere), the
    cores of the machine and those this process may run on (its affinity: a pinned or
    containerised run sees fewer)."""
    model = None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), None)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cpu_count": os.cpu_count(), "cpus_usable": usable}


def random_train_batch(rows: int, length: int, vocab: int, prompt: int, group_size: int = 4) -> Any:
    """A full-length random :class:`~asyncrl.rollout.trajectory.TrainBatch` of ``rows`` x ``length``
    tokens: ``prompt`` untrained tokens, then trained ones to the end (behaviour log-probs in
    [-4, -0.5], policy version 0), in groups of ``group_size`` rows with normal rewards."""
    import numpy as np

    from asyncrl.rollout.trajectory import TrainBatch

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=(rows, length)).astype(np.int32)
    attention = np.ones((rows, length), bool)
    loss = attention.copy()
    loss[:, :prompt] = False
    behavior = np.where(loss, -rng.uniform(0.5, 4.0, size=(rows, length)), 0.0).astype(np.float32)
    versions = np.where(loss, 0, -1).astype(np.int32)
    group_index = (np.arange(rows) // group_size).astype(np.int32)
    rewards = rng.normal(size=rows).astype(np.float32)
    return TrainBatch(ids, attention, loss, behavior, versions, rewards, group_index, np.zeros(rows, bool), 1.0)


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
