"""TrainBatches and configs for the trainer tests, built directly in numpy (no executor).

Imported by ``tests/trainer/`` and by the subprocesses they spawn.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncrl.config import load_config
from asyncrl.rollout.trajectory import TrainBatch


def tiny_model(seed: int = 0, **spec: Any):
    """``(graphdef, params)`` of the ``tiny`` model built in memory (the same weights as
    ``load_model("tiny:seed=...")`` without importing transformers, which takes seconds)."""
    from asyncrl.model import init_decoder, split_params
    from asyncrl.model.tiny import TinySpec, tiny_decoder_config

    return split_params(init_decoder(tiny_decoder_config(TinySpec(seed=seed, **spec)), seed=seed))

VOCAB_LOW, VOCAB_HIGH = 6, 28  # the tiny model's character tokens (specials are 0..5)


def make_batch(
    rows: int = 16,
    length: int = 24,
    group_size: int = 4,
    padding_rows: int = 0,
    seed: int = 0,
    version: int = 0,
    prompt: int = 6,
    temperature: float = 1.0,
) -> TrainBatch:
    """A right-padded TrainBatch: ``rows - padding_rows`` real rows in groups of ``group_size``,
    random tokens and lengths, a ``prompt``-token untrained prefix, behaviour log-probs in
    [-4, -0.5] on trained tokens, and random rewards."""
    rng = np.random.default_rng(seed)
    real = rows - padding_rows
    ids = rng.integers(VOCAB_LOW, VOCAB_HIGH, size=(rows, length)).astype(np.int32)
    lengths = rng.integers(length // 2, length + 1, size=rows)
    attention = np.arange(length)[None] < lengths[:, None]
    attention[real:] = False
    ids[~attention] = 0
    loss = attention.copy()
    loss[:, :prompt] = False
    behavior = np.where(loss, -rng.uniform(0.5, 4.0, size=(rows, length)), 0.0).astype(np.float32)
    versions = np.where(loss, version, -1).astype(np.int32)
    group_index = np.full(rows, -1, np.int32)
    group_index[:real] = np.arange(real) // group_size
    rewards = np.where(group_index >= 0, rng.normal(size=rows), 0.0).astype(np.float32)
    truncated = np.zeros(rows, bool)
    return TrainBatch(ids, attention, loss, behavior, versions, rewards, group_index, truncated, temperature)


def slice_rows(batch: TrainBatch, start: int, stop: int, group_offset: int = 0) -> TrainBatch:
    """Rows ``[start, stop)`` of ``batch`` with group indices shifted down by ``group_offset``."""
    gi = batch.group_index[start:stop]
    return TrainBatch(
        batch.input_ids[start:stop], batch.attention_mask[start:stop], batch.loss_mask[start:stop],
        batch.behavior_logprobs[start:stop], batch.versions[start:stop], batch.rewards[start:stop],
        np.where(gi >= 0, gi - group_offset, -1).astype(np.int32), batch.truncated[start:stop], batch.temperature,
    )


def trainer_config(**sections: Any):
    """A Config with ``group_size`` 4 and the given section overrides (``optim={...}``, ...)."""
    data: dict[str, Any] = {"rollout": {"group_size": 4, "batch_size": 4}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return load_config(data=data)


SGD = {"optimizer": "sgd", "lr": 0.5, "max_grad_norm": None}
"""One plain SGD update: what the equivalence tests compare (a large lr shows differences)."""


def mixed_length_batch(rows: int = 16, padding_rows: int = 2, seed: int = 0, multi_turn: bool = True, length: int = 32):
    """For the packing tests: rows of 3..``length`` tokens (several fit one packed row), prompts of
    2..6 tokens, multi-turn loss masks (an untrained tool span inside some completions), and
    ``padding_rows`` padding rows."""
    batch = make_batch(rows=rows, length=length, seed=seed, padding_rows=padding_rows)
    rng = np.random.default_rng(seed + 100)
    ends = rng.integers(3, length + 1, size=rows)
    ends[0] = length  # one full row
    prompts = np.minimum(rng.integers(2, 7, size=rows), ends - 1)
    pos = np.arange(length)[None]
    batch.attention_mask[:] = pos < ends[:, None]
    batch.attention_mask[rows - padding_rows:] = False
    batch.input_ids[:] = np.where(batch.attention_mask, rng.integers(VOCAB_LOW, VOCAB_HIGH, (rows, length)), 0)
    loss = batch.attention_mask & (pos >= prompts[:, None])
    if multi_turn:  # a tool reply of 3 untrained tokens in the middle of every third completion
        for r in range(0, rows, 3):
            mid = (prompts[r] + ends[r]) // 2
            if ends[r] - prompts[r] >= 6:
                loss[r, mid:mid + 3] = False
    batch.loss_mask[:] = loss
    batch.behavior_logprobs[:] = np.where(loss, -rng.uniform(0.5, 4.0, (rows, length)), 0.0)
    batch.versions[:] = np.where(loss, 0, -1)
    return batch
