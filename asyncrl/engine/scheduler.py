"""The scheduler of :class:`~asyncrl.engine.jax_engine.JaxEngine`: requests, admission, chunk
boundaries; no device arrays.

One daemon thread (:meth:`Scheduler.run`) makes every device call through the model runner
(:mod:`asyncrl.engine.model_runner`): it installs published weights, admits waiting requests into
free rows of the decode batch (where their KV goes and what they reuse is the KV cache manager's
answer, :mod:`asyncrl.engine.kv_cache_manager`), runs beam-search requests between chunks, decodes
one chunk for all rows, hands finished requests back through their futures, and repeats.
Continuous batching, the early end of a chunk and the paired refills are described in
:mod:`asyncrl.engine.jax_engine`'s docstring.

Callers (any thread) reach it only through :meth:`Scheduler.submit`, :meth:`Scheduler.post_update`,
:meth:`Scheduler.post_abort`, :meth:`Scheduler.post_flush` and :meth:`Scheduler.close`, under its
condition; every other attribute is the scheduler thread's.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from typing import Any, Optional

import numpy as np

from asyncrl.config import EngineConfig
from asyncrl.engine.attention_buckets import chunk_bucket
from asyncrl.engine.constraints import TokenTrie, TriePool
from asyncrl.engine.jax_programs import PrefillPlan, idle_controls, snapshot
from asyncrl.engine.kv_cache_manager import KVCacheManager
from asyncrl.engine.model_runner import ModelRunner
from asyncrl.engine.prefix_cache import Admission
from asyncrl.engine.prefix_programs import COPY_ROWS, CopyPlan, ExtendPlan
from asyncrl.engine.protocol import StopReason
from asyncrl.engine.requests import EngineStats, Pending, Sequence, Update, key_parts
from asyncrl.errors import EngineCrashed

logger = logging.getLogger("asyncrl.engine")

PAIRED_REFILL_MIN_SLOTS = 8
"""From this many slots a chunk ends early only once ``prefill_rows`` slots are free, so refills
are prefilled together; with fewer, one idle slot is too large a share to keep waiting."""


class Scheduler:
    """Requests in, sequences through the decode batch, responses out.

    Args:
        config: the ``engine`` section.
        runner: the model runner (device state and programs).
        cache: the KV cache manager.
        stats: the engine's counters (written here, read by :meth:`JaxEngine.metrics`).
        root_key: the run seed's key, root of every sample key.
        version: the served weights' version at start.
        buckets, extend_buckets, attention_buckets: the shapes the programs are compiled for.
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner, cache: KVCacheManager, stats: EngineStats,
                 root_key: Any, version: int, buckets: tuple[int, ...], extend_buckets: tuple[int, ...],
                 attention_buckets: tuple[int, ...]):
        self.config = config
        self.runner = runner
        self.cache = cache
        self.stats = stats
        self.root_key = root_key
        self.version = version
        self.buckets, self.extend_buckets, self.attention_buckets = buckets, extend_buckets, attention_buckets
        self.slots = int(config.slots)
        self.chunk = config.decode_chunk
        self.prefill_rows = runner.prefill_rows
        # the decode batch: which sequence each row runs, and what each row asks of the next chunk
        self.rows: list[Optional[Sequence]] = [None] * self.slots
        self.controls = idle_controls(self.slots, config.max_stop_ids)
        self.tries = TriePool()  # the tries of the constrained requests admitted
        self.trie_tables: Any = None  # self.tries.tables on the devices
        self.running: set[Pending] = set()
        self.freed = 0  # rows the last decode chunk freed
        self.step_s = 0.0  # wall seconds per step of the last decode chunk
        # shared with callers, under cond
        self.cond = threading.Condition()
        self.waiting: collections.deque[Pending] = collections.deque()
        self.update: Optional[Update] = None
        self.aborts: list[threading.Event] = []
        self.flush = False
        self.closed = False
        self.crash: Optional[str] = None

    # ------------------------------------------------------------------ callers (under cond)

    def raise_if_unusable(self) -> None:
        from asyncrl.errors import EngineClosed

        if self.crash is not None:
            raise EngineCrashed("the inference engine's thread died", self.crash)
        if self.closed:
            raise EngineClosed("the inference engine was shut down")

    def submit(self, pending: Pending) -> None:
        with self.cond:
            self.raise_if_unusable()
            self.waiting.append(pending)
            self.cond.notify_all()

    def post_update(self, update: Update) -> None:
        with self.cond:
            self.raise_if_unusable()
            if self.update is not None or update.version != self.version + 1:
                raise ValueError(f"update_weights: version {update.version} is no longer next (engine serves {self.version})")
            self.update = update
            self.cond.notify_all()

    def post_abort(self, done: threading.Event) -> None:
        with self.cond:
            self.raise_if_unusable()
            self.aborts.append(done)
            self.cond.notify_all()

    def post_flush(self) -> None:
        with self.cond:
            self.flush = True
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    # ------------------------------------------------------------------ the thread

    def run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not (self.closed or self.waiting or self.update is not None or self.running or self.aborts):
                        self.cond.wait(1.0)
                    if self.closed:
                        return
                    update, self.update = self.update, None
                    aborts, self.aborts = self.aborts, []
                    flush, self.flush = self.flush, False
                if flush:
                    self.cache.flush()
                if aborts:
                    self._abort_now(aborts)
                if update is not None:
                    self._install(update)
                self._expire()
                self._admit()
                if self.running:
                    self._decode()
                    self._await_refill()
        except BaseException:  # noqa: BLE001 - delivered to every caller
            tb = traceback.format_exc()
            logger.error("inference engine thread died:\n%s", tb)
            with self.cond:
                self.crash = tb
                update, self.update = self.update, None
            if update is not None:
                update.error = EngineCrashed("the inference engine's thread died", tb)
                update.done.set()
            self.fail_all(EngineCrashed("the inference engine's thread died", tb))

    def _install(self, update: Update) -> None:
        # The old serving copy is dropped before the new one is made (ModelRunner.install): a publish
        # holds one copy at its peak; the decode waits for the copy (its seconds: swap_latency_s).
        self.runner.install(update.params)
        update.params = None
        with self.cond:
            self.version = update.version
        latency = time.monotonic() - update.requested
        self.stats.swaps += 1
        self.stats.swap_s += latency
        self.stats.swap_max_s = max(self.stats.swap_max_s, latency)
        update.done.set()

    def _abort_now(self, aborts: list[threading.Event]) -> None:
        with self.cond:
            waiting = list(self.waiting)
            self.waiting.clear()
        for p in waiting:
            self.running.add(p)
        for p in list(self.running):
            for s in p.sequences:
                if s.stop_reason is None:
                    self._end(s, "aborted")
        for done in aborts:
            done.set()

    def fail_all(self, error: BaseException) -> None:
        with self.cond:
            pending = list(self.waiting) + list(self.running)
            self.waiting.clear()
            self.running.clear()
        self.rows = [None] * self.slots
        for p in pending:
            if not p.future.done():
                p.future.set_exception(error)

    def _free_rows(self) -> list[int]:
        return [i for i, owner in enumerate(self.rows) if owner is None]

    def _finish(self, pending: Pending) -> None:
        self.running.discard(pending)
        self.stats.requests += 1
        pending.usage.requests += 1
        pending.future.set_result(pending.response())

    def _end(self, sequence: Sequence, reason: StopReason) -> None:
        pending = sequence.pending
        sequence.stop_reason = reason
        if reason == "aborted":
            self.stats.aborted += 1
            pending.usage.samples_aborted += 1
        if sequence.row is not None:
            self.rows[sequence.row] = None
            self.controls.active[sequence.row] = False
            self.cache.released(sequence.row)
            sequence.row = None
        if all(s.stop_reason is not None for s in pending.sequences):
            self._finish(pending)

    def _expire(self) -> None:
        now = time.monotonic()
        with self.cond:
            expired = [p for p in self.waiting if p.deadline is not None and now > p.deadline]
            for p in expired:
                self.waiting.remove(p)
        for p in expired:
            self.running.add(p)
            for s in p.sequences:
                self._end(s, "aborted")
        for p in [p for p in self.running if p.deadline is not None and now > p.deadline]:
            for s in p.sequences:
                if s.stop_reason is None:
                    self._end(s, "aborted")

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        """Move waiting requests (in order) into free rows while the next one fits, and prefill
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
            self.runner.block()
            self.stats.prefill_s += time.monotonic() - started

    def _run_beams(self) -> None:
        """Run the waiting beam-search requests, one program call each (they take no rows: the
        running samples wait one call)."""
        with self.cond:
            beams = [p for p in self.waiting if p.request.beam]
            for p in beams:
                self.waiting.remove(p)
                self.running.add(p)
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
        stop_vocab = np.zeros(self.runner.vocab_size, bool)
        stop_vocab[list(pending.stop_ids)] = True
        trie = request.constraint
        tries = None
        if trie is not None:
            root = self._trie_offset(trie)  # first: it may rebuild the pool's tables
            tries = (self.trie_tables, np.int32(root))
        started = time.monotonic()
        out = self.runner.beam_search(ids, np.arange(bucket) < context, np.int32(prompt[-1]), stop_vocab,
                                      np.float32(request.length_penalty), tries, k=request.n, max_new=request.max_new_tokens,
                                      capacity=bucket + request.max_new_tokens,
                                      max_branch=self.tries.max_branch if trie else 0)
        tokens, logprobs, lengths, scores = (np.asarray(x) for x in out)
        self.stats.beam_calls += 1
        self.stats.beam_s += time.monotonic() - started
        for j, sequence in enumerate(pending.sequences):
            n = int(lengths[j])
            sequence.tokens, sequence.logprobs = tokens[j, :n].tolist(), logprobs[j, :n].tolist()
            sequence.versions = [self.version] * n
            sequence.score = float(scores[j])
            if trie is not None:
                sequence.stop_reason = "stop" if trie.contains(sequence.tokens) else "length"
            else:
                sequence.stop_reason = "eos" if n and sequence.tokens[-1] in pending.stop_set else "length"
        self._finish(pending)

    def _take_waiting(self) -> list[tuple[Pending, Admission]]:
        """Pop waiting requests in order while the next one fits in the free rows; each with where
        it goes (:class:`~asyncrl.engine.prefix_cache.Admission`: its rows, not yet owned, and with
        a prefix cache the kept prefix it starts from)."""
        admitted: list[tuple[Pending, Admission]] = []
        round_ = self.cache.admission_round(self._free_rows(), self.version)
        with self.cond:
            while self.waiting and not self.waiting[0].request.beam:
                request = self.waiting[0].request
                admission = round_.take(np.asarray(request.prompt_ids[:-1], np.int32), request.n)
                if admission is None:
                    break
                pending = self.waiting.popleft()
                self.running.add(pending)
                admitted.append((pending, admission))
        return admitted

    def _prefill(self, bucket: int, group: list[tuple[Pending, list[int]]], admitted_at: float) -> None:
        """Prefill ``group`` (up to ``prefill_rows`` requests and their rows, prompts of ``bucket``
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
                self._start(pending.sequences[j], slot)
            self.stats.prefill_tokens += context
            pending.usage.prefill_tokens += context
        self.stats.prefill_calls += 1
        self.runner.prefill(plan, self.root_key)

    def _note_admitted(self, pending: Pending, admitted_at: float) -> None:
        wait = admitted_at - pending.submitted
        self.stats.admitted += 1
        self.stats.queue_wait_s += wait
        self.stats.queue_wait_max_s = max(self.stats.queue_wait_max_s, wait)

    def _start(self, sequence: Sequence, row: int, floor: Optional[int] = None) -> None:
        """``sequence`` runs on ``row`` (its context prefilled: the first decode step feeds the last
        prompt token); ``floor``: the oldest weights version of a reused prefix its tokens attend
        to, when older than the served one (``engine.prefix_cache.across_versions``)."""
        self.rows[row] = sequence
        sequence.row = row
        sequence.version_floor = floor
        request = sequence.request
        c = self.controls
        c.last_token[row], c.generated[row], c.active[row] = int(request.prompt_ids[-1]), 0, True
        c.greedy[row] = request.greedy
        c.temperature[row] = 1.0 if request.greedy else request.temperature
        c.top_k[row] = 0 if request.greedy else request.top_k
        c.top_p[row] = 1.0 if request.greedy else request.top_p
        c.min_new_tokens[row], c.max_new_tokens[row] = request.min_new_tokens, request.max_new_tokens
        stop_ids = sequence.pending.stop_ids
        c.stop_ids[row] = -1
        c.stop_ids[row, : len(stop_ids)] = stop_ids
        c.node[row] = -1
        if request.constraint is not None:
            c.node[row] = self._trie_offset(request.constraint)

    def _reuse(self, admitted: list[tuple[Pending, Admission]], admitted_at: float) -> None:
        """Start requests from kept prefixes (:mod:`asyncrl.engine.prefix_cache`): each takes its
        source's first positions into its first slot (a copy, or in place), prefills the rest of its
        context after them there, then copies the whole context to its other slots
        (:mod:`asyncrl.engine.prefix_programs`)."""
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
            floor = self.cache.version_floor(first, length, self.version)
            for j, slot in enumerate(admission.slots):
                self._start(pending.sequences[j], slot, floor)
            self.stats.prefill_tokens += len(context) - length
            self.stats.prefix_hit_tokens += length
            pending.usage.prefill_tokens += len(context) - length
            pending.usage.prefix_hit_tokens += length
        for stage in sorted(stages):  # a stage's sources are complete once the stages before it ran
            first_copies, extends, later_copies = stages[stage]
            self._copy(first_copies)
            self._extend(extends)
            self._copy(later_copies)

    def _copy(self, copies: list) -> None:
        """Copy-prefix calls for ``(source, destination, length, request, sample index)`` entries."""
        for first in range(0, len(copies), COPY_ROWS):
            plan = CopyPlan.empty(self.slots)
            cross = False
            for k, (src, dst, length, request, j) in enumerate(copies[first : first + COPY_ROWS]):
                plan.src_rows[k], plan.dst_rows[k], plan.lengths[k] = src, dst, length
                plan.sample_id[k], plan.turn[k], plan.key_index[k] = key_parts(request, j)
                cross = cross or self.cache.replica_of(src) != self.cache.replica_of(dst)
            self.stats.prefill_calls += 1
            self.runner.copy(plan, self.root_key, cross)

    def _extend(self, extends: list[tuple[int, np.ndarray]]) -> None:
        """Extend calls for ``(slot, tokens after its kept prefix)`` entries: by bucket, each replica's
        rows from its own slots (``prefill_rows`` per call, as fresh prefills)."""
        replicas = self.cache.replicas
        per_replica = self.prefill_rows // replicas
        by_bucket: dict[int, list[list[tuple[int, np.ndarray]]]] = {}
        for slot, tokens in extends:
            bucket = next(b for b in self.extend_buckets if b >= len(tokens))
            by_bucket.setdefault(bucket, [[] for _ in range(replicas)])[self.cache.replica_of(slot)].append((slot, tokens))
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
                self.stats.prefill_calls += 1
                self.runner.extend(plan)

    def _trie_offset(self, trie: TokenTrie) -> int:
        """``trie``'s node offset in the engine's pool, adding it (with the tries still in use, whose
        rows' nodes are moved to their new offsets) when it is new."""
        offset = self.tries.offset(trie)
        if offset is not None:
            return offset
        live = [(s.request.constraint, s, row) for row, s in enumerate(self.rows)
                if s is not None and s.request.constraint is not None and self.controls.node[row] >= 0]
        self.tries.rebuild([t for t, _, _ in live] + [trie])
        for live_trie, sequence, row in live:
            self.controls.node[row] = self.tries.require(live_trie) + sequence.node
        assert self.tries.tables is not None
        self.trie_tables = self.runner.put_tables(self.tries.tables)
        return self.tries.require(trie)

    # ------------------------------------------------------------------ decode

    def _decode(self) -> None:
        started = time.monotonic()
        c = self.controls
        active = c.active.copy()
        filtered = bool(np.any(active & ((c.top_k > 0) | (c.top_p < 1.0))))
        constrained = bool(np.any(active & (c.node >= 0)))
        with self.cond:
            # A row freed inside the chunk ends it early when the next waiting request fits and
            # (with PAIRED_REFILL_MIN_SLOTS or more) prefill_rows rows are free: two prompts
            # prefill in one call for about the price of one, while the first freed row idles
            # only until the next finish. With none waiting the same holds: a client usually
            # submits again at once.
            pair = self.prefill_rows if self.slots >= PAIRED_REFILL_MIN_SLOTS else 1
            c.refill_free[...] = max(self.waiting[0].request.n if self.waiting else 1, pair)
        version = self.version
        contexts = (s.context for row, s in enumerate(self.rows) if s is not None and active[row])
        tokens, logprobs, emitted = self.runner.decode(
            snapshot(c), self.chunk, filtered, self.trie_tables if constrained else None,
            self.tries.max_branch if constrained else 0, chunk_bucket(self.attention_buckets, contexts, self.chunk))
        dispatched = time.monotonic()
        tokens, logprobs, emitted = np.asarray(tokens), np.asarray(logprobs), np.asarray(emitted)
        ready = time.monotonic()
        steps = int(emitted.any(axis=0).sum())
        self.stats.decode_steps += steps
        for row in map(int, np.flatnonzero(active)):
            sequence = self.rows[row]
            assert sequence is not None, f"active row {row} has no sequence"
            fed = int(c.last_token[row])
            before = len(sequence.tokens)
            self._consume(sequence, tokens[row], logprobs[row], emitted[row], version)
            if len(sequence.tokens) > before:  # its steps fed its last token, then its new ones but the newest
                self.cache.fed(row, [fed, *sequence.tokens[before:-1]], version)
        finished = time.monotonic()
        self.freed = int(np.sum(active & ~c.active))
        self.step_s = (finished - started) / max(steps, 1)
        self.stats.decode_s += finished - started
        self.stats.decode_wait_s += ready - dispatched
        self.stats.decode_host_s += (dispatched - started) + (finished - ready)

    def _await_refill(self) -> None:
        """After a chunk that freed rows, give the callers whose requests just finished a moment
        to submit their next ones before the next chunk starts without them: until waiting
        samples cover the freed rows (so they are prefilled together, ``prefill_rows`` per
        call), at most a tenth of a decode step (an idle row would otherwise wait for the next
        chunk boundary)."""
        if not self.freed:
            return
        started = time.monotonic()
        deadline = started + min(0.1 * self.step_s, 0.05)
        with self.cond:
            while not (sum(p.request.n for p in self.waiting) >= self.freed or self.closed
                       or self.update is not None or self.aborts):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
        self.stats.refill_wait_s += time.monotonic() - started

    def _consume(self, sequence: Sequence, tokens, logprobs, emitted, version: int) -> None:
        """Append one row's chunk output to its sequence and end it when it stopped."""
        pending = sequence.pending
        request = pending.request
        trie = request.constraint
        if sequence.version_floor is not None:  # it attends to a kept prefix of older weights (across_versions)
            version = min(version, sequence.version_floor)
        row = sequence.row
        assert row is not None
        for t in np.flatnonzero(emitted):
            token = int(tokens[t])
            sequence.tokens.append(token)
            sequence.logprobs.append(float(logprobs[t]))
            sequence.versions.append(version)
            # Counted as kept: a stop sequence is found here, on the host, so the tokens the device
            # decoded after it in the chunk (as many as the chunk's timing allows) are not counted,
            # and the counters are the same in every run of the same requests.
            self.stats.decode_tokens += 1
            pending.usage.decode_tokens += 1
            index = len(sequence.tokens) - 1
            if trie is not None:  # the device followed the same trie: the token is allowed
                sequence.node = trie.child(sequence.node, token)
                if trie.is_leaf(sequence.node):
                    return self._end(sequence, "stop")
            elif index >= request.min_new_tokens:
                if token in pending.stop_set:
                    return self._end(sequence, "eos")
                for seq in pending.stop_sequences:
                    if sequence.tokens[-len(seq):] == seq:
                        return self._end(sequence, "stop")
            if len(sequence.tokens) >= request.max_new_tokens:
                return self._end(sequence, "length")
        self.controls.last_token[row] = sequence.tokens[-1]
        self.controls.generated[row] = len(sequence.tokens)
        if trie is not None:
            self.controls.node[row] = self.tries.require(trie) + sequence.node
