"""FakeEngine honours the InferenceEngine protocol: determinism, versions, crash, stop rules."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from asyncrl.engine import FakeEngine, GenerationRequest, InferenceEngine
from asyncrl.errors import EngineCrashed
from asyncrl.registry import resolve

pytestmark = pytest.mark.timeout(30)


def req(**kw):
    base = dict(prompt_ids=[2, 3, 4], n=3, max_new_tokens=12, sample_id=5)
    base.update(kw)
    return GenerationRequest(**base)


def test_protocol_alias_and_request_validation():
    engine = FakeEngine()
    assert isinstance(engine, InferenceEngine)
    assert resolve("engine", "fake") is FakeEngine
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        GenerationRequest(prompt_ids=[])
    with pytest.raises(ValueError, match="temperature"):
        GenerationRequest(prompt_ids=[1], temperature=0.0)


def test_outputs_depend_only_on_seed_sample_index_and_turn():
    a = FakeEngine(seed=1).generate(req())
    b = FakeEngine(seed=1, delay_s=(0, 0.002)).generate(req(n=1, index_in_group=1))[0]
    np.testing.assert_array_equal(a[1].output_ids, b.output_ids)
    np.testing.assert_array_equal(a[1].logprobs, b.logprobs)
    c = FakeEngine(seed=1).generate(req(turn=1))
    assert any(not np.array_equal(x.output_ids, y.output_ids) for x, y in zip(a, c))
    for r in a:
        assert r.output_ids.dtype == np.int32 and r.logprobs.dtype == np.float32 and r.versions.dtype == np.int32
        assert (r.logprobs <= 0).all() and len(r.output_ids) == len(r.logprobs) == len(r.versions)
        if r.stop_reason == "eos":
            assert r.output_ids[-1] == 1  # EOS kept
        else:
            assert r.stop_reason == "length" and len(r.output_ids) == 12


def test_versions_switch_at_chunk_boundaries_during_a_request():
    engine = FakeEngine(version=3, chunk_size=2, delay_s=0.2, eos_prob=0.0)
    future = engine.submit(req(n=1, max_new_tokens=8))
    threading.Timer(0.09, lambda: engine.update_weights({"w": 1}, 4)).start()
    out = future.result(timeout=5)[0]
    versions = out.versions.tolist()
    assert versions == sorted(versions) and versions[0] == 3 and versions[-1] == 4
    assert all(len(set(versions[i:i + 2])) == 1 for i in range(0, 8, 2))  # constant within a chunk
    with pytest.raises(ValueError, match="must be 5"):
        engine.update_weights({}, 7)


def test_crash_raises_with_the_engine_traceback_forever_after():
    engine = FakeEngine(crash_after_calls=1)
    engine.generate(req())
    for _ in range(2):
        with pytest.raises(EngineCrashed, match="(?s)engine traceback.*scripted crash of the engine thread"):
            engine.generate(req())
    with pytest.raises(EngineCrashed):
        engine.submit(req()).result(timeout=5)


def test_stop_sequences_min_tokens_responder_and_timeout():
    scripted = FakeEngine(responder=lambda r, i: [5, 6, 7, 1, 9])
    out = scripted.generate(req(n=1, stop_sequences=[[6, 7]]))[0]
    assert out.output_ids.tolist() == [5, 6, 7] and out.stop_reason == "stop"
    out = scripted.generate(req(n=1, min_new_tokens=5))[0]
    assert out.output_ids.tolist() == [5, 6, 7, 1, 9] and out.stop_reason == "stop"
    out = scripted.generate(req(n=1, stop_token_ids=[7]))[0]
    assert out.output_ids.tolist() == [5, 6, 7] and out.stop_reason == "eos"
    slow = FakeEngine(chunk_size=1, delay_s=1.0, eos_prob=0.0)
    out = slow.generate(req(n=1, max_new_tokens=10, timeout_s=0.25))[0]
    assert out.stop_reason == "aborted" and 0 < len(out.output_ids) < 10
