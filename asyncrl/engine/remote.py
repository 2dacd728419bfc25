"""RemoteEngine: the InferenceEngine protocol over inference servers speaking SGLang's native HTTP API.

(Past 600 lines as one class on purpose: its scheduling, health rotation, publish and segment
bookkeeping share one server list, one lock and one set of counters; one server's HTTP client,
retries and health are apart, in :mod:`asyncrl.engine.remote_server`.)

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

Weights. ``update_weights(params, N)`` writes ``weights/vN`` (a sharded HF safetensors directory
in ``engine.remote.dtype``, each process of the run writing its share, complete or absent:
:class:`~asyncrl.engine.publish.WeightsWriter`; older versions removed, the last ``keep_weights``
kept), then (:meth:`RemoteEngine.load_version`) on every healthy server: ``/pause_generation`` -> ``/update_weights_from_disk(model_path, weight_version=N)``
-> ``/continue_generation``, and checks ``/get_model_info`` reports ``N``. A server that fails is
retried ``update_retries`` times, then marked unhealthy. A health thread re-admits a server that
answers again once it has loaded the current version.

Adapters (``engine.remote.publish_adapters`` with ``model.lora``; :meth:`RemoteEngine.update_lora`).
The first publish writes the frozen base once (the same sharded directory, unmerged) and each
publish writes only the adapters, ``weights/adapters/vN`` in PEFT's format (megabytes); every
healthy server gets ``/pause_generation`` -> (``/update_weights_from_disk`` of the base, the first
time) -> ``/load_lora_adapter(lora_name="asyncrl-vN")`` -> ``/unload_lora_adapter`` of all but the
previous adapter -> ``/continue_generation``. Each ``/generate`` names the newest adapter in
``lora_path``, and its tokens carry that adapter's version, so per-token versions stay exact
(a request held across the swap still names the previous adapter, which is still loaded; one sent
without an adapter that the server ran on the bare base, labelled with the base's version, is
discarded and resubmitted under the adapter). A full
publish (:meth:`update_weights`, a resumed run's first version) goes back to serving merged weights
and the next adapter publish writes the base again.

Log-probs are the server's (``log softmax(logits / T)`` of the sampled token, before top-k/top-p;
temperature 0 is greedy). SGLang must run without ``SGLANG_RETURN_ORIGINAL_LOGPROB``.

This module is the scheduling and publish logic; one server's HTTP calls, retries, health state
and figures are :class:`~asyncrl.engine.remote_server.RemoteServer`'s.
It stays one file: scheduling, resubmission after a pause and the publish share one lock and
one record of what each server serves, and the per-token versions are exact only if they are
read and changed in one place.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
from pydantic import ValidationError

from asyncrl.config import RemoteEngineConfig
from asyncrl.engine import sglang_protocol as sp
from asyncrl.engine.protocol import GenerationRequest, GenerationResponse, RequestUsage, StopReason
from asyncrl.engine.publish import ADAPTERS_DIR
from asyncrl.engine.remote_server import RemoteEngineError, RemoteEngineStartupError, RemoteServer, ServerUnavailable
from asyncrl.errors import EngineClosed, EngineRequestError
from asyncrl.registry import register

logger = logging.getLogger("asyncrl.engine.remote")

SEGMENT_TURN_STRIDE = 1 << 20
"""Segment ``k`` of a sample folds key turn ``turn + k * SEGMENT_TURN_STRIDE``."""


class _Sample:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.stop_reason: Optional[StopReason] = None
        self.segments = 0


@dataclasses.dataclass
class RemoteStats:
    """The cumulative figures behind :meth:`RemoteEngine.metrics` (fields, so a misspelt name is an error)."""

    requests: int = 0  # generate/submit calls accepted
    aborted: int = 0  # samples ended by abort
    tokens: int = 0  # tokens the servers returned
    prefill_tokens: int = 0  # prompt tokens the servers computed (meta_info: prompt_tokens - cached_tokens)
    prefix_hit_tokens: int = 0  # prompt tokens the servers took from their prefix caches (cached_tokens)
    retries: int = 0  # requests retried after a failed try
    resubmits: int = 0  # samples cut by a pause and resubmitted with their tokens so far
    swaps: int = 0  # weight versions loaded by the servers
    last_update_s: float = 0.0  # wall time of the last pause -> load -> continue

@register("engine", "remote")
class RemoteEngine:
    """An :class:`~asyncrl.engine.protocol.InferenceEngine` over SGLang-API servers.

    Args:
        settings: the ``engine.remote`` section (:class:`~asyncrl.config.RemoteEngineConfig`):
            server URLs, HTTP timeouts, retries and backoff, pause mode, update retries, health
            check period, concurrency, weights kept and segments per sample, each documented there.
        graphdef: the policy's graphdef (its config names the published tensors); ``tokenizer`` and
            ``stop_token_ids`` are written beside the weights.
        weights_dir: where ``v{N}`` weight directories go (every server must read this path).
        writer: the :class:`~asyncrl.engine.publish.WeightsWriter` to publish with (a multi-process
            run shares it with the processes that have no engine); default: one for ``weights_dir``.
        version: the version the servers must serve at start (``k`` on resume).
        api_key: sent as ``Authorization: Bearer``.
        check: query every server at start (an unreachable URL fails within ``connect_timeout_s``).
    """

    def __init__(
        self,
        settings: RemoteEngineConfig,
        *,
        graphdef: Any = None,
        tokenizer: Any = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        weights_dir: Optional[str | os.PathLike] = None,
        writer: Any = None,
        version: int = 0,
        api_key: Optional[str] = None,
        check: bool = True,
    ):
        import httpx

        self.settings = settings  # the engine.remote section: timeouts, retries, pause mode, limits
        self.graphdef = graphdef
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None else None
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.writer = writer
        if writer is not None and self.weights_dir is None:
            self.weights_dir = writer.weights_dir
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        concurrent = settings.max_concurrent_requests
        limits = httpx.Limits(max_connections=concurrent + 8, max_keepalive_connections=concurrent + 8)
        timeout = httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s)
        self.servers = [
            RemoteServer(i, url, httpx.Client(base_url=url.rstrip("/"), timeout=timeout, limits=limits, headers=self._headers),
                         connect_timeout_s=settings.connect_timeout_s, retries=settings.retries, backoff_s=settings.backoff_s)
            for i, url in enumerate(settings.urls)
        ]
        self._version = int(version)
        self._adapter: Optional[tuple[str, int]] = None
        """``(lora_name, version)`` that new requests name; None: plain weights."""
        self._loaded_adapters: list[str] = []
        self._base_published: Optional[int] = None
        """The version label of the unmerged base the servers hold (the first adapter publish wrote it)."""
        self._lock = threading.Condition()
        self._update_lock = threading.Lock()
        self._closed = False
        self._stats = RemoteStats()
        self._stats_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(concurrent, thread_name_prefix="asyncrl-remote")
        if check:
            try:
                self._check_servers()
            except RemoteEngineError as err:  # nothing has run yet: a user error, shown in one line
                self._pool.shutdown(wait=False)
                for server in self.servers:
                    server.client.close()
                raise RemoteEngineStartupError(str(err)) from None
        self._stop_health = threading.Event()
        self._health: Optional[threading.Thread] = None
        if settings.health_check_every_s > 0:
            self._health = threading.Thread(target=self._health_loop, args=(settings.health_check_every_s,),
                                             name="asyncrl-remote-health", daemon=True)
            self._health.start()

    @classmethod
    def from_config(cls, settings: RemoteEngineConfig, *, version: int = 0, **kwargs: Any) -> "RemoteEngine":
        """An engine for an ``engine.remote`` section, its API key read from ``settings.api_key_env``."""
        key = os.environ.get(settings.api_key_env) if settings.api_key_env else None
        return cls(settings, version=version, api_key=key or None, **kwargs)

    # ------------------------------------------------------------------ protocol

    @property
    def version(self) -> int:
        return self._version

    def generate(self, request: GenerationRequest) -> list[GenerationResponse]:
        return self.submit(request).result()

    def submit(self, request: GenerationRequest) -> "Future[list[GenerationResponse]]":
        if not isinstance(request, GenerationRequest):
            raise EngineRequestError(f"expected a GenerationRequest, got {type(request).__name__}")
        if request.constraint is not None or request.beam:
            raise EngineRequestError("GenerationRequest: trie constraints and beam search need the in-process JAX engine "
                                     "(the remote engine only samples or decodes greedily; docs/decoding.md)")
        if self._closed:
            raise EngineClosed("the remote engine was shut down")
        return self._pool.submit(self._run, request)

    def update_weights(self, params: Any, version: int) -> None:
        if version != self._version + 1:
            raise ValueError(f"update_weights: version must be {self._version + 1} (engine serves {self._version}), given {version}")
        self.load_version(self.write_weights(params, version), version)

    def load_version(self, path: Path, version: int) -> None:
        """Have every healthy server load ``path`` (written by :meth:`write_weights`, by every
        process of the run) as ``version``: the server half of :meth:`update_weights`."""
        if version != self._version + 1:
            raise ValueError(f"load_version: version must be {self._version + 1} (engine serves {self._version}), given {version}")
        with self._update_lock:
            self._version = version  # new segments are checked against it from now on
            self._update_all(path, version)
            self._adapter, self._base_published = None, None

    def update_lora(self, base_params: Any, adapters: Any, spec: Any, version: int) -> None:
        """Publish version ``version`` as LoRA adapters on the base (module docstring): the base
        once (the first time, or after a full publish), then the adapters alone. ``base_params``:
        the frozen base (the trainer's ``base_params``); ``adapters``: ``{...: {"lora": {"lora_a",
        "lora_b"}}}``; ``spec``: the :class:`~asyncrl.model.lora.LoraSpec`. One process writes
        (multi-process runs publish merged weights)."""
        if version != self._version + 1:
            raise ValueError(f"update_lora: version must be {self._version + 1} (engine serves {self._version}), given {version}")
        with self._update_lock:
            base = None if self._base_published is not None else self.write_weights(base_params, version)
            assert self.writer is not None  # write_weights made it
            adapter = self.writer.write_adapter(adapters, spec, version)
            name = adapter_name(version)
            unload = self._loaded_adapters[:-1]
            self._version = version
            started = time.monotonic()
            healthy = self._require_healthy(f"publishing adapter version {version}")
            _on_every_server(healthy, lambda server: self._retry(
                server, version, lambda: server.load_adapter(base, adapter, name, version, unload, self.settings.pause_mode)))
            if base is not None:
                self._base_published = version
            self._loaded_adapters = [n for n in self._loaded_adapters if n not in unload] + [name]
            self._adapter = (name, version)
            self._count("swaps", 1)
            self._stats.last_update_s = time.monotonic() - started
            self._require_healthy(f"publishing adapter version {version}")

    # ------------------------------------------------------------------ lifecycle, metrics

    def ensure_version(self, params: Any, written: Optional[Path] = None) -> None:
        """Bring servers that serve another version than ``self.version`` (fresh servers on a
        resumed run) to it, writing its weights first (or loading ``written``, already written by
        every process of a multi-process run)."""
        stale = [s for s in self.servers if s.healthy and s.version != self._version]
        if not stale:
            return
        path = written if written is not None else self.write_weights(params, self._version)
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
            "engine/requests": float(s.requests),
            "engine/samples_aborted": float(s.aborted),
            "engine/decode_tokens": float(s.tokens),
            "engine/prefill_tokens": float(s.prefill_tokens),
            "engine/prefix_hit_tokens": float(s.prefix_hit_tokens),
            "engine/prefix_hit_rate": (s.prefix_hit_tokens / (s.prefix_hit_tokens + s.prefill_tokens)
                                       if s.prefix_hit_tokens + s.prefill_tokens else 0.0),
            "engine/retries": float(s.retries),
            "engine/resubmits": float(s.resubmits),
            "engine/swaps": float(s.swaps),
            "engine/healthy_servers": float(sum(srv.healthy for srv in self.servers)),
            "engine/pause_update_s": float(s.last_update_s),
        }
        for server in self.servers:
            out.update(server.metrics())
        return out

    def _count(self, name: str, value: float = 1, usage: Optional[RequestUsage] = None) -> None:
        """Add ``value`` to the :class:`RemoteStats` field ``name`` (an unknown name is an error), and
        to the request's ``usage`` where the field is one of its counters."""
        with self._stats_lock:
            setattr(self._stats, name, getattr(self._stats, name) + value)
        field = _USAGE_FIELDS.get(name)
        if usage is not None and field is not None:
            setattr(usage, field, getattr(usage, field) + int(value))

    def _check_servers(self) -> None:
        """Ask every server for its model and weights version; one try each, so an unreachable
        URL fails within the connect timeout."""
        for server in self.servers:
            try:
                server.version = server.served_version(timeout=self.settings.read_timeout_s, retries=0)
            except ServerUnavailable as err:
                raise RemoteEngineError(f"engine.remote.urls: {server.url} is unreachable (connect timeout "
                                        f"{self.settings.connect_timeout_s} s): {err}") from None
        logger.info("remote engine: %s", ", ".join(f"server{s.index}={s.url} (v{s.version})" for s in self.servers))

    # ------------------------------------------------------------------ servers

    def _require_healthy(self, doing: str) -> list[RemoteServer]:
        healthy = [s for s in self.servers if s.healthy]
        if not healthy:
            causes = "; ".join(f"{s.url}: {s.cause or 'unhealthy'}" for s in self.servers)
            raise RemoteEngineError(f"remote engine: no healthy inference server while {doing} ({causes})")
        return healthy

    def _mark_unhealthy(self, server: RemoteServer, cause: str) -> None:
        with self._lock:
            if server.healthy:
                logger.warning("remote engine: %s is out of rotation: %s", server.url, cause)
            server.healthy = False
            server.cause = cause

    def _acquire(self, prefer: Optional[RemoteServer]) -> RemoteServer:
        with self._lock:
            if prefer is not None and prefer.healthy:
                server = prefer
            else:
                server = min(self._require_healthy("sending a request"), key=lambda s: s.outstanding)
            server.outstanding += 1
            return server

    def _release(self, server: RemoteServer) -> None:
        with self._lock:
            server.outstanding -= 1

    def _health_loop(self, every_s: float) -> None:
        while not self._stop_health.wait(every_s):
            for server in self.servers:
                try:
                    self._check_one(server)
                except Exception as err:  # noqa: BLE001 - a health check never kills the trainer
                    logger.warning("remote engine: health check of %s failed: %s", server.url, err)

    def _check_one(self, server: RemoteServer) -> None:
        try:
            server.call("GET", "/health", timeout=self.settings.connect_timeout_s, retries=0)
        except ServerUnavailable as err:
            self._mark_unhealthy(server, str(err))
            return
        if server.healthy or self.weights_dir is None:
            return
        with self._update_lock:  # rejoin: load the current version first
            served = server.served_version(timeout=self.settings.connect_timeout_s, retries=0)
            if served != self._version and self._adapter is not None and self._base_published is not None:
                name, version = self._adapter  # adapter publishes: the base, then the current adapter
                base = self.weights_dir / f"v{self._base_published}"
                adapter = self.weights_dir / ADAPTERS_DIR / f"v{version}"
                if not (base.is_dir() and adapter.is_dir()):
                    return
                self._retry(server, version, lambda: server.load_adapter(base, adapter, name, version, [], self.settings.pause_mode,
                                                                         replace=True), rejoin=True)
            elif served != self._version:
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
        """``weights_dir/v{version}`` (:class:`~asyncrl.engine.publish.WeightsWriter`: sharded, in
        ``engine.remote.dtype``, complete or absent); prunes old ones. In a multi-process run every
        process calls it (each writes its share)."""
        if self.writer is None:
            if self.weights_dir is None or self.graphdef is None:
                raise RemoteEngineError("remote engine: publishing weights needs weights_dir and graphdef (train sets them)")
            from asyncrl.engine.jax_programs import graphdef_config
            from asyncrl.engine.publish import WeightsWriter

            self.writer = WeightsWriter(graphdef_config(self.graphdef, params), self.weights_dir,
                                        dtype=self.settings.dtype, keep=self.settings.keep_weights,
                                        tokenizer=self.tokenizer, stop_token_ids=self.stop_token_ids)
        return self.writer.write(params, version)

    def _update_all(self, path: Path, version: int) -> None:
        started = time.monotonic()
        healthy = self._require_healthy(f"publishing version {version}")
        _on_every_server(healthy, lambda server: self._update_one(server, path, version))
        self._count("swaps", 1)
        self._stats.last_update_s = time.monotonic() - started
        self._require_healthy(f"publishing version {version}")

    def _update_one(self, server: RemoteServer, path: Path, version: int, rejoin: bool = False) -> None:
        """pause -> update_weights_from_disk -> continue -> check (:meth:`RemoteServer.load_weights`),
        retried; else out of rotation."""
        self._retry(server, version, lambda: server.load_weights(path, version, self.settings.pause_mode), rejoin)

    def _retry(self, server: RemoteServer, version: int, load: Callable[[], Any], rejoin: bool = False) -> None:
        """``load()`` (one try of a server's update), retried ``update_retries`` times; else out of rotation."""
        error = ""
        for attempt in range(self.settings.update_retries + 1):
            try:
                load()
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
        usage = RequestUsage()
        server: Optional[RemoteServer] = None
        while True:
            todo = [i for i, s in enumerate(samples) if s.stop_reason is None]
            if not todo:
                break
            if self._closed:
                raise EngineClosed("the remote engine was shut down")
            if deadline is not None and time.monotonic() > deadline:
                for i in todo:
                    samples[i].stop_reason = "aborted"
                    self._count("aborted", 1, usage)
                break
            server = self._acquire(server)
            try:
                self._segment(server, request, samples, todo, deadline, usage)
            except ServerUnavailable as err:
                self._mark_unhealthy(server, str(err))
                self._count("retries", 1)
                logger.warning("remote engine: resubmitting %d sample(s) elsewhere: %s", len(todo), err)
            finally:
                self._release(server)
        self._count("requests", 1, usage)
        return [
            GenerationResponse(
                output_ids=np.asarray(s.tokens, np.int32), logprobs=np.asarray(s.logprobs, np.float32),
                versions=np.asarray(s.versions, np.int32), stop_reason=s.stop_reason or "aborted", usage=usage,
            )
            for s in samples
        ]

    def _segment(self, server: RemoteServer, request: GenerationRequest, samples: list[_Sample], todo: list[int],
                 deadline: Optional[float], usage: RequestUsage) -> None:
        """One ``/generate`` call for the unfinished samples ``todo``; appends what came back."""
        adapter = self._adapter
        body = self._body(request, samples, todo, adapter)
        submitted_version = server.version
        timeout = self.settings.read_timeout_s if deadline is None else max(0.1, min(self.settings.read_timeout_s, deadline - time.monotonic()))
        started = time.monotonic()
        raw = server.call("POST", "/generate", body.model_dump(exclude_none=True), timeout=timeout)
        server.record_generate(time.monotonic() - started)
        try:
            answer = sp.GenerateResponse.validate_python(raw)
        except ValidationError as err:
            raise RemoteEngineError(f"{server.url}/generate: the answer breaks SGLang's protocol: {err}") from None
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(todo):
            raise RemoteEngineError(f"{server.url}/generate: {len(items)} answers for {len(todo)} prompts")
        for i, item in zip(todo, items):
            if adapter is None and self._ran_on_bare_base(item):
                item = _discarded(item)  # no tokens, finish abort: resubmitted under the adapter
            version = self._segment_version(server, item, submitted_version) if adapter is None else adapter[1]
            self._append(request, samples[i], item, version, server, usage)

    def _body(self, request: GenerationRequest, samples: list[_Sample], todo: list[int],
              adapter: Optional[tuple[str, int]] = None) -> sp.GenerateReqInput:
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
        return sp.GenerateReqInput(input_ids=prompts, sampling_params=params, return_logprob=True,
                                   lora_path=adapter[0] if adapter is not None else None)

    def _ran_on_bare_base(self, item: sp.GenerateItem) -> bool:
        """A request sent without an adapter that a server ran on the base of an adapter publish
        (its label is the base's version or later): its tokens are of no trainer version."""
        base = self._base_published
        if base is None:
            return False
        try:
            return sp.parse_version_label(item.meta_info.weight_version, "") >= base
        except ValueError:
            return False

    def _segment_version(self, server: RemoteServer, item: sp.GenerateItem, submitted: int) -> int:
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
        return version if self.settings.pause_mode == "abort" else submitted

    def _append(self, request: GenerationRequest, sample: _Sample, item: sp.GenerateItem, version: int, server: RemoteServer,
                usage: RequestUsage) -> None:
        meta = item.meta_info
        tokens = [int(t) for t in item.output_ids]
        logprobs = meta.output_token_logprobs
        if logprobs is None or len(logprobs) != len(tokens) or any(int(t) != lp[1] for t, lp in zip(tokens, logprobs)):
            raise RemoteEngineError(f"{server.url}/generate: meta_info.output_token_logprobs does not match output_ids")
        start = len(sample.tokens)
        sample.tokens += tokens
        sample.logprobs += [float(lp[0]) for lp in logprobs]
        sample.versions += [version] * len(tokens)
        server.record_tokens(len(tokens))
        self._count("tokens", len(tokens), usage)
        cached = min(meta.cached_tokens, meta.prompt_tokens)
        self._count("prefill_tokens", meta.prompt_tokens - cached, usage)
        self._count("prefix_hit_tokens", cached, usage)
        if _cut_at_stop_sequence(sample, request, start):
            return
        kind = meta.finish_reason.type if meta.finish_reason is not None else "abort"
        if kind == "stop":
            sample.stop_reason = "eos"
        elif kind == "length" or len(sample.tokens) >= request.max_new_tokens:
            sample.stop_reason = "length"
        elif sample.segments >= self.settings.max_segments:
            sample.stop_reason = "aborted"
            self._count("aborted", 1, usage)
        else:
            self._count("resubmits", 1)  # cut by a pause: resubmitted with its tokens so far


