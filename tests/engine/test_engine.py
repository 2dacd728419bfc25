"""JaxEngine on the tiny model: log-probs, determinism under batching, concurrency, stops,
weight updates at chunk boundaries, compile counts, errors, crash and shutdown.

References are independent of the engine's decode path (the model's KV-cache forward, one
token per step): ``per_token_logprobs`` and a plain forward without a cache over the whole
sequence (padded to one length, so they compile once).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.config import EngineConfig
from asyncrl.engine.jax_engine import JaxEngine
from asyncrl.engine.jax_programs import compile_count
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.errors import EngineClosed, EngineCrashed, EngineRequestError
from asyncrl.model import forward_jit, init_kv_cache, per_token_logprobs_jit

pytestmark = pytest.mark.timeout(120)

CFG = EngineConfig(slots=16, kv_capacity=96, decode_chunk=4, prefill_buckets=[8, 32])
REF_LEN = 96  # reference sequences are right-padded to this length (one compilation each)


@pytest.fixture(scope="module")
def engine(tiny_split):
    lm, graphdef, params = tiny_split
    eng = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=CFG, seed=1)
    yield eng
    eng.shutdown()


def prompt_of(i: int, length: int, vocab: int = 28) -> list[int]:
    rng = np.random.default_rng(1000 + i)
    return [int(t) for t in rng.integers(6, vocab, size=length)]


def padded(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((len(seqs), REF_LEN), np.int32)
    mask = np.zeros((len(seqs), REF_LEN), bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = True
    return ids, mask


def check_logprobs(graphdef, params, prompt, responses, temperature, tol=1e-4):
    """Each response's log-probs equal per_token_logprobs on prompt + output."""
    seqs = [np.concatenate([prompt, r.output_ids]) for r in responses]
    ids, mask = padded(seqs)
    ref, _ = per_token_logprobs_jit(graphdef, params, ids, mask, jnp.float32(temperature))
    ref = np.asarray(ref)
    for b, r in enumerate(responses):
        got = ref[b, len(prompt) : len(prompt) + len(r.output_ids)]
        np.testing.assert_allclose(r.logprobs, got, atol=tol, rtol=0)


def perturbed(params, scale: float, seed: int):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def slow_decode(engine, seconds: float):
    """Make each decode chunk take at least ``seconds`` (an instance-level patch)."""
    original = engine.scheduler._decode

    def decode():
        time.sleep(seconds)
        original()

    engine.scheduler._decode = decode
    return original


# --------------------------------------------------------------------------- correctness


def test_logprobs_match_per_token_logprobs_and_stops(engine, tiny_split):
    lm, graphdef, params = tiny_split
    prompt = prompt_of(0, 11)
    request = GenerationRequest(prompt_ids=prompt, n=4, temperature=0.7, max_new_tokens=40, sample_id=3)
    responses = engine.generate(request)
    assert len(responses) == 4
    eos = set(lm.stop_token_ids)
    for r in responses:
        assert r.output_ids.dtype == np.int32 and r.logprobs.dtype == np.float32 and r.versions.dtype == np.int32
        assert len(r.output_ids) == len(r.logprobs) == len(r.versions) >= 1
        assert np.all(r.versions == 0) and np.all(r.logprobs <= 0)
        if r.stop_reason == "eos":
            assert r.output_ids[-1] in eos and not eos & set(r.output_ids[:-1].tolist())
        else:
            assert r.stop_reason == "length" and len(r.output_ids) == 40
    assert len({tuple(r.output_ids) for r in responses}) > 1, "the n samples must differ"
    check_logprobs(graphdef, params, prompt, responses, 0.7)
    # Greedy: log-probs at temperature 1.
    greedy = engine.generate(GenerationRequest(prompt_ids=prompt, greedy=True, max_new_tokens=20, stop_token_ids=[]))
    check_logprobs(graphdef, params, prompt, greedy, 1.0)


