"""FakeEngine: the InferenceEngine protocol without a model, for testing workflows and the executor.

Outputs are scripted and deterministic: the tokens and log-probs of a sample depend only on
``(seed, sample_id, index_in_group + i, turn)``, like the real engine's random key, never on
timing or on other requests. Generation proceeds in chunks of ``chunk_size`` tokens; the
served version is read at each chunk boundary, so a publish during a request tags the later
chunks with the new version, as the real engine does. Optional per-call delays (spread over
the chunks) make thread interleavings realistic, and ``crash_after_calls`` simulates the
engine's thread dying.
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from asyncrl.engine.protocol import GenerationRequest, GenerationResponse, StopReason
from asyncrl.errors import EngineCrashed, EngineRequestError
from asyncrl.registry import register

Delay = Union[float, tuple[float, float], Callable[[GenerationRequest], float]]
Responder = Callable[[GenerationRequest, int], Sequence[int]]


@register("engine", "fake")
class FakeEngine:
    """A deterministic, scripted :class:`~asyncrl.engine.protocol.InferenceEngine`.

    Args:
        vocab_size: token ids are drawn from ``[first_token_id, vocab_size)`` minus the stop ids.
        eos_token_id: the default stop token (used when a request gives no ``stop_token_ids``).
        version: the version served at start (``k`` when resuming from step ``k``).
        seed: the run seed (first fold of every sample's random stream).
        chunk_size: tokens per chunk; versions are read at chunk boundaries.
        delay_s: time one call takes, spread over its chunks: seconds, a ``(low, high)`` range
            drawn deterministically per request, or ``fn(request) -> seconds``.
        eos_prob: chance per position (from ``min_new_tokens`` on) that the sample ends with EOS.
        responder: ``fn(request, i) -> token ids`` scripting sample ``i``'s output; the stop
            reason follows from its last token. Log-probs stay pseudo-random.
        crash_after_calls: the engine's "thread" dies on call number ``k`` (0-based): that and
            every later call raise :class:`~asyncrl.errors.EngineCrashed` with its traceback.
        first_token_id: lowest id the fake samples (keeps special tokens out of outputs).
    """

    def __init__(
        self,
        vocab_size: int = 32,
        eos_token_id: int = 1,
        *,
        version: int = 0,
        seed: int = 0,
        chunk_size: int = 4,
        delay_s: Delay = 0.0,
        eos_prob: float = 0.15,
        responder: Optional[Responder] = None,
        crash_after_calls: Optional[int] = None,
        first_token_id: int = 0,
    ):
        if chunk_size < 1:
            raise ValueError(f"FakeEngine.chunk_size must be >= 1 (given {chunk_size})")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.chunk_size = chunk_size
        self.delay_s = delay_s
        self.eos_prob = eos_prob
        self.responder = responder
        self.crash_after_calls = crash_after_calls
        self.first_token_id = first_token_id
        self.params: Any = None
        self.calls = 0
        self._version = version
        self._lock = threading.Lock()
        self._crash_traceback: Optional[str] = None

    # ------------------------------------------------------------------ protocol

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def update_weights(self, params: Any, version: int) -> None:
        with self._lock:
            if version != self._version + 1:
                raise ValueError(f"update_weights: version must be {self._version + 1} (engine serves {self._version}), given {version}")
            self.params = params
            self._version = version

    def generate(self, request: GenerationRequest) -> list[GenerationResponse]:
        if request.constraint is not None or request.beam:
            raise EngineRequestError("FakeEngine: trie constraints and beam search need the JAX engine (a scripted "
                                     "responder would silently ignore them)")
        with self._lock:
            call = self.calls
            self.calls += 1
            if self._crash_traceback is None and self.crash_after_calls is not None and call >= self.crash_after_calls:
                try:
                    raise RuntimeError(f"FakeEngine: scripted crash of the engine thread on call {call}")
                except RuntimeError:
                    self._crash_traceback = traceback.format_exc()
            crashed = self._crash_traceback
        if crashed is not None:
            raise EngineCrashed("the inference engine's thread died", crashed)
        return self._generate(request)

    def submit(self, request: GenerationRequest) -> "Future[list[GenerationResponse]]":
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self.generate(request))
            except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(err)

        threading.Thread(target=run, name="fake-engine-submit", daemon=True).start()
        return future

    # ------------------------------------------------------------------ internals

    def _rng(self, request: GenerationRequest, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, request.sample_id, index, request.turn])

    def _delay(self, request: GenerationRequest) -> float:
        if callable(self.delay_s):
            return float(self.delay_s(request))
        if isinstance(self.delay_s, tuple):
            low, high = self.delay_s
            rng = np.random.default_rng([self.seed, request.sample_id, request.index_in_group, request.turn, 1])
            return float(rng.uniform(low, high))
        return float(self.delay_s)

    def _script(self, request: GenerationRequest, i: int, stop_ids: set[int]) -> tuple[list[int], np.ndarray]:
        rng = self._rng(request, request.index_in_group + i)
        logprobs = -rng.uniform(0.01, 4.0, size=request.max_new_tokens).astype(np.float32)
        if self.responder is not None:
            tokens = [int(t) for t in self.responder(request, i)][: request.max_new_tokens]
            if not tokens:
                raise ValueError("FakeEngine.responder returned no tokens")
            return tokens, logprobs[: len(tokens)]
        allowed = np.setdiff1d(np.arange(self.first_token_id, self.vocab_size, dtype=np.int32),
                               np.fromiter(stop_ids, dtype=np.int32, count=len(stop_ids)))
        ends = rng.random(request.max_new_tokens) < self.eos_prob
        choices = rng.integers(0, len(allowed), size=request.max_new_tokens)
        eos = self.eos_token_id if self.eos_token_id in stop_ids else min(stop_ids) if stop_ids else None
        tokens = []
        for pos in range(request.max_new_tokens):
            if eos is not None and pos >= request.min_new_tokens and ends[pos]:
                tokens.append(eos)
                break
            tokens.append(int(allowed[choices[pos]]))
        return tokens, logprobs[: len(tokens)]

    def _generate(self, request: GenerationRequest) -> list[GenerationResponse]:
        stop_ids = set(request.stop_token_ids) if request.stop_token_ids is not None else {self.eos_token_id}
        scripts = [self._script(request, i, stop_ids) for i in range(request.n)]
        longest = max(len(tokens) for tokens, _ in scripts)
        chunks = math.ceil(longest / self.chunk_size)
        pause = self._delay(request) / chunks
        start = time.monotonic()
        versions = np.empty(longest, dtype=np.int32)
        aborted_at: Optional[int] = None
        for c in range(chunks):
            if pause > 0:
                time.sleep(pause)
            if request.timeout_s is not None and time.monotonic() - start > request.timeout_s:
                aborted_at = c * self.chunk_size
                break
            versions[c * self.chunk_size : (c + 1) * self.chunk_size] = self.version
        responses = []
        for tokens, logprobs in scripts:
            out, reason = self._cut(tokens, request, stop_ids)
            if aborted_at is not None and len(out) > aborted_at:
                out, reason = out[:aborted_at], "aborted"
            responses.append(
                GenerationResponse(
                    output_ids=np.asarray(out, dtype=np.int32),
                    logprobs=logprobs[: len(out)].copy(),
                    versions=versions[: len(out)].copy(),
                    stop_reason=reason,
                )
            )
        return responses

    @staticmethod
    def _cut(tokens: list[int], request: GenerationRequest, stop_ids: set[int]) -> tuple[list[int], StopReason]:
        """Apply stop ids and stop sequences to a scripted output."""
        for pos, token in enumerate(tokens):
            if pos + 1 >= request.min_new_tokens:
                if token in stop_ids:
                    return tokens[: pos + 1], "eos"
                for seq in request.stop_sequences:
                    if seq and tokens[max(0, pos + 1 - len(seq)) : pos + 1] == list(seq):
                        return tokens[: pos + 1], "stop"
        # A scripted output that ends on no stop token: "length" when it used the whole budget,
        # otherwise it ended as a stop sequence would have.
        return tokens, "length" if len(tokens) >= request.max_new_tokens else "stop"