_USAGE_FIELDS = {"requests": "requests", "aborted": "samples_aborted", "tokens": "decode_tokens",
                 "prefill_tokens": "prefill_tokens", "prefix_hit_tokens": "prefix_hit_tokens"}
"""The :class:`RemoteStats` fields a request's :class:`~asyncrl.engine.protocol.RequestUsage` mirrors."""


def _discarded(item: sp.GenerateItem) -> sp.GenerateItem:
    """``item`` with its tokens dropped and finish type ``abort`` (so it is resubmitted)."""
    meta = item.meta_info.model_copy(update={"output_token_logprobs": [], "completion_tokens": 0,
                                             "finish_reason": sp.FinishReason(type="abort", message="ran on the bare LoRA base")})
    return item.model_copy(update={"output_ids": [], "meta_info": meta})


def adapter_name(version: int) -> str:
    """The ``lora_name`` of the adapter of trainer version ``version`` (what requests give as ``lora_path``)."""
    return f"asyncrl-v{int(version)}"


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


def _on_every_server(servers: list[RemoteServer], update: Callable[[RemoteServer], Any]) -> None:
    """``update(server)`` on every server at once, one daemon thread each (each call's HTTP
    requests are bounded by their timeouts and retries); the first failure is raised here, on
    the trainer's thread, after all have ended."""
    errors: list[BaseException] = []

    def run(server: RemoteServer) -> None:
        try:
            update(server)
        except BaseException as err:  # noqa: BLE001 - re-raised on the trainer's thread below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(s,), name="asyncrl-remote-update", daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