def test_decode_tokens_counts_the_tokens_a_stop_sequence_leaves(engine):
    """A stop sequence is found on the host after a chunk (4 steps here): the tokens the device
    decoded after it are not the request's, and ``engine/decode_tokens`` does not count them, so
    the counter does not depend on where chunks happen to end."""
    prompt = prompt_of(5, 9)
    free = engine.generate(GenerationRequest(prompt_ids=prompt, greedy=True, max_new_tokens=12, stop_token_ids=[]))[0]
    stop = [int(t) for t in free.output_ids[4:6]]  # the sample ends where this pair first occurs, inside a chunk
    before = engine.metrics()["engine/decode_tokens"]
    [cut] = engine.generate(GenerationRequest(prompt_ids=prompt, greedy=True, max_new_tokens=12, stop_token_ids=[],
                                              stop_sequences=[stop]))
    assert cut.stop_reason == "stop" and len(cut.output_ids) < 8
    assert engine.metrics()["engine/decode_tokens"] - before == len(cut.output_ids) == cut.usage.decode_tokens


def test_seeded_request_identical_alone_and_among_31_concurrent(engine, tiny_split):
    _, graphdef, params = tiny_split
    target = GenerationRequest(prompt_ids=prompt_of(1, 9), n=2, temperature=1.0, max_new_tokens=30, sample_id=77, index_in_group=2, turn=1)
    alone = engine.generate(target)
    others = [
        GenerationRequest(
            prompt_ids=prompt_of(100 + i, 2 + (7 * i) % 30), n=1 + i % 3, temperature=0.5 + 0.1 * (i % 5),
            top_k=5 if i % 4 == 0 else 0, top_p=0.8 if i % 6 == 1 else 1.0, greedy=i % 7 == 3,
            max_new_tokens=8 + (11 * i) % 50, sample_id=i,
        )
        for i in range(31)
    ]
    requests = others[:15] + [target] + others[15:]
    barrier = threading.Barrier(len(requests))

    def call(req):
        barrier.wait(timeout=30)
        return engine.generate(req)

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(call, requests, timeout=90))
    among = results[15]
    for a, b in zip(alone, among):
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
        assert a.stop_reason == b.stop_reason
    # Same key, different turn: different draws.
    other_turn = engine.generate(GenerationRequest(**{**target.__dict__, "turn": 2}))
    assert any(not np.array_equal(a.output_ids, b.output_ids) for a, b in zip(alone, other_turn))


def test_32_threads_complete_and_correct(engine, tiny_split):
    _, graphdef, params = tiny_split
    requests = [
        GenerationRequest(prompt_ids=prompt_of(200 + i, 1 + (5 * i) % 33), temperature=0.9, max_new_tokens=5 + (13 * i) % 60,
                          min_new_tokens=(i % 3), sample_id=1000 + i)
        for i in range(32)
    ]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(engine.generate, requests, timeout=90))
    seqs, responses = [], []
    for req, (r,) in zip(requests, results):
        assert 1 <= len(r.output_ids) <= req.max_new_tokens
        assert r.stop_reason in ("eos", "length")
        assert r.stop_reason != "length" or len(r.output_ids) == req.max_new_tokens
        assert len(r.output_ids) > req.min_new_tokens or r.stop_reason == "length"
        seqs.append(np.concatenate([req.prompt_ids, r.output_ids]))
        responses.append(r)
    ids, mask = padded(seqs)
    ref = np.asarray(per_token_logprobs_jit(graphdef, params, ids, mask, jnp.float32(0.9))[0])
    for b, (req, r) in enumerate(zip(requests, responses)):
        p = len(req.prompt_ids)
        np.testing.assert_allclose(r.logprobs, ref[b, p : p + len(r.output_ids)], atol=1e-4, rtol=0)
    m = engine.metrics()
    assert m["engine/decode_tokens"] > 0 and 0 < m["engine/slot_occupancy"] <= 1 and m["engine/compiles"] >= 2
    # Waits are measured from each request's own admission (32 clients arrive while earlier
    # prompts are being prefilled; timing from the admission pass's start read negative).
    assert 0 <= m["engine/queue_wait_s"] <= m["engine/queue_wait_max_s"]


