"""The in-process OpenAI clients: the real ``openai`` SDK, answered by an engine without HTTP.

:class:`AgentAsyncOpenAI` and :class:`AgentOpenAI` are ``openai.AsyncOpenAI`` / ``openai.OpenAI``
whose httpx client has a transport (:class:`AsyncEngineTransport`, :class:`EngineTransport`)
that hands each request to :class:`~asyncrl.agent.api.OpenAIEndpoint` and the engine, in the
same process. The SDK builds the requests and parses the answers, so agents get the SDK's own
types (``ChatCompletion``, ``BadRequestError``, ...). Each completion is recorded on the run's
:class:`~asyncrl.agent.recording.EpisodeRecorder`; ``client.set_reward(completion.id, r)``
rewards one completion.

Example (outside training, e.g. to try an agent on the fake engine)::

    client = AgentAsyncOpenAI(engine, OpenAIEndpoint(tokenizer), EpisodeRecorder())
    answer = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
    client.recorder.records[0].response.output_ids  # the ids the engine sampled
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import openai

try:  # openai 3 is built on httpx2 (the client types it declares); older versions on httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover - depends on the installed openai
    import httpx  # type: ignore[no-redef]

from asyncrl.agent.api import ApiError, OpenAIEndpoint, Prepared
from asyncrl.agent.recording import EpisodeRecorder
from asyncrl.engine.protocol import InferenceEngine

IN_PROCESS_BASE_URL = "http://asyncrl.in-process/v1"
"""The base URL of the in-process clients (never resolved: their transport answers)."""


def route_of(path: str) -> str:
    """The route after ``/v1`` of a URL path (``/episodes/KEY/v1/chat/completions`` -> ``/chat/completions``)."""
    head, sep, tail = path.partition("/v1/")
    return "/" + tail if sep else path


def _body(content: bytes) -> Optional[Any]:
    if not content:
        return None
    try:
        return json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({err})") from None


def _note_failure(recorder: Optional[EpisodeRecorder], err: BaseException) -> None:
    # The SDK turns a transport's exception into APIConnectionError; the episode re-raises this one.
    if recorder is not None:
        recorder.failure = err


def _error(err: ApiError) -> httpx.Response:
    return httpx.Response(err.status, json=err.body())


class EngineTransport(httpx.BaseTransport):
    """A synchronous httpx transport answering the OpenAI routes from ``engine`` (blocking calls)."""

    def __init__(self, engine: InferenceEngine, endpoint: OpenAIEndpoint, recorder: Optional[EpisodeRecorder]):
        self.engine, self.endpoint, self.recorder = engine, endpoint, recorder

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            prepared = self.endpoint.prepare(request.method, route_of(request.url.path), _body(request.read()), self.recorder)
        except ApiError as err:
            return _error(err)
        try:
            responses = self.engine.generate(prepared.request) if prepared.request is not None else []
        except Exception as err:
            _note_failure(self.recorder, err)
            raise
        return httpx.Response(200, json=prepared.finish(responses))


class AsyncEngineTransport(httpx.AsyncBaseTransport):
    """An asyncio httpx transport answering the OpenAI routes from ``engine`` (``engine.submit``,
    awaited: many agent runs share one event loop)."""

    def __init__(self, engine: InferenceEngine, endpoint: OpenAIEndpoint, recorder: Optional[EpisodeRecorder]):
        self.engine, self.endpoint, self.recorder = engine, endpoint, recorder

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            prepared: Prepared = self.endpoint.prepare(request.method, route_of(request.url.path),
                                                       _body(await request.aread()), self.recorder)
        except ApiError as err:
            return _error(err)
        try:
            responses = await asyncio.wrap_future(self.engine.submit(prepared.request)) if prepared.request is not None else []
        except Exception as err:
            _note_failure(self.recorder, err)
            raise
        return httpx.Response(200, json=prepared.finish(responses))


class _RewardMixin:
    recorder: EpisodeRecorder

    def set_reward(self, completion_id: str, reward: float, choice: Optional[int] = None) -> None:
        """Reward of one completion (by its ``id``; every choice, or only ``choice``). Completions
        without one get the next one's times ``turn_discount`` (see :mod:`asyncrl.agent.recording`)."""
        self.recorder.set_reward(completion_id, reward, choice)


class AgentAsyncOpenAI(_RewardMixin, openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` answered in-process by ``engine``, recording on ``recorder``.

    ``base_url``/``api_key`` default to the in-process ones; give a real base URL (the episode
    gateway's) and ``http_client=None`` to go over HTTP instead, recording the same way.
    """

    def __init__(self, engine: InferenceEngine, endpoint: OpenAIEndpoint, recorder: EpisodeRecorder, *,
                 base_url: Optional[str] = None, api_key: str = "asyncrl-in-process", over_http: bool = False):
        self.recorder = recorder
        http_client = None if over_http else httpx.AsyncClient(transport=AsyncEngineTransport(engine, endpoint, recorder))
        super().__init__(base_url=base_url or IN_PROCESS_BASE_URL, api_key=api_key, http_client=http_client, max_retries=0)


class AgentOpenAI(_RewardMixin, openai.OpenAI):
    """``openai.OpenAI`` (synchronous) answered in-process by ``engine``, recording on ``recorder``."""

    def __init__(self, engine: InferenceEngine, endpoint: OpenAIEndpoint, recorder: EpisodeRecorder, *,
                 base_url: Optional[str] = None, api_key: str = "asyncrl-in-process", over_http: bool = False):
        self.recorder = recorder
        http_client = None if over_http else httpx.Client(transport=EngineTransport(engine, endpoint, recorder))
        super().__init__(base_url=base_url or IN_PROCESS_BASE_URL, api_key=api_key, http_client=http_client, max_retries=0)
