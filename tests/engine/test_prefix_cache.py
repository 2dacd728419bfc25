"""Prefix reuse (engine.prefix_cache): the store's rules, and the engine's results with reuse
against the same engine without it: greedy tokens exactly, sampled tokens exactly for the same
keys, log-probs within 1e-5 (float32); whole contexts copied bit for bit; nothing reused across a
publish unless asked, and then with the oldest version on the tokens; eviction never holding a
request back; memory flat over many publishes."""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

from asyncrl.config import EngineConfig
from asyncrl.engine.jax_engine import JaxEngine
from asyncrl.engine.prefix_cache import KEPT, RUNNING, AdmissionRound, PrefixStore
from asyncrl.engine.protocol import GenerationRequest

pytestmark = pytest.mark.timeout(180)


# ----------------------------------------------------------------------------- the store (pure)


def store_with(contexts: dict[int, list[int]], slots: int = 4, version: int = 0, **kwargs) -> PrefixStore:
    store = PrefixStore(slots, 32, min_tokens=kwargs.pop("min_tokens", 3), **kwargs)
    for slot, tokens in contexts.items():
        store.start(slot, np.asarray(tokens, np.int32), version)
        store.keep(slot)
    return store


def test_match_is_token_exact_versioned_and_worth_it():
    store = store_with({0: [5, 6, 7, 8, 9], 1: [5, 6, 1]})
    m = store.match(np.array([5, 6, 7, 8, 2]), 0)
    assert (m.slot, m.length) == (0, 4)
    assert store.match(np.array([5, 6]), 0).length == 2  # a whole context is reused, however short
    assert store.match(np.array([5, 6, 2, 2, 2]), 0) is None  # 2 shared positions: under min_tokens = 3
    assert store.match(np.array([5, 6, 7, 8, 2]), 1) is None  # computed with version 0, served version 1
    across = store_with({0: [5, 6, 7, 8, 9]}, across_versions=True)
    assert across.match(np.array([5, 6, 7, 8, 2]), 3).length == 4 and across.version_floor(0, 4) == 0
    assert store.match(np.array([5, 6, 7, 8, 2]), 0, exclude=[0]) is None


def test_fed_tokens_extend_what_a_running_slot_holds():
    store = PrefixStore(2, 16, min_tokens=1)
    store.start(0, np.array([1, 2, 3], np.int32), 0)
    store.fed(0, [4, 5], 1)  # two decode steps at version 1
    assert store.lengths[0] == 5 and store.state[0] == RUNNING
    assert store.match(np.array([1, 2, 3, 4, 5, 6]), 1) is None  # positions 0-2 are of version 0
    assert store.match(np.array([1, 2, 3, 4, 5, 6]), 0).length == 3
    store.keep(0)
    assert store.state[0] == KEPT


def test_destinations_take_empty_slots_then_the_least_recently_used():
    store = store_with({0: [1, 1, 1], 2: [2, 2, 2]})
    store.keep(0)  # 0 used after 2
    assert store.destinations(4, [0, 1, 2, 3], protected=set()) == [1, 3, 2, 0]
    assert store.destinations(4, [0, 1, 2, 3], protected={2}) == [1, 3, 0]


def test_a_round_shares_a_fresh_prompt_and_never_overwrites_its_sources():
    store = store_with({0: [9, 9, 9, 9, 9]}, slots=3)
    round_ = AdmissionRound(store, [0, 1, 2], version=0)
    group = np.array([1, 2, 3, 4], np.int32)
    leader = round_.take(group, 1)
    assert leader.fresh and leader.slots == (1,)  # empty slots first: slot 0 keeps its prefix
    follower = round_.take(group, 1)
    assert (follower.source, follower.length) == (1, 4) and follower.slots == (2,)  # copies the leader's whole context
    assert round_.take(np.array([9, 9, 9, 9, 9, 7], np.int32), 1) is not None  # slot 0, in place
    assert round_.take(group, 1) is None  # no slot left: waits for the next round
    # A source of the round is never a destination: the request waits rather than overwrite it.
    store = store_with({0: [9, 9, 9, 9, 9]}, slots=2)
    round_ = AdmissionRound(store, [0, 1], version=0)
    taken = round_.take(np.array([9, 9, 9, 9, 8], np.int32), 1)
    assert taken.slots == (0,) and taken.source == 0  # in place
    assert round_.take(np.array([9, 9, 9, 9, 7], np.int32), 2) is None


# ----------------------------------------------------------------------------- the engine


ENGINE = dict(slots=8, kv_capacity=160, decode_chunk=4, prefill_buckets=[16, 64, 128])


def make_engine(tiny_split, reuse: bool, **prefix) -> JaxEngine:
    _, graphdef, params = tiny_split
    cfg = EngineConfig.model_validate({**ENGINE, "prefix_cache": {"enabled": reuse, "min_tokens": 8, **prefix}})
    return JaxEngine(graphdef, params, config=cfg, seed=1)


PROMPT = [int(t) for t in np.random.default_rng(0).integers(6, 28, size=40)]


def request(prompt, greedy: bool, sample_id: int = 1, turn: int = 0, index: int = 0, n: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, greedy=greedy, temperature=1.0, max_new_tokens=10, stop_token_ids=[],
                             sample_id=sample_id, turn=turn, index_in_group=index, n=n)