def test_stop_ids_min_new_tokens_and_stop_sequences(engine):
    prompt = prompt_of(2, 6)
    base = dict(prompt_ids=prompt, greedy=True, max_new_tokens=24)
    (free,) = engine.generate(GenerationRequest(**base, stop_token_ids=[]))
    assert free.stop_reason == "length" and len(free.output_ids) == 24
    out = free.output_ids.tolist()
    (eos,) = engine.generate(GenerationRequest(**base, stop_token_ids=[out[0]]))
    assert eos.output_ids.tolist() == out[:1] and eos.stop_reason == "eos"
    (late,) = engine.generate(GenerationRequest(**base, stop_token_ids=[out[0]], min_new_tokens=3))
    got = late.output_ids.tolist()
    assert out[0] not in got[:3], "stop ids must not be drawn before min_new_tokens"
    if late.stop_reason == "eos":
        assert got[-1] == out[0] and len(got) >= 4
    (seq,) = engine.generate(GenerationRequest(**base, stop_token_ids=[], stop_sequences=[out[2:4]]))
    first = next(i for i in range(1, 24) if out[i - 1 : i + 1] == out[2:4])
    assert seq.output_ids.tolist() == out[: first + 1] and seq.stop_reason == "stop"


def test_compile_count_constant_on_second_pass(engine):
    def workload():
        reqs = [
            GenerationRequest(prompt_ids=prompt_of(300 + i, 1 + (9 * i) % 33), n=1 + i % 2, max_new_tokens=4 + (7 * i) % 30,
                              top_k=3 if i % 5 == 0 else 0, greedy=i % 4 == 1, sample_id=i)
            for i in range(12)
        ]
        for f in [engine.submit(r) for r in reqs]:
            assert len(f.result(timeout=90)) >= 1

    before = compile_count()
    workload()
    after_first = compile_count()
    workload()
    assert compile_count() == after_first
    # Bounded by configuration: one prefill per bucket and two decode variants.
    assert after_first - before <= len(CFG.prefill_buckets) + 2
    assert engine.metrics()["engine/compiles"] == after_first


def test_requests_admitted_together_are_prefilled_together(tiny_split):
    """Requests waiting at one chunk boundary are prefilled two prompts of one bucket per call,
    and each draws exactly the tokens and log-probs (bitwise) it draws when prefilled alone
    (prefix reuse off: with it the second round would copy the first round's kept prompts)."""
    lm, graphdef, params = tiny_split
    cfg = CFG.model_copy(update={"prefix_cache": CFG.prefix_cache.model_copy(update={"enabled": False})})
    engine = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=cfg, seed=1)
    requests = [
        GenerationRequest(prompt_ids=prompt_of(400 + i, 3 + 4 * i), n=1 + i % 2, temperature=1.0, max_new_tokens=12,
                          stop_token_ids=[], sample_id=500 + i, index_in_group=i)
        for i in range(5)
    ]  # contexts 2, 6 (bucket 8) and 10, 14, 18 (bucket 32); 7 samples in all
    alone = [engine.generate(r) for r in requests]
    calls = engine.prefill_calls
    with engine.scheduler.cond:  # the scheduler cannot take any of them before all five wait
        futures = [engine.submit(r) for r in requests]
    together = [f.result(timeout=60) for f in futures]
    assert engine.prefill_rows == 2 and engine.prefill_calls - calls == 3  # [2, 6] and [10, 14], [18]
    for a_samples, b_samples in zip(alone, together):
        for a, b in zip(a_samples, b_samples):
            np.testing.assert_array_equal(a.output_ids, b.output_ids)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
    engine.shutdown()


# --------------------------------------------------------------------------- weights


