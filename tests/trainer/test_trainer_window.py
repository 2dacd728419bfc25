"""The trainer's performance paths change work, not results: the lm-head window (log-probs and
the loss over trained positions only) equals the full-sequence step, and bfloat16 compute with
float32 master weights trains like float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.model.logprobs import window_starts
from asyncrl.trainer import Trainer
from asyncrl.trainer.step import loss_window, train_step
from tests.trainer_fixtures import VOCAB_HIGH, VOCAB_LOW, make_batch, trainer_config

LENGTH = 32


def varied_prompt_batch(seed: int = 0):
    """16 rows of ``LENGTH`` tokens: prompts of 4..20 tokens, completions of 1..12 (so every row's
    trained span fits a window of 16 < LENGTH), right-padded; one padding row."""
    batch = make_batch(rows=16, length=LENGTH, seed=seed, padding_rows=1)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(4, 21, size=16)
    completions = rng.integers(1, 13, size=16)
    ends = prompts + completions
    pos = np.arange(LENGTH)[None]
    batch.attention_mask[:] = pos < ends[:, None]
    batch.attention_mask[-1] = False
    batch.input_ids[:] = np.where(batch.attention_mask, rng.integers(VOCAB_LOW, VOCAB_HIGH, (16, LENGTH)), 0)
    batch.loss_mask[:] = batch.attention_mask & (pos >= prompts[:, None])
    batch.behavior_logprobs[:] = np.where(batch.loss_mask, -rng.uniform(0.5, 4.0, (16, LENGTH)), 0.0)
    batch.versions[:] = np.where(batch.loss_mask, 0, -1)
    return batch


def test_loss_window_covers_every_span_in_buckets():
    mask = np.zeros((3, 40), bool)
    mask[0, 5:9] = True
    mask[1, 30:40] = True  # span 10, ends at L
    assert loss_window(mask, 8) == 16 and loss_window(mask, 64) == 40  # capped at L
    assert loss_window(np.zeros((2, 40), bool), 8) == 8
    starts = np.asarray(window_starts(jnp.asarray(mask), 16))
    assert starts.tolist() == [5, 24, 0]  # row 1 moved left so that its window ends by L


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_windowed_step_equals_the_full_sequence_step(tiny_one_layer):
    """pi_prox recomputed (mismatch correction) and the entropy bonus on, prompts of varied
    lengths: one update over the window (16 of 32 positions) equals one over the full sequence."""
    graphdef, params = tiny_one_layer
    cfg = trainer_config(rollout={"length_bucket": 8}, algo={"mismatch_correction": True, "entropy_coef": 0.01},
                         optim={"lr": 0.05})
    batch = varied_prompt_batch(seed=2)
    trainer = Trainer(cfg, graphdef, params)
    args, kwargs = trainer._step_arguments(batch)
    assert kwargs["window"] == 16
    results = []
    for window in (16, None):
        call = list(args)
        call[2] = jax.tree.map(jnp.copy, args[2])  # the optimizer state is donated
        _, new_params, metrics = train_step(*call, **dict(kwargs, window=window))
        results.append((jax.device_get(new_params), jax.device_get(metrics)))
    (p_win, m_win), (p_full, m_full) = results
    for key in m_full:
        np.testing.assert_allclose(m_win[key], m_full[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert m_full["trained_tokens"] == batch.loss_mask[:-1].sum() and m_full["entropy"] > 0
    for a, b in zip(jax.tree.leaves(p_win), jax.tree.leaves(p_full)):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow  # a step compiled for bfloat16 (seconds); the paths it runs are the float32 ones
def test_bfloat16_compute_keeps_float32_master_weights(tiny_one_layer):
    """compute_dtype bfloat16: float32 parameters and Adam moments, and losses near float32's."""
    from asyncrl.model import init_decoder, split_params
    from asyncrl.model.tiny import TinySpec, tiny_decoder_config

    graphdef, params = tiny_one_layer
    bf16 = tiny_decoder_config(TinySpec(layers=1)).replace(compute_dtype="bfloat16")
    bf16_graphdef, bf16_params = split_params(init_decoder(bf16, seed=0))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(bf16_params)))
    cfg = trainer_config()
    losses = {}
    for name, gd in (("float32", graphdef), ("bfloat16", bf16_graphdef)):
        trainer = Trainer(cfg, gd, params)
        losses[name] = [trainer.step(make_batch(seed=s))["loss/total"] for s in (7, 8)]
        dtypes = {x.dtype for x in jax.tree.leaves((trainer.params, trainer.opt_state)) if x.ndim > 0}
        assert dtypes == {jnp.dtype(jnp.float32)}, (name, dtypes)
    assert np.all(np.isfinite(losses["bfloat16"]))
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=0.1, atol=0.02)
