"""Sequence packing (``rollout.pack``): trained tokens per second of the trainer step, packed against
unpacked, on batches with GSM8K-like lengths.

Lengths: each row is one GSM8K example, drawn at random from ``--data``'s ``train.jsonl``: its
question's token count as the (untrained) prompt and its answer's as the (trained) completion,
counted with Qwen2's pre-tokenizer split (a digit alone, a word with its leading space, a run of
punctuation, a newline run: :func:`approx_tokens`), which approximates Qwen2.5's token counts
(common words are one token; rare ones split further, so real counts run a little longer). The
completions span about 20 to 400 tokens (median about 110): the spread the issue measures.

Every batch is a GRPO batch of ``--rows`` rows (groups of 4), ``L`` its longest row rounded up to
``--bucket``. The same ``--batches`` batches are stepped packed and unpacked, alternating one step
of each (a shared machine's load moves both alike); every shape is compiled in a first,
untimed round, then ``--rounds`` timed rounds follow. ``trained_tokens_per_s`` is the trained
(loss-mask) tokens of all timed steps over their summed ``perf/train_time``; ``speedup`` packed
over unpacked; ``positions`` the ``rows x L`` each step computes (packed: the packed rows).

``--prompt-tokens N`` puts N more untrained tokens before every prompt: the long-prompt case,
where an unpacked step sends only its completions' window through the lm head and a packed one
every position.

``--lengths long``: the long-tailed lengths of long-reasoning RL instead of GSM8K's, drawn from
a stated mix: a length budget of ``--budget`` tokens (default 2,048: the length cap, the
packed row's length), prompts uniform in [32, 96] tokens, completions log-normal with a median of
``--budget / 16`` tokens and sigma 1.1, cut at the budget (the truncated ones are the mix's long
tail); the median sequence is at most 1/8 of the budget (``mix`` reports the drawn percentiles).
Both modes then train by the same tokens per micro-batch and device: unpacked, micro-batches of
``--micro-rows`` rows of the batch's length; packed, ``optim.micro_batch_tokens = --micro-rows x
--budget`` (packed rows of the batch's length, as many micro-batches as the packing needs).
``target``: packed at least 3x unpacked (``pass``).

Usage: python scripts/bench.py pack [--models tiny] [--rows 64] [--batches 4] [--rounds 2]
       [--bucket 64] [--data $ASYNCRL_SHARED_DATA/gsm8k] [--prompt-tokens 0]
       python scripts/bench.py pack --lengths long [--budget 2048] [--micro-rows 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from bench_common import load_avg, load_avg_since

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = Path(os.environ.get("ASYNCRL_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data") / "gsm8k"
_PIECES = re.compile(r"\d| ?[A-Za-z]+| ?[^\sA-Za-z\d]+|\s+")


def approx_tokens(text: str) -> int:
    """Qwen2-style pre-tokenizer pieces of ``text`` (each piece one token: an approximation)."""
    return len(_PIECES.findall(text))


def gsm8k_lengths(data: Path) -> list[tuple[int, int]]:
    """``(prompt, completion)`` approximate token counts of every example of ``data/train.jsonl``."""
    out = []
    with open(data / "train.jsonl") as f:
        for line in f:
            example = json.loads(line)
            out.append((approx_tokens(example["question"]) + 1, approx_tokens(example["answer"]) + 1))  # + EOS
    return out


def gsm8k_like_batch(lengths: list[tuple[int, int]], rows: int, bucket: int, vocab: int, seed: int,
                     prompt_tokens: int = 0) -> Any:
    """A right-padded GRPO TrainBatch of ``rows`` GSM8K-length rows (random tokens and rewards);
    ``prompt_tokens`` more (untrained) tokens before every prompt (a long few-shot prompt)."""
    import numpy as np

    from asyncrl.rollout.trajectory import TrainBatch

    rng = np.random.default_rng(seed)
    picks = [(p + prompt_tokens, c) for p, c in (lengths[i] for i in rng.integers(0, len(lengths), size=rows))]
    ends = np.array([p + c for p, c in picks])
    length = int(-(-ends.max() // bucket) * bucket)
    pos = np.arange(length)[None]
    attention = pos < ends[:, None]
    loss = attention & (pos >= np.array([p for p, _ in picks])[:, None])
    ids = np.where(attention, rng.integers(0, vocab, size=(rows, length)), 0).astype(np.int32)
    behavior = np.where(loss, -rng.uniform(0.5, 4.0, size=(rows, length)), 0.0).astype(np.float32)
    versions = np.where(loss, 0, -1).astype(np.int32)
    group_index = (np.arange(rows) // 4).astype(np.int32)
    rewards = rng.normal(size=rows).astype(np.float32)
    return TrainBatch(ids, attention, loss, behavior, versions, rewards, group_index, np.zeros(rows, bool), 1.0)


LONG_PROMPTS = (32, 96)
"""``--lengths long``: prompt tokens, uniform in this range."""
LONG_SIGMA = 1.1
"""``--lengths long``: the completions' log-normal sigma (median ``--budget / 16``)."""
LONG_TARGET = 3.0
"""``--lengths long``: packed trained tokens/s at least this many times unpacked."""


