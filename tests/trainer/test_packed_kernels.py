"""Packed rows through the fused kernels' own forms, with micro-batches by a token budget.

cuDNN's packed layout (asyncrl/model/cudnn_packed.py ``cudnn_segments``: each row's runs of equal
segment id as cuDNN segments, offsets from the row's start, at most a static bound per row) is
checked against an independent interpreter of the call jax makes
(``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with ``q_offsets`` /
``kv_offsets``): it attends within each ``[offset, offset + length)`` causally, which must be the
packed mask. On the CPU the trainer's step then runs cuDNN's calls through that interpreter (and
the unpacked lengths form through XLA's implementation of the same call), so a packed step by a
token budget is compared with the unpacked step: same losses, diagnostics and updated weights.
Splash's segment ids in interpret mode: the same comparison, slow. Compiled for an H100 (the
kernel in the optimized HLO, no ``[T, T]`` operand): tests/model/test_attention_targets.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.model import attention as attention_module
from asyncrl.model.attention import SelfAttentionMask, compiled_for, einsum_attention
from asyncrl.model.cudnn_packed import cudnn_segments
from asyncrl.model.logprobs import per_token_logprobs
from asyncrl.model.tiny import TinySpec, tiny_decoder_config
from asyncrl.trainer import Trainer
from tests.trainer_fixtures import SGD, mixed_length_batch, trainer_config

LENGTHS = {"data": {"max_prompt_tokens": 8}, "rollout": {"max_new_tokens": 24, "length_bucket": 32}}
"""mixed_length_batch's rows: 32 tokens at most, one length bucket."""


def model_with(attention: str):
    """``(graphdef, params)`` of a one-layer tiny model whose ``model.attention`` is ``attention``."""
    from asyncrl.model import init_decoder, split_params

    return split_params(init_decoder(tiny_decoder_config(TinySpec(layers=1)).replace(attention=attention), seed=0))


def cudnn_packed_interpreter(query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None, q_offsets=None,
                             kv_offsets=None, fp8_params=None, *, scale=1.0, mask_type=None, sliding_window_length=None,
                             **_):
    """What cuDNN computes for jax's packed layout, by einsum in float32: query ``t`` of row ``b``
    attends key ``s`` iff both lie in one segment ``[q_offsets[b, i], q_offsets[b, i] + q_seqlen[b, i])``
    (entries ``-1``: no segment), ``s <= t`` and, with a window, ``t - s < window``; a position in
    no segment gets zeros."""
    assert bias is None and mask is None and q_offsets is not None
    b, t = query.shape[:2]
    starts, lengths = q_offsets[:, :-1], q_seqlen
    pos = jnp.arange(t)
    inside = (starts[:, :, None] >= 0) & (pos >= starts[:, :, None]) & (pos < (starts + lengths)[:, :, None])  # [B, M, T]
    covered = inside.any(axis=1)
    segment = jnp.argmax(inside, axis=1)  # [B, T]
    allowed = (covered[:, :, None] & covered[:, None, :] & (segment[:, :, None] == segment[:, None, :])
               & (pos[None, :, None] >= pos[None, None, :]))
    if sliding_window_length is not None:
        allowed = allowed & (pos[None, :, None] - pos[None, None, :] < sliding_window_length)
    out = einsum_attention(query, key, value, allowed, "bskd", scale)
    return jnp.where(covered[:, :, None, None], out, 0.0).astype(query.dtype)


def packed_rows():
    """``segment_ids`` [4, 12]: three sequences then padding; two filling the row; padding only; the
    bound's four sequences then padding."""
    return np.array([
        [1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0, 0],
        [1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2],
        [0] * 12,
        [1, 2, 2, 3, 3, 3, 4, 4, 0, 0, 0, 0],
    ], np.int32)


@functools.partial(jax.jit, static_argnames=("window",))
def interpreted_and_reference(q, k, v, lengths, offsets, ids, window):
    got = cudnn_packed_interpreter(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
                                   scale=0.3, sliding_window_length=window)
    mask = SelfAttentionMask(ids > 0, ids, window)
    return got, einsum_attention(q, k, v, mask.dense(), "bskd", 0.3)


def test_cudnn_segments_are_the_runs_of_each_row_and_give_the_packed_attention():
    ids = packed_rows()
    lengths, offsets = cudnn_segments(jnp.asarray(ids), segments=4)
    assert lengths.shape == (4, 5) and offsets.shape == (4, 6)
    assert np.asarray(offsets).tolist() == [[0, 3, 5, 9, -1, -1], [0, 5, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1],
                                            [0, 1, 3, 6, 8, -1]]
    assert np.asarray(lengths).tolist() == [[3, 2, 4, 3, -1], [5, 7, -1, -1, -1], [12, -1, -1, -1, -1],
                                            [1, 2, 3, 2, 4]]
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 12, h, 8)), jnp.float32) for h in (4, 2, 2))
    for window in (None, 2):
        got, want = interpreted_and_reference(q, k, v, lengths, offsets, jnp.asarray(ids), window)
        real = ids > 0
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5)
        assert np.isfinite(np.asarray(got)).all()  # padding runs attend themselves: nothing left unwritten


