"""WorkflowExecutor: rollout threads in the background, validated batches on demand.

One dispatcher thread admits episodes through the :class:`StalenessLedger` (at most
``rollout.max_concurrent`` in flight) and hands them, through an internal list guarded by the
executor's lock, to a fixed pool of ``rollout.max_concurrent`` daemon worker threads started
by :meth:`WorkflowExecutor.start` (so the number of live threads is constant). A worker
runs ``workflow.run_episode(engine, sample)``, checks the group against the trajectory schema,
and puts it on the :class:`SimpleDataQueue`. The trainer's thread calls
:meth:`WorkflowExecutor.next_batch`, which drains the queue, applies the consumption
filters through the pure :func:`~asyncrl.rollout.batch.prepare_batch`, records every decision in
the ledger, and returns a :class:`~asyncrl.rollout.batch.PreparedBatch` (batch, groups, sample ids,
metrics): the executor is the RL stage's :class:`~asyncrl.rollout.batch.BatchSource`.

Where batches are chosen: the :class:`SimpleDataQueue` is only the hand-off from the rollout
threads to the trainer's thread (the documented contract: workers put, nobody else takes).
``next_batch`` moves everything on it into ``_ready``, a buffer keyed by ledger ticket, and
the batch is chosen there: the ledger orders the ready tickets (``rollout.batch_order``),
:func:`~asyncrl.rollout.batch.prepare_batch` drops the stale or filtered ones, and the first
``batch_size`` survivors are consumed. ``next_batch`` waits on the executor's condition
``_wake``, not on the queue: a finished episode, a fatal error and ``close()`` notify it.

Failure handling:

* an episode that raises, breaks the schema (``failed:schema:<rule>``) or runs past
  ``rollout.episode_timeout_s`` (``failed:timeout``; its worker is abandoned and one
  replacement worker started, so the pool keeps its size) is counted and its slot
  refilled; ``rollout.max_consecutive_failures`` in a row stop training with the root
  cause, raised from ``next_batch``;
* :class:`~asyncrl.errors.EngineCrashed` from the engine stops training at once: the queue is
  closed, admission stops, and ``next_batch`` raises it (with the engine's traceback);
* every wait has a timeout or is woken by ``close()``/a fatal error; ``close()`` returns
  within its timeout. Idle workers exit at once; workers still running an episode then are
  abandoned (daemons) and exit when it returns; those samples stay ``in_flight`` in the ledger
  and are re-issued after a restore.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import pydantic

from asyncrl.config import Config
from asyncrl.data import sample_at
from asyncrl.engine.protocol import InferenceEngine
from asyncrl.errors import EngineCrashed, RolloutError, TrajectorySchemaError
from asyncrl.rollout.batch import BatchAbandoned, PreparedBatch, prepare_batch, select_groups
from asyncrl.rollout.ledger import QUEUED, SampleShare, StalenessLedger
from asyncrl.rollout.queue import QueueClosed, SimpleDataQueue
from asyncrl.rollout.rewards import RewardFailuresExceeded
from asyncrl.rollout.trajectory import TrainBatch, TrajectoryGroup, check_group
from asyncrl.rollout.workflow import RolloutWorkflow, SkipSample

log = logging.getLogger(__name__)

STATE_FORMAT = 1
_MAX_WAIT_S = 1.0  # upper bound of any single wait: a lost wake-up costs at most this
FAILURES_LOGGED_IN_FULL = 3
"""Failed episodes of one kind logged with their traceback; later ones go into a periodic summary."""
FAILURE_SUMMARY_EVERY_S = 60.0
NOT_COUNTED_AS_DROPS = ("stale", "zero_variance")
"""Drop reasons that are part of normal operation, never a sign that nothing can be trained."""


@dataclasses.dataclass
class _Episode:
    ticket: int
    sample_id: int
    started: float
    deadline: float
    worker: Optional[threading.Thread] = None  # the pool worker running it (an abandoned one leaves the pool)


class WorkflowExecutor:
    """Runs ``workflow`` episodes against ``engine`` on ``dataset`` samples, bounded by staleness.

    Args:
        workflow: the :class:`RolloutWorkflow` whose ``run_episode`` each thread runs.
        engine: an :class:`~asyncrl.engine.protocol.InferenceEngine`.
        dataset: a :class:`~asyncrl.data.SampleOrder` (sample id ``s`` is its draw ``s``) or a
            plain sequence of sample mappings (cycled in order: ``dataset[s % len(dataset)]``).
        cfg: the run config (``rollout.*``, ``data.*``).
        version: the version served at start (default: ``engine.version``; ``k`` on resume).
        row_multiple: batch rows are padded to a multiple of this (the trainer's sharding).
        share: the sample ids it draws and the groups of each step it makes (a process's share
            in a multi-process run, :func:`~asyncrl.rollout.ledger.process_share`); default all.
    """

    def __init__(
        self,
        workflow: RolloutWorkflow,
        engine: InferenceEngine,
        dataset: Sequence[Mapping[str, Any]],
        cfg: Config,
        *,
        version: Optional[int] = None,
        row_multiple: int = 1,
        share: Optional[SampleShare] = None,
    ):
        if len(dataset) == 0:
            raise RolloutError("WorkflowExecutor: the dataset is empty")
        self.workflow = workflow
        self.engine = engine
        self.dataset = dataset
        self.cfg = cfg
        self.row_multiple = row_multiple
        rollout = cfg.rollout
        self.ledger = StalenessLedger(share.count if share is not None else rollout.batch_size, rollout.max_staleness,
                                      rollout.max_concurrent, engine.version if version is None else version, share)
        self._queue: SimpleDataQueue = SimpleDataQueue(rollout.queue_capacity)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ready: dict[int, TrajectoryGroup] = {}
        """Groups taken off the queue, by ticket, not yet consumed: where next_batch chooses a batch."""
        self._latency: dict[int, float] = {}
        self._running: dict[int, _Episode] = {}
        self._pending: collections.deque[_Episode] = collections.deque()
        """Admitted episodes no worker has taken yet (also in ``_running``, so their deadline counts)."""
        self._work = threading.Condition(self._lock)
        """Wakes idle workers: an episode was admitted, or ``close()``."""
        self._workers_started = 0
        self.workers: list[threading.Thread] = []  # the live pool (the run joins it when it ends)
        self._recent_latencies: collections.deque = collections.deque(maxlen=512)
        self._fatal: Optional[BaseException] = None
        self._consecutive_failures = 0
        self._failures_logged: collections.Counter = collections.Counter()
        self._failures_unlogged: collections.Counter = collections.Counter()
        self._last_failure_summary = time.monotonic()
        self._skips_in_a_row = 0
        self._drops_in_a_row = 0
        self._drop_reasons_logged: set[str] = set()
        self._metrics_error_logged = False
        self._stopping = threading.Event()
        self._dispatcher: Optional[threading.Thread] = None
        self._published: Optional[tuple[dict[str, Any], dict[int, TrajectoryGroup]]] = None
        """The ledger and the queued groups as of the last :meth:`set_version` (or :meth:`start`):
        what :meth:`checkpoint_state` packs."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "WorkflowExecutor":
        """Start admitting episodes (once)."""
        if self._dispatcher is not None:
            raise RuntimeError("WorkflowExecutor.start() was already called")
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="asyncrl-dispatcher", daemon=True)
        with self._lock:
            self._published = self._snapshot()
            for _ in range(self.cfg.rollout.max_concurrent):
                self._start_worker()
        self._dispatcher.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop admitting, wake every waiter and return within ``timeout`` seconds."""
        self._stopping.set()
        self._queue.close()
        with self._wake:
            self._wake.notify_all()
            self._work.notify_all()
        if self._dispatcher is not None and self._dispatcher is not threading.current_thread():
            self._dispatcher.join(timeout)

    def __enter__(self) -> "WorkflowExecutor":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def set_version(self, version: int) -> None:
        """The engine now serves ``version`` (call after ``engine.update_weights`` returned)."""
        served = self.engine.version
        if version > served:
            raise RolloutError(
                f"set_version({version}) while the engine serves version {served}: call engine.update_weights(params, "
                f"{version}) first, so that no token of the old weights is tagged with the new version"
            )
        with self._wake:
            self.ledger.publish(version)
            # Taken in the same hold of the lock as the publish: nothing admitted under the new
            # version has started, so this is the rollout state that goes with the engine counters
            # the loop read just before (docs/design.md "Versions and the publish order", step 4).
            self._published = self._snapshot()
            self._wake.notify_all()

    @property
    def version(self) -> int:
        with self._lock:
            return self.ledger.version

    def counts(self) -> dict[str, int]:
        """Samples per accounting category (docs/design.md "Accounting")."""
        with self._lock:
            return self.ledger.counts()

    # ------------------------------------------------------------------ dispatcher

    def _dispatch_loop(self) -> None:
        try:
            with self._wake:
                while not self._stopping.is_set() and self._fatal is None:
                    now = time.monotonic()
                    for episode in [e for e in self._running.values() if now >= e.deadline]:
                        del self._running[episode.ticket]
                        if episode in self._pending:  # no worker took it yet: the pool is intact
                            self._pending.remove(episode)
                        else:  # its worker is stuck in the episode: abandoned, one replacement keeps the pool size
                            self._start_worker(replacing=episode.worker)
                        self._record_failure(
                            episode, "timeout",
                            f"episode ran past rollout.episode_timeout_s = {self.cfg.rollout.episode_timeout_s} s; worker thread abandoned",
                        )
                    while self._fatal is None and self.ledger.can_admit():
                        self._start_episode(*self.ledger.admit())
                    next_deadline = min((e.deadline for e in self._running.values()), default=now + _MAX_WAIT_S)
                    self._wake.wait(max(0.0, min(_MAX_WAIT_S, next_deadline - time.monotonic())))
        except BaseException as err:  # noqa: BLE001 - the dispatcher's own bug must reach the trainer
            with self._lock:
                self._set_fatal(RolloutError(f"rollout dispatcher thread crashed:\n{traceback.format_exc()}"), err)

    def _start_episode(self, ticket: int, sample_id: int) -> None:
        """Hand an admitted episode to the worker pool (lock held); its timeout runs from now."""
        now = time.monotonic()
        episode = _Episode(ticket, sample_id, now, now + self.cfg.rollout.episode_timeout_s)
        self._running[ticket] = episode
        self._pending.append(episode)
        self._work.notify()

    def _start_worker(self, replacing: Optional[threading.Thread] = None) -> None:
        """Start one pool worker (lock held), in place of ``replacing`` (abandoned: nobody waits for it)."""
        self._workers_started += 1
        worker = threading.Thread(target=self._worker_loop, name=f"asyncrl-rollout-worker-{self._workers_started}", daemon=True)
        self.workers = [w for w in self.workers if w.is_alive() and w is not replacing] + [worker]
        worker.start()

    # ------------------------------------------------------------------ episodes

    def _worker_loop(self) -> None:
        """Run admitted episodes one at a time until ``close()`` or until this worker is abandoned."""
        try:
            while True:
                with self._work:
                    while not self._pending and not self._stopping.is_set():
                        self._work.wait(_MAX_WAIT_S)
                    if self._stopping.is_set():
                        return
                    episode = self._pending.popleft()
                    episode.worker = threading.current_thread()
                if not self._run_episode(episode):
                    return
        except BaseException as err:  # noqa: BLE001 - a worker's own bug must reach the trainer
            with self._lock:
                self._set_fatal(RolloutError(f"rollout worker thread crashed:\n{traceback.format_exc()}"), err)

    def _run_episode(self, episode: _Episode) -> bool:
        """Run one episode and record its outcome; False when this worker must exit (the episode
        timed out, so a replacement took its place, or the executor was stopped)."""
        group: Optional[TrajectoryGroup] = None
        error: Optional[BaseException] = None
        outcome, detail = "ok", ""
        try:
            sample = dict(sample_at(self.dataset, episode.sample_id))
            sample["sample_id"] = episode.sample_id
            group = self.workflow.run_episode(self.engine, sample)
            if group is not None:
                check_group(
                    group,
                    group_size=self.cfg.rollout.group_size,
                    workflow=self.workflow.name,
                    sample_id=episode.sample_id,
                    expected_temperature=self.cfg.rollout.temperature,
                )
        except EngineCrashed as err:
            outcome, error = "crash", err
        except SkipSample as err:
            outcome, detail = "skip", err.reason
        except TrajectorySchemaError as err:
            outcome, detail, error = "schema", err.rule, err
        except pydantic.ValidationError as err:
            is_schema = err.title in ("Trajectory", "TrajectoryGroup")
            outcome, detail, error = ("schema", "type", err) if is_schema else ("error", "", err)
        except BaseException as err:  # noqa: BLE001 - any episode error is a counted failure
            crash = _in_chain(err, EngineCrashed)
            reward_stop = _in_chain(err, RewardFailuresExceeded)
            if crash is not None:
                outcome, error = "crash", crash
            elif reward_stop is not None:
                outcome, error = "reward_stop", reward_stop
            else:
                outcome, error = "error", err
        text = "".join(traceback.format_exception(error)) if error is not None else ""
        with self._wake:
            if self._running.get(episode.ticket) is not episode or self._stopping.is_set():
                return False  # timed out (already counted) or stopped (stays in flight for reissue)
            del self._running[episode.ticket]
            self._wake.notify_all()
            if outcome in ("crash", "reward_stop"):
                assert error is not None  # both outcomes carry their exception
                self.ledger.fail(episode.ticket, "engine_crash" if outcome == "crash" else "exception")
                self._set_fatal(error, error if outcome == "crash" else None)
            elif outcome == "skip":
                self.ledger.drop(episode.ticket, detail)
                self._skips_in_a_row += 1
                self._note_drop(detail, self._skips_in_a_row, episode.sample_id)
            elif outcome == "schema":
                where = f"workflow '{self.workflow.name}', sample {episode.sample_id}"
                if not isinstance(error, TrajectorySchemaError):
                    text = f"{where}: a Trajectory field has the wrong type (schema rule 'type'):\n{text}"
                self._record_failure(episode, f"schema:{detail}", text)
            elif outcome == "error":
                self._record_failure(episode, "exception", f"workflow '{self.workflow.name}', sample {episode.sample_id}:\n{text}")
            elif group is None:
                self.ledger.returned_none(episode.ticket)
            else:
                self._consecutive_failures = 0
                self._skips_in_a_row = 0
                latency = time.monotonic() - episode.started
                self._recent_latencies.append(latency)
                self.ledger.complete(episode.ticket, group.min_version)
                try:
                    # Never blocks: the admission rule keeps queued groups below the capacity.
                    self._queue.put((episode.ticket, group), timeout=_MAX_WAIT_S)
                except QueueClosed:
                    self._ready[episode.ticket] = group  # keep it for state_dict after close
                except Exception as err:  # queue.Full: the capacity invariant is broken
                    self._set_fatal(RolloutError(f"rollout queue full ({self._queue.capacity}): {err}"), err)
        return True

    def _record_failure(self, episode: _Episode, reason: str, text: str) -> None:
        """Count a failed episode (lock held); too many in a row is fatal."""
        self.ledger.fail(episode.ticket, reason)
        self._consecutive_failures += 1
        if self._failures_logged[reason] < FAILURES_LOGGED_IN_FULL:
            self._failures_logged[reason] += 1
            later = " (later ones of this kind are summarised periodically)" if self._failures_logged[reason] == FAILURES_LOGGED_IN_FULL else ""
            log.warning("episode failed (failed:%s), sample %s%s: %s", reason, episode.sample_id, later, text.strip())
        else:
            self._failures_unlogged[reason] += 1
            log.debug("episode failed (failed:%s), sample %s: %s", reason, episode.sample_id, text.strip())
            self._log_failure_summary()
        limit = self.cfg.rollout.max_consecutive_failures
        if self._consecutive_failures >= limit:
            self._set_fatal(
                RolloutError(
                    f"{self._consecutive_failures} episodes failed in a row (rollout.max_consecutive_failures = {limit}); "
                    f"last failure: failed:{reason}, sample {episode.sample_id}:\n{text.strip()}"
                ),
                None,
            )

    def _log_failure_summary(self, force: bool = False) -> None:
        """Every FAILURE_SUMMARY_EVERY_S: how many failures were not logged in full (lock held)."""
        now = time.monotonic()
        if not self._failures_unlogged or (not force and now - self._last_failure_summary < FAILURE_SUMMARY_EVERY_S):
            return
        counts = ", ".join(f"failed:{k} {v}" for k, v in sorted(self._failures_unlogged.items()))
        log.warning("%d more episodes failed in the last %.0f s (%s); totals in rollout/count/failed/*",
                    sum(self._failures_unlogged.values()), now - self._last_failure_summary, counts)
        self._failures_unlogged.clear()
        self._last_failure_summary = now

    def _note_drop(self, reason: str, in_a_row: int, sample_id: Any) -> None:
        """A finished group (or skipped sample) was dropped for ``reason`` (lock held): log the first
        of each reason; ``in_a_row`` such drops with nothing kept in between stop training."""
        if reason in NOT_COUNTED_AS_DROPS:
            return
        if reason not in self._drop_reasons_logged:
            self._drop_reasons_logged.add(reason)
            log.warning("sample %s dropped (dropped:%s): %s; later ones are counted in rollout/count/dropped/%s",
                        sample_id, reason, _drop_hint(reason, self.cfg), reason)
        limit = self.cfg.rollout.resolved_max_consecutive_drops
        if in_a_row >= limit:
            self._set_fatal(
                RolloutError(
                    f"the last {in_a_row} finished groups were all dropped as {reason} and none kept "
                    f"(rollout.max_consecutive_drops = {limit}): {_drop_hint(reason, self.cfg)}"
                ),
                None,
            )

    def _set_fatal(self, error: BaseException, cause: Optional[BaseException]) -> None:
        if self._fatal is None:
            if cause is not None and cause is not error:
                error.__cause__ = cause
            self._fatal = error
        self._queue.close()  # no more hand-offs: a group finished from now on stays in _ready (for state_dict)
        self._wake.notify_all()  # what wakes next_batch (it waits on _wake, not on the queue)

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    # ------------------------------------------------------------------ batches

    def next_batch(self, version: int, timeout: Optional[float] = None, *,
                   abandon_if: Optional[Callable[[], bool]] = None) -> PreparedBatch:
        """The batch for the trainer step starting from ``version`` (the served version), with
        its groups and sample ids (batch ``group_index`` order) and the step's rollout metrics
        (queue depth, in-flight, counts, lag, latency, wait, drops, the workflow's own).

        Waits up to ``timeout`` seconds (None: forever, still woken by errors and ``close``).
        ``abandon_if`` is polled while waiting (at least every second): once it returns True
        the wait ends with :class:`BatchAbandoned`, nothing consumed (a shutdown request).
        Raises the engine's :class:`EngineCrashed`, a :class:`RolloutError` (too many failures,
        timeout, stopped) or a schema error.
        """
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        rollout = self.cfg.rollout
        size = self.ledger.batch_size
        budget = rollout.resolved_max_filtered_per_step
        filtered = 0
        dropped_now: collections.Counter = collections.Counter()
        with self._wake:
            if version != self.ledger.version:
                raise RolloutError(
                    f"next_batch(version={version}) but the executor is at version {self.ledger.version}: "
                    "a batch is prepared with the version it will be trained at (publish, then set_version)"
                )
            while True:
                self._raise_fatal()
                for ticket, group in self._queue.get_all():
                    self._ready[ticket] = group
                tickets = self.ledger.candidates(rollout.batch_order)
                groups = [self._ready[t] for t in tickets]
                kept, dropped = select_groups(groups, version, self.cfg, filter_budget=budget - filtered, batch_size=size)
                if kept:
                    self._drops_in_a_row = 0
                for index, reason in dropped:
                    # Dropped groups leave the counts at once, so their slots are refilled.
                    sample_id = self.ledger.sample_id(tickets[index])
                    self.ledger.drop(tickets[index], reason)
                    del self._ready[tickets[index]]
                    dropped_now[reason] += 1
                    filtered += reason == "zero_variance"
                    if reason not in NOT_COUNTED_AS_DROPS:
                        self._drops_in_a_row += 1
                        self._note_drop(reason, self._drops_in_a_row, sample_id)
                if dropped:
                    self._wake.notify_all()
                if len(kept) == size:
                    chosen = [tickets[i] for i in kept]
                    batch, more = prepare_batch(
                        [self._ready[t] for t in chosen], version, self.cfg,
                        row_multiple=self.row_multiple, filter_budget=budget - filtered, batch_size=size,
                    )
                    assert not more, "prepare_batch dropped a group select_groups kept"
                    sample_ids = tuple(self.ledger.sample_id(t) for t in chosen)
                    self.ledger.consume(chosen)
                    kept_groups = tuple(self._ready.pop(t) for t in chosen)
                    self._wake.notify_all()
                    metrics = self._step_metrics(batch, kept_groups, version, time.monotonic() - started, dropped_now)
                    return PreparedBatch(batch, kept_groups, sample_ids, metrics)
                if self._stopping.is_set():
                    raise RolloutError("next_batch: the executor was closed")
                if abandon_if is not None and abandon_if():
                    raise BatchAbandoned(
                        f"next_batch abandoned with {len(kept)} of {size} groups ready; nothing consumed"
                    )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    blocking = self.ledger.in_flight_tickets()[:1]
                    raise RolloutError(
                        f"next_batch timed out after {timeout} s with {len(kept)} of {size} groups ready "
                        f"(batch_order {rollout.batch_order}, oldest in-flight ticket {blocking or 'none'}); "
                        f"counts: {self.ledger.counts()}"
                    )
                # Every episode end, drop, publish, fatal error and stop notifies this condition.
                self._wake.wait(_MAX_WAIT_S if remaining is None else min(remaining, _MAX_WAIT_S))

    def _step_metrics(self, batch: TrainBatch, groups: Sequence[TrajectoryGroup], version: int, waited: float,
                      dropped_now: Mapping[str, int]) -> dict[str, float]:
        """Metrics of the step (lock held)."""
        self._log_failure_summary()
        lag = (version - batch.versions[batch.loss_mask]).astype(np.float64)
        latencies = np.asarray(self._recent_latencies, dtype=np.float64)
        metrics: dict[str, float] = {
            "rollout/queue_depth": float(len(self._ready) + self._queue.qsize()),
            "rollout/in_flight": float(self.ledger.in_flight),
            "rollout/lag_max": float(lag.max()) if lag.size else 0.0,
            "rollout/lag_mean": float(lag.mean()) if lag.size else 0.0,
            "rollout/lag_p90": float(np.percentile(lag, 90)) if lag.size else 0.0,
            "rollout/zero_variance_share": float(np.mean([g.zero_variance for g in groups])),
            "rollout/episode_latency_p50_s": float(np.percentile(latencies, 50)) if latencies.size else 0.0,
            "rollout/episode_latency_p90_s": float(np.percentile(latencies, 90)) if latencies.size else 0.0,
            "rollout/wait_s": waited,
            "rollout/dropped_stale": float(self.ledger.counts().get("dropped:stale", 0)),
            "rollout/consecutive_failures": float(self._consecutive_failures),
        }
        for category, count in self.ledger.counts().items():
            # "dropped:stale" -> "rollout/count/dropped/stale": TensorBoard tags take no colons.
            metrics[f"rollout/count/{category.replace(':', '/')}"] = float(count)
        for reason, count in dropped_now.items():
            metrics[f"rollout/step_dropped/{reason}"] = float(count)
        try:
            workflow_metrics = self.workflow.metrics()
        except Exception:  # noqa: BLE001 - a metrics bug must not lose a consumed batch
            if not self._metrics_error_logged:
                log.exception("workflow %s: metrics() raised; its metrics are left out", self.workflow.name)
                self._metrics_error_logged = True
            workflow_metrics = {}
        for name, value in workflow_metrics.items():
            metrics[f"rollout/workflow/{name}"] = float(value)
        return metrics

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """``{"meta": JSON-serialisable dict, "arrays": {name: np.ndarray}}``: the ledger (tickets,
        sample ids drawn, accounting) and every queued group, packed by
        :meth:`TrajectoryGroup.pack` (arrays named ``g<ticket>_<name>``), now. In-flight episodes
        are not saved: their sample ids are re-issued by :meth:`load_state_dict`."""
        with self._lock:
            snapshot = self._snapshot()
        return _pack_state(*snapshot)

    def checkpoint_state(self) -> dict[str, Any]:
        """:meth:`state_dict` as of the last :meth:`set_version` (before it, :meth:`start`): what
        a checkpoint of the step just published keeps. Groups that finished since (with
        ``max_staleness: 0``, the next step's, generated while the loop logged, evaluated or
        waited for the checkpoint before) are in flight in it and generated again on a resume,
        exactly once in all, like their engine work: the engine counters a checkpoint keeps are
        read before that publish, so a resume that restored them queued never counted them."""
        with self._lock:
            snapshot = self._published if self._published is not None else self._snapshot()
        return _pack_state(*snapshot)

    def _snapshot(self) -> tuple[dict[str, Any], dict[int, TrajectoryGroup]]:
        """The ledger's snapshot and the queued groups (lock held; the groups are not copied:
        a group is never changed once queued)."""
        for ticket, group in self._queue.get_all():
            self._ready[ticket] = group
        groups = {ticket: group for ticket, group in self._ready.items() if self.ledger.state_of(ticket) == QUEUED}
        return self.ledger.snapshot(), groups

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore before :meth:`start`: queued groups come back (each checked by the trajectory
        schema as it unpacks), in-flight samples are re-issued first."""
        if self._dispatcher is not None:
            raise RuntimeError("load_state_dict must be called before start()")
        meta, arrays = state["meta"], state["arrays"]
        if meta.get("format") != STATE_FORMAT:
            raise RolloutError(f"rollout state: format {meta.get('format')!r}, this asyncrl reads {STATE_FORMAT}")
        ready: dict[int, TrajectoryGroup] = {}
        for key, gmeta in meta["groups"].items():
            prefix = f"g{key}_"
            mine = {name[len(prefix):]: array for name, array in arrays.items() if name.startswith(prefix)}
            ready[int(key)] = TrajectoryGroup.unpack(gmeta, mine, where=f"rollout state, queued group {key}")
        if int(meta["ledger"]["version"]) != self.engine.version:
            raise RolloutError(f"rollout state is at version {meta['ledger']['version']} but the engine serves "
                               f"{self.engine.version}: start the engine at the checkpoint's version")
        with self._lock:
            self.ledger.load_snapshot(meta["ledger"])
            if missing := [t for t in self.ledger.candidates("completion") if t not in ready]:
                raise RolloutError(f"rollout state: queued tickets {missing} have no stored group")
            self._ready = ready