def test_update_weights_at_chunk_boundary_and_not_stale(tiny_split):
    lm, graphdef, params = tiny_split
    new_params = perturbed(params, 0.3, seed=6)  # changes the greedy output (checked below)
    eng = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=CFG, seed=1, version=3)
    try:
        assert eng.version == 3
        with pytest.raises(ValueError, match="version must be 4"):
            eng.update_weights(new_params, 5)
        slow_decode(eng, 0.03)
        prompt = prompt_of(3, 10)
        temperature = 0.8
        future = eng.submit(GenerationRequest(prompt_ids=prompt, temperature=temperature, max_new_tokens=60, stop_token_ids=[], sample_id=9))
        deadline = time.monotonic() + 30
        while eng.metrics()["engine/decode_tokens"] < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        eng.update_weights(new_params, 4)
        assert eng.version == 4
        (r,) = future.result(timeout=60)
        switch = int(np.argmax(r.versions == 4))
        assert set(r.versions[:switch].tolist()) == {3} and set(r.versions[switch:].tolist()) == {4}
        assert 0 < switch < len(r.versions) and switch % CFG.decode_chunk == 0, r.versions

        # Before the swap: the old weights' log-probs.
        p, n = len(prompt), len(r.output_ids)
        seq = np.concatenate([prompt, r.output_ids]).astype(np.int32)
        ids, mask = padded([seq])
        old_lp = np.asarray(per_token_logprobs_jit(graphdef, params, ids, mask, jnp.float32(temperature))[0])[0]
        np.testing.assert_allclose(r.logprobs[:switch], old_lp[p : p + switch], atol=1e-4, rtol=0)
        # After: new weights on top of the old weights' KV of the prefix. The KV of
        # tokens < p + switch - 1 was written before the swap; token p + switch - 1 is the
        # first one fed to the new weights.
        prefix = p + switch - 1
        cache = init_kv_cache(lm.model.cfg, batch=1, capacity=2 * REF_LEN)
        pre_mask = np.zeros((1, REF_LEN), bool)
        pre_mask[0, :prefix] = True
        _, cache = forward_jit(graphdef, params, ids, None, pre_mask, cache)
        rest = np.zeros((1, REF_LEN), np.int32)
        rest[0, : p + n - 1 - prefix] = seq[prefix : p + n - 1]
        rest_mask = np.zeros((1, REF_LEN), bool)
        rest_mask[0, : p + n - 1 - prefix] = True
        logits, _ = forward_jit(graphdef, new_params, rest, None, rest_mask, cache)
        logits = np.asarray(logits, np.float64)[0, : n - switch] / temperature
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        ref = logits[np.arange(n - switch), r.output_ids[switch:]] - logz
        # float32 log-probs of magnitude ~10 summed in another order (one token at a time vs the whole
        # rest at once) differ by a few ulp; the old weights' log-probs would be off by far more.
        np.testing.assert_allclose(r.logprobs[switch:], ref, atol=1e-4, rtol=0)

        # A greedy request after update_weights returned is the new weights' greedy output.
        (g,) = eng.generate(GenerationRequest(prompt_ids=prompt, greedy=True, max_new_tokens=30, stop_token_ids=[]))
        assert np.all(g.versions == 4)
        seq = np.concatenate([prompt, g.output_ids]).astype(np.int32)
        ids, mask = padded([seq])
        steps = np.arange(p - 1, p - 1 + len(g.output_ids))
        new_logits = np.asarray(forward_jit(graphdef, new_params, ids, None, mask)[0])[0, steps]
        old_logits = np.asarray(forward_jit(graphdef, params, ids, None, mask)[0])[0, steps]
        top2 = np.sort(new_logits, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-4
        upto = int(np.argmin(clear)) if not clear.all() else len(clear)
        assert upto >= 5
        np.testing.assert_array_equal(g.output_ids[:upto], new_logits.argmax(-1)[:upto])
        assert not np.array_equal(old_logits.argmax(-1), g.output_ids), "the old weights would give the same output"
        m = eng.metrics()
        assert m["engine/swaps"] == 1 and m["engine/swap_latency_s"] > 0
    finally:
        eng.shutdown()


def test_update_weights_when_idle_and_bad_params(tiny_split):
    lm, graphdef, params = tiny_split
    eng = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=CFG)
    try:
        t0 = time.monotonic()
        eng.update_weights(perturbed(params, 0.01, seed=1), 1)
        assert eng.version == 1 and time.monotonic() - t0 < 5
        bad = jax.tree.map(lambda x: x, params)
        bad["norm"]["weight"] = jnp.ones((3,))
        with pytest.raises(ValueError, match="shape or dtype"):
            eng.update_weights(bad, 2)
        with pytest.raises(ValueError, match="structure"):
            eng.update_weights({"x": jnp.ones(2)}, 2)
        assert eng.version == 1
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------- errors and lifecycle