@pytest.fixture
def cudnn_by_interpreter(monkeypatch):
    """Every several-token attention takes cuDNN's path, its calls run on the CPU: the packed layout by
    :func:`cudnn_packed_interpreter`, the lengths form by XLA's implementation of the same call."""
    from jax._src.cudnn import fused_attention_stablehlo

    real_attention = jax.nn.dot_product_attention
    calls: list[str] = []

    def lengths_form(*args, implementation=None, **kwargs):
        calls.append("lengths" if kwargs.get("mask") is None else "dense")
        return real_attention(*args, implementation="xla", **kwargs)

    def packed_layout(*args, **kwargs):
        calls.append("packed")
        return cudnn_packed_interpreter(*args, **kwargs)

    monkeypatch.setattr(attention_module, "attention_kernel", lambda *args, **kwargs: "cudnn")
    monkeypatch.setattr(attention_module, "cudnn_packed_unavailable", lambda segments: None if segments else "no bound")
    monkeypatch.setattr(attention_module.jax.nn, "dot_product_attention", lengths_form)
    monkeypatch.setattr(fused_attention_stablehlo, "dot_product_attention", packed_layout)
    return calls


def _step(model, batch, **sections):
    sections = {**sections, "data": LENGTHS["data"], "rollout": {**LENGTHS["rollout"], **sections.get("rollout", {})}}
    trainer = Trainer(trainer_config(**sections), *model)
    metrics = trainer.step(batch)
    return metrics, jax.device_get(trainer.params)


def _assert_same_step(got, want):
    (m_got, p_got), (m_want, p_want) = got, want
    for key, value in m_want.items():
        if not key.startswith(("perf/", "memory/")) and key in m_got:
            np.testing.assert_allclose(m_got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(p_want), jax.tree.leaves(p_got)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6)


@functools.partial(jax.jit, static_argnums=0)
def _logprobs_and_grads(graphdef, params, ids, valid, segments):
    def total(p):
        lp, _ = per_token_logprobs(graphdef, p, ids, valid, 1.0, segment_ids=segments)
        return lp.sum(), lp

    with compiled_for(platform="cpu", segments=3):  # packed rows of at most 3 sequences, as the trainer's step says
        return jax.value_and_grad(total, has_aux=True)(params)


def test_packed_log_probs_and_gradients_through_cudnn_equal_the_unpacked_rows(cudnn_by_interpreter):
    """The model's log-probs and gradients (float32, cuDNN's calls interpreted): packed rows through the
    packed layout equal the unpacked rows through the lengths form, token for token."""
    from asyncrl.rollout.packing import pack_train_batch

    graphdef, params = model_with("cudnn")
    batch = mixed_length_batch(rows=8, padding_rows=0, seed=2)
    fields = {name: getattr(batch, name) for name in ("input_ids", "attention_mask", "loss_mask", "rewards", "group_index",
                                                       "truncated")}
    packed = pack_train_batch(fields, max_segments=3)
    assert packed.rows < 8 and packed.segment_ids.max() <= 3
    (_, lp_rows), g_rows = _logprobs_and_grads(graphdef, params, jnp.asarray(batch.input_ids),
                                               jnp.asarray(batch.attention_mask), None)
    assert set(cudnn_by_interpreter) == {"lengths"}
    (_, lp_packed), g_packed = _logprobs_and_grads(graphdef, params, jnp.asarray(packed.tokens["input_ids"]),
                                                   jnp.asarray(packed.tokens["attention_mask"]),
                                                   jnp.asarray(packed.segment_ids))
    assert "packed" in cudnn_by_interpreter and "dense" not in cudnn_by_interpreter
    for r in range(8):
        where = np.argwhere(packed.token_row == r)
        np.testing.assert_allclose(np.asarray(lp_packed)[where[0, 0], where[:, 1]],
                                   np.asarray(lp_rows)[r, :len(where)], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_rows), jax.tree.leaves(g_packed)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(a))))


