"""The scheduler of :class:`~asyncrl.engine.jax_engine.JaxEngine`: requests, admission, chunk
boundaries, preemption; no device arrays.

One daemon thread (:meth:`Scheduler.run`) makes every device call through the model runner
(:mod:`asyncrl.engine.model_runner`): it installs published weights, admits waiting requests into
free rows of the decode batch (where their KV goes and what they share or reuse is the KV cache
manager's answer, :mod:`asyncrl.engine.kv_cache_manager`), prefills their contexts in chunks of the
largest prefill bucket, runs beam-search requests between chunks, gives every running sequence the
pages its next chunk writes (preempting the latest admitted when the pool runs out), decodes one
chunk for all rows, hands finished requests back through their futures, and repeats. Continuous
batching, the early end of a chunk and the paired refills are described in
:mod:`asyncrl.engine.jax_engine`'s docstring.

Callers (any thread) reach it only through :meth:`Scheduler.submit`, :meth:`Scheduler.post_update`,
:meth:`Scheduler.post_abort`, :meth:`Scheduler.post_flush` and :meth:`Scheduler.close`, under its
condition; every other attribute is the scheduler thread's. The module stays one file for that
reason: its methods are the steps of one thread's loop over state no other thread touches, and a
split would spread one owner's state over several modules.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import threading
import time
import traceback
from typing import Any, Optional, Union

import numpy as np

from asyncrl.config import EngineConfig
from asyncrl.engine.attention_buckets import chunk_bucket
from asyncrl.engine.beam_search import run_beam_request
from asyncrl.engine.constraints import TokenTrie, TriePool
from asyncrl.engine.jax_programs import SlotControls, snapshot
from asyncrl.engine.kv_cache_manager import Chunk, KVCacheManager, Part, SequenceKV
from asyncrl.engine.model_runner import ModelRunner
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
        buckets, extend_buckets: the prefill programs' token counts (first chunks; chunks after
            what a sequence holds).
        flat_sizes, view_sizes: the CPU decode attention's size classes: of the flat list of pages
            (per replica), of the pages per row of each row's view.
        row_sizes: the CPU decode chunk's size classes of rows per replica (a chunk runs the busy
            rows and idle ones up to the smallest class holding the busiest replica's); empty: every row.
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner, cache: KVCacheManager, stats: EngineStats,
                 root_key: Any, version: int, buckets: tuple[int, ...], extend_buckets: tuple[int, ...],
                 flat_sizes: tuple[int, ...], view_sizes: tuple[int, ...] = (1,), row_sizes: tuple[int, ...] = ()):
        self.config = config
        self.runner = runner
        self.cache = cache
        self.stats = stats
        self.root_key = root_key
        self.version = version
        self.buckets, self.extend_buckets, self.flat_sizes, self.view_sizes = buckets, extend_buckets, flat_sizes, view_sizes
        self.slots = int(config.slots)
        self.chunk = config.decode_chunk
        self.prefill_rows = runner.prefill_rows
        self.replicas = runner.replicas
        self.rows_per_replica = self.slots // self.replicas
        self.row_sizes = tuple(size for size in row_sizes if size < self.rows_per_replica)
        self.page_size = cache.page_size
        self.no_page = cache.pages_per_replica  # a page table's and a copy's "none"
        self.growth_pages = -(-self.chunk // self.page_size)  # pages one chunk can take a sequence into
        # the decode batch: which sequence each row runs, and what each row asks of the next chunk
        self.rows: list[Optional[Sequence]] = [None] * self.slots
        self.controls = runner.idle_controls()
        self.tries = TriePool()  # the tries of the constrained requests admitted
        self.trie_tables: Any = None  # self.tries.tables on the devices
        self.running: set[Pending] = set()
        self.resume: list[Sequence] = []  # admitted sequences without pages (preempted, or not placed yet), oldest first
        self.copying: list[Part] = []  # parts whose page copies the next decode chunk makes
        self.orders = itertools.count()
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

    def waiting_samples(self) -> int:
        """Samples waiting for a row: of waiting requests, and admitted sequences waiting to resume."""
        return sum(p.request.n for p in self.waiting) + len(self.resume)

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
                if self.running or self.copying:
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
        self.cache.published()
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
        self.resume = []
        for p in pending:
            if not p.future.done():
                p.future.set_exception(error)

    def _free_rows(self) -> list[list[int]]:
        """The free rows of each replica."""
        per = self.rows_per_replica
        return [[row for row in range(r * per, (r + 1) * per) if self.rows[row] is None] for r in range(self.replicas)]

    def _finish(self, pending: Pending) -> None:
        self.running.discard(pending)
        self.stats.requests += 1
        pending.usage.requests += 1
        pending.future.set_result(pending.response())

    def _vacate(self, sequence: Sequence) -> None:
        """``sequence`` leaves the decode batch and gives its pages back (those in the prefix tree
        stay there, reusable)."""
        if sequence.kv is not None:
            self.cache.release(sequence.kv)
            sequence.kv = None
        row = sequence.row
        if row is not None:
            self.rows[row] = None
            self.controls.active[row] = False
            self.controls.page_table[row] = self.no_page
            sequence.row = None

    def _end(self, sequence: Sequence, reason: StopReason) -> None:
        pending = sequence.pending
        sequence.stop_reason = reason
        if reason == "aborted":
            self.stats.aborted += 1
            pending.usage.samples_aborted += 1
        self._vacate(sequence)
        if sequence in self.resume:
            self.resume.remove(sequence)
        if all(s.stop_reason is not None for s in pending.sequences):
            self._finish(pending)

    def _preempt(self, sequence: Sequence) -> None:
        """The pool ran out: ``sequence`` gives its pages back and waits to resume with the tokens
        it has (its context prefilled again, or found in the prefix tree)."""
        self._vacate(sequence)
        self.stats.preemptions += 1
        bisect.insort(self.resume, sequence, key=lambda s: s.order)

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
        """Move waiting sequences (resumed ones first, oldest first, then new requests in order)
        into free rows while the next one fits, and prefill their contexts: ``prefill_rows``
        rows per call, a context longer than the largest bucket in chunks of it, a context that
        begins with pages the prefix tree holds from after them. Requests that arrive while the
        calls are dispatched are taken too (clients of a burst submit a moment apart)."""
        self._run_beams()
        started = time.monotonic()
        any_admitted = False
        while admitted := self._take_waiting():
            any_admitted = True
            self._dispatch(admitted, time.monotonic())
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
        """Beam search for ``pending`` (:func:`~asyncrl.engine.beam_search.run_beam_request`)."""
        trie = pending.request.constraint
        tries = None
        if trie is not None:
            root = self._trie_offset(trie)  # first: it may rebuild the pool's tables
            tries = (self.trie_tables, np.int32(root), self.tries.max_branch)
        started = time.monotonic()
        run_beam_request(self.runner, pending, self.buckets, self.version, tries)
        self.stats.beam_calls += 1
        self.stats.beam_s += time.monotonic() - started
        self._finish(pending)

    def _take_waiting(self) -> list[tuple[Optional[Pending], list[tuple[Part, list[Sequence], list[int]]]]]:
        """Admit waiting sequences in order while the next one fits: rows for all its samples, and
        pages for as many of them as the pool holds with room for the running sequences' next
        chunk (samples left over wait to resume). Each admitted entry: its request (None for a
        resumed sequence) and its parts (:class:`~asyncrl.engine.kv_cache_manager.Part`, with their
        sequences and rows). Stops before a request whose best match is pages this round has not
        written yet (it is admitted in the next round, after them)."""
        admitted: list[tuple[Optional[Pending], list[tuple[Part, list[Sequence], list[int]]]]] = []
        free = self._free_rows()
        busy = [sum(1 for row in range(r * self.rows_per_replica, (r + 1) * self.rows_per_replica)
                    if self.rows[row] is not None) for r in range(self.replicas)]
        with self.cond:
            while True:
                pending: Optional[Pending]
                if self.resume:
                    pending, sequences = None, [self.resume[0]]
                elif self.waiting and not self.waiting[0].request.beam:
                    pending = self.waiting[0]
                    sequences = list(pending.sequences)
                else:
                    break
                if len(sequences) > sum(len(f) for f in free):
                    break
                placed = self._plan(sequences, free, busy)
                if placed is None:
                    break
                if pending is not None:
                    self.waiting.popleft()
                    self.running.add(pending)
                    for sequence in sequences:
                        sequence.order = next(self.orders)
                else:
                    self.resume.pop(0)
                left = [s for s in sequences if all(s not in seqs for _, seqs, _ in placed)]
                for sequence in left:
                    bisect.insort(self.resume, sequence, key=lambda s: s.order)
                admitted.append((pending, placed))
        return admitted

    def _plan(self, sequences: list[Sequence], free: list[list[int]],
              busy: list[int]) -> Optional[list[tuple[Part, list[Sequence], list[int]]]]:
        """Place ``sequences`` (one context: a request's samples, or one resumed sequence) on the
        replicas (:meth:`~asyncrl.engine.kv_cache_manager.KVCacheManager.admit`), each part on rows
        of its replica taken from ``free`` and counted in ``busy``; None when no sample fits."""
        context = np.asarray(sequences[0].context_ids(), np.int32)
        parts = self.cache.admit(context, len(sequences), [len(f) for f in free], busy, self.version, self.growth_pages,
                                 self.buckets[-1])
        if parts is None:
            return None
        placed, first = [], 0
        for part in parts:
            k = len(part.kvs)
            rows, free[part.replica] = free[part.replica][:k], free[part.replica][k:]
            busy[part.replica] += k
            placed.append((part, sequences[first : first + k], rows))
            first += k
        return placed

    def _dispatch(self, admitted: list[tuple[Optional[Pending], list[tuple[Part, list[Sequence], list[int]]]]],
                  admitted_at: float) -> None:
        """Prefill the admitted contexts (their chunks, stage by stage) and start their sequences."""
        chunks: list[Chunk] = []
        for pending, placed in admitted:
            if pending is not None:
                self._note_admitted(pending, admitted_at)
            for part, sequences, _ in placed:
                chunks += part.chunks
                context = part.kvs[0].length
                usage = sequences[0].pending.usage
                self.stats.prefill_tokens += context - part.reused
                self.stats.prefix_hit_tokens += part.reused
                usage.prefill_tokens += context - part.reused
                usage.prefix_hit_tokens += part.reused
                # The part's first sample computes what it did not reuse; the others share its pages.
                prompt = sequences[0].pending.prompt_kv_tokens
                for j, sequence in enumerate(sequences):
                    sequence.prompt_computed += max(prompt - (part.reused if j == 0 else context), 0)
        for stage in sorted({chunk.stage for chunk in chunks}):
            for fresh in (True, False):
                self._prefill([c for c in chunks if c.stage == stage and (c.start == 0) == fresh], fresh)
        self.cache.settle()
        for _, placed in admitted:
            for part, sequences, rows in placed:
                for sequence, kv, row in zip(sequences, part.kvs, rows):
                    self._start(sequence, row, kv)
                for j, src, dst in part.copies:
                    self.controls.copy_src[rows[j]], self.controls.copy_dst[rows[j]] = src, dst
                self.copying.append(part)

    def _prefill(self, chunks: list[Chunk], fresh: bool) -> None:
        """Prefill calls for ``chunks`` (one stage, all first chunks or all later ones)."""
        if chunks:
            work = [(c.kv.replica, c.start, c.tokens, self.cache.table(c.kv), c.copy) for c in chunks]
            self.stats.prefill_calls += self.runner.prefill_chunks(work, self.buckets if fresh else self.extend_buckets, fresh)

    def _note_admitted(self, pending: Pending, admitted_at: float) -> None:
        wait = admitted_at - pending.submitted
        self.stats.admitted += 1
        self.stats.queue_wait_s += wait
        self.stats.queue_wait_max_s = max(self.stats.queue_wait_max_s, wait)

    def _start(self, sequence: Sequence, row: int, kv: SequenceKV) -> None:
        """``sequence`` runs on ``row`` over the pages of ``kv`` (its context written: its next decode
        step feeds its last token); its tokens carry ``kv.floor`` when it reuses KV of older weights
        (``engine.prefix_cache.across_versions``)."""
        self.rows[row] = sequence
        sequence.row = row
        sequence.kv = kv
        if kv.floor is not None:
            floor = sequence.version_floor
            sequence.version_floor = kv.floor if floor is None else min(floor, kv.floor)
        request = sequence.request
        c = self.controls
        c.last_token[row], c.generated[row], c.active[row] = sequence.last_token, len(sequence.tokens), True
        c.greedy[row] = request.greedy
        c.temperature[row] = 1.0 if request.greedy else request.temperature
        c.top_k[row] = 0 if request.greedy else request.top_k
        c.top_p[row] = 1.0 if request.greedy else request.top_p
        c.min_new_tokens[row], c.max_new_tokens[row] = request.min_new_tokens, request.max_new_tokens
        stop_ids = sequence.pending.stop_ids
        c.stop_ids[row] = -1
        c.stop_ids[row, : len(stop_ids)] = stop_ids
        c.lengths[row] = kv.length
        c.page_table[row] = self.cache.table(kv)
        c.sample_id[row], c.turn[row], c.key_index[row] = key_parts(request, sequence.index)
        c.node[row] = -1
        if request.constraint is not None:
            c.node[row] = self._trie_offset(request.constraint) + sequence.node

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

    def _reach(self, sequence: Sequence) -> int:
        """Positions ``sequence`` can hold by the end of the next chunk."""
        assert sequence.kv is not None
        return min(sequence.kv.length + self.chunk, sequence.positions)

    def _grow(self) -> None:
        """Give every running sequence the pages its next chunk writes, oldest first; when a
        replica's pool cannot, preempt its latest admitted sequence (that one last) and retry."""
        running = sorted((s for s in self.rows if s is not None), key=lambda s: s.order)
        for sequence in running:
            while sequence.kv is not None and not self.cache.grow(sequence.kv, self._reach(sequence)):
                replica = sequence.kv.replica
                victim = max((s for s in self.rows if s is not None and s.kv is not None and s.kv.replica == replica),
                             key=lambda s: s.order)
                self._preempt(victim)
            if sequence.row is not None and sequence.kv is not None:
                self.controls.page_table[sequence.row] = self.cache.table(sequence.kv)

    def _decode(self) -> None:
        started = time.monotonic()
        self._grow()
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
            following = 1 if self.resume else self.waiting[0].request.n if self.waiting else 1
            c.refill_free[...] = max(following, pair)
        version = self.version
        chosen = self._chunk_rows(active)
        controls, per = snapshot(c), self.rows_per_replica
        if chosen is not None:  # the rows left out are idle: the chunk's free rows count them
            controls = SlotControls(*(x if name == "refill_free" else x[chosen]
                                      for name, x in zip(SlotControls._fields, controls)))
            controls.refill_free[...] = max(int(c.refill_free) - (self.slots - len(chosen)), 0)
            per = len(chosen) // self.replicas
        flat, view_pages = None, 0
        if self.runner.flat_attention:  # the CPU: a view of the pages the chunk reads (each row's first ones, or a list)
            running = [self.rows[row] for row in (range(self.slots) if chosen is None else map(int, chosen))]
            reach = [(j, s.kv, self._reach(s)) for j, s in enumerate(running) if s is not None and s.kv is not None and s.row is not None
                     and active[s.row]]
            view_pages = chunk_bucket(self.view_sizes, max((self.cache.pages_for(n) for _, _, n in reach), default=1))
            listed = chunk_bucket(self.flat_sizes, self.cache.listed_pages(reach, per))
            if listed < view_pages * per:
                flat, view_pages = self.cache.flat_pages(reach, per, self.flat_sizes), 0
        tokens, logprobs, emitted = self.runner.decode(
            controls, flat, self.root_key, self.chunk, filtered, self.trie_tables if constrained else None,
            self.tries.max_branch if constrained else 0, view_pages)
        if self.copying:  # the chunk made them: the copied pages are matchable, their sources free to go
            c.copy_dst[:] = self.no_page
            self.cache.settle_copies()
            for part in self.copying:
                self.cache.unprotect(part)
            self.copying = []
        dispatched = time.monotonic()
        tokens, logprobs, emitted = np.asarray(tokens), np.asarray(logprobs), np.asarray(emitted)
        ready = time.monotonic()
        if chosen is not None:  # back to the engine's rows
            tokens, logprobs, emitted = (_scatter_rows(x, chosen, self.slots) for x in (tokens, logprobs, emitted))
        steps = int(emitted.any(axis=0).sum())
        self.stats.decode_steps += steps
        for row in map(int, np.flatnonzero(active)):
            sequence = self.rows[row]
            assert sequence is not None and sequence.kv is not None, f"active row {row} has no sequence"
            fed, before = sequence.last_token, len(sequence.tokens)
            reason = self._consume(sequence, tokens[row], logprobs[row], emitted[row], version)
            new = sequence.tokens[before:]
            if new:  # its steps fed its last token, then its new ones but the newest
                self.cache.written(sequence.kv, [fed, *new[:-1]], version)
                c.lengths[row] = sequence.kv.length
            if reason is not None:
                self._end(sequence, reason)
            else:
                c.last_token[row] = sequence.last_token
                c.generated[row] = len(sequence.tokens)
                if sequence.request.constraint is not None:
                    c.node[row] = self.tries.require(sequence.request.constraint) + sequence.node
        finished = time.monotonic()
        self.freed = int(np.sum(active & ~c.active))
        self.step_s = (finished - started) / max(steps, 1)
        self.stats.decode_s += finished - started
        self.stats.decode_wait_s += ready - dispatched
        self.stats.decode_host_s += (dispatched - started) + (finished - ready)

    def _chunk_rows(self, active: np.ndarray) -> Optional[np.ndarray]:
        """The rows a decode chunk runs when fewer than all (``row_sizes``; the CPU's, whose step
        costs every row it runs): per replica in turn, its busy rows (running, or making a page copy)
        and idle ones up to the smallest size class holding the busiest replica's; None: every row."""
        if not self.row_sizes:
            return None
        per = self.rows_per_replica
        busy = active | (self.controls.copy_dst != self.no_page)
        blocks = [np.flatnonzero(busy[r * per:(r + 1) * per]) for r in range(self.replicas)]
        size = chunk_bucket((*self.row_sizes, per), max(len(b) for b in blocks))
        if size >= per:
            return None
        chosen = []
        for r, block in enumerate(blocks):
            idle = np.setdiff1d(np.arange(per), block)[: size - len(block)]
            chosen.append(r * per + np.concatenate([block, idle]))
        return np.concatenate(chosen).astype(np.int64)

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
            while not (self.waiting_samples() >= self.freed or self.closed or self.update is not None or self.aborts):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
        self.stats.refill_wait_s += time.monotonic() - started

    def _consume(self, sequence: Sequence, tokens, logprobs, emitted, version: int) -> Union[StopReason, None]:
        """Append one row's chunk output to its sequence; why it stopped, or None."""
        pending = sequence.pending
        request = pending.request
        trie = request.constraint
        if sequence.version_floor is not None:  # it attends to a kept prefix of older weights (across_versions)
            version = min(version, sequence.version_floor)
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
                    return "stop"
            elif index >= request.min_new_tokens:
                if token in pending.stop_set:
                    return "eos"
                for seq in pending.stop_sequences:
                    if sequence.tokens[-len(seq):] == seq:
                        return "stop"
            if len(sequence.tokens) >= request.max_new_tokens:
                return "length"
        return None


def _scatter_rows(values: np.ndarray, rows: np.ndarray, slots: int) -> np.ndarray:
    """``values`` ``[len(rows), ...]`` of a chunk that ran ``rows``, as ``[slots, ...]`` (zeros elsewhere)."""
    out = np.zeros((slots, *values.shape[1:]), values.dtype)
    out[rows] = values
    return out
