"""RemoteEngine against real ``asyncrl serve`` subprocesses (the SGLang HTTP protocol), and against
a scripted server for the answers a healthy server never gives."""

from __future__ import annotations

import json
import threading
import time

import httpx
import jax
import numpy as np
import pytest

from asyncrl.config import RemoteEngineConfig
from asyncrl.engine import sglang_protocol as sp
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.engine.remote import RemoteEngine, RemoteEngineError
from asyncrl.errors import EngineRequestError
from tests.remote_helpers import API_KEY, QUICKSTART, check_tagged_logprobs, inprocess_servers, scripted_server, servers

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def model():
    from asyncrl.config import load_config
    from asyncrl.model import load_model

    # The quickstart's engine (its decode program is shared with the loop tests), with a prefill
    # bucket that holds a resubmitted prompt.
    cfg = load_config(QUICKSTART, ["engine.prefill_buckets=[32]"])
    loaded = load_model(cfg.model)
    return cfg, loaded


@pytest.fixture(scope="module", params=["in-process", pytest.param("subprocess", marks=pytest.mark.slow)])
def two(request, tmp_path_factory, model):
    """Two servers: ``asyncrl serve``'s app on threads of this process (default suite), or two
    real ``asyncrl serve`` subprocesses (slow: ~30 s to start each on a busy 2-core machine)."""
    tmp = tmp_path_factory.mktemp("remote")
    cfg, loaded = model
    context = servers(tmp, 2) if request.param == "subprocess" else inprocess_servers(tmp, 2, loaded, cfg)
    with context as started:
        yield tmp, started


def served_version(url: str) -> int:
    info = sp.ModelInfo.model_validate(httpx.get(f"{url}/get_model_info", headers=AUTH).json())
    assert info.weight_version is not None, f"{url} reports no weight_version"
    return int(info.weight_version)


def remote_engine(tmp, started, loaded, **kwargs) -> RemoteEngine:
    graphdef, _ = loaded.split()
    settings = RemoteEngineConfig(urls=[s.url for s in started], health_check_every_s=0.5, backoff_s=0.05, **kwargs)
    return RemoteEngine(
        settings, graphdef=graphdef, tokenizer=None, stop_token_ids=loaded.stop_token_ids,
        weights_dir=tmp / "weights" / "run", version=served_version(started[0].url), api_key=API_KEY,
    )


# --------------------------------------------------------------------------- protocol


def test_every_endpoint_speaks_sglang_protocol(two, model):
    from asyncrl.model import export_hf

    tmp, (server, _) = two
    cfg, loaded = model
    url = server.url
    post = lambda path, body, **kw: httpx.post(f"{url}{path}", json=body, headers=kw.pop("headers", AUTH), timeout=60, **kw)

    info = sp.ModelInfo.model_validate(httpx.get(f"{url}/get_model_info", headers=AUTH).json())
    assert info.is_generation and info.weight_version is not None
    assert httpx.get(f"{url}/health", headers=AUTH).status_code == 200

    one = sp.GenerateReqInput(input_ids=[5, 6, 7], sampling_params=sp.SamplingParams(max_new_tokens=4, temperature=0),
                              return_logprob=True)
    answer = sp.GenerateResponse.validate_python(post("/generate", one.model_dump(exclude_none=True)).json())
    assert isinstance(answer, sp.GenerateItem) and len(answer.output_ids) == answer.meta_info.completion_tokens
    assert [t for _, t, _ in answer.meta_info.output_token_logprobs] == answer.output_ids
    assert answer.meta_info.prompt_tokens == 3
    batch = sp.GenerateReqInput(input_ids=[[5, 6], [7, 8, 9]], sampling_params=sp.SamplingParams(max_new_tokens=3, n=2))
    items = sp.GenerateResponse.validate_python(post("/generate", batch.model_dump(exclude_none=True)).json())
    assert isinstance(items, list) and len(items) == 4 and items[0].meta_info.output_token_logprobs is None

    assert post("/pause_generation", sp.PauseGenerationReqInput(mode="abort").model_dump()).status_code == 200
    assert post("/continue_generation", sp.ContinueGenerationReqInput().model_dump()).status_code == 200
    assert post("/abort_request", sp.AbortReq(abort_all=True).model_dump()).status_code == 200
    assert post("/flush_cache", {}).status_code == 200
    # Reloading the served weights under the same label changes nothing it generates.
    label = info.weight_version
    path = export_hf(loaded, None, tmp / "weights" / "same")
    done = post("/update_weights_from_disk", sp.UpdateWeightFromDiskReqInput(model_path=str(path), weight_version=label).model_dump())
    assert sp.UpdateWeightFromDiskReqOutput.model_validate(done.json()).success, done.text

    # Refusals: one clear line each.
    def refused(status, path, body, needle, headers=AUTH, raw=None):
        answer = httpx.post(f"{url}{path}", content=raw, headers=headers) if raw is not None else post(path, body, headers=headers)
        assert answer.status_code == status, answer.text
        assert needle in answer.json()["error"]["message"], answer.text

    refused(401, "/generate", one.model_dump(), "API key", headers={})
    refused(401, "/pause_generation", {}, "API key", headers={"Authorization": "Bearer wrong"})
    refused(403, "/update_weights_from_disk", {"model_path": str(tmp)}, "outside the weights root")
    refused(400, "/generate", {"input_ids": [1], "text_only": 1}, "text_only: field not supported")
    refused(400, "/generate", None, "not JSON", raw=b"{nope")
    refused(400, "/pause_generation", {"mode": "retract"}, "only 'abort'")
    missing = post("/update_weights_from_disk", {"model_path": str(tmp / "weights" / "missing")})
    assert missing.status_code == 400 and not missing.json()["success"] and "missing" in missing.json()["message"]


