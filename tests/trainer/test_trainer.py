"""Trainer on one device: NaN guard, publishing safety, state round trip, pi_prox / reference
log-probs, batch checks, the optimizer's schedule and weight-decay mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.errors import TrainerError
from asyncrl.model import per_token_logprobs_jit
from asyncrl.trainer import Trainer, compile_count, learning_rate_schedule, weight_decay_mask
from asyncrl.trainer.optim import OptimParams
from tests.trainer_fixtures import make_batch, trainer_config


def host(tree):
    return jax.tree.map(np.asarray, tree)


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_nan_in_batch_skips_update_and_repeated_nan_stops(tiny_one_layer):
    graphdef, params = tiny_one_layer
    cfg = trainer_config(optim={"max_consecutive_nonfinite": 2})  # same compilation as the other tests
    trainer = Trainer(cfg, graphdef, params)
    trainer.step(make_batch(seed=1))  # one good update: Adam's count and the schedule at 1
    before = host(trainer.state_dict())
    assert before["update_count"] == 1

    bad = make_batch(seed=2)
    bad.rewards[3] = np.nan
    metrics = trainer.step(bad)
    after = host(trainer.state_dict())
    assert metrics["train/skipped_updates"] == 1 and metrics["train/skipped_updates_total"] == 1
    assert max_diff(before["params"], after["params"]) == 0.0
    assert max_diff(before["opt_state"], after["opt_state"]) == 0.0  # Adam's moments and counts
    assert after["update_count"] == 1 and after["consecutive_nonfinite"] == 1
    assert after["step"] == 2  # the step itself happened (and is published as usual)

    bad.behavior_logprobs[5, 10] = np.nan  # inf alone is clamped by the loss
    bad.rewards[3] = 0.0
    bad.loss_mask[5, 10] = True
    with pytest.raises(TrainerError, match="max_consecutive_nonfinite"):
        trainer.step(bad)
    assert trainer.skipped_updates_total == 2


def test_published_params_stay_readable_after_next_steps(tiny_one_layer):
    graphdef, params = tiny_one_layer
    trainer = Trainer(trainer_config(), graphdef, params)
    initial = trainer.params_for_publish()
    trainer.step(make_batch(seed=3))
    compiled = compile_count()
    published = trainer.params_for_publish()
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(published))
    copy = host(published)
    trainer.step(make_batch(seed=4))
    trainer.step(make_batch(seed=5))
    # The step's outputs spell their shardings differently from the initial placement (one more
    # jit dispatch-cache entry), but the program is the same: perf/compile_count must not grow.
    assert compile_count() == compiled
    assert max_diff(host(published), copy) == 0.0  # still readable, unchanged
    assert max_diff(host(initial), host(params)) == 0.0
    assert max_diff(host(trainer.params), copy) > 0.0  # while training moved on


def test_state_dict_round_trip_continues_identically(tiny_one_layer):
    graphdef, params = tiny_one_layer
    cfg = trainer_config()
    a = Trainer(cfg, graphdef, params)
    a.step(make_batch(seed=6))
    state = a.state_dict()
    assert all(isinstance(v, np.ndarray) for v in jax.tree.leaves(state["opt_state"]))  # host arrays, no pickle needed
    b = Trainer(cfg, graphdef, params)
    b.load_state_dict(state)
    assert (b.version, b.update_count) == (1, 1)
    compiled = compile_count()
    a.step(make_batch(seed=7))
    metrics = b.step(make_batch(seed=7))
    assert compile_count() == compiled == metrics["perf/compile_count"]  # equal configs share the jitted step
    # Final names, made here: the loss under loss/, the trainer's own time (never the loop's step_time).
    assert {"loss/total", "loss/pg", "perf/train_time", "perf/train_tokens_per_train_s", "train/grad_norm"} <= set(metrics)
    assert not {"perf/step_time", "perf/trained_tokens_per_s", "train/loss", "train/pg_loss"} & set(metrics)
    assert max_diff(host(a.params), host(b.params)) == 0.0


def test_prox_and_reference_logprobs(tiny_one_layer):
    """Decoupled PPO with KL: pi_prox and pi_ref are the step's starting weights on its
    first update, so the ratio starts at 1, KL(ref) at 0, and w = pi_prox / pi_behave."""
    graphdef, params = tiny_one_layer
    cfg = trainer_config(algo={"decoupled": True, "kl_coef": 0.1, "behave_weight_cap": None},
                         optim={"max_grad_norm": None})
    batch = make_batch(seed=8, temperature=0.7)
    trainer = Trainer(cfg, graphdef, params)
    metrics = trainer.step(batch)
    logp, _ = per_token_logprobs_jit(graphdef, params, jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask), 0.7)
    logp = np.asarray(logp)
    m = batch.loss_mask
    w = np.exp(logp - batch.behavior_logprobs)[m]
    assert metrics["train/behave_weight_mean"] == pytest.approx(w.mean(), rel=1e-4)
    assert metrics["train/behave_weight_max"] == pytest.approx(w.max(), rel=1e-4)
    assert metrics["train/approx_kl_prox"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["train/trained_tokens"] == m.sum()
    # The second step's reference is still the initial weights, its pi_prox the new ones.
    logp_now, _ = per_token_logprobs_jit(graphdef, trainer.params, jnp.asarray(batch.input_ids),
                                         jnp.asarray(batch.attention_mask), 0.7)
    delta = np.asarray(logp_now) - logp  # log pi - log pi_ref
    expected_kl = (np.exp(-delta) - 1 + delta)[m].mean()  # k3
    second = trainer.step(batch)
    assert second["train/kl_ref"] == pytest.approx(expected_kl, rel=1e-3)
    assert second["train/approx_kl_prox"] == pytest.approx(0.0, abs=1e-6)


def test_batch_checks(tiny_one_layer):
    graphdef, params = tiny_one_layer
    trainer = Trainer(trainer_config(algo={"mini_batches": 2}, optim={"micro_batches": 3}), graphdef, params)
    assert trainer.row_multiple == 6
    with pytest.raises(TrainerError, match="not a multiple of 6"):
        trainer.step(make_batch(rows=16))
    behave = Trainer(trainer_config(algo={"decoupled": True, "prox_logp": "behave"}), graphdef, params)
    with pytest.raises(TrainerError, match="prox_logp 'behave'.*version 0"):
        behave.step(make_batch(version=1))


def test_schedule_and_weight_decay_mask():
    p = OptimParams(lr=2.0, warmup_steps=4, schedule="cosine", decay_steps=10, min_lr_ratio=0.1)
    schedule = learning_rate_schedule(p)
    for count in [0, 1, 3, 4, 9, 14, 20]:
        warm = min(1.0, (count + 1) / 4)
        k = min(max(count - 4, 0), 10)
        expected = 2.0 * warm * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * k / 10)))
        assert float(schedule(count)) == pytest.approx(expected, rel=1e-6)
    assert float(learning_rate_schedule(OptimParams(lr=0.5))(7)) == 0.5
    params = {"embed_tokens": {"embedding": 0}, "norm": {"weight": 0},
              "layers": {0: {"self_attn": {"q_proj": {"kernel": 0, "bias": 0}}, "input_layernorm": {"weight": 0}}},
              "lm_head": {"kernel": 0}}
    mask = weight_decay_mask(params, ("embed", "norm", "bias"))
    assert mask == {"embed_tokens": {"embedding": False}, "norm": {"weight": False},
                    "layers": {0: {"self_attn": {"q_proj": {"kernel": True, "bias": False}},
                                   "input_layernorm": {"weight": False}}},
                    "lm_head": {"kernel": True}}