def long_tailed_lengths(budget: int, count: int, seed: int) -> list[tuple[int, int]]:
    """``count`` ``(prompt, completion)`` token counts of the long mix (module docstring)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = rng.integers(LONG_PROMPTS[0], LONG_PROMPTS[1] + 1, size=count)
    completions = np.exp(rng.normal(np.log(budget / 16), LONG_SIGMA, size=count)).astype(np.int64)
    completions = np.clip(completions, 1, budget - prompts)
    return [(int(p), int(c)) for p, c in zip(prompts, completions)]


def mix_stats(budget: int, lengths: list[tuple[int, int]]) -> dict:
    """The drawn mix: the budget, sequence-length percentiles, the share cut at the budget."""
    import numpy as np

    totals = np.array([p + c for p, c in lengths])
    return {"budget": budget, "prompt_tokens": list(LONG_PROMPTS), "completion_median": budget // 16,
            "completion_sigma": LONG_SIGMA,
            "sequence_p5_p50_p95_max": [int(np.percentile(totals, q)) for q in (5, 50, 95, 100)],
            "median_over_budget": round(float(np.median(totals)) / budget, 3),
            "truncated_fraction": round(float(np.mean(totals >= budget)), 3)}


def bench_model(name: str, args: argparse.Namespace, lengths: list[tuple[int, int]]) -> dict:
    from asyncrl.config import load_config
    from asyncrl.model import bench_40m_config, init_decoder, split_params
    from asyncrl.model.tiny import TinySpec, tiny_decoder_config
    from asyncrl.rollout.packing import packed_shape
    from asyncrl.trainer import Trainer

    model_cfg = bench_40m_config() if name == "bench-40m" else tiny_decoder_config(TinySpec())
    graphdef, params = split_params(init_decoder(model_cfg, seed=0))
    long = args.lengths == "long"
    batches = [gsm8k_like_batch(long_tailed_lengths(args.budget, 4 * args.rows, seed) if long else lengths, args.rows,
                                args.bucket, model_cfg.vocab_size, seed, args.prompt_tokens)
               for seed in range(args.batches)]
    longest = max(b.input_ids.shape[1] for b in batches)
    trainers = {}
    for pack in (False, True):
        sections: dict[str, Any] = {"rollout": {"group_size": 4, "batch_size": args.rows // 4, "pack": pack,
                                                "length_bucket": args.bucket, "max_seq_len": max(longest, 1024)}}
        if long:  # the same tokens per micro-batch and device: unpacked rows of the batch's length, packed by budget
            sections["rollout"]["max_seq_len"] = args.budget
            sections["optim"] = ({"micro_batch_tokens": args.micro_rows * args.budget} if pack
                                 else {"micro_batches": args.rows // args.micro_rows})
        trainers[pack] = Trainer(load_config(data=sections), graphdef, params)
    times = {False: 0.0, True: 0.0}
    trained = {False: 0.0, True: 0.0}
    for round_index in range(args.rounds + 1):  # round 0 compiles every shape
        for batch in batches:
            for pack in (False, True):
                metrics = trainers[pack].step(batch)
                if round_index:
                    times[pack] += metrics["perf/train_time"]
                    trained[pack] += metrics["train/trained_tokens"]
    positions = {False: sum(b.input_ids.size for b in batches), True: 0}
    for b in batches:
        rows, length = packed_shape(b.attention_mask.sum(axis=1), b.input_ids.shape[1],
                                    max_segments=trainers[True].cfg.rollout.pack_max_segments)
        positions[True] += rows * length
    real = sum(int(b.attention_mask.sum()) for b in batches)
    rate = {pack: trained[pack] / times[pack] for pack in (False, True)}
    return {
        "lengths": [list(b.input_ids.shape) for b in batches],
        "real_tokens_fraction_unpacked": round(real / positions[False], 3),
        "real_tokens_fraction_packed": round(real / positions[True], 3),
        "unpacked": {"trained_tokens_per_s": round(rate[False], 1), "train_time_s": round(times[False], 3)},
        "packed": {"trained_tokens_per_s": round(rate[True], 1), "train_time_s": round(times[True], 3)},
        "speedup": round(rate[True] / rate[False], 3),
        **({"target": {"value": LONG_TARGET, "pass": rate[True] / rate[False] >= LONG_TARGET}} if long else {}),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="tiny", help="comma-separated: tiny, bench-40m")
    parser.add_argument("--rows", type=int, default=64, help="rows per batch (groups of 4)")
    parser.add_argument("--batches", type=int, default=4, help="distinct batches (each compiled once per mode)")
    parser.add_argument("--rounds", type=int, default=2, help="timed passes over the batches")
    parser.add_argument("--bucket", type=int, default=64, help="rollout.length_bucket")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory of GSM8K's train.jsonl")
    parser.add_argument("--lengths", choices=("gsm8k", "long"), default="gsm8k",
                        help="gsm8k: GSM8K's lengths; long: the long-tailed mix of the module docstring")
    parser.add_argument("--budget", type=int, default=2048, help="--lengths long: the length budget (the cap)")
    parser.add_argument("--micro-rows", type=int, default=8,
                        help="--lengths long: rows of the budget's length per micro-batch and device, both modes")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="untrained tokens added before every prompt (the long-prompt case: unpacked rows score "
                             "only the lm-head window of their completions, packed rows whole)")


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    load_start = load_avg()
    result: dict[str, Any] = {
        "lengths": args.lengths, "rows": args.rows, "batches": args.batches, "rounds": args.rounds, "bucket": args.bucket,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }
    if args.lengths == "long":
        if args.budget < 2 * LONG_PROMPTS[1] or args.rows % args.micro_rows or args.rows % 4:
            raise SystemExit(f"bench.py pack --lengths long: --budget at least {2 * LONG_PROMPTS[1]}, --rows a multiple of "
                             f"4 and of --micro-rows (given {args.budget}, {args.rows}, {args.micro_rows})")
        lengths: list[tuple[int, int]] = []
        result["mix"] = mix_stats(args.budget, [pair for seed in range(args.batches)
                                                for pair in long_tailed_lengths(args.budget, 4 * args.rows, seed)])
        result["micro_batch_tokens"] = args.micro_rows * args.budget
    else:
        lengths = gsm8k_lengths(args.data)
        completions = sorted(c for _, c in lengths)
        result["prompt_tokens"] = args.prompt_tokens
        result["completion_tokens_p5_p50_p95_max"] = [completions[int(q * (len(completions) - 1))]
                                                      for q in (0.05, 0.5, 0.95, 1.0)]
    for name in args.models.split(","):
        result[name] = bench_model(name, args, lengths)
    return {**result, **load_avg_since(load_start)}