def test_the_servers_prefix_cache_is_reported_and_flushed(two, model):
    """``asyncrl serve`` runs the engine's prefix reuse: a prompt whose context a finished sample's
    pages hold is not computed again (``meta_info.cached_tokens``, from the engine's prefix tree, as
    SGLang reports its radix cache's), ``/flush_cache`` forgets it, an agent's history survives
    another episode sharing its system prompt (A, B, then A's next turn: A's whole history), and a
    RemoteEngine counts what the servers computed and reused (engine/prefill_tokens,
    engine/prefix_hit_tokens)."""
    tmp, (server, _) = two
    _, loaded = model
    prompt = [int(t) for t in np.random.default_rng(54).integers(5, 28, size=20)]
    one = sp.GenerateReqInput(input_ids=prompt, sampling_params=sp.SamplingParams(max_new_tokens=2, temperature=0))

    def cached() -> int:
        answer = httpx.post(f"{server.url}/generate", json=one.model_dump(exclude_none=True), headers=AUTH, timeout=60)
        return sp.GenerateItem.model_validate(answer.json()).meta_info.cached_tokens

    assert cached() == 0
    assert cached() == len(prompt) - 1  # the whole context (the last prompt token is the first decode step's)
    assert httpx.post(f"{server.url}/flush_cache", headers=AUTH).text == "Cache flushed."
    assert cached() == 0

    def turn(ids: list[int]) -> sp.GenerateItem:  # 4 greedy tokens (the server's contexts hold 32: pages of 16)
        body = sp.GenerateReqInput(input_ids=ids, sampling_params=sp.SamplingParams(max_new_tokens=4, temperature=0,
                                                                                      ignore_eos=True))
        answer = httpx.post(f"{server.url}/generate", json=body.model_dump(exclude_none=True), headers=AUTH, timeout=60)
        return sp.GenerateItem.model_validate(answer.json())

    rng = np.random.default_rng(55)
    system = [int(t) for t in rng.integers(5, 28, size=16)]  # one page
    a, b = (system + [int(t) for t in rng.integers(5, 28, size=3)] for _ in range(2))
    first = turn(a)
    assert turn(b).meta_info.cached_tokens >= 16  # the system prompt's page (and whatever of B's A's next page holds)
    again = turn(a + first.output_ids + [7, 8])
    assert again.meta_info.cached_tokens == len(a) - 1 + len(first.output_ids)  # all of A's history, B in between

    engine = remote_engine(tmp, [server], loaded)
    try:
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=2, greedy=True)
        engine.generate(request)  # the server still holds the context from the last answer above
        metrics = engine.metrics()
        assert metrics["engine/prefix_hit_tokens"] == len(prompt) - 1 and metrics["engine/prefill_tokens"] == 1
        assert metrics["engine/prefix_hit_rate"] == (len(prompt) - 1) / len(prompt)
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- exactness