def test_a_token_budget_sets_each_step_s_micro_batches_from_its_packing():
    """Host side of a packed step by a token budget: 64 tokens per micro-batch are 2 packed rows of 32
    per device; the mini-batches' packed rows set the micro-batches (rounded up to bound the shapes)."""
    batch = mixed_length_batch(seed=4)
    trainer = Trainer(trainer_config(optim={"micro_batch_tokens": 64}, algo={"mini_batches": 2},
                                     rollout={**LENGTHS["rollout"], "pack": True, "pack_max_segments": 3},
                                     data=LENGTHS["data"]), *model_with("auto"))
    arrays, _, window, micro_batches = trainer._device_batch(batch, pack=True)
    rows = arrays["input_ids"].shape[0]
    assert window is None and rows == 2 * micro_batches * 2  # 2 mini-batches x micro-batches x 2 rows
    assert int(np.asarray(arrays["segment_ids"]).max()) <= 3
    assert int(np.asarray(arrays["attention_mask"]).sum()) == int(batch.attention_mask.sum())  # every token, once
    assert micro_batches < trainer.cfg.rollout.batch_size  # fewer than one row each


@pytest.mark.slow  # two train-step compiles (about 10 s alone, several times that beside other work)
def test_packed_step_by_token_budget_through_cudnn_equals_the_unpacked_step(cudnn_by_interpreter):
    """A model whose attention is cuDNN's (its calls interpreted here; its own config, so its trace is
    its own), GRPO with 2 mini-batches and the entropy bonus: packed rows of at most 3 sequences in
    micro-batches of one 32-token row per device equal the unpacked step in 2 fixed micro-batches."""
    model = model_with("cudnn")
    batch = mixed_length_batch(seed=4)
    algo = {"mini_batches": 2, "aggregation": "seq-mean-token-mean", "entropy_coef": 0.01}
    unpacked = _step(model, batch, algo=algo, optim=dict(SGD, micro_batches=2), rollout={"pack": False})
    assert set(cudnn_by_interpreter) == {"lengths"}
    cudnn_by_interpreter.clear()
    packed = _step(model, batch, algo=algo, optim=dict(SGD, micro_batch_tokens=32),
                   rollout={"pack": True, "pack_max_segments": 3})
    assert set(cudnn_by_interpreter) == {"packed"}  # no dense mask
    _assert_same_step(packed, unpacked)
    assert packed[0]["train/micro_batches"] >= 2  # one 32-token row each: the packing decides how many


@pytest.mark.slow  # splash's interpret-mode backward: about a minute here
def test_packed_step_through_splash_equals_the_unpacked_step():
    model = model_with("splash")
    batch = mixed_length_batch(seed=5)
    algo = {"aggregation": "token-mean", "kl_coef": 0.05}
    unpacked = _step(model, batch, algo=algo, optim=SGD, rollout={"pack": False})
    packed = _step(model, batch, algo=algo, optim=dict(SGD, micro_batch_tokens=64), rollout={"pack": True})
    _assert_same_step(packed, unpacked)


def test_packing_keeps_to_the_segment_bound_and_a_budget_below_a_row_is_refused():
    from asyncrl.errors import ConfigError
    from asyncrl.rollout.packing import first_fit_decreasing

    bins = first_fit_decreasing([1] * 10, capacity=64, max_items=4)
    assert [len(b) for b in bins] == [4, 4, 2]
    with pytest.raises(ConfigError, match=r"optim.micro_batch_tokens: 100 is below one row of the longest sequence, 128"):
        trainer_config(optim={"micro_batch_tokens": 100}, data={"max_prompt_tokens": 68},
                       rollout={"pack": True, "max_new_tokens": 32, "length_bucket": 64})
    with pytest.raises(ConfigError, match=r"optim.micro_batches: auto: micro-batches by a token budget pack their rows"):
        trainer_config(optim={"micro_batches": "auto"}, rollout={"pack": False})


def test_a_run_chooses_the_token_budget_from_memory_in_one_line(caplog):
    """``optim.micro_batches: auto`` on this CPU (the host's memory), as the run resolves it before it
    builds a stage's trainer: every row of a mini-batch's share in one micro-batch, within 32,768
    tokens, said once; a trainer given ``auto`` unchosen takes one row. The row multiple leaves out
    the micro-batches."""
    import logging

    from asyncrl.run.auto_slots import resolve_auto_micro_batches

    cfg = trainer_config(optim={"micro_batches": "auto"}, algo={"mini_batches": 2}, **LENGTHS)
    graphdef, params = model_with("auto")
    with caplog.at_level(logging.INFO, logger="asyncrl.run"):
        chosen = resolve_auto_micro_batches(cfg, tiny_decoder_config(TinySpec(layers=1)))
    assert chosen.optim.micro_batch_tokens == 8 * 32  # 16 rows / 2 mini-batches, one device
    assert any(line.startswith("optim.micro_batches: auto -> optim.micro_batch_tokens=256 (8 row(s) of 32 tokens")
               for line in caplog.messages)
    trainer = Trainer(chosen, graphdef, params)
    assert trainer.pack and trainer.micro_batch_tokens == 256 and trainer.row_multiple == 2
    assert trainer.spec.packed_segments == cfg.rollout.pack_max_segments
    assert Trainer(cfg, graphdef, params).micro_batch_tokens == 32  # unchosen: one row
