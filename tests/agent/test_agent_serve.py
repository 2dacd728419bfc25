"""``asyncrl serve``'s OpenAI-compatible routes (/v1/chat/completions, /v1/completions, /v1/models),
driven by the real ``openai`` SDK over a real socket: the app of ``asyncrl serve`` on a thread, over
a FakeEngine (the routes only submit requests), with its API key."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from asyncrl.serve.app import build_app
from asyncrl.serve.state import ServeState
from tests.agent_fakes import qwen_char_tokenizer, text_engine
from tests.remote_helpers import free_port

TOK = qwen_char_tokenizer()


@pytest.fixture(scope="module")
def server():
    import uvicorn

    engine = text_engine(TOK, lambda r, i: f"hi {i}")
    state = ServeState(engine, None, "/models/tiny-agent", weights_root=None, api_key="secret", tokenizer=TOK)
    port = free_port()
    app_server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="error", access_log=False))
    thread = threading.Thread(target=app_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not app_server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1"
    app_server.should_exit = True
    thread.join(10)


def test_chat_completions_models_and_text_completions_over_http(server):
    client = openai.OpenAI(base_url=server, api_key="secret", max_retries=0)
    answer = client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": "hello"}], n=2)
    assert [c.message.content for c in answer.choices] == ["hi 0", "hi 1"] and answer.model == "tiny-agent"
    assert [m.id for m in client.models.list()] == ["tiny-agent"]
    assert client.completions.create(model="tiny-agent", prompt="x").choices[0].text == "hi 0"


def test_refusals_name_the_parameter_and_the_key_is_required(server):
    client = openai.OpenAI(base_url=server, api_key="secret", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="stream: streaming is not supported"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server, api_key="wrong", max_retries=0).models.list()


@pytest.mark.timeout(300)
def test_tiny_models_chat_over_asyncrl_serve_equals_the_engines_own_sample(tmp_path):
    """The real JaxEngine behind the /v1 routes (the `tiny` model, its tokenizer and chat template):
    a greedy chat completion's text is the decode of exactly what the engine generates for the
    templated prompt, asked directly."""
    from asyncrl.agent.api import Limits, OpenAIEndpoint
    from asyncrl.config import load_config
    from asyncrl.engine.protocol import GenerationRequest
    from asyncrl.model import load_model
    from tests.remote_helpers import QUICKSTART, InProcessServer

    cfg = load_config(QUICKSTART, ["engine.prefill_buckets=[32]"])
    loaded = load_model(cfg.model)
    server = InProcessServer(loaded, cfg, tmp_path, api_key=None)
    server.state.openai = OpenAIEndpoint(loaded.tokenizer, limits=Limits(max_new_tokens=8, max_total_tokens=32, max_prompt_tokens=32))
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "C:482"}]
        answer = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6)
        prompt = server.state.openai.render(messages)
        [direct] = server.state.engine.generate(GenerationRequest(prompt_ids=prompt, greedy=True, max_new_tokens=6))
        assert answer.choices[0].message.content == loaded.tokenizer.decode(list(direct.output_ids), skip_special_tokens=True)
        assert answer.usage.completion_tokens == len(direct.output_ids) and answer.usage.prompt_tokens == len(prompt)
    finally:
        server.terminate()
