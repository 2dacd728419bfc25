"""Learning check: the trainer turns a one-token bandit into a near-deterministic choice.

Fixed prompt; the policy samples one token; reward 1 for the token ranked third by the
initial model's probability, 0 otherwise. Group size 16, 8 prompts per step (128 rows),
GRPO, AdamW lr 1e-2: the target's probability must exceed 0.9 within 50 steps. Sampling
uses numpy from the model's exact next-token distribution, and the batch carries the
behaviour log-probs and versions an engine would give.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.model import forward_jit
from asyncrl.rollout.trajectory import TrainBatch
from asyncrl.trainer import Trainer
from tests.trainer_fixtures import tiny_model, trainer_config

PROMPT = [3, 7, 17, 8, 5, 4]  # <|user|>1+2<|end|><|assistant|>
LENGTH = 8  # prompt + 1 generated token, padded
GROUP_SIZE, PROMPTS_PER_STEP, MAX_STEPS = 16, 8, 50


def next_token_probs(graphdef, params) -> np.ndarray:
    ids = jnp.asarray([PROMPT], jnp.int32)
    logits, _ = forward_jit(graphdef, params, ids, None, jnp.ones_like(ids, bool))
    return np.asarray(jax.nn.softmax(logits[0, -1].astype(jnp.float32)), np.float64)


def bandit_batch(probs: np.ndarray, target: int, rng: np.random.Generator, version: int) -> TrainBatch:
    rows, n = GROUP_SIZE * PROMPTS_PER_STEP, len(PROMPT)
    sampled = rng.choice(len(probs), size=rows, p=probs / probs.sum())
    input_ids = np.zeros((rows, LENGTH), np.int32)
    input_ids[:, :n] = PROMPT
    input_ids[:, n] = sampled
    attention_mask = np.zeros((rows, LENGTH), bool)
    attention_mask[:, : n + 1] = True
    loss_mask = np.zeros((rows, LENGTH), bool)
    loss_mask[:, n] = True
    behavior = np.zeros((rows, LENGTH), np.float32)
    behavior[:, n] = np.log(probs[sampled])
    versions = np.where(loss_mask, version, -1).astype(np.int32)
    rewards = (sampled == target).astype(np.float32)
    group_index = (np.arange(rows) // GROUP_SIZE).astype(np.int32)
    return TrainBatch(input_ids, attention_mask, loss_mask, behavior, versions, rewards, group_index,
                      np.zeros(rows, bool), 1.0)


def run_bandit(seed: int) -> list[float]:
    graphdef, params = tiny_model(seed=seed)
    cfg = trainer_config(rollout={"group_size": GROUP_SIZE, "batch_size": PROMPTS_PER_STEP},
                         optim={"lr": 1e-2}, run={"seed": seed})
    trainer = Trainer(cfg, graphdef, params)
    probs = next_token_probs(graphdef, trainer.params)
    target = int(np.argsort(-probs)[2])
    rng = np.random.default_rng(seed)
    history = [probs[target]]
    for _ in range(MAX_STEPS):
        trainer.step(bandit_batch(probs, target, rng, trainer.version))
        probs = next_token_probs(graphdef, trainer.params_for_publish())
        history.append(probs[target])
        if probs[target] > 0.9:
            break
    return history


@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_bandit_learns_third_ranked_token(seed):
    """Three seeds (model init, sampling): each converges in about 6 steps, well inside 50."""
    history = run_bandit(seed=seed)
    assert history[0] < 0.2
    assert history[-1] > 0.9, f"seed {seed}, after {len(history) - 1} steps: {history[::5]}"
