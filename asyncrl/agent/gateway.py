"""The episode gateway: the OpenAI routes over HTTP, one scoped endpoint per running agent run.

For agent frameworks that only take a ``base_url`` (and an API key). Each run of an
:class:`~asyncrl.agent.workflow.AgentWorkflow` with ``http: true`` gets a fresh random key;
its base URL is ``http://127.0.0.1:PORT/episodes/KEY/v1`` and the key is also its API key,
so either one routes a request to that run's recorder, and concurrent runs never mix. A
request to ``/v1/...`` without a path key is routed by ``Authorization: Bearer KEY``. A key
whose run ended (or never existed) gets 404.

The server binds 127.0.0.1 on a free port, on a daemon thread (one thread per connection),
started on first use and stopped by :meth:`EpisodeGateway.close`.
"""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from asyncrl.agent.api import ApiError, OpenAIEndpoint
from asyncrl.agent.client import route_of
from asyncrl.agent.recording import EpisodeRecorder
from asyncrl.engine.protocol import InferenceEngine


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    gateway: "EpisodeGateway"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass  # one line per request would flood the training log

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            status, body = 200, self.server.gateway.handle(method, self.path, raw, self.headers.get("Authorization"))
        except ApiError as err:
            status, body = err.status, err.body()
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class EpisodeGateway:
    """HTTP server routing ``/episodes/KEY/v1/...`` (or a Bearer KEY) to the run opened as KEY."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._episodes: dict[str, tuple[InferenceEngine, OpenAIEndpoint, EpisodeRecorder]] = {}
        self._lock = threading.Lock()
        self._server = _Server((host, port), _Handler)
        self._server.gateway = self
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="agent-gateway", daemon=True)
        self._thread.start()

    def open_episode(self, engine: InferenceEngine, endpoint: OpenAIEndpoint, recorder: EpisodeRecorder) -> tuple[str, str]:
        """A fresh key for one run: ``(key, base_url)``; the key is also the run's API key."""
        key = secrets.token_urlsafe(16)
        with self._lock:
            self._episodes[key] = (engine, endpoint, recorder)
        return key, f"{self.url}/episodes/{key}/v1"

    def close_episode(self, key: str) -> None:
        with self._lock:
            self._episodes.pop(key, None)

    def handle(self, method: str, path: str, raw: bytes, authorization: Optional[str]) -> dict[str, Any]:
        path = path.split("?", 1)[0]
        if path.startswith("/episodes/"):
            key = path[len("/episodes/"):].split("/", 1)[0]
        elif authorization and authorization.startswith("Bearer "):
            key = authorization[len("Bearer "):].strip()
        else:
            raise ApiError(401, "no episode key: use the run's base_url (/episodes/KEY/v1) or its api_key as the Bearer token")
        with self._lock:
            episode = self._episodes.get(key)
        if episode is None:
            raise ApiError(404, "unknown episode key: this run has ended, or the key is wrong", code="episode_not_found")
        engine, endpoint, recorder = episode
        try:
            body = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON ({err})") from None
        prepared = endpoint.prepare(method, route_of(path), body, recorder)
        try:
            responses = engine.generate(prepared.request) if prepared.request is not None else []
        except Exception as err:  # noqa: BLE001 - answered as a 500; the episode re-raises it
            recorder.failure = err
            raise ApiError(500, f"the inference engine failed: {type(err).__name__}: {err}") from None
        return prepared.finish(responses)

    def close(self) -> None:
        """Stop serving (returns once the server thread has ended, at most a few seconds)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