def test_greedy_and_sampled_equal_the_in_process_engine(two, model):
    from asyncrl.run.build import build_local_engine

    tmp, started = two
    cfg, loaded = model
    remote = remote_engine(tmp, started, loaded)
    local = build_local_engine(cfg, *loaded.split(), loaded.stop_token_ids)
    try:
        requests = [
            GenerationRequest(prompt_ids=[3, 4, 5, 6], greedy=True, max_new_tokens=12),
            GenerationRequest(prompt_ids=[9, 8, 7], n=3, max_new_tokens=10, sample_id=11, turn=1),
            GenerationRequest(prompt_ids=list(range(2, 14)), n=2, max_new_tokens=8, temperature=0.7, sample_id=5),
        ]
        for request in requests:
            for a, b in zip(remote.generate(request), local.generate(request)):
                assert a.output_ids.tolist() == b.output_ids.tolist() and a.stop_reason == b.stop_reason
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
                assert set(a.versions.tolist()) <= {remote.version}
    finally:
        remote.shutdown()
        local.shutdown()


def test_updates_during_generation_tag_every_token_with_its_weights(two, model):
    """Weights published while requests run: cut requests are resubmitted, each segment carries
    the version that made it, and every sampled log-prob is that version's ``per_token_logprobs``."""
    tmp, started = two
    cfg, loaded = model
    remote = remote_engine(tmp, started, loaded, keep_weights=4)
    graphdef, params = loaded.split()
    start = remote.version
    weights = {start: params}
    results: list = []
    stop = threading.Event()

    def load() -> None:  # keeps 8 requests running until both updates are done (more would only queue)
        i = 0
        running: list = []
        while not stop.is_set() or i < 8:
            running = [f for f in running if not f.done()]
            if len(running) >= 8:
                time.sleep(0.002)
                continue
            prompt = [3 + i % 7, 4, 5]
            request = GenerationRequest(prompt_ids=prompt, n=4, max_new_tokens=24, stop_token_ids=[], sample_id=i)
            results.append((prompt, remote.submit(request)))
            running.append(results[-1][1])
            i += 1

    try:
        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        for k in (1, 2):
            published = jax.tree.map(lambda x, k=k: x * (1 + 0.05 * k), params)
            # The servers hold what was published: the weights rounded to engine.remote.dtype (bfloat16).
            weights[start + k] = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16).astype(x.dtype), published)
            time.sleep(0.2)
            # Publish while requests run (on a fast moment every request may be done already, and
            # nothing would be cut): wait until one sent before the newest is still running.
            deadline = time.monotonic() + 20
            while not any(not f.done() for _, f in list(results)[:-1]) and time.monotonic() < deadline:
                time.sleep(0.005)
            remote.update_weights(published, start + k)
        stop.set()
        thread.join(30)
        samples = [(p, r) for p, f in results for r in f.result(timeout=60)]
        metrics = remote.metrics()

    finally:
        remote.shutdown()
    assert all(r.stop_reason == "length" and len(r.output_ids) == 24 for _, r in samples)
    assert metrics["engine/resubmits"] > 0 and metrics["engine/swaps"] == 2
    assert all(np.all(np.diff(r.versions) >= 0) for _, r in samples)
    assert {int(v) for _, r in samples for v in r.versions} >= {start, start + 2}
    assert all(served_version(s.url) == start + 2 for s in started)
    check_tagged_logprobs(samples, lambda version: (graphdef, weights[version]), 1.0, length=32)


# --------------------------------------------------------------------------- bad answers


def _model_info(version="0"):
    return 200, json.dumps({"model_path": "scripted", "weight_version": version}).encode()


