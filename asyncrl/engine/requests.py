"""The JaxEngine's host-side records of its work: a submitted request (:class:`Pending`) and each
of its samples' state in one record (:class:`Sequence`), a published version waiting for a chunk
boundary (:class:`Update`), and the cumulative counters behind its metrics (:class:`EngineStats`).
The scheduler thread (:mod:`asyncrl.engine.scheduler`) owns them once a request is admitted."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

import numpy as np

from asyncrl.engine.protocol import GenerationRequest, GenerationResponse, RequestUsage, StopReason


class Sequence:
    """One sample of a request, everything the engine knows of it: what it generated (tokens,
    log-probs, versions), where it decodes (its row of the decode batch, None while it waits or
    when it ended), the oldest weights version a reused prefix it attends to was computed with,
    its trie node and why it ended."""

    __slots__ = ("pending", "index", "tokens", "logprobs", "versions", "stop_reason", "row", "node", "score",
                 "version_floor", "kv", "order", "prompt_computed")

    def __init__(self, pending: "Pending", index: int) -> None:
        self.pending = pending
        self.index = index  # j: the sample's index within its request (its key's index_in_group + j)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.stop_reason: Optional[StopReason] = None
        self.row: Optional[int] = None
        self.node = 0  # the trie node after the tokens so far (constrained requests only)
        self.score: Optional[float] = None  # beam search's ranking score
        self.version_floor: Optional[int] = None  # set when it reuses KV of older weights (across_versions)
        self.kv: Any = None  # its pages (asyncrl.engine.kv_cache_manager.SequenceKV) while admitted; None while it waits
        self.order = -1  # when it was first admitted (the latest admitted is preempted first)
        self.prompt_computed = 0  # prompt tokens whose KV was computed for it (again after a preemption)

    @property
    def request(self) -> GenerationRequest:
        return self.pending.request

    @property
    def context(self) -> int:
        """KV positions it holds: its prompt but the last token, and the tokens it generated but the last."""
        return len(self.pending.request.prompt_ids) - 1 + len(self.tokens)

    def context_ids(self) -> list[int]:
        """The token ids of :attr:`context` (what it must hold again when it resumes after a preemption)."""
        return [*self.pending.request.prompt_ids, *self.tokens][: self.context]

    @property
    def last_token(self) -> int:
        """The token its next decode step feeds."""
        return int(self.tokens[-1]) if self.tokens else int(self.pending.request.prompt_ids[-1])

    @property
    def positions(self) -> int:
        """The most KV positions its decode steps can write to: its prompt but the last token, then one
        per step (the step that samples its last token feeds the token before it)."""
        return len(self.pending.request.prompt_ids) - 1 + self.pending.request.max_new_tokens


class Pending:
    """A submitted request and its progress."""

    def __init__(self, request: GenerationRequest, stop_ids: tuple[int, ...], deadline: Optional[float]):
        self.request = request
        self.stop_ids = stop_ids
        self.stop_set = frozenset(stop_ids)
        self.stop_sequences = [list(map(int, s)) for s in request.stop_sequences if len(s) > 0]
        self.future: Future = Future()
        self.submitted = time.monotonic()
        self.deadline = deadline
        self.sequences = [Sequence(self, j) for j in range(request.n)]
        self.usage = RequestUsage()  # this request's share of the engine's counters

    def response(self) -> list[GenerationResponse]:
        return [
            GenerationResponse(
                output_ids=np.asarray(s.tokens, dtype=np.int32),
                logprobs=np.asarray(s.logprobs, dtype=np.float32),
                versions=np.asarray(s.versions, dtype=np.int32),
                stop_reason=s.stop_reason or "aborted",
                score=s.score,
                usage=self.usage,
                cached_tokens=None if self.request.beam else max(self.prompt_kv_tokens - s.prompt_computed, 0),
            )
            for s in self.sequences
        ]

    @property
    def prompt_kv_tokens(self) -> int:
        """The prompt tokens whose KV a sample's prefill holds: all but the last, which its first decode step feeds."""
        return max(len(self.request.prompt_ids) - 1, 0)


class Update:
    """A published version waiting for the next chunk boundary, where the scheduler installs it."""

    def __init__(self, params: Any, version: int):
        self.params = params  # the publisher's arrays (never donated: the trainer keeps them)
        self.version = version
        self.requested = time.monotonic()
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


@dataclasses.dataclass
class EngineStats:
    """The cumulative figures behind :meth:`JaxEngine.metrics`, updated by the scheduler thread
    (``requests`` and ``aborted`` also by callers, under the engine's condition). Fields, not
    string keys, so a misspelt counter is an error instead of a new key."""

    requests: int = 0  # generate/submit calls accepted
    aborted: int = 0  # samples ended by abort (timeout or cancel)
    admitted: int = 0  # requests given slots
    queue_wait_s: float = 0.0  # summed wait from submit to admission
    queue_wait_max_s: float = 0.0
    prefill_calls: int = 0  # prefill program calls
    prefill_tokens: int = 0  # context tokens prefilled (a prompt's, or a preempted sequence's again; a reused prefix's are not)
    prefix_hit_tokens: int = 0  # context tokens whose KV was reused from a kept prefix
    preemptions: int = 0  # sequences preempted (pages released, resumed later) when the pool ran out
    prefill_s: float = 0.0
    decode_steps: int = 0  # decode steps (every slot advances one token per step)
    decode_tokens: int = 0  # tokens the samples kept from decode steps (none past a stop)
    decode_s: float = 0.0  # wall time of decode chunks = decode_wait_s + decode_host_s
    decode_wait_s: float = 0.0  # blocked on a chunk's results (device time not hidden by host work)
    decode_host_s: float = 0.0  # dispatch, control upload and per-slot bookkeeping
    refill_wait_s: float = 0.0  # after chunks that freed slots, waiting for callers to submit again
    beam_calls: int = 0  # beam-search requests run
    beam_s: float = 0.0  # their wall time
    swaps: int = 0  # weight versions installed
    swap_s: float = 0.0  # summed install latency (publish to installed)
    swap_max_s: float = 0.0


def key_parts(request: GenerationRequest, j: int) -> tuple[int, int, int]:
    """``(sample_id, turn, index_in_group + j)`` of sample ``j``'s key, as uint32 values."""
    return request.sample_id % 2**32, request.turn % 2**32, (request.index_in_group + j) % 2**32
