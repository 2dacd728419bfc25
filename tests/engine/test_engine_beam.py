"""Beam search in JaxEngine (docs/decoding.md): against an exhaustive search on the tiny model
where the beams can hold every prefix (small vocabulary and length, or a small trie), with a
length penalty, and the remote engine's refusal.

The reference scores every possible completion with the model's plain forward (no KV cache)
and ranks them by ``sum(log-probs) / length ** length_penalty``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from asyncrl.config import EngineConfig
from asyncrl.engine.constraints import TokenTrie
from asyncrl.engine.jax_engine import JaxEngine
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.errors import EngineRequestError
from asyncrl.model import forward_jit

pytestmark = pytest.mark.timeout(300)

VOCAB = 28  # the tiny model's
CFG = EngineConfig(slots=32, kv_capacity=32, decode_chunk=4, prefill_buckets=[8])
PROMPT = [3, 9, 14, 5]
REF_LEN = 16


@pytest.fixture(scope="module")
def engine(tiny_split):
    lm, graphdef, params = tiny_split
    eng = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=CFG, seed=0)
    yield eng
    eng.shutdown()


def sequence_logprobs(graphdef, params, prompt, completions, allowed_at=None) -> list[np.ndarray]:
    """Per completion its tokens' log-probs (T = 1; restricted to ``allowed_at(prefix)`` when given)."""
    out = []
    for first in range(0, len(completions), 256):
        part = completions[first:first + 256]
        ids = np.zeros((256, REF_LEN), np.int32)
        mask = np.zeros(ids.shape, bool)
        for b, c in enumerate(part):
            seq = list(prompt) + list(c)
            ids[b, : len(seq)], mask[b, : len(seq)] = seq, True
        logits = np.asarray(forward_jit(graphdef, params, ids, None, mask)[0], np.float64)
        for b, c in enumerate(part):
            lps = []
            for i, token in enumerate(c):
                z = logits[b, len(prompt) - 1 + i]
                allowed = np.arange(VOCAB) if allowed_at is None else allowed_at(list(c[:i]))
                sub = z[allowed]
                lps.append(z[token] - sub.max() - np.log(np.exp(sub - sub.max()).sum()))
            out.append(np.asarray(lps))
    return out


def ranked(completions, logprobs, k, length_penalty):
    scores = [lp.sum() / len(c) ** length_penalty for c, lp in zip(completions, logprobs)]
    order = np.argsort(scores)[::-1][:k]
    return [list(completions[i]) for i in order], [scores[i] for i in order], [logprobs[i] for i in order]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_free_beam_search_equals_exhaustive_search(engine, tiny_split, length_penalty):
    """k = 28 = the vocabulary, 2 new tokens: the beams hold every one-token prefix, so beam search
    ranks every possible completion (a stop token ends one after one token)."""
    lm, graphdef, params = tiny_split
    stops = set(lm.stop_token_ids)
    completions = [(a,) for a in stops] + [(a, b) for a, b in itertools.product(range(VOCAB), repeat=2) if a not in stops]
    lps = sequence_logprobs(graphdef, params, PROMPT, completions)
    k = VOCAB
    want, scores, want_lps = ranked(completions, lps, k, length_penalty)
    got = engine.generate(GenerationRequest(PROMPT, n=k, beam=True, max_new_tokens=2, length_penalty=length_penalty))
    assert len(got) == k
    assert [r.output_ids.tolist() for r in got] == want
    np.testing.assert_allclose([r.score for r in got], scores, atol=1e-4)
    for r, lp in zip(got, want_lps):
        np.testing.assert_allclose(r.logprobs, lp, atol=1e-4)
        assert r.stop_reason == ("eos" if r.output_ids[-1] in stops else "length")


@pytest.mark.slow  # beams beside samples stay in the default selection
def test_constrained_beam_search_equals_exhaustive_search(engine, tiny_split):
    """A 10-sequence trie and k = 10: every sequence comes back, ranked by its masked score."""
    _, graphdef, params = tiny_split
    rng = np.random.default_rng(7)
    sequences: list[tuple[int, ...]] = []
    while len(sequences) < 10:
        seq = tuple(int(t) for t in rng.integers(6, VOCAB, size=int(rng.integers(2, 5))))
        if all(seq[: len(s)] != s and s[: len(seq)] != seq for s in sequences):
            sequences.append(seq)
    trie = TokenTrie(sequences)
    lps = sequence_logprobs(graphdef, params, PROMPT, sequences, allowed_at=lambda prefix: trie.allowed(trie.walk(prefix)[-1]))
    for k, length_penalty in [(10, 1.0), (3, 0.5)]:
        want, scores, _ = ranked(sequences, lps, 10, length_penalty)
        got = engine.generate(GenerationRequest(PROMPT, n=k, beam=True, constraint=trie, max_new_tokens=5,
                                                length_penalty=length_penalty))
        if k == 10:  # exhaustive: every sequence, ranked, with its score
            assert [r.output_ids.tolist() for r in got] == want
            np.testing.assert_allclose([r.score for r in got], scores, atol=1e-4)
        else:  # narrower than the trie: not exhaustive, but every beam is a trie sequence, none beats the best
            assert all(trie.contains(r.output_ids.tolist()) for r in got)
            assert got[0].score <= scores[0] + 1e-4
        assert all(r.stop_reason == "stop" for r in got)


def test_beam_errors(engine):
    trie = TokenTrie([[6, 7], [8, 9]])
    with pytest.raises(EngineRequestError, match="n = 3 beams, but constraint .* has only 2 sequences"):
        engine.generate(GenerationRequest(PROMPT, n=3, beam=True, constraint=trie, max_new_tokens=3))
    with pytest.raises(ValueError, match="beam search takes no top_k"):
        GenerationRequest(PROMPT, n=2, beam=True, top_k=3)


def test_beams_and_samples_share_the_engine(engine):
    """A beam request between sampling requests: both complete; the beams are deterministic."""
    sampled = [engine.submit(GenerationRequest(PROMPT, n=4, sample_id=i, max_new_tokens=6)) for i in range(3)]
    beams = [engine.submit(GenerationRequest(PROMPT, n=4, beam=True, max_new_tokens=4)) for _ in range(2)]
    for f in sampled:
        assert len(f.result(timeout=120)) == 4
    a, b = (f.result(timeout=120) for f in beams)
    assert [r.output_ids.tolist() for r in a] == [r.output_ids.tolist() for r in b]
    assert all(x.score >= y.score for x, y in zip(a, a[1:]))


def test_remote_and_fake_engines_refuse_constraints_and_beams():
    from asyncrl.config import RemoteEngineConfig
    from asyncrl.engine.remote import RemoteEngine

    engine = RemoteEngine(RemoteEngineConfig(urls=["http://127.0.0.1:9"]), check=False)  # never contacted
    try:
        for request in (GenerationRequest(PROMPT, constraint=TokenTrie([[6, 7]]), max_new_tokens=2),
                        GenerationRequest(PROMPT, n=2, beam=True)):
            with pytest.raises(EngineRequestError, match="need the in-process JAX engine"):
                engine.submit(request)
    finally:
        engine.shutdown()
    from asyncrl.engine.fake import FakeEngine

    for request in (GenerationRequest(PROMPT, constraint=TokenTrie([[6, 7]]), max_new_tokens=2),
                    GenerationRequest(PROMPT, n=2, beam=True)):
        with pytest.raises(EngineRequestError, match="FakeEngine: trie constraints and beam search need the JAX engine"):
            FakeEngine().generate(request)