def episode(engine: JaxEngine, greedy: bool) -> list:
    """A multi-turn episode (each turn's prompt extends the last one's with its output and a tool
    result), then a group of four n = 1 requests and one n = 3 request on the last prompt."""
    first = engine.generate(request(PROMPT, greedy))[0]
    second_prompt = PROMPT + first.output_ids.tolist() + [7, 8, 9, 10, 11]
    second = engine.generate(request(second_prompt, greedy, turn=1))[0]
    third_prompt = second_prompt + second.output_ids.tolist() + [12, 13]
    group = [engine.submit(request(third_prompt, greedy, sample_id=2, index=i)) for i in range(4)]
    many = engine.submit(request(third_prompt, greedy, sample_id=3, n=3))
    return [first, second, *(f.result()[0] for f in group), *many.result()]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_reuse_gives_a_fresh_prefill_results(tiny_split, greedy):
    with_reuse, without = make_engine(tiny_split, True), make_engine(tiny_split, False)
    try:
        got, want = episode(with_reuse, greedy), episode(without, greedy)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.output_ids, b.output_ids)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        used, fresh = with_reuse.metrics(), without.metrics()
        assert fresh["engine/prefix_hit_tokens"] == 0
        # Each turn prefills only what it adds; the group and the n = 3 request copy the third prompt.
        assert used["engine/prefill_tokens"] < fresh["engine/prefill_tokens"] / 4
        computed = used["engine/prefill_tokens"] + used["engine/prefix_hit_tokens"]
        assert computed == fresh["engine/prefill_tokens"]  # every prompt token is either computed or reused
        assert used["engine/prefix_hit_rate"] == pytest.approx(used["engine/prefix_hit_tokens"] / computed)
        usage = got[-1].usage
        assert usage.prefix_hit_tokens == len(PROMPT) + 10 + 5 + 10 + 2 - 1 and usage.prefill_tokens == 0
    finally:
        with_reuse.shutdown()
        without.shutdown()


def test_a_whole_context_is_copied_bit_for_bit(tiny_split):
    """A group's requests on one prompt: one prefill, copied; the bits of four separate prefills."""
    with_reuse, without = make_engine(tiny_split, True), make_engine(tiny_split, False)
    try:
        def group(engine):
            futures = [engine.submit(request(PROMPT, False, sample_id=5, index=i)) for i in range(4)]
            return [f.result()[0] for f in futures]

        for a, b in zip(group(with_reuse), group(without)):
            np.testing.assert_array_equal(a.output_ids, b.output_ids)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert with_reuse.metrics()["engine/prefill_tokens"] == len(PROMPT) - 1
    finally:
        with_reuse.shutdown()
        without.shutdown()


def test_a_publish_makes_kept_prefixes_stale_unless_asked(tiny_split):
    _, _, params = tiny_split
    shifted = jax.tree.map(lambda x: x * 1.01, params)
    for across in (False, True):
        engine = make_engine(tiny_split, True, across_versions=across)
        try:
            engine.generate(request(PROMPT, True))
            engine.update_weights(shifted, 1)
            hit = engine.metrics()["engine/prefix_hit_tokens"]
            (again,) = engine.generate(request(PROMPT, True, turn=1))
            reused = engine.metrics()["engine/prefix_hit_tokens"] - hit
            if across:  # reused, and its tokens carry the version of the KV they attended to
                assert reused == len(PROMPT) - 1 and set(again.versions.tolist()) == {0}
            else:
                assert reused == 0 and set(again.versions.tolist()) == {1}
        finally:
            engine.shutdown()


def test_attention_buckets_and_reuse(tiny_split):
    _, graphdef, params = tiny_split
    cfgs = [EngineConfig(**ENGINE, attention_buckets=3, prefix_cache={"enabled": on, "min_tokens": 8}) for on in (True, False)]
    engines = [JaxEngine(graphdef, params, config=cfg, seed=1) for cfg in cfgs]
    try:
        got, want = (episode(engine, True) for engine in engines)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.output_ids, b.output_ids)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    finally:
        for engine in engines:
            engine.shutdown()


def test_kept_prefixes_never_hold_a_request_back(tiny_split):
    """Every slot keeps a prefix; a request that needs all of them still starts (evicting them)."""
    _, graphdef, params = tiny_split
    engine = JaxEngine(graphdef, params, config=EngineConfig(**{**ENGINE, "slots": 4}), seed=1)
    try:
        for i in range(4):
            engine.generate(request([6 + i] * 20, True, sample_id=i))
        assert (engine.cache.store.state == KEPT).all()
        (out,) = engine.generate(request([20] * 30, True, sample_id=9, n=4))[:1]
        assert len(out.output_ids) == 10
    finally:
        engine.shutdown()


@pytest.mark.parametrize("publishes", [10, pytest.param(40, marks=pytest.mark.slow)])
def test_memory_is_flat_over_many_publishes(tiny_split, publishes):
    """A soak: publishes with a multi-turn episode between each; the live device arrays do not
    grow (10 in the default selection, 40 by name)."""
    _, _, params = tiny_split
    engine = make_engine(tiny_split, True)
    try:
        counts = {}
        for version in range(1, publishes + 1):
            episode(engine, version % 2 == 0)
            engine.update_weights(params, version)
            if version in (4, publishes):  # (a collection in a long test session takes a second)
                gc.collect()
                counts[version] = len(jax.live_arrays())
        assert counts[publishes] <= counts[4], counts
        assert engine.metrics()["engine/prefix_hit_tokens"] > 0
    finally:
        engine.shutdown()
