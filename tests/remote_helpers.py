"""Helpers for the remote-engine tests: real ``asyncrl serve`` subprocesses, and a scripted
in-process HTTP server for answers a real server never gives (5xx, bad JSON, wrong versions)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from asyncrl.cluster.launch import free_port
from tests.helpers import REPO_ROOT, subprocess_env

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from runlib import wait_for_health  # noqa: E402  (the benchmarks' server wait, shared)

API_KEY = "test-key"
QUICKSTART = REPO_ROOT / "configs" / "quickstart.yaml"
# The quickstart's engine, with a prefill bucket that holds a resubmitted prompt (prompt + partial output).
SERVE_SETTINGS = ["--set", "engine.prefill_buckets=[32]"]


class Server:
    """One ``asyncrl serve`` subprocess (killed by :meth:`stop` whatever happens)."""

    def __init__(self, weights_root: Path, log: Path, *, port: Optional[int] = None, api_key: Optional[str] = API_KEY,
                 model: str = str(QUICKSTART), extra: tuple = tuple(SERVE_SETTINGS)):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [sys.executable, "-m", "asyncrl.cli", "serve", model, "--port", str(self.port),
                "--weights-root", str(weights_root), *extra]
        if api_key:
            args += ["--api-key", api_key]
        self.args = args
        self.proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=subprocess_env(),
                                     cwd=REPO_ROOT)

    def wait_ready(self, timeout: float = 300.0) -> None:
        wait_for_health(self.url, self.proc, timeout, self.log.read_text, headers={"Authorization": f"Bearer {API_KEY}"})

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM (graceful), SIGKILL when it does not exit in ``timeout``; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


@contextlib.contextmanager
def servers(tmp: Path, count: int, **kwargs: Any):
    """``count`` servers started together, all killed on exit."""
    root = tmp / "weights"
    root.mkdir(exist_ok=True)
    started = []
    try:
        for i in range(count):
            started.append(Server(root, tmp / f"serve{i}.log", **kwargs))
        for s in started:
            s.wait_ready()
        yield started
    finally:
        for s in started:
            s.terminate(5)


@contextlib.contextmanager
def scripted_server(handler: Callable[[str, dict], Any]):
    """An in-process HTTP server: ``handler(path, body) -> (status, body_bytes)`` answers every call."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def any_route(request: Request) -> Response:
        raw = await request.body()
        import json

        status, body = handler(request.url.path, json.loads(raw) if raw.strip() else {})
        return Response(body, status_code=status, media_type="application/json")

    paths = ["/generate", "/get_model_info", "/health", "/pause_generation", "/continue_generation",
             "/update_weights_from_disk"]
    app = Starlette(routes=[Route(p, any_route, methods=["GET", "POST"]) for p in paths])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


class InProcessServer:
    """``asyncrl serve``'s app (same code, same HTTP stack, a real socket) on a thread of this process:
    the default suite's stand-in for the subprocess, which takes ~30 s to import and start on a busy CPU."""

    def __init__(self, loaded: Any, cfg: Any, weights_root: Path, api_key: Optional[str] = API_KEY):
        import uvicorn

        from asyncrl.run.build import build_local_engine
        from asyncrl.serve.app import build_app
        from asyncrl.serve.state import ServeState

        graphdef, params = loaded.split()
        engine = build_local_engine(cfg, graphdef, params, loaded.stop_token_ids)
        self.state = ServeState(engine, loaded.model.cfg, str(loaded.path), weights_root=weights_root, api_key=api_key)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.state), host="127.0.0.1", port=self.port,
                                                    log_level="error", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline:
                raise AssertionError(f"in-process server on {self.url} did not start within {timeout} s")
            time.sleep(0.02)

    def terminate(self, timeout: float = 10.0) -> int:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.state.engine.shutdown()
        return 0


@contextlib.contextmanager
def inprocess_servers(tmp: Path, count: int, loaded: Any, cfg: Any):
    root = tmp / "weights"
    root.mkdir(exist_ok=True)
    started = []
    try:
        for _ in range(count):
            started.append(InProcessServer(loaded, cfg, root))
        for s in started:
            s.wait_ready()
        yield started
    finally:
        for s in started:
            s.terminate()


def record_remote_generations(monkeypatch) -> list:
    """Every (request, responses) a RemoteEngine returns from now on (the test's API key set)."""
    import threading

    from asyncrl.engine.remote import RemoteEngine

    seen: list = []
    lock = threading.Lock()
    original = RemoteEngine._run

    def run(self, request):
        responses = original(self, request)
        with lock:
            seen.append((request, responses))
        return responses

    monkeypatch.setattr(RemoteEngine, "_run", run)
    monkeypatch.setenv("ASYNCRL_TEST_API_KEY", API_KEY)
    return seen


def check_tagged_logprobs(samples: list, model_of: Callable[[int], tuple[Any, Any]], temperature: float, *,
                          rows: int = 16, length: Optional[int] = None) -> list[int]:
    """Every sampled token's log-prob equals ``per_token_logprobs`` (1e-5) under the model of the
    version it is tagged with: the tags name the weights that produced the tokens.

    ``samples`` are ``(prompt ids, GenerationResult)``; ``model_of(version)`` gives that version's
    ``(graphdef, params)``. Per version, at most ``rows`` samples are checked, those spanning
    versions first, in one ``[rows, length]`` batch (``length``: the longest sample when None).
    Returns the versions seen."""
    import numpy as np

    from asyncrl.model import per_token_logprobs_jit

    versions = sorted({int(v) for _, r in samples for v in r.versions})
    for version in versions:
        tagged = [(p, r) for p, r in samples if version in r.versions]
        tagged.sort(key=lambda pr: len(set(pr[1].versions.tolist())) == 1)  # mixed versions first
        tagged = tagged[:rows]
        width = length or max(len(p) + len(r.output_ids) for p, r in tagged)
        ids = np.zeros((rows, width), np.int32)
        mask = np.zeros((rows, width), bool)
        for i, (p, r) in enumerate(tagged):
            seq = list(p) + r.output_ids.tolist()
            ids[i, : len(seq)], mask[i, : len(seq)] = seq, True
        graphdef, params = model_of(version)
        logprobs = np.asarray(per_token_logprobs_jit(graphdef, params, ids, mask, temperature)[0])
        for i, (p, r) in enumerate(tagged):
            at = np.flatnonzero(r.versions == version)
            np.testing.assert_allclose(r.logprobs[at], logprobs[i, len(p) + at], atol=1e-5, err_msg=f"version {version}")
    return versions