def test_bad_requests_raise_on_caller_thread(engine):
    cases = [
        (GenerationRequest(prompt_ids=[7] * 40, max_new_tokens=60), "kv_capacity"),
        (GenerationRequest(prompt_ids=[7] * 3, top_p=0.0), "top_p"),
        (GenerationRequest(prompt_ids=[7] * 3, top_p=1.5), "top_p"),
        (GenerationRequest(prompt_ids=[7] * 3, top_k=-1), "top_k"),
        (GenerationRequest(prompt_ids=[7] * 3, n=17), "engine.slots"),
        (GenerationRequest(prompt_ids=[7, 999]), "prompt_ids"),
        (GenerationRequest(prompt_ids=[7], stop_token_ids=list(range(9))), "max_stop_ids"),
        (GenerationRequest(prompt_ids=[7], stop_token_ids=[500]), "stop_token_ids"),
        (GenerationRequest(prompt_ids=[7], temperature=float("inf")), "temperature"),
    ]
    for request, field in cases:
        with pytest.raises(EngineRequestError, match=field):
            engine.submit(request)
    with pytest.raises(ValueError, match="temperature"):
        GenerationRequest(prompt_ids=[7], temperature=0.0)


def test_timeout_aborts_with_partial_output(tiny_split):
    lm, graphdef, params = tiny_split
    eng = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=CFG)
    try:
        slow_decode(eng, 0.05)
        (r,) = eng.generate(GenerationRequest(prompt_ids=[7, 8, 9], max_new_tokens=60, stop_token_ids=[], timeout_s=0.3))
        assert r.stop_reason == "aborted" and 0 < len(r.output_ids) < 60
        assert len(r.logprobs) == len(r.versions) == len(r.output_ids)
        assert eng.metrics()["engine/samples_aborted"] == 1
    finally:
        eng.shutdown()


def test_crash_reaches_every_caller(tiny_split):
    lm, graphdef, params = tiny_split
    eng = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=CFG)
    try:
        def boom():
            raise RuntimeError("scripted device failure")

        eng.scheduler._decode = boom
        futures = [eng.submit(GenerationRequest(prompt_ids=[7, 8], sample_id=i)) for i in range(3)]
        for f in futures:
            with pytest.raises(EngineCrashed, match="scripted device failure"):
                f.result(timeout=30)
        assert "scripted device failure" in eng.crashed
        with pytest.raises(EngineCrashed):
            eng.generate(GenerationRequest(prompt_ids=[7]))
        with pytest.raises(EngineCrashed):
            eng.update_weights(params, 1)
    finally:
        eng.shutdown()


def test_shutdown_fails_pending_and_joins(tiny_split):
    lm, graphdef, params = tiny_split
    eng = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=CFG)
    slow_decode(eng, 0.05)
    futures = [eng.submit(GenerationRequest(prompt_ids=[7, 8], n=8, max_new_tokens=60, stop_token_ids=[], sample_id=i)) for i in range(4)]
    time.sleep(0.2)
    eng.shutdown()
    assert not eng._thread.is_alive()
    for f in futures:
        with pytest.raises(EngineClosed):
            f.result(timeout=5)
    with pytest.raises(EngineClosed):
        eng.submit(GenerationRequest(prompt_ids=[7]))


def test_registered_as_jax_engine():
    from asyncrl.registry import resolve

    assert resolve("engine", "jax") is JaxEngine


# --------------------------------------------------------------------------- sampling math


def test_top_k_top_p_mask_matches_sorted_reference():
    from asyncrl.engine.jax_programs import _top_k_top_p

    rng = np.random.default_rng(0)
    scaled = rng.normal(size=(6, 50)).astype(np.float32) * 2
    scaled[5, 10:20] = -np.inf  # masked stop ids
    top_k = np.array([0, 3, 0, 7, 1, 4], np.int32)
    top_p = np.array([1.0, 1.0, 0.5, 0.8, 0.3, 0.95], np.float32)
    got = np.asarray(_top_k_top_p(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(top_p)))
    for b in range(6):
        row = scaled[b].astype(np.float64)
        order = np.argsort(-row, kind="stable")
        keep = np.ones(50, bool)
        if top_k[b] > 0:
            keep[order[top_k[b]:]] = False
        if top_p[b] < 1:
            kept = np.where(keep, row, -np.inf)
            probs = np.exp(kept - kept.max())
            probs /= probs.sum()
            mass_before = np.cumsum(probs[order]) - probs[order]
            keep[order[mass_before >= top_p[b]]] = False
        np.testing.assert_array_equal(np.isfinite(got[b]), keep & np.isfinite(row), err_msg=f"row {b}")
        np.testing.assert_array_equal(got[b][keep & np.isfinite(row)], scaled[b][keep & np.isfinite(row)])


