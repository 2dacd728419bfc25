"""The scheduler thread of :class:`~asyncrl.engine.jax_engine.JaxEngine` and its host bookkeeping.

One daemon thread owns every device call (``_loop``): it installs published weights, admits
waiting requests into free slots (prefill + copy, ``PREFILL_ROWS`` prompts of one bucket per
call), runs beam-search requests between chunks, decodes one chunk for all slots, hands finished
requests back through their futures, and repeats. Continuous batching, the early end of a chunk
and the paired refills are described in :mod:`asyncrl.engine.jax_engine`'s docstring; the
programs it calls and the slot state they carry are in :mod:`asyncrl.engine.jax_programs`.

:class:`EngineScheduler` is a base of :class:`~asyncrl.engine.jax_engine.JaxEngine` (it holds the
scheduler thread's methods; the engine's constructor sets the state they share with the caller
side, declared below).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from typing import Any, Optional

import jax
import numpy as np

from asyncrl.config import EngineConfig
from asyncrl.engine.attention_buckets import chunk_bucket
from asyncrl.engine.beam_search import beam_search_jit
from asyncrl.engine.constraints import TokenTrie, TriePool
from asyncrl.engine.jax_programs import (
    PrefillPlan,
    SlotControls,
    SlotState,
    decode_chunk_jit,
    prefill_insert_jit,
    snapshot,
)
from asyncrl.engine.prefix_cache import Admission, AdmissionRound, PrefixStore
from asyncrl.engine.prefix_programs import COPY_ROWS, CopyPlan, ExtendPlan, copy_prefix_jit, extend_jit
from asyncrl.engine.protocol import GenerationRequest, StopReason
from asyncrl.engine.requests import EngineStats, Pending, Update, key_parts
from asyncrl.errors import EngineCrashed
from asyncrl.model.attention import KernelTarget

logger = logging.getLogger("asyncrl.engine")

PAIRED_REFILL_MIN_SLOTS = 8
"""From this many slots a chunk ends early only once ``prefill_rows`` slots are free, so refills
are prefilled together; with fewer, one idle slot is too large a share to keep waiting."""

class EngineScheduler:
    """The scheduler thread's methods of :class:`~asyncrl.engine.jax_engine.JaxEngine`."""

    # Set by JaxEngine.__init__; the caller side reads the queue, the update and the flags under
    # ``_cond``, everything else is the scheduler thread's alone.
    config: EngineConfig
    graphdef: Any
    mesh: Any
    slots: int
    chunk: int
    buckets: tuple[int, ...]
    prefill_rows: int
    vocab_size: int
    attention_buckets: tuple[int, ...]
    kernel: KernelTarget  # the engine's devices (its mesh, or platform and count): pick the attention kernels
    cache_layout: str  # the KV cache's layout (asyncrl.engine.layouts.kv_cache_layout)
    _params: Any
    _serving: Any
    _version: int
    _layout: Optional[SlotState]
    _root_key: Any
    _state: Any
    _controls: SlotControls
    _slot_owner: list[Optional[tuple[Pending, int]]]
    _prefixes: Optional[PrefixStore]  # what each slot's KV holds (engine.prefix_cache), or None: no reuse
    _version_floor: list[Optional[int]]  # per slot: the oldest weights version its reused prefix was computed with
    _flush: bool  # flush_prefixes was asked
    extend_buckets: tuple[int, ...]  # token counts the extension after a kept prefix is compiled for
    _tries: TriePool
    _trie_tables: Any
    _cond: threading.Condition
    _waiting: collections.deque[Pending]
    _running: set[Pending]
    _update: Optional[Update]
    _aborts: list[threading.Event]
    _closed: bool
    _crash: Optional[str]
    _freed: int
    _step_s: float
    _stats: EngineStats

    def _state_shardings(self) -> Any:
        raise NotImplementedError  # JaxEngine's

    def _decode_options(self, attend: int) -> dict[str, Any]:
        raise NotImplementedError  # JaxEngine's

    def _take(self, params: Any) -> None:
        raise NotImplementedError  # JaxEngine's


    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._waiting or self._update is not None or self._running or self._aborts):
                        self._cond.wait(1.0)
                    if self._closed:
                        return
                    update, self._update = self._update, None
                    aborts, self._aborts = self._aborts, []
                    flush, self._flush = self._flush, False
                if flush and self._prefixes is not None:
                    self._prefixes.forget()
                if aborts:
                    self._abort_now(aborts)
                if update is not None:
                    self._install(update)
                self._expire()
                self._admit()
                if self._running:
                    self._decode()
                    self._await_refill()
        except BaseException:  # noqa: BLE001 - delivered to every caller
            tb = traceback.format_exc()
            logger.error("inference engine thread died:\n%s", tb)
            with self._cond:
                self._crash = tb
                update, self._update = self._update, None
            if update is not None:
                update.error = EngineCrashed("the inference engine's thread died", tb)
                update.done.set()
            self._fail_all(EngineCrashed("the inference engine's thread died", tb))

    def _install(self, update: Update) -> None:
        # The old serving copy is dropped before the new one is made (JaxEngine._take): a publish
        # holds one copy at its peak; the decode waits for the copy (its seconds: swap_latency_s).
        self._take(update.params)
        update.params = None
        self._version = update.version
        latency = time.monotonic() - update.requested
        self._stats.swaps += 1
        self._stats.swap_s += latency
        self._stats.swap_max_s = max(self._stats.swap_max_s, latency)
        update.done.set()

    def _abort_now(self, aborts: list[threading.Event]) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        for p in waiting:
            self._running.add(p)
        for p in list(self._running):
            for j, s in enumerate(p.samples):
                if s.stop_reason is None:
                    self._end_sample(p, j, "aborted")
        for done in aborts:
            done.set()

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            pending = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._running.clear()
        self._slot_owner = [None] * self.slots
        for p in pending:
            if not p.future.done():
                p.future.set_exception(error)

    def _free_slots(self) -> list[int]:
        return [i for i, owner in enumerate(self._slot_owner) if owner is None]

    def _finish(self, pending: Pending) -> None:
        self._running.discard(pending)
        self._stats.requests += 1
        pending.usage.requests += 1
        pending.future.set_result(pending.response())

    def _end_sample(self, pending: Pending, j: int, reason: StopReason) -> None:
        sample = pending.samples[j]
        sample.stop_reason = reason
        if reason == "aborted":
            self._stats.aborted += 1
            pending.usage.samples_aborted += 1
        if sample.slot is not None:
            self._slot_owner[sample.slot] = None
            self._controls.active[sample.slot] = False
            if self._prefixes is not None:
                self._prefixes.keep(sample.slot)
            sample.slot = None
        if all(s.stop_reason is not None for s in pending.samples):
            self._finish(pending)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cond:
            expired = [p for p in self._waiting if p.deadline is not None and now > p.deadline]
            for p in expired:
                self._waiting.remove(p)
        for p in expired:
            self._running.add(p)
            for j in range(p.request.n):
                self._end_sample(p, j, "aborted")
        for p in [p for p in self._running if p.deadline is not None and now > p.deadline]:
            for j, s in enumerate(p.samples):
                if s.stop_reason is None:
                    self._end_sample(p, j, "aborted")

    def _admit(self) -> None:
        """Move waiting requests (in order) into free slots while the next one fits, and prefill
        them, ``PREFILL_ROWS`` prompts of one bucket per program call, so the weights are read
        once per call rather than once per request. Requests that arrive while the calls are
        dispatched are taken too (clients of a burst submit a moment apart). With
        ``engine.prefix_cache`` a request that begins with KV a slot holds starts from it
        (:meth:`_reuse`)."""
        self._run_beams()
        started = time.monotonic()
        any_admitted = False
        while admitted := self._take_waiting():
            any_admitted = True
            taken_at = time.monotonic()  # a request taken on a later pass may have arrived after `started`
            fresh = [(pending, list(admission.slots)) for pending, admission in admitted if admission.fresh]
            by_bucket: dict[int, list[tuple[Pending, list[int]]]] = {}
            for pending, rows in fresh:
                context = len(pending.request.prompt_ids) - 1  # the last prompt token is fed by the first decode step
                bucket = next(b for b in self.buckets if b >= max(context, 1))
                by_bucket.setdefault(bucket, []).append((pending, rows))
            for bucket in sorted(by_bucket):
                group = by_bucket[bucket]
                for first in range(0, len(group), self.prefill_rows):
                    self._prefill(bucket, group[first : first + self.prefill_rows], taken_at)
            reusing = [(pending, admission) for pending, admission in admitted if not admission.fresh]
            if reusing:
                self._reuse(reusing, taken_at)
        if any_admitted:
            # Prefills run asynchronously: wait for them here so that their device time counts
            # as prefill_s, not as the next chunk's decode_s (engine/decode_ms_per_step).
            jax.block_until_ready(self._state)
            self._stats.prefill_s += time.monotonic() - started

    def _run_beams(self) -> None:
        """Run the waiting beam-search requests, one program call each (they take no slots: the
        running samples wait one call)."""
        with self._cond:
            beams = [p for p in self._waiting if p.request.beam]
            for p in beams:
                self._waiting.remove(p)
                self._running.add(p)
        for pending in beams:
            self._beam(pending)

    def _beam(self, pending: Pending) -> None:
        """Beam search for ``pending`` (:func:`~asyncrl.engine.beam_search._beam_search`); the
        ``n`` best beams become its samples, best first."""
        request = pending.request
        prompt = np.asarray(request.prompt_ids, np.int32)
        context = len(prompt) - 1
        bucket = next(b for b in self.buckets if b >= max(context, 1))
        ids = np.zeros(bucket, np.int32)
        ids[:context] = prompt[:context]
        stop_vocab = np.zeros(self.vocab_size, bool)
        stop_vocab[list(pending.stop_ids)] = True
        trie = request.constraint
        tries = None
        if trie is not None:
            root = self._trie_offset(trie)  # first: it may rebuild the pool's tables
            tries = (self._trie_tables, np.int32(root))
        started = time.monotonic()
        out = beam_search_jit(self.graphdef, self._serving, ids, np.arange(bucket) < context, np.int32(prompt[-1]), stop_vocab,
                              np.float32(request.length_penalty), tries, k=request.n, max_new=request.max_new_tokens,
                              capacity=bucket + request.max_new_tokens, max_branch=self._tries.max_branch if trie else 0,
                              kernel=self.kernel, cache_layout=self.cache_layout)
        tokens, logprobs, lengths, scores = (np.asarray(x) for x in out)
        self._stats.beam_calls += 1
        self._stats.beam_s += time.monotonic() - started
        for j, sample in enumerate(pending.samples):
            n = int(lengths[j])
            sample.tokens, sample.logprobs = tokens[j, :n].tolist(), logprobs[j, :n].tolist()
            sample.versions = [self._version] * n
            sample.score = float(scores[j])
            if trie is not None:
                sample.stop_reason = "stop" if trie.contains(sample.tokens) else "length"
            else:
                sample.stop_reason = "eos" if n and sample.tokens[-1] in pending.stop_set else "length"
        self._finish(pending)

    def _take_waiting(self) -> list[tuple[Pending, Admission]]:
        """Pop waiting requests in order while the next one fits in the free slots; each with
        where it goes (:class:`~asyncrl.engine.prefix_cache.Admission`: its slots, not yet owned,
        and with a prefix cache the kept prefix it starts from)."""
        admitted: list[tuple[Pending, Admission]] = []
        free = self._free_slots()
        round_ = AdmissionRound(self._prefixes, free, self._version) if self._prefixes is not None else None
        with self._cond:
            while self._waiting and not self._waiting[0].request.beam:
                request = self._waiting[0].request
                if round_ is None:
                    if request.n > len(free):
                        break
                    admission = Admission(tuple(free[: request.n]))
                    free = free[request.n:]
                else:
                    taken = round_.take(np.asarray(request.prompt_ids[:-1], np.int32), request.n)
                    if taken is None:
                        break
                    admission = taken
                pending = self._waiting.popleft()
                self._running.add(pending)
                admitted.append((pending, admission))
        return admitted

    def _prefill(self, bucket: int, group: list[tuple[Pending, list[int]]], admitted_at: float) -> None:
        """Prefill ``group`` (up to ``prefill_rows`` requests and their slots, prompts of ``bucket``
        tokens at most) in one call: prompt row ``r`` is request ``r``'s ``prompt[:-1]``,
        right-padded; rows past the group are all padding."""
        plan = PrefillPlan.empty(self.prefill_rows, bucket, self.slots)
        k = 0  # destinations filled so far
        for row, (pending, slots) in enumerate(group):
            request = pending.request
            self._note_admitted(pending, admitted_at)
            prompt = np.asarray(request.prompt_ids, np.int32)
            context = len(prompt) - 1
            plan.prompt_ids[row, :context] = prompt[:context]
            plan.prompt_mask[row, :context] = True
            for j, slot in enumerate(slots):
                plan.src_rows[k], plan.dst_rows[k] = row, slot
                plan.sample_id[k], plan.turn[k], plan.key_index[k] = key_parts(request, j)
                k += 1
                self._own(pending, j, slot)
            self._stats.prefill_tokens += context
            pending.usage.prefill_tokens += context
        self._stats.prefill_calls += 1
        self._state = prefill_insert_jit(self.graphdef, self._serving, self._state, plan, self._root_key, self._layout,
                                         self.kernel)

    def _note_admitted(self, pending: Pending, admitted_at: float) -> None:
        wait = admitted_at - pending.submitted
        self._stats.admitted += 1
        self._stats.queue_wait_s += wait
        self._stats.queue_wait_max_s = max(self._stats.queue_wait_max_s, wait)

    def _own(self, pending: Pending, j: int, slot: int, floor: Optional[int] = None) -> None:
        """Slot ``slot`` runs sample ``j`` of ``pending`` (its context prefilled: the first decode step
        feeds the last prompt token); ``floor``: the oldest weights version of a reused prefix its
        tokens attend to, when older than the served one (``engine.prefix_cache.across_versions``)."""
        self._slot_owner[slot] = (pending, j)
        pending.samples[j].slot = slot
        self._version_floor[slot] = floor
        self._start_slot(slot, pending.request, pending.stop_ids, int(pending.request.prompt_ids[-1]))

    def _reuse(self, admitted: list[tuple[Pending, Admission]], admitted_at: float) -> None:
        """Start requests from kept prefixes (:mod:`asyncrl.engine.prefix_cache`): each takes its
        source's first positions into its first slot (a copy, or in place), prefills the rest of its
        context after them there, then copies the whole context to its other slots
        (:mod:`asyncrl.engine.prefix_programs`)."""
        store = self._prefixes
        assert store is not None
        stages: dict[int, tuple[list, list, list]] = {}  # stage -> (first copies, extensions, copies to other slots)
        for pending, admission in admitted:
            request = pending.request
            self._note_admitted(pending, admitted_at)
            context = np.asarray(request.prompt_ids[:-1], np.int32)
            first, length = admission.slots[0], admission.length
            first_copies, extends, later_copies = stages.setdefault(admission.stage, ([], [], []))
            first_copies.append((admission.source, first, length, request, 0))
            if length < len(context):
                extends.append((first, context[length:]))
            for j, slot in enumerate(admission.slots[1:], start=1):
                later_copies.append((first, slot, len(context), request, j))
            floor = store.version_floor(first, length) if store.across_versions else None
            floor = floor if floor is not None and floor < self._version else None
            for j, slot in enumerate(admission.slots):
                self._own(pending, j, slot, floor)
            self._stats.prefill_tokens += len(context) - length
            self._stats.prefix_hit_tokens += length
            pending.usage.prefill_tokens += len(context) - length
            pending.usage.prefix_hit_tokens += length
        for stage in sorted(stages):  # a stage's sources are complete once the stages before it ran
            first_copies, extends, later_copies = stages[stage]
            self._copy(first_copies)
            self._extend(extends)
            self._copy(later_copies)

    def _copy(self, copies: list) -> None:
        """Copy-prefix calls for ``(source, destination, length, request, sample index)`` entries."""
        store = self._prefixes
        assert store is not None
        for first in range(0, len(copies), COPY_ROWS):
            plan = CopyPlan.empty(self.slots)
            cross = False
            for k, (src, dst, length, request, j) in enumerate(copies[first : first + COPY_ROWS]):
                plan.src_rows[k], plan.dst_rows[k], plan.lengths[k] = src, dst, length
                plan.sample_id[k], plan.turn[k], plan.key_index[k] = key_parts(request, j)
                cross = cross or store.replica_of(src) != store.replica_of(dst)
            self._stats.prefill_calls += 1
            self._state = copy_prefix_jit(self._state, plan, self._root_key, self._layout, cross and self._layout is not None)

    def _extend(self, extends: list[tuple[int, np.ndarray]]) -> None:
        """Extend calls for ``(slot, tokens after its kept prefix)`` entries: by bucket, each replica's
        rows from its own slots (``prefill_rows`` per call, as fresh prefills)."""
        store = self._prefixes
        assert store is not None
        per_replica = self.prefill_rows // store.replicas
        by_bucket: dict[int, list[list[tuple[int, np.ndarray]]]] = {}
        for slot, tokens in extends:
            bucket = next(b for b in self.extend_buckets if b >= len(tokens))
            by_bucket.setdefault(bucket, [[] for _ in range(store.replicas)])[store.replica_of(slot)].append((slot, tokens))
        for bucket, queues in sorted(by_bucket.items()):
            while any(queues):
                plan = ExtendPlan.empty(self.prefill_rows, bucket, self.slots)
                for replica, queue in enumerate(queues):
                    for k in range(per_replica):
                        if not queue:
                            break
                        slot, tokens = queue.pop(0)
                        row = replica * per_replica + k
                        plan.rows[row] = slot
                        plan.token_ids[row, : len(tokens)] = tokens
                        plan.token_mask[row, : len(tokens)] = True
                self._stats.prefill_calls += 1
                self._state = extend_jit(self.graphdef, self._serving, self._state, plan, self._layout, self.kernel)

    def _start_slot(self, slot: int, request: GenerationRequest, stop_ids: tuple[int, ...], last_token: int) -> None:
        """Set a freshly prefilled slot's controls from its request."""
        c = self._controls
        c.last_token[slot], c.generated[slot], c.active[slot] = last_token, 0, True
        c.greedy[slot] = request.greedy
        c.temperature[slot] = 1.0 if request.greedy else request.temperature
        c.top_k[slot] = 0 if request.greedy else request.top_k
        c.top_p[slot] = 1.0 if request.greedy else request.top_p
        c.min_new_tokens[slot], c.max_new_tokens[slot] = request.min_new_tokens, request.max_new_tokens
        c.stop_ids[slot] = -1
        c.stop_ids[slot, : len(stop_ids)] = stop_ids
        c.node[slot] = -1
        if request.constraint is not None:
            c.node[slot] = self._trie_offset(request.constraint)

    def _trie_offset(self, trie: TokenTrie) -> int:
        """``trie``'s node offset in the engine's pool, adding it (with the tries still in use, whose
        slots' nodes are moved to their new offsets) when it is new."""
        offset = self._tries.offset(trie)
        if offset is not None:
            return offset
        live = [(owner[0].request.constraint, owner[0].samples[owner[1]], slot) for slot, owner in enumerate(self._slot_owner)
                if owner is not None and owner[0].request.constraint is not None and self._controls.node[slot] >= 0]
        self._tries.rebuild([t for t, _, _ in live] + [trie])
        for live_trie, sample, slot in live:
            self._controls.node[slot] = self._tries.require(live_trie) + sample.node
        assert self._tries.tables is not None
        replicated = (jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()) if self._layout is not None
                      else self._state_shardings())
        self._trie_tables = jax.device_put(self._tries.tables, replicated)
        return self._tries.require(trie)

    def _decode(self) -> None:
        started = time.monotonic()
        c = self._controls
        active = c.active.copy()
        filtered = bool(np.any(active & ((c.top_k > 0) | (c.top_p < 1.0))))
        constrained = bool(np.any(active & (c.node >= 0)))
        with self._cond:
            # A slot freed inside the chunk ends it early when the next waiting request fits and
            # (with PAIRED_REFILL_MIN_SLOTS or more) prefill_rows slots are free: two prompts
            # prefill in one call for about the price of one, while the first freed slot idles
            # only until the next finish. With none waiting the same holds: a client usually
            # submits again at once.
            pair = self.prefill_rows if self.slots >= PAIRED_REFILL_MIN_SLOTS else 1
            c.refill_free[...] = max(self._waiting[0].request.n if self._waiting else 1, pair)
        version = self._version
        contexts = (len(owner[0].request.prompt_ids) - 1 + int(c.generated[slot])
                    for slot, owner in enumerate(self._slot_owner) if active[slot] and owner is not None)
        self._state, tokens, logprobs, emitted = decode_chunk_jit(
            self.graphdef, self._serving, self._state, snapshot(c), self.chunk, filtered, self._layout,
            self._trie_tables if constrained else None, self._tries.max_branch if constrained else 0,
            **self._decode_options(chunk_bucket(self.attention_buckets, contexts, self.chunk)),
        )
        dispatched = time.monotonic()
        tokens, logprobs, emitted = np.asarray(tokens), np.asarray(logprobs), np.asarray(emitted)
        ready = time.monotonic()
        steps = int(emitted.any(axis=0).sum())
        self._stats.decode_steps += steps
        for slot in map(int, np.flatnonzero(active)):
            owner = self._slot_owner[slot]
            assert owner is not None, f"active slot {slot} has no owner"
            pending, j = owner
            sample, fed = pending.samples[j], int(c.last_token[slot])
            before = len(sample.tokens)
            self._consume(pending, j, slot, tokens[slot], logprobs[slot], emitted[slot], version)
            if self._prefixes is not None and len(sample.tokens) > before:  # its steps fed its last token, then its new ones but the newest
                self._prefixes.fed(slot, [fed, *sample.tokens[before:-1]], version)
        finished = time.monotonic()
        self._freed = int(np.sum(active & ~c.active))
        self._step_s = (finished - started) / max(steps, 1)
        self._stats.decode_s += finished - started
        self._stats.decode_wait_s += ready - dispatched
        self._stats.decode_host_s += (dispatched - started) + (finished - ready)

    def _await_refill(self) -> None:
        """After a chunk that freed slots, give the callers whose requests just finished a moment
        to submit their next ones before the next chunk starts without them: until waiting
        samples cover the freed slots (so they are prefilled together, ``prefill_rows`` per
        call), at most a tenth of a decode step (an idle slot would otherwise wait for the next
        chunk boundary)."""
        if not self._freed:
            return
        started = time.monotonic()
        deadline = started + min(0.1 * self._step_s, 0.05)
        with self._cond:
            while not (sum(p.request.n for p in self._waiting) >= self._freed or self._closed
                       or self._update is not None or self._aborts):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        self._stats.refill_wait_s += time.monotonic() - started

    def _consume(self, pending: Pending, j: int, slot: int, tokens, logprobs, emitted, version: int) -> None:
        """Append one slot's chunk output to its sample and end the sample when it stopped."""
        request = pending.request
        sample = pending.samples[j]
        trie = request.constraint
        floor = self._version_floor[slot]
        if floor is not None:  # it attends to a kept prefix of older weights (engine.prefix_cache.across_versions)
            version = min(version, floor)
        for t in np.flatnonzero(emitted):
            token = int(tokens[t])
            sample.tokens.append(token)
            sample.logprobs.append(float(logprobs[t]))
            sample.versions.append(version)
            # Counted as kept: a stop sequence is found here, on the host, so the tokens the device
            # decoded after it in the chunk (as many as the chunk's timing allows) are not counted,
            # and the counters are the same in every run of the same requests.
            self._stats.decode_tokens += 1
            pending.usage.decode_tokens += 1
            index = len(sample.tokens) - 1
            if trie is not None:  # the device followed the same trie: the token is allowed
                sample.node = trie.child(sample.node, token)
                if trie.is_leaf(sample.node):
                    return self._end_sample(pending, j, "stop")
            elif index >= request.min_new_tokens:
                if token in pending.stop_set:
                    return self._end_sample(pending, j, "eos")
                for seq in pending.stop_sequences:
                    if sample.tokens[-len(seq):] == seq:
                        return self._end_sample(pending, j, "stop")
            if len(sample.tokens) >= request.max_new_tokens:
                return self._end_sample(pending, j, "length")
        self._controls.last_token[slot] = sample.tokens[-1]
        self._controls.generated[slot] = len(sample.tokens)
        if trie is not None:
            self._controls.node[slot] = self._tries.require(trie) + sample.node
