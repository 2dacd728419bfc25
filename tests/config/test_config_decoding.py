"""rollout.decoding / eval.decoding (docs/decoding.md): the config's checks, the constraint file
shared by workflow, eval and trainer, and what eval asks the engine for."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from asyncrl.config import load_config
from asyncrl.engine.constraints import TokenTrie, load_trie
from asyncrl.engine.protocol import GenerationRequest, GenerationResponse
from asyncrl.errors import ConfigError
from asyncrl.run.evaluate import EvalEngine


def test_decoding_defaults_and_refusals(tmp_path):
    cfg = load_config(data={})
    assert cfg.rollout.decoding.strategy == "sample" and cfg.eval.decoding.strategy == "greedy"
    assert cfg.rollout.decoding.constraint is None
    cases = [
        ({"rollout": {"decoding": {"strategy": "beam"}}}, "rollout.decoding.strategy: training rollouts must sample"),
        ({"eval": {"decoding": {"strategy": "sample"}}}, "eval.decoding.strategy: 'greedy' or 'beam'"),
        ({"eval": {"decoding": {"strategy": "beam", "beam_width": 64}}}, r"beam_width \(64\) must be at most engine.slots"),
        ({"rollout": {"decoding": {"constraint": "a.txt"}}, "eval": {"decoding": {"constraint": "b.txt"}}},
         "leave eval.decoding.constraint null"),
        ({"rollout": {"decoding": {"constraint": "a.txt"}}, "engine": {"remote": {"urls": ["http://127.0.0.1:1"]}}},
         "trie constraints and beam search need the in-process engine"),
    ]
    for data, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(data=data)


def test_load_trie_reads_once_per_file_version(tmp_path):
    path = tmp_path / "items.txt"
    path.write_text("6 7 8\n6 9 10\n")
    first = load_trie(path)
    assert load_trie(str(path)) is first and first.num_sequences == 2
    path.write_text("6 7 8\n6 9 10\n11 12 13\n")
    assert load_trie(path).num_sequences == 3
    with pytest.raises(FileNotFoundError, match="decoding.constraint .*nope.txt: not found"):
        load_trie(tmp_path / "nope.txt")


class RecordingEngine:
    """Answers every request with n copies of its prompt's first token, and records the requests."""

    version = 0

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    def submit(self, request: GenerationRequest) -> Future:
        import numpy as np

        self.requests.append(request)
        done: Future = Future()
        done.set_result([GenerationResponse(np.array([i], np.int32), np.zeros(1, np.float32), np.zeros(1, np.int32), "length",
                                            score=-float(i)) for i in range(request.n)])
        return done


def test_eval_engine_beam_and_constraint(tmp_path):
    path = tmp_path / "items.txt"
    path.write_text("6 7\n8 9\n10 11\n")
    trie = load_trie(path)
    inner = RecordingEngine()
    beam = EvalEngine(inner, greedy=True, temperature=1.0, max_new_tokens=None, timeout_s=5, beam_width=3,
                      length_penalty=0.5, constraint=trie)
    out = beam.generate(GenerationRequest([1, 2], n=4, max_new_tokens=3))
    request = inner.requests[-1]
    assert request.beam and request.n == 3 and request.length_penalty == 0.5 and request.constraint is trie
    assert [r.output_ids.tolist() for r in out] == [[0]] * 4  # the best beam stands for the n samples
    own = TokenTrie([[6, 7], [8, 9]])
    sampling = EvalEngine(inner, greedy=False, temperature=0.7, max_new_tokens=None, timeout_s=5, constraint=trie)
    sampling.generate(GenerationRequest([1, 2], n=2, max_new_tokens=3, constraint=own))
    assert inner.requests[-1].constraint is own and not inner.requests[-1].beam  # a request's own constraint stays