def _item(version="0", tokens=(4, 5), finish="length"):
    meta = {"id": "r", "finish_reason": {"type": finish}, "prompt_tokens": 2, "completion_tokens": len(tokens),
            "weight_version": version, "output_token_logprobs": [[-1.0, t, None] for t in tokens]}
    return {"text": "", "output_ids": list(tokens), "meta_info": meta}


@pytest.mark.parametrize("case, error, needle", [
    ("5xx", RemoteEngineError, "no healthy inference server"),
    ("not json", RemoteEngineError, "not JSON"),
    ("bad shape", RemoteEngineError, "breaks SGLang's protocol"),
    ("wrong version", RemoteEngineError, "answered weight_version 7"),
    ("400", EngineRequestError, "prompt too long"),
])
def test_bad_answers_give_clear_errors(case, error, needle):
    calls = []

    def handler(path, body):
        calls.append(path)
        if path == "/get_model_info":
            return _model_info()
        if case == "5xx":
            return 503, b'{"error": {"message": "overloaded"}}'
        if case == "not json":
            return 200, b"<html>proxy error</html>"
        if case == "bad shape":
            return 200, b'{"output_ids": [1]}'
        if case == "wrong version":
            return 200, json.dumps([_item("7")]).encode()
        return 400, b'{"error": {"message": "prompt too long"}}'

    with scripted_server(handler) as url:
        engine = RemoteEngine(RemoteEngineConfig(urls=[url], retries=2, backoff_s=0.01, health_check_every_s=0))
        try:
            with pytest.raises(error, match=needle) as info:
                engine.generate(GenerationRequest(prompt_ids=[1, 2], max_new_tokens=2))
        finally:
            engine.shutdown()
    assert url in str(info.value)
    generate_calls = calls.count("/generate")
    assert generate_calls == (3 if case == "5xx" else 1)  # retried on 5xx only


def test_unreachable_url_fails_at_start_naming_it():
    from tests.remote_helpers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(RemoteEngineError, match=f"{url} is unreachable"):
        RemoteEngine(RemoteEngineConfig(urls=[url], connect_timeout_s=2.0, health_check_every_s=0))
    assert time.monotonic() - started < 2.0 + 1.0


def test_version_labels_that_are_not_asyncrl_versions_are_refused():
    with scripted_server(lambda path, body: _model_info("base-model")) as url:
        with pytest.raises(RemoteEngineError, match="weight_version 'base-model' is not an asyncrl version"):
            RemoteEngine(RemoteEngineConfig(urls=[url], health_check_every_s=0))


def test_stop_sequences_are_applied_across_segments():
    """The server knows only stop ids: a stop sequence spanning two segments ends the sample at its match."""
    answers = iter([_item("0", (4, 5, 6), "abort"), _item("0", (7, 8, 9), "length")])

    def handler(path, body):
        if path == "/get_model_info":
            return _model_info()
        return 200, json.dumps([next(answers)]).encode()

    with scripted_server(handler) as url:
        engine = RemoteEngine(RemoteEngineConfig(urls=[url], health_check_every_s=0))
        try:
            (out,) = engine.generate(GenerationRequest(prompt_ids=[1], max_new_tokens=8, stop_sequences=[[6, 7]]))
        finally:
            engine.shutdown()
    assert out.output_ids.tolist() == [4, 5, 6, 7] and out.stop_reason == "stop"
    assert engine.metrics()["engine/resubmits"] == 1


def test_a_server_without_weight_version_stops_the_cli_with_one_line(tmp_path, capsys):
    """SGLang-Jax 0.0.1 reports no weight_version: asyncrl train says so in one line, no traceback."""
    from asyncrl.cli import main
    from tests.remote_helpers import QUICKSTART

    with scripted_server(lambda path, body: _model_info(None)) as url:
        remote = json.dumps({"urls": [url], "weights_dir": str(tmp_path / "weights"), "health_check_every_s": 0})
        code = main(["train", str(QUICKSTART), "--set", f"run.output_dir={tmp_path / 'runs'}", "--set", f"engine.remote={remote}"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"asyncrl: error: {url}/get_model_info: weight_version None is not an asyncrl version"), err