def _pack_state(ledger: dict[str, Any], groups: Mapping[int, TrajectoryGroup]) -> dict[str, Any]:
    """A rollout state (:meth:`WorkflowExecutor.state_dict`) of a ledger snapshot and its queued groups."""
    groups_meta: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for ticket in sorted(groups):
        groups_meta[str(ticket)], packed = groups[ticket].pack()
        arrays.update({f"g{ticket}_{name}": array for name, array in packed.items()})
    return {"meta": {"format": STATE_FORMAT, "ledger": ledger, "groups": groups_meta}, "arrays": arrays}


def _drop_hint(reason: str, cfg: Config) -> str:
    """What a drop reason means and the setting that changes it."""
    if reason == "too_long":
        source = "rollout.max_seq_len" if cfg.rollout.max_seq_len is not None else (
            "the default data.max_prompt_tokens + rollout.max_new_tokens, room for one turn only"
        )
        return (f"a trajectory is longer than the batch length cap of {cfg.max_seq_len} tokens ({source}); raise "
                "rollout.max_seq_len to the longest episode (prompt, every turn and tool output; see docs/workflows.md)")
    if reason == "prompt_too_long":
        return (f"the prompt is longer than data.max_prompt_tokens = {cfg.data.max_prompt_tokens} tokens after the chat "
                "template; raise data.max_prompt_tokens (and engine.kv_capacity with it)")
    if reason == "aborted":
        return "the engine aborted a request (its timeout_s ran out, or the engine shut down)"
    return f"the workflow raised SkipSample('{reason}')"


def _in_chain(err: Optional[BaseException], kind: type) -> Optional[BaseException]:
    """An exception of ``kind`` that a workflow wrapped in its own exception (cause or context)."""
    seen: set[int] = set()
    link: Optional[BaseException] = err
    while link is not None and id(link) not in seen:
        if isinstance(link, kind):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None
