"""One inference server of a :class:`~asyncrl.engine.remote.RemoteEngine`: its HTTP client, health and figures.

:class:`RemoteServer` makes one server's calls of SGLang's native HTTP API (retries with
exponential backoff on connection errors and 5xx, never on 4xx; answers validated against
:mod:`asyncrl.engine.sglang_protocol`), and holds what the engine knows of it: healthy or not
and why, the weights version it serves, its outstanding requests, and its figures for the
``engine/server{i}/*`` metrics. Which server gets a request, when one leaves or rejoins the
rotation and the order of a weight publish are the engine's (:mod:`asyncrl.engine.remote`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from pydantic import ValidationError

from asyncrl.engine import sglang_protocol as sp
from asyncrl.errors import AsyncRLError, EngineCrashed, EngineRequestError

logger = logging.getLogger("asyncrl.engine.remote")


class RemoteEngineError(EngineCrashed):
    """The servers cannot serve: none healthy, an answer that breaks the protocol, a refused
    key or path. Stops training (it is an :class:`EngineCrashed`); the message names the URL."""

    def __init__(self, message: str):
        super().__init__(message)


class RemoteEngineStartupError(RemoteEngineError, AsyncRLError):
    """The servers failed the start-up check (unreachable, a refused key, a ``weight_version``
    that is not an asyncrl version): nothing has run, so it is a user error (one line, no traceback)."""


class ServerUnavailable(Exception):
    """A server did not answer (connection error, timeout, 5xx) after its retries."""


class RemoteServer:
    """One server: its client, health, served version and figures.

    ``client`` is an ``httpx.Client`` on the server's base URL (timeouts, pooled connections and
    the API key set by the engine); ``retries`` and ``backoff_s`` are the default retry policy
    of :meth:`call`, ``connect_timeout_s`` the connect part of a per-call timeout. ``healthy``,
    ``cause`` and ``outstanding`` are read and written under the engine's lock."""

    def __init__(self, index: int, url: str, client: Any, *, connect_timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.5):
        self.index = index
        self.url = url.rstrip("/")
        self.client = client
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
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
        self._figures_lock = threading.Lock()

    # ------------------------------------------------------------------ figures

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

    def record_generate(self, seconds: float) -> None:
        """Count one ``/generate`` call that took ``seconds``."""
        with self._figures_lock:
            self.busy_s += seconds
            self.latencies.append(seconds)
            self.requests += 1

    def record_tokens(self, count: int) -> None:
        with self._figures_lock:
            self.tokens += count

    # ------------------------------------------------------------------ HTTP

    def call(self, method: str, path: str, body: Optional[dict] = None, *,
             timeout: Optional[float] = None, retries: Optional[int] = None) -> Any:
        """One call with retries on connection errors and 5xx (never 4xx); returns the JSON
        answer (None for an empty body). 4xx raises :class:`EngineRequestError` (400) or
        :class:`RemoteEngineError`; exhausting the retries raises :class:`ServerUnavailable`."""
        import httpx

        where = f"{self.url}{path}"
        tries = (self.retries if retries is None else retries) + 1
        last = ""
        for attempt in range(tries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            kwargs: dict[str, Any] = {"json": body} if body is not None else {}
            if timeout is not None:
                kwargs["timeout"] = httpx.Timeout(timeout, connect=self.connect_timeout_s)
            try:
                answer = self.client.request(method, path, **kwargs)
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
        with self._figures_lock:
            self.errors += 1
        raise ServerUnavailable(f"{where}: no answer after {tries} tries ({last})")

    def served_version(self, *, timeout: Optional[float] = None, retries: Optional[int] = None) -> int:
        """The weights version ``/get_model_info`` reports (:class:`RemoteEngineError` when its
        answer breaks the protocol)."""
        info = self.call("GET", "/get_model_info", timeout=timeout, retries=retries)
        try:
            model_info = sp.ModelInfo.model_validate(info)
        except ValidationError as err:
            raise RemoteEngineError(f"{self.url}/get_model_info: the answer breaks SGLang's protocol: {err}") from None
        try:
            return sp.parse_version_label(model_info.weight_version, f"{self.url}/get_model_info")
        except ValueError as err:
            raise RemoteEngineError(str(err)) from None

    def load_weights(self, path: Path, version: int, pause_mode: sp.PauseMode) -> None:
        """One try of ``/pause_generation`` -> ``/update_weights_from_disk`` -> ``/continue_generation``
        (always sent once paused), then a check that the server reports ``version``; records the
        time taken and the new version. Raises :class:`ServerUnavailable`, :class:`EngineRequestError`
        or ``ValidationError`` for a failed try (the engine retries), :class:`RemoteEngineError`
        when the server loaded something else."""
        body = sp.UpdateWeightFromDiskReqInput(model_path=str(path.resolve()), weight_version=sp.version_label(version))
        started = time.monotonic()
        self.call("POST", "/pause_generation", sp.PauseGenerationReqInput(mode=pause_mode).model_dump())
        try:
            answer = self.call("POST", "/update_weights_from_disk", body.model_dump(exclude_none=True))
        finally:
            self.call("POST", "/continue_generation", {})
        result = sp.UpdateWeightFromDiskReqOutput.model_validate(answer)
        if not result.success:
            raise EngineRequestError(f"{self.url}/update_weights_from_disk: {result.message}")
        served = self.served_version()
        if served != version:
            raise RemoteEngineError(f"{self.url}: after loading {path} it reports weight_version {served}, not {version}")
        self.update_s.append(time.monotonic() - started)
        self.version = version


    def load_adapter(self, base: Optional[Path], adapter: Path, name: str, version: int, unload: Sequence[str],
                     pause_mode: sp.PauseMode, replace: bool = False) -> None:
        """One try of an adapter-only publish: ``/pause_generation`` -> (``/update_weights_from_disk``
        of ``base`` as ``version``, the first time) -> ``/load_lora_adapter(name, adapter)`` ->
        ``/unload_lora_adapter`` of each of ``unload`` -> ``/continue_generation`` (always sent once
        paused). Requests then name ``name`` (:meth:`RemoteEngine._body`); the version of their tokens
        is the adapter's. ``replace``: first unload ``name`` if the server still has it (a server
        rejoining). Raises like :meth:`load_weights`."""
        started = time.monotonic()
        self.call("POST", "/pause_generation", sp.PauseGenerationReqInput(mode=pause_mode).model_dump())
        try:
            if base is not None:
                body = sp.UpdateWeightFromDiskReqInput(model_path=str(base.resolve()), weight_version=sp.version_label(version))
                result = sp.UpdateWeightFromDiskReqOutput.model_validate(
                    self.call("POST", "/update_weights_from_disk", body.model_dump(exclude_none=True)))
                if not result.success:
                    raise EngineRequestError(f"{self.url}/update_weights_from_disk: {result.message}")
            for old in [name] if replace else []:
                try:
                    self.call("POST", "/unload_lora_adapter", sp.UnloadLoRAAdapterReqInput(lora_name=old).model_dump())
                except EngineRequestError:
                    pass  # it did not have it: the usual case for a restarted server
            load = sp.LoadLoRAAdapterReqInput(lora_name=name, lora_path=str(adapter.resolve()))
            loaded = sp.LoRAUpdateOutput.model_validate(self.call("POST", "/load_lora_adapter", load.model_dump()))
            if not loaded.success:
                raise EngineRequestError(f"{self.url}/load_lora_adapter: {loaded.error_message}")
            for old in unload:  # an adapter the server no longer holds (a restart) is not an error
                try:
                    self.call("POST", "/unload_lora_adapter", sp.UnloadLoRAAdapterReqInput(lora_name=old).model_dump())
                except EngineRequestError as err:
                    logger.warning("%s: unloading adapter %s: %s", self.url, old, err)
        finally:
            self.call("POST", "/continue_generation", {})
        self.update_s.append(time.monotonic() - started)
        self.version = version


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
        if data.get("error_message"):
            return str(data["error_message"])
    return str(data)[:300]
