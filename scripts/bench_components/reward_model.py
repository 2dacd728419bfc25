"""Reward-model scoring throughput: samples scored per second by a ``bench-40m``-sized reward model.

    python scripts/bench.py reward_model                  # batch 64, sequences of 128-256 tokens
    python scripts/bench.py reward_model --quick          # a 2-layer hidden-64 model: checks the script

The reward model is ``bench-40m``'s decoder (hidden 512, 8 layers, vocabulary 32000, random
init, in memory) with a one-label ``score`` head. Prints one JSON line:

- ``device_samples_per_s``: one jitted :func:`~asyncrl.model.reward_model.reward_scores` call on
  ``--batch`` sequences padded to the length bucket (median of ``--repeats``), no queue;
- ``queue_samples_per_s``: the same sequences through the scoring queue
  (:class:`~asyncrl.rollout.reward_scoring.RewardModelScorer`, ``batch_size = --batch``) from
  ``--threads`` caller threads, each submitting groups of ``--group`` at once as the single-turn
  workflow does (``--samples`` in all), wall time from the first submit to the last score;
  ``queue_mean_batch`` is its mean rows per device call;
- the load average at start and end, the jax version and the device.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import numpy as np
from bench_common import load_avg, load_avg_since, run_times


def reward_model(quick: bool, seed: int = 0):
    """A random-init reward model (``bench-40m`` or, with ``quick``, a 2-layer twin) in memory."""
    import jax

    from asyncrl.model import bench_40m_config, init_decoder, split_params
    from asyncrl.model.reward_model import NO_PAD_ID, LoadedRewardModel

    cfg = bench_40m_config(param_dtype="float32", compute_dtype="float32")
    if quick:
        cfg = cfg.replace(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    graphdef, params = split_params(init_decoder(cfg, seed))
    head = np.random.default_rng(seed).standard_normal(cfg.hidden_size).astype(np.float32) * 0.02
    return LoadedRewardModel(graphdef, params, jax.device_put(head), NO_PAD_ID, None, Path("."), cfg)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="sequences per device call")
    parser.add_argument("--length", type=int, default=256, help="the length bucket; sequences are length/2..length tokens")
    parser.add_argument("--samples", type=int, default=1024, help="sequences through the queue")
    parser.add_argument("--threads", type=int, default=16, help="caller threads (rollout threads)")
    parser.add_argument("--group", type=int, default=8, help="sequences a caller submits at once (a GRPO group)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a 2-layer hidden-64 model, few samples")


def run(args: argparse.Namespace) -> dict:
    if args.quick:
        args.samples, args.repeats, args.length = min(args.samples, 128), min(args.repeats, 2), min(args.length, 64)

    import jax

    from asyncrl.model.reward_model import pad_id_array, reward_scores_jit
    from asyncrl.rollout.reward_scoring import RewardModelScorer

    load_start = load_avg()
    model = reward_model(args.quick)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    seqs = [rng.integers(0, vocab, int(rng.integers(args.length // 2, args.length + 1))).tolist() for _ in range(args.samples)]

    ids = np.zeros((args.batch, args.length), np.int32)
    mask = np.zeros((args.batch, args.length), bool)
    for row in range(args.batch):
        seq = seqs[row % len(seqs)]
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = True
    pad = pad_id_array(model.pad_id)
    times = run_times(lambda: reward_scores_jit(model.graphdef, model.params, model.score_weight, ids, mask, pad).block_until_ready(),
                      args.repeats)
    device_rate = args.batch / statistics.median(times)

    scorer = RewardModelScorer(model, batch_size=args.batch, length_buckets=(args.length,), name="bench")
    try:
        scorer.score(seqs[: args.batch], timeout_s=600)  # compile every row count the queue may use
        for rows in scorer.row_buckets:
            scorer.score(seqs[:rows], timeout_s=600)
        before = scorer.metrics()
        chunks = [seqs[i : i + args.group] for i in range(0, len(seqs), args.group)]
        errors: list[BaseException] = []

        def caller(k: int) -> None:
            try:
                for chunk in chunks[k :: args.threads]:
                    futures = [scorer.submit(s) for s in chunk]
                    for f in futures:
                        f.result(timeout=600)
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=caller, args=(k,), daemon=True) for k in range(args.threads)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=1200)
        wall = time.perf_counter() - start
        if errors:
            raise errors[0]
        after = scorer.metrics()
    finally:
        scorer.close()
    batches = after["reward_model/batches"] - before["reward_model/batches"]
    result = {
        "model": "quick" if args.quick else "bench-40m",
        "params": model.config.num_params() + model.config.hidden_size,
        "batch": args.batch,
        "length_bucket": args.length,
        "device_samples_per_s": round(device_rate, 1),
        "device_batch_ms": round(1000 * statistics.median(times), 1),
        "queue_samples_per_s": round(len(seqs) / wall, 1),
        "queue_mean_batch": round(len(seqs) / batches, 1) if batches else None,
        "threads": args.threads,
        "group": args.group,
        **load_avg_since(load_start),
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
    }
    return result
