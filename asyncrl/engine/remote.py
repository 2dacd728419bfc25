"""RemoteEngine: the InferenceEngine protocol over inference servers speaking SGLang's native HTTP API.

The servers are SGLang (GPUs), SGLang-Jax (TPUs) or ``asyncrl serve``; docs/remote.md tells how to
start them. Token ids go in and come out (nothing is re-tokenised); the wire format is
:mod:`asyncrl.engine.sglang_protocol`, and every answer is validated against it.

Requests. One request (its ``n`` samples) goes to one server as one batched ``/generate`` call
(the samples share the prompt: one prefix-cache entry), chosen by least outstanding requests among
the healthy servers. A sample the server cut (finish type ``abort``, e.g. by a weight update's
pause) is resubmitted as prompt + its tokens so far with the remaining budget: a *segment*. Each
segment's tokens carry the ``weight_version`` the server reported for it, so per-token versions
are exact across updates (the server runs no request across an update: pause mode ``abort``).
Segment ``k`` of a sample uses key turn ``turn + k * 2**20`` so its random draws differ from the
first segment's. A server that fails (connection errors or 5xx after ``retries``) is marked
unhealthy and the request's unfinished samples are resubmitted elsewhere from their last complete
segment (``engine/retries``); when no server is healthy, every call raises
:class:`RemoteEngineError` naming the URLs, which stops training.

Weights. ``update_weights(params, N)`` writes ``weights/vN`` (an HF safetensors directory, via a
temporary name and a rename; older versions removed, the last ``keep_weights`` kept), then on every
healthy server: ``/pause_generation`` -> ``/update_weights_from_disk(model_path, weight_version=N)``
-> ``/continue_generation``, and checks ``/get_model_info`` reports ``N``. A server that fails is
retried ``update_retries`` times, then marked unhealthy. A health thread re-admits a server that
answers again once it has loaded the current version.

Log-probs are the server's (``log softmax(logits / T)`` of the sampled token, before top-k/top-p;
temperature 0 is greedy). SGLang must run without ``SGLANG_RETURN_ORIGINAL_LOGPROB``.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from pydantic import ValidationError

from asyncrl.engine import sglang_protocol as sp
from asyncrl.engine.protocol import GenerationRequest, GenerationResponse, StopReason
from asyncrl.errors import EngineClosed, EngineCrashed, EngineRequestError
from asyncrl.registry import register

logger = logging.getLogger("asyncrl.engine.remote")

SEGMENT_TURN_STRIDE = 1 << 20
"""Segment ``k`` of a sample folds key turn ``turn + k * SEGMENT_TURN_STRIDE``."""


class RemoteEngineError(EngineCrashed):
    """The servers cannot serve: none healthy, an answer that breaks the protocol, a refused
    key or path. Stops training (it is an :class:`EngineCrashed`); the message names the URL."""

    def __init__(self, message: str):
        super().__init__(message)


class ServerUnavailable(Exception):
    """A server did not answer (connection error, timeout, 5xx) after its retries."""


class _Server:
    """One server: its client, health, served version and figures."""

    def __init__(self, index: int, url: str, client: Any):
        self.index = index
        self.url = url.rstrip("/")
        self.client = client
        self.healthy = True
        self.version = -1
        self.outstanding = 0
        self.cause = ""
        self.requests = 0
        self.tokens = 0
        self.busy_s = 0.0
        self.errors = 0
        self.latencies: collections.deque = collections.deque(maxlen=2048)
        self.update_s: collections.deque = collections.deque(maxlen=64)

    def metrics(self) -> dict[str, float]:
        lat = np.asarray(self.latencies, float)
        prefix = f"engine/server{self.index}"
        return {
            f"{prefix}/healthy": float(self.healthy),
            f"{prefix}/version": float(self.version),
            f"{prefix}/requests": float(self.requests),
            f"{prefix}/tokens_per_s": self.tokens / self.busy_s if self.busy_s else 0.0,
            f"{prefix}/latency_p50_s": float(np.percentile(lat, 50)) if lat.size else 0.0,
            f"{prefix}/latency_p90_s": float(np.percentile(lat, 90)) if lat.size else 0.0,
            f"{prefix}/errors": float(self.errors),
            f"{prefix}/pause_update_s": float(self.update_s[-1]) if self.update_s else 0.0,
        }


class _Sample:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.stop_reason: Optional[StopReason] = None
        self.segments = 0


@register("engine", "remote")
class RemoteEngine:
    """An :class:`~asyncrl.engine.protocol.InferenceEngine` over SGLang-API servers.

    Args:
        urls: server base URLs (``http://host:port``).
        graphdef: the policy's graphdef (to export published params); ``tokenizer`` and
            ``stop_token_ids`` are written beside the weights.
        weights_dir: where ``v{N}`` weight directories go (every server must read this path).
        version: the version the servers must serve at start (``k`` on resume).
        api_key: sent as ``Authorization: Bearer``.
        connect_timeout_s, read_timeout_s: HTTP timeouts (a generation must answer within the read timeout).
        retries, backoff_s: retries of a call on connection errors and 5xx (never 4xx), waiting
            ``backoff_s * 2**attempt`` between tries.
        pause_mode: ``/pause_generation`` mode. ``abort`` (default) keeps versions exact; with
            ``retract``/``in_place`` a request continues across the update and its segment is tagged
            with the version it started on (older than some of its tokens: staleness is overstated).
        update_retries: whole pause-update-continue retries before a server is marked unhealthy.
        health_check_every_s: period of the health thread (0: off).
        max_concurrent_requests: requests in flight at once (threads and pooled connections).
        keep_weights: weight versions kept on disk.
        max_segments: segments per sample before it is given up as ``aborted``.
        check: query every server at start (an unreachable URL fails within ``connect_timeout_s``).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        graphdef: Any = None,
        tokenizer: Any = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        weights_dir: Optional[str | os.PathLike] = None,
        version: int = 0,
        api_key: Optional[str] = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        pause_mode: sp.PauseMode = "abort",
        update_retries: int = 2,
        health_check_every_s: float = 5.0,
        max_concurrent_requests: int = 64,
        keep_weights: int = 2,
        max_segments: int = 64,
        check: bool = True,
    ):
        import httpx

        if not urls:
            raise EngineRequestError("RemoteEngine: engine.remote.urls is empty: give at least one server URL")
        self.graphdef = graphdef
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None else None
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.pause_mode = pause_mode
        self.update_retries = update_retries
        self.keep_weights = keep_weights
        self.max_segments = max_segments
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_concurrent_requests + 8, max_keepalive_connections=max_concurrent_requests + 8)
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self.servers = [
            _Server(i, url, httpx.Client(base_url=url.rstrip("/"), timeout=timeout, limits=limits, headers=self._headers))
            for i, url in enumerate(urls)
        ]
        self._version = int(version)
        self._lock = threading.Condition()
        self._update_lock = threading.Lock()
        self._closed = False
        self._stats: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._stats_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_concurrent_requests, thread_name_prefix="asyncrl-remote")
        if check:
            self._check_servers()
        self._stop_health = threading.Event()
        self._health: Optional[threading.Thread] = None
        if health_check_every_s > 0:
            self._health = threading.Thread(target=self._health_loop, args=(health_check_every_s,),
                                             name="asyncrl-remote-health", daemon=True)
            self._health.start()

    @classmethod
    def from_config(cls, rcfg: Any, *, version: int = 0, **kwargs: Any) -> "RemoteEngine":
        """An engine from an ``engine.remote`` section (:class:`asyncrl.config.RemoteEngineConfig`)."""
        key = os.environ.get(rcfg.api_key_env) if rcfg.api_key_env else None
        return cls(
            rcfg.urls, version=version, api_key=key or None, connect_timeout_s=rcfg.connect_timeout_s,
            read_timeout_s=rcfg.read_timeout_s, retries=rcfg.retries, backoff_s=rcfg.backoff_s,
            pause_mode=rcfg.pause_mode, update_retries=rcfg.update_retries,
            health_check_every_s=rcfg.health_check_every_s, max_concurrent_requests=rcfg.max_concurrent_requests,
            keep_weights=rcfg.keep_weights, max_segments=rcfg.max_segments, **kwargs,
        )

    # ------------------------------------------------------------------ protocol

    @property
    def version(self) -> int:
        return self._version

    def generate(self, request: GenerationRequest) -> list[GenerationResponse]:
        return self.submit(request).result()

    def submit(self, request: GenerationRequest) -> "Future[list[GenerationResponse]]":
        if not isinstance(request, GenerationRequest):
            raise EngineRequestError(f"expected a GenerationRequest, got {type(request).__name__}")
        if self._closed:
            raise EngineClosed("the remote engine was shut down")
        return self._pool.submit(self._run, request)

    def update_weights(self, params: Any, version: int) -> None:
        if version != self._version + 1:
            raise ValueError(f"update_weights: version must be {self._version + 1} (engine serves {self._version}), given {version}")
        path = self.write_weights(params, version)
        with self._update_lock:
            self._version = version  # new segments are checked against it from now on
            self._update_all(path, version)

    # ------------------------------------------------------------------ lifecycle, metrics

    def ensure_version(self, params: Any) -> None:
        """Bring servers that serve another version than ``self.version`` (fresh servers on a
        resumed run) to it, writing its weights first."""
        stale = [s for s in self.servers if s.healthy and s.version != self._version]
        if not stale:
            return
        path = self.write_weights(params, self._version)
        with self._update_lock:
            for server in stale:
                self._update_one(server, path, self._version)
            self._require_healthy("loading the starting weights")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop: pending requests fail with :class:`EngineClosed`; connections close."""
        self._closed = True
        self._stop_health.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._health is not None:
            self._health.join(timeout)
        for server in self.servers:
            server.client.close()

    close = shutdown

    def __enter__(self) -> "RemoteEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    crashed = None  # the protocol's JaxEngine attribute: a remote engine has no thread of its own to die

    def metrics(self) -> dict[str, float]:
        s = self._stats
        out = {
            "engine/version": float(self._version),
            "engine/requests": float(s["requests"]),
            "engine/samples_aborted": float(s["aborted"]),
            "engine/decode_tokens": float(s["tokens"]),
            "engine/retries": float(s["retries"]),
            "engine/resubmits": float(s["resubmits"]),
            "engine/swaps": float(s["swaps"]),
            "engine/healthy_servers": float(sum(srv.healthy for srv in self.servers)),
            "engine/pause_update_s": float(s["last_update_s"]),
        }
        for server in self.servers:
            out.update(server.metrics())
        return out

    def _count(self, name: str, value: float) -> None:
        with self._stats_lock:
            self._stats[name] += value

    # ------------------------------------------------------------------ HTTP

    def _call(self, server: _Server, method: str, path: str, body: Optional[dict] = None, *,
              timeout: Optional[float] = None, retries: Optional[int] = None) -> Any:
        """One call with retries on connection errors and 5xx (never 4xx); returns the JSON
        answer (None for an empty body). 4xx raises :class:`EngineRequestError` (400) or
        :class:`RemoteEngineError`; exhausting the retries raises :class:`ServerUnavailable`."""
        import httpx

        where = f"{server.url}{path}"
        tries = (self.retries if retries is None else retries) + 1
        last = ""
        for attempt in range(tries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            kwargs: dict[str, Any] = {"json": body} if body is not None else {}
            if timeout is not None:
                kwargs["timeout"] = httpx.Timeout(timeout, connect=self.connect_timeout_s)
            try:
                answer = server.client.request(method, path, **kwargs)
            except httpx.TransportError as err:
                last = f"{type(err).__name__}: {err}"
                continue
            if answer.status_code >= 500:
                last = f"HTTP {answer.status_code}: {_message(answer)}"
                continue
            if answer.status_code in (401, 403):
                raise RemoteEngineError(f"{where}: HTTP {answer.status_code}: {_message(answer)} "
                                        "(check engine.remote.api_key_env and the server's --api-key / --weights-root)")
            if answer.status_code >= 400:
                raise EngineRequestError(f"{where}: HTTP {answer.status_code}: {_message(answer)}")
            if not answer.content.strip():
                return None
            try:
                return answer.json()
            except ValueError:
                raise RemoteEngineError(f"{where}: the answer is not JSON: {answer.text[:200]!r}") from None
        with self._stats_lock:
            server.errors += 1
        raise ServerUnavailable(f"{where}: no answer after {tries} tries ({last})")

    def _check_servers(self) -> None:
        """Ask every server for its model and weights version; one try each, so an unreachable
        URL fails within the connect timeout."""
        for server in self.servers:
            try:
                info = self._call(server, "GET", "/get_model_info", timeout=self.read_timeout_s, retries=0)
            except ServerUnavailable as err:
                raise RemoteEngineError(f"engine.remote.urls: {server.url} is unreachable (connect timeout "
                                        f"{self.connect_timeout_s} s): {err}") from None
            server.version = self._info_version(server, info)
        logger.info("remote engine: %s", ", ".join(f"server{s.index}={s.url} (v{s.version})" for s in self.servers))

    def _info_version(self, server: _Server, info: Any) -> int:
        try:
            model_info = sp.ModelInfo.model_validate(info)
        except ValidationError as err:
            raise RemoteEngineError(f"{server.url}/get_model_info: the answer breaks SGLang's protocol: {err}") from None
        try:
            return sp.parse_version_label(model_info.weight_version, f"{server.url}/get_model_info")
        except ValueError as err:
            raise RemoteEngineError(str(err)) from None

    # ------------------------------------------------------------------ servers

    def _require_healthy(self, doing: str) -> list[_Server]:
        healthy = [s for s in self.servers if s.healthy]
        if not healthy:
            causes = "; ".join(f"{s.url}: {s.cause or 'unhealthy'}" for s in self.servers)
            raise RemoteEngineError(f"remote engine: no healthy inference server while {doing} ({causes})")
        return healthy

    def _mark_unhealthy(self, server: _Server, cause: str) -> None:
        with self._lock:
            if server.healthy:
                logger.warning("remote engine: %s is out of rotation: %s", server.url, cause)
            server.healthy = False
            server.cause = cause

    def _acquire(self, prefer: Optional[_Server]) -> _Server:
        with self._lock:
            if prefer is not None and prefer.healthy:
                server = prefer
            else:
                server = min(self._require_healthy("sending a request"), key=lambda s: s.outstanding)
            server.outstanding += 1
            return server

    def _release(self, server: _Server) -> None:
        with self._lock:
            server.outstanding -= 1

    def _health_loop(self, every_s: float) -> None:
        while not self._stop_health.wait(every_s):
            for server in self.servers:
                try:
                    self._check_one(server)
                except Exception as err:  # noqa: BLE001 - a health check never kills the trainer
                    logger.warning("remote engine: health check of %s failed: %s", server.url, err)

    def _check_one(self, server: _Server) -> None:
        try:
            self._call(server, "GET", "/health", timeout=self.connect_timeout_s, retries=0)
        except ServerUnavailable as err:
            self._mark_unhealthy(server, str(err))
            return
        if server.healthy or self.weights_dir is None:
            return
        with self._update_lock:  # rejoin: load the current version first
            info = self._call(server, "GET", "/get_model_info", timeout=self.connect_timeout_s, retries=0)
            served = self._info_version(server, info)
            if served != self._version:
                path = self.weights_dir / f"v{self._version}"
                if not path.is_dir():
                    return
                self._update_one(server, path, self._version, rejoin=True)
            else:
                server.version = served
                server.healthy = True
            if server.healthy:
                logger.warning("remote engine: %s rejoined at version %d", server.url, self._version)

    # ------------------------------------------------------------------ weights

    def write_weights(self, params: Any, version: int) -> Path:
        """``weights_dir/v{version}`` (written under a temporary name, then renamed); prunes old ones."""
        from asyncrl.model import export_hf

        if self.weights_dir is None or self.graphdef is None:
            raise RemoteEngineError("remote engine: publishing weights needs weights_dir and graphdef (train sets them)")
        from asyncrl.pytree import tree_to_host

        path = self.weights_dir / f"v{version}"
        export_hf(self.graphdef, self.tokenizer, path, params=tree_to_host(params),
                  stop_token_ids=self.stop_token_ids, overwrite=True)
        kept = sorted((p for p in self.weights_dir.glob("v*") if p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
        for old in kept[: -self.keep_weights]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def _update_all(self, path: Path, version: int) -> None:
        started = time.monotonic()
        healthy = self._require_healthy(f"publishing version {version}")
        errors: list[BaseException] = []

        def update(server: _Server) -> None:
            try:
                self._update_one(server, path, version)
            except BaseException as err:  # noqa: BLE001 - re-raised on the trainer's thread below
                errors.append(err)

        threads = [threading.Thread(target=update, args=(s,), name="asyncrl-remote-update", daemon=True) for s in healthy]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self._count("swaps", 1)
        self._stats["last_update_s"] = time.monotonic() - started
        self._require_healthy(f"publishing version {version}")

    def _update_one(self, server: _Server, path: Path, version: int, rejoin: bool = False) -> None:
        """pause -> update_weights_from_disk -> continue -> check, retried; else out of rotation."""
        body = sp.UpdateWeightFromDiskReqInput(model_path=str(path.resolve()), weight_version=sp.version_label(version))
        error = ""
        for attempt in range(self.update_retries + 1):
            started = time.monotonic()
            try:
                self._call(server, "POST", "/pause_generation", sp.PauseGenerationReqInput(mode=self.pause_mode).model_dump())
                try:
                    answer = self._call(server, "POST", "/update_weights_from_disk", body.model_dump(exclude_none=True))
                finally:
                    self._call(server, "POST", "/continue_generation", {})
                result = sp.UpdateWeightFromDiskReqOutput.model_validate(answer)
                if not result.success:
                    raise EngineRequestError(f"{server.url}/update_weights_from_disk: {result.message}")
                served = self._info_version(server, self._call(server, "GET", "/get_model_info"))
                if served != version:
                    raise RemoteEngineError(f"{server.url}: after loading {path} it reports weight_version {served}, not {version}")
                server.update_s.append(time.monotonic() - started)
                server.version = version
                if rejoin:
                    with self._lock:
                        server.healthy, server.cause = True, ""
                return
            except RemoteEngineError:
                raise
            except (ServerUnavailable, EngineRequestError, ValidationError) as err:
                error = str(err)
                logger.warning("remote engine: update of %s to version %d failed (try %d): %s", server.url, version, attempt + 1, err)
        if not rejoin:
            self._mark_unhealthy(server, f"weight update to version {version} failed: {error}")

    # ------------------------------------------------------------------ generation

    def _run(self, request: GenerationRequest) -> list[GenerationResponse]:
        deadline = None if request.timeout_s is None else time.monotonic() + request.timeout_s
        samples = [_Sample() for _ in range(request.n)]
        server: Optional[_Server] = None
        while True:
            todo = [i for i, s in enumerate(samples) if s.stop_reason is None]
            if not todo:
                break
            if self._closed:
                raise EngineClosed("the remote engine was shut down")
            if deadline is not None and time.monotonic() > deadline:
                for i in todo:
                    samples[i].stop_reason = "aborted"
                    self._count("aborted", 1)
                break
            server = self._acquire(server)
            try:
                self._segment(server, request, samples, todo, deadline)
            except ServerUnavailable as err:
                self._mark_unhealthy(server, str(err))
                self._count("retries", 1)
                logger.warning("remote engine: resubmitting %d sample(s) elsewhere: %s", len(todo), err)
            finally:
                self._release(server)
        self._count("requests", 1)
        return [
            GenerationResponse(
                output_ids=np.asarray(s.tokens, np.int32), logprobs=np.asarray(s.logprobs, np.float32),
                versions=np.asarray(s.versions, np.int32), stop_reason=s.stop_reason or "aborted",
            )
            for s in samples
        ]

    def _segment(self, server: _Server, request: GenerationRequest, samples: list[_Sample], todo: list[int],
                 deadline: Optional[float]) -> None:
        """One ``/generate`` call for the unfinished samples ``todo``; appends what came back."""
        body = self._body(request, samples, todo)
        submitted_version = server.version
        timeout = self.read_timeout_s if deadline is None else max(0.1, min(self.read_timeout_s, deadline - time.monotonic()))
        started = time.monotonic()
        raw = self._call(server, "POST", "/generate", body.model_dump(exclude_none=True), timeout=timeout)
        with self._stats_lock:
            server.busy_s += time.monotonic() - started
            server.latencies.append(time.monotonic() - started)
            server.requests += 1
        try:
            answer = sp.GenerateResponse.validate_python(raw)
        except ValidationError as err:
            raise RemoteEngineError(f"{server.url}/generate: the answer breaks SGLang's protocol: {err}") from None
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(todo):
            raise RemoteEngineError(f"{server.url}/generate: {len(items)} answers for {len(todo)} prompts")
        for i, item in zip(todo, items):
            version = self._segment_version(server, item, submitted_version)
            self._append(request, samples[i], item, version, server)

    def _body(self, request: GenerationRequest, samples: list[_Sample], todo: list[int]) -> sp.GenerateReqInput:
        prompts, params = [], []
        for i in todo:
            s = samples[i]
            prompts.append([int(t) for t in request.prompt_ids] + s.tokens)
            params.append(sp.SamplingParams(
                max_new_tokens=request.max_new_tokens - len(s.tokens),
                min_new_tokens=max(0, request.min_new_tokens - len(s.tokens)),
                temperature=0.0 if request.greedy else request.temperature,
                top_p=request.top_p, top_k=request.top_k if request.top_k > 0 else -1,
                # SGLang adds stop_token_ids to the model's EOS ids; an explicitly empty list means none at all.
                stop_token_ids=list(request.stop_token_ids) if request.stop_token_ids else None,
                ignore_eos=request.stop_token_ids is not None and len(request.stop_token_ids) == 0,
                custom_params={"asyncrl_key": [request.sample_id, request.index_in_group + i,
                                               request.turn + s.segments * SEGMENT_TURN_STRIDE]},
            ))
            s.segments += 1
        return sp.GenerateReqInput(input_ids=prompts, sampling_params=params, return_logprob=True)

    def _segment_version(self, server: _Server, item: sp.GenerateItem, submitted: int) -> int:
        where = f"{server.url}/generate"
        try:
            version = sp.parse_version_label(item.meta_info.weight_version, where)
        except ValueError as err:
            raise RemoteEngineError(str(err)) from None
        # The server can only hold versions between the one it served when the segment was sent
        # and the newest one published: anything else means someone else updates it.
        if not submitted <= version <= self._version:
            raise RemoteEngineError(
                f"{where}: answered weight_version {version}, but it served {submitted} when the request was sent and the "
                f"trainer has published up to {self._version}: is another trainer updating this server?"
            )
        return version if self.pause_mode == "abort" else submitted

    def _append(self, request: GenerationRequest, sample: _Sample, item: sp.GenerateItem, version: int, server: _Server) -> None:
        meta = item.meta_info
        tokens = [int(t) for t in item.output_ids]
        logprobs = meta.output_token_logprobs
        if logprobs is None or len(logprobs) != len(tokens) or any(int(t) != lp[1] for t, lp in zip(tokens, logprobs)):
            raise RemoteEngineError(f"{server.url}/generate: meta_info.output_token_logprobs does not match output_ids")
        start = len(sample.tokens)
        sample.tokens += tokens
        sample.logprobs += [float(lp[0]) for lp in logprobs]
        sample.versions += [version] * len(tokens)
        with self._stats_lock:
            server.tokens += len(tokens)
        self._count("tokens", len(tokens))
        if _cut_at_stop_sequence(sample, request, start):
            return
        kind = meta.finish_reason.type if meta.finish_reason is not None else "abort"
        if kind == "stop":
            sample.stop_reason = "eos"
        elif kind == "length" or len(sample.tokens) >= request.max_new_tokens:
            sample.stop_reason = "length"
        elif sample.segments >= self.max_segments:
            sample.stop_reason = "aborted"
            self._count("aborted", 1)
        else:
            self._count("resubmits", 1)  # cut by a pause: resubmitted with its tokens so far


def _cut_at_stop_sequence(sample: _Sample, request: GenerationRequest, start: int) -> bool:
    """End ``sample`` at the first stop sequence completed at or after position ``start``
    (the server knows only stop ids; tokens it drew past the match are dropped)."""
    sequences = [list(map(int, s)) for s in request.stop_sequences if len(s) > 0]
    if not sequences:
        return False
    for pos in range(max(start, request.min_new_tokens - 1, 0), len(sample.tokens)):
        for seq in sequences:
            if pos + 1 >= len(seq) and sample.tokens[pos + 1 - len(seq) : pos + 1] == seq:
                del sample.tokens[pos + 1 :], sample.logprobs[pos + 1 :], sample.versions[pos + 1 :]
                sample.stop_reason = "stop"
                return True
    return False


def _message(answer: Any) -> str:
    """The error text of a non-200 answer (SGLang/asyncrl serve JSON, or the raw body)."""
    try:
        data = answer.json()
    except ValueError:
        return answer.text[:300]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
    return str(data)[:300]