def test_inverse_cdf_sampler_frequencies():
    from asyncrl.engine.jax_programs import _sample

    logits = jnp.log(jnp.array([0.5, 0.3, 0.0, 0.15, 0.05], jnp.float32))
    keys = jax.random.split(jax.random.PRNGKey(0), 40000)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: _sample(k[None], logits[None])[0]))(keys))
    freq = np.bincount(draws, minlength=5) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.0, 0.15, 0.05], atol=0.01)
    assert freq[2] == 0


def test_inverse_cdf_sampler_across_blocks():
    """The two-level inverse CDF (blocks of 128 tokens, a padded last block, blocks without
    mass) draws each token with its probability and never a zero-probability one."""
    from asyncrl.engine.jax_programs import _sample

    probs = np.zeros(300, np.float32)
    probs[[5, 127, 128, 200, 299]] = [0.2, 0.1, 0.3, 0.15, 0.25]
    with np.errstate(divide="ignore"):
        logits = jnp.asarray(np.log(probs))
    keys = jax.random.split(jax.random.PRNGKey(1), 40000)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: _sample(k[None], logits[None])[0]))(keys))
    freq = np.bincount(draws, minlength=300) / len(draws)
    np.testing.assert_allclose(freq, probs, atol=0.01)
    assert set(np.flatnonzero(freq)) <= {5, 127, 128, 200, 299}


def test_decode_chunk_ends_early_when_a_finished_slot_can_be_refilled(tiny_split):
    """A slot that finishes inside a chunk ends it once ``refill_free`` slots are free (so the
    scheduler refills it at once); with ``refill_free`` above the slot count the chunk runs on."""
    from asyncrl.engine.jax_programs import decode_chunk_jit, idle_controls, init_pool

    lm, graphdef, params = tiny_split
    controls = idle_controls(2, 8, pages_per_seq=2, pool_pages=4)
    controls.active[:] = True
    controls.max_new_tokens[:] = [3, 20]
    controls.last_token[:] = [7, 9]
    controls.page_table[:] = [[0, 1], [2, 3]]
    emitted = {}
    for refill_free in (1, 2, 3):
        controls.refill_free[...] = refill_free
        pool = init_pool(lm.model.cfg, 4, 16)
        _, _, _, out = decode_chunk_jit(graphdef, params, pool, controls, None, np.zeros(2, np.uint32), 8, False, None)
        emitted[refill_free] = np.asarray(out).sum(axis=1).tolist()
    assert emitted[1] == [3, 3]  # slot 0 ended at step 3 and one free slot is enough to refill
    assert emitted[2] == [3, 8]  # two free slots needed: slot 1 is still running
    assert emitted[3] == [3, 8]


def test_engine_config_cross_field_checks():
    from asyncrl.config import load_config
    from asyncrl.errors import ConfigError

    assert load_config().engine.kv_capacity >= 256 + 32
    with pytest.raises(ConfigError, match="engine.kv_capacity"):
        load_config(overrides=["engine.kv_capacity=100", "engine.prefill_buckets=[16]"])
    with pytest.raises(ConfigError, match="engine.slots"):
        load_config(overrides=["engine.slots=2", "rollout.group_size=4"])
    with pytest.raises(ConfigError, match="engine.prefill_buckets"):
        load_config(overrides=["engine.prefill_buckets=[16, 1024]"])
    # prompts longer than the largest bucket are prefilled in chunks of it
    assert load_config(overrides=["data.max_prompt_tokens=300", "engine.prefill_buckets=[16, 128]"])
    with pytest.raises(ConfigError, match="engine.page_size: 24 does not divide engine.kv_capacity"):
        load_config(overrides=["engine.page_size=24"])
    with pytest.raises(ConfigError, match="engine.kv_pages: 8 pages of 16 tokens hold less than one sequence"):
        load_config(overrides=["engine.page_size=16", "engine.kv_pages=8"])
