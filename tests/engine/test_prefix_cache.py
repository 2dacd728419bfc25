"""Prefix reuse (engine.prefix_cache) over the paged KV cache: the prefix tree's rules (pages
matched token for token, a partial page copied on write, least recently used eviction of what
nobody runs on, publishes and flushes), the manager's sharing of a group's prompt pages, and the
engine's results with reuse against the same engine without it: greedy tokens exactly, sampled
tokens exactly for the same keys, log-probs within 1e-5 (float32); whole contexts shared bit for
bit; nothing reused across a publish unless asked, and then with the oldest version on the tokens;
an agent's history kept while another episode runs; memory flat over many publishes."""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

from asyncrl.config import EngineConfig
from asyncrl.engine.jax_engine import JaxEngine
from asyncrl.engine.kv_cache_manager import KVCacheManager
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.engine.radix_tree import PrefixTree

pytestmark = pytest.mark.timeout(180)


# ----------------------------------------------------------------------------- the tree (pure)


def kept_sequence(tree: PrefixTree, tokens: list[int], version: int = 0, first_page: int = 0) -> list:
    """The nodes of a sequence of ``tokens`` written into pages ``first_page, first_page + 1, ...``,
    then released (kept)."""
    nodes, parent = [], tree.root
    for i, start in enumerate(range(0, len(tokens), tree.page_size)):
        part = tokens[start : start + tree.page_size]
        node = tree.add(parent, part, [version] * len(part), first_page + i)
        tree.reference(node)
        nodes.append(node)
        parent = node
    for node in reversed(nodes):
        assert tree.release(node) is None  # kept in the tree
    return nodes


def test_match_is_page_exact_then_a_partial_page_to_copy():
    tree = PrefixTree(page_size=4)
    a = kept_sequence(tree, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # pages [1-4], [5-8], [9, 10]
    found = tree.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 0)
    assert found.nodes == a[:2] and found.partial is a[2] and found.extra == 2 and found.length(4) == 10
    found = tree.match([1, 2, 3, 4, 5, 6, 0, 0], 0)  # diverges inside the second page: its first 2 tokens, copied
    assert found.nodes == a[:1] and found.partial is a[1] and found.extra == 2
    assert tree.match([9, 9, 9], 0).length(4) == 0
    assert tree.kept == 3 and all(node.refs == 0 for node in a)
    duplicate = tree.add(tree.root, [1, 2, 3, 4], [0] * 4, 7)  # the same page computed again: its sequence's own
    tree.reference(duplicate)
    assert not duplicate.attached and tree.release(duplicate) == 7  # freed with its last reference
    assert tree.kept == 3


def test_the_manager_reuses_a_whole_page_or_a_whole_context_only():
    manager = KVCacheManager(page_size=4, pages_per_replica=16, capacity=32)
    kept_sequence(manager.trees[0], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert manager.match(0, [1, 2, 9, 9, 9, 9, 9, 9], 0).length(4) == 0  # 2 tokens: under a page
    assert manager.match(0, [1, 2], 0).length(4) == 2  # the whole context: worth a page copy
    assert manager.match(0, [1, 2, 3, 4, 5, 9], 0).length(4) == 5  # a page, then a copy of the next one's first token


def test_unreferenced_leaves_are_evicted_least_recently_used_first():
    tree = PrefixTree(page_size=2)
    old = kept_sequence(tree, [1, 1, 2, 2], first_page=0)
    new = kept_sequence(tree, [3, 3, 4, 4], first_page=2)
    tree.match([1, 1, 2, 2, 5], 0)  # the older sequence is used again: now the most recent
    assert tree.evict(1) == [3]  # the other's last page goes first
    for node in old:  # a running sequence continues the older one: its pages are not evictable
        tree.reference(node)
    assert tree.evict(10) == [2]  # the other's first page, a leaf now
    for node in reversed(old):
        tree.release(node)
    assert tree.evict(10) == [1, 0] and tree.kept == 0 and not tree.root.children
    assert not new[0].attached


def test_a_publish_detaches_everything_and_a_flush_frees_what_nobody_runs_on():
    tree = PrefixTree(page_size=2)
    kept = kept_sequence(tree, [1, 1, 2, 2], first_page=0)
    running = tree.add(tree.root, [3, 3], [0, 0], 2)
    tree.reference(running)
    assert sorted(tree.flush()) == [0, 1] and running.attached  # a running sequence keeps its pages, matchable
    assert tree.match([3, 3, 7], 0).nodes == [running]
    assert tree.detach_all() == [] and not running.attached  # referenced: freed with its last reference
    assert tree.release(running) == 2 and tree.match([3, 3, 7], 0).length(2) == 0
    assert not kept[0].attached


def test_a_group_holds_its_prompt_pages_once():
    """16 samples of a 1,024-token prompt: the prompt's 64 pages once (page-aligned: nothing to
    copy), then each sample's own pages as it grows; a prompt ending inside a page adds one copy
    of that page per sample but the first."""
    manager = KVCacheManager(page_size=16, pages_per_replica=200, capacity=2048)
    prompt = np.arange(1024) % 97
    found = manager.match(0, prompt, 0)
    part = manager.place(0, prompt, found, 16, 0, 256)
    assert 200 - len(manager.free[0]) == 64 and len(part.chunks) == 4 and not part.copies
    assert all(kv.pages == part.kvs[0].pages for kv in part.kvs)
    for kv in part.kvs:
        assert manager.grow(kv, 1024 + 40)  # 40 new tokens: 3 pages of its own each
    assert 200 - len(manager.free[0]) == 64 + 16 * 3
    manager.settle()  # the prefills were dispatched
    used = 200 - len(manager.free[0])
    ragged = manager.place(0, prompt[:1000], manager.match(0, prompt[:1000], 0), 4, 0, 256)
    # 62 whole pages shared, the 63rd's first 8 tokens copied for each sample: the whole context, no prefill
    assert ragged.reused == 1000 and len(ragged.copies) == 4 and not ragged.chunks
    assert 200 - len(manager.free[0]) == used + 4


# ----------------------------------------------------------------------------- the engine


ENGINE = dict(slots=8, kv_capacity=160, decode_chunk=4, prefill_buckets=[16, 64, 128])


def make_engine(tiny_split, reuse: bool, **prefix) -> JaxEngine:
    _, graphdef, params = tiny_split
    cfg = EngineConfig.model_validate({**ENGINE, "prefix_cache": {"enabled": reuse, **prefix}})
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
    cfgs = [EngineConfig(**ENGINE, attention_buckets=3, prefix_cache={"enabled": on}) for on in (True, False)]
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
    """Kept pages fill most of a pool of one longest context; a request that needs them all still
    starts (the least recently used are evicted)."""
    _, graphdef, params = tiny_split
    engine = JaxEngine(graphdef, params, config=EngineConfig(**{**ENGINE, "slots": 4, "kv_pages": 10}), seed=1)
    try:
        for i in range(4):
            engine.generate(request([6 + i] * 20, True, sample_id=i))
        assert engine.cache.trees[0].kept == 8 and engine.metrics()["engine/kv_pages_kept"] == 0.8
        out = engine.generate(request([20] * 30, True, sample_id=9, n=4))
        assert [len(r.output_ids) for r in out] == [10] * 4 and engine.metrics()["engine/preemptions"] == 0
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
