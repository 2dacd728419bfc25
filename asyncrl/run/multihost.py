"""The asynchronous loop across processes (JAX's multi-controller runtime).

``asyncrl train CONFIG`` started as N processes (``mesh.distributed``, or the environment
variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) runs one
program in every process; this module holds everything in it that differs by process, so the
loop (:mod:`asyncrl.run.loop`) reads the same with one process or many:

* **Start** (:func:`~asyncrl.cluster.distributed.initialize_distributed`): ``jax.distributed.initialize``
  first thing, before anything touches a device; on with ``mesh.distributed.enabled`` or when
  all three variables above are set, null fields read from them.
* **Roles** (:class:`Hosts`): every process runs an engine of its own on its own devices, the
  rollout executor, the workflows and the rewards over its share of the prompts
  (:meth:`Hosts.share`), its part of every eval, and the trainer step on the global mesh;
  process 0 alone writes the run's files (its metrics row combines every process's figures).
* **Batches** (:class:`HostBatchSource`): each process's executor makes its block of the step's
  batch from its own trajectories; a small JSON header per process (rows, length, or "abandoned"
  / "failed") goes through the coordinator's key-value store, every process pads its block to
  the largest rows and length, and the trainer assembles the global batch from the blocks
  (``jax.make_array_from_process_local_data``). Nothing else crosses hosts, and no host holds
  the whole batch.
* **Reports** (:meth:`Hosts.gather`): what process 0 logs of the others (their engine and rollout
  metrics, rewards, trajectories to dump, eval parts) reaches it as JSON through the key-value
  store; the others do not wait for it.
* **Stop agreement**: a signal on any process makes all of them stop at the same step boundary.
  Every process posts its first signal to the key-value store, where every other process sees it
  while it waits for a batch (its header then says "abandoned", with the exit code); after each
  step every process's flag is combined by a tiny all-gather (:meth:`Hosts.agree_stop`), which
  also carries whether each process's part of the checkpoint in flight has failed, so a failed
  asynchronous write stops every process at the same step.
* **Publishing**: every process hands the trainer's global params to its own engine, whose
  install lays them out on its devices in one collective that every process enters at the same
  point (:mod:`asyncrl.engine.device_copy`). With ``engine.remote`` every process instead writes
  its share of the published files (:mod:`asyncrl.engine.publish`).
* **Checkpoints**: every process writes its own shards of the trainer state (Orbax, never
  gathered) and its own rollout state, process 0 the run's JSON files, then all meet at a
  barrier with a timeout (``checkpoint.barrier_timeout_s``). A checkpoint records its process
  count; a resume on another count redistributes the rollout states
  (:func:`~asyncrl.rollout.redistribute.redistribute_states`) and reads the arrays onto the new
  shardings (:mod:`asyncrl.checkpoint.arrays`).

Every cross-process wait is bounded (key-value waits in polls that end when the coordinator
is lost, barriers with timeouts) or is a collective that JAX's failure detection ends.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional

import numpy as np

from asyncrl.cluster.distributed import DistributedError, coordination_client, wait_at_barrier
from asyncrl.errors import AsyncRLError, RolloutError
from asyncrl.rollout.batch import BatchAbandoned, PreparedBatch
from asyncrl.rollout.ledger import SampleShare, process_share
from asyncrl.rollout.trajectory import TrainBatch

log = logging.getLogger(__name__)

_STOP_DIR = "asyncrl/stop/"
_BATCH_KEY = "asyncrl/batch/{}/"
_WAIT_POLL_MS = 5000
_WAIT_LOG_S = 120.0
_STOP_POLL_S = 0.2


def _is_deadline(err: Exception) -> bool:
    text = str(err)
    return "DEADLINE_EXCEEDED" in text or "Deadline Exceeded" in text


# ---------------------------------------------------------------------------- roles and agreement


class NoSink:
    """The log sinks of a process other than 0: it writes nothing in ``run.output_dir``."""

    tags: dict = {}
    prefix = ""

    def write(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def append(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class Hosts:
    """This process's place in the run, and the agreements between processes.

    With one process every method is the local answer (no collective, no thread).
    """

    def __init__(self, *, barrier_timeout_s: float = 600.0):
        import jax

        self.count = jax.process_count()
        self.index = jax.process_index()
        self.multi = self.count > 1
        self.is_main = self.index == 0
        """Process 0: writes the run's files (every process generates and trains)."""
        self.barrier_timeout_s = barrier_timeout_s
        self.guard: Any = None
        self._code: Optional[int] = None
        self._seq = 0
        self._gathered: dict[str, int] = {}
        self._last_poll = 0.0
        self._closed = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ signals

    def watch(self, guard: Any) -> None:
        """Follow ``guard`` (the run's ShutdownGuard). With several processes a daemon thread posts
        this process's first signal to the key-value store, where the others see it while they
        wait for their batches (this process's main thread may be blocked in a collective meanwhile)."""
        self.guard = guard
        if self.multi:
            self._watcher = threading.Thread(target=self._post_signal, name="asyncrl-stop-poster", daemon=True)
            self._watcher.start()

    def _post_signal(self) -> None:
        while not self._closed.is_set():
            if self.guard.wait(0.5):
                try:
                    coordination_client().key_value_set(f"{_STOP_DIR}{self.index}", str(self.guard.exit_code))
                except Exception as err:  # the coordinator is gone: the collectives fail too
                    log.warning("process %d: cannot post the stop request to the other processes (%s)", self.index, err)
                return

    def stop_requested(self) -> bool:
        """Whether to abandon the wait for a batch: a signal here, or on any other process."""
        if self.guard.requested:
            self._code = self._code or self.guard.exit_code
            return True
        if self.multi and time.monotonic() - self._last_poll >= _STOP_POLL_S:
            self._last_poll = time.monotonic()
            posted = coordination_client().key_value_dir_get(_STOP_DIR)
            if posted:
                key, code = min(posted, key=lambda kv: int(kv[0].rsplit("/", 1)[-1]))  # the lowest process
                self._code = int(code)
                log.warning("process %s received a signal: abandoning the wait for the batch, every process "
                            "checkpoints and exits with status %d", key.rsplit("/", 1)[-1], self._code)
                return True
        return False

    def abandon_code(self) -> int:
        """The exit code all processes use after an abandoned batch (that of the first signal seen)."""
        return self._code or self.guard.exit_code

    def agree_stop(self, save_failed: bool = False) -> tuple[Optional[int], list[int]]:
        """At a step boundary, the same answer on every process: the exit code to stop with (None:
        go on; else 128 + the signal of the lowest-numbered process that got one), and the
        processes whose part of the checkpoint in flight has failed (``save_failed``: this
        process's; such a failure ends the run on every process at this step)."""
        local = self.guard.exit_code if self.guard.requested else 0
        if not self.multi:
            return local or None, [self.index] if save_failed else []
        from jax.experimental import multihost_utils

        mine = np.asarray([local, int(save_failed)], np.int32)
        gathered = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
        stop = next((int(c) for c in gathered[:, 0] if c), None)
        if stop is not None:
            self._code = self._code or stop
        return stop, [int(i) for i in np.flatnonzero(gathered[:, 1])]

    # ------------------------------------------------------------------ agreement and barriers

    def same_everywhere(self, value: int, what: str, fix: str) -> None:
        """Refuse a run whose processes see different ``value`` s of ``what`` (one line with ``fix``)."""
        if not self.multi:
            return
        from jax.experimental import multihost_utils

        values = [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int64(value))).reshape(-1)]
        if len(set(values)) > 1:
            seen = ", ".join(f"process {i}: {v}" for i, v in enumerate(values))
            raise AsyncRLError(f"the processes disagree on {what} ({seen}); {fix}")

    def on_main(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on process 0 only; every process learns whether it succeeded (a failure
        there ends the others with one line instead of leaving them in a collective)."""
        if not self.multi:
            return fn()
        result, failure = None, None
        if self.is_main:
            try:
                result = fn()
            except Exception as err:
                failure = err
        from jax.experimental import multihost_utils

        failed = np.asarray(multihost_utils.process_allgather(np.int32(failure is not None))).reshape(-1)
        if failure is not None:
            raise failure
        if failed.any():
            raise AsyncRLError(f"process 0 failed {what}; its log has the cause")
        return result

    def barrier(self, name: str) -> None:
        """Wait until every process reaches ``name`` (at most ``checkpoint.barrier_timeout_s``)."""
        if not self.multi:
            return
        try:
            wait_at_barrier(f"asyncrl/{name}", self.barrier_timeout_s)
        except DistributedError as err:
            raise DistributedError(f"process {self.index}: {err} (checkpoint.barrier_timeout_s)") from None

    def close(self) -> None:
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)

    # ------------------------------------------------------------------ shares and reports

    def share(self, batch_size: int) -> SampleShare:
        """This process's share of the prompts and of each step's ``batch_size`` groups
        (:func:`~asyncrl.rollout.ledger.process_share`; one process: all of them)."""
        return process_share(batch_size, self.index, self.count)

    def gather(self, kind: str, payload: Any) -> Optional[list[Any]]:
        """Every process's ``payload`` (JSON-able) on process 0, in process order; None on the
        others, which do not wait. Every process calls it at the same point (the n-th call of a
        ``kind`` on every process pair up). A payload ``{"error": text}`` stands for a failure
        of that process's part: process 0 raises it naming the process."""
        if not self.multi:
            return [payload]
        seq = self._gathered[kind] = self._gathered.get(kind, 0) + 1
        client = coordination_client()
        client.key_value_set(f"asyncrl/{kind}/{seq}/{self.index}", json.dumps(payload))
        if not self.is_main:
            return None
        out = [payload]
        for p in range(1, self.count):
            key = f"asyncrl/{kind}/{seq}/{p}"
            out.append(json.loads(_wait_key(key, self.index, f"process {p}'s {kind} report")))
            client.key_value_delete(key)
        client.key_value_delete(f"asyncrl/{kind}/{seq}/0")
        failed = [(p, part["error"]) for p, part in enumerate(out) if isinstance(part, dict) and "error" in part]
        if failed:
            raise AsyncRLError(f"process {failed[0][0]} of {self.count} failed its part of the {kind}: {failed[0][1]}")
        return out

    def batch_source(self, source: Any) -> Any:
        """This process's ``source`` as the step's BatchSource: with several processes its blocks
        padded to the shape every process agrees on (:class:`HostBatchSource`)."""
        return HostBatchSource(self, source) if self.multi else source

    def own_blocks(self, source: Any, row_multiple: int) -> Any:
        """An SFT source (``SFTData``, the same on every process) whose batches are this process's
        blocks of them (:class:`OwnBlocks`); ``source`` itself with one process."""
        return OwnBlocks(source, self, row_multiple) if self.multi else source

    def eval_blocks(self, data: Any, row_multiple: int) -> Any:
        """An SFT eval split (``SFTData``) whose batches are this process's blocks
        (:class:`EvalBlocks`); ``data`` itself with one process."""
        return EvalBlocks(data, self, row_multiple) if self.multi else data

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq


# ---------------------------------------------------------------------------- batches


_FIELDS = (("input_ids", np.int32, 2), ("attention_mask", np.bool_, 2), ("loss_mask", np.bool_, 2),
           ("behavior_logprobs", np.float32, 2), ("versions", np.int32, 2), ("rewards", np.float32, 1),
           ("group_index", np.int32, 1), ("truncated", np.bool_, 1))
_PAD = {"versions": -1, "group_index": -1}


def _check_unconstrained(batch: TrainBatch) -> None:
    if batch.constraint_nodes is not None:
        raise NotImplementedError("rollout.decoding.constraint: multi-process training does not carry constraint nodes "
                                  "across processes yet; train constrained rollouts in one process")


def pad_block(block: TrainBatch, rows: int, length: int) -> TrainBatch:
    """``block`` padded to ``[rows, length]`` with padding rows (``group_index`` -1, masks false)
    and padding positions; unchanged when it has that shape already. Pure numpy."""
    _check_unconstrained(block)
    if block.input_ids.shape == (rows, length):
        return block
    fields: dict[str, Any] = {}
    for name, dtype, ndim in _FIELDS + ((("advantages", np.float32, 2),) if block.advantages is not None else ()):
        value = np.asarray(getattr(block, name))
        out = np.full((rows, length) if ndim == 2 else (rows,), _PAD.get(name, 0), dtype)
        out[tuple(slice(0, n) for n in value.shape)] = value
        fields[name] = out
    return TrainBatch(temperature=block.temperature, **fields)


def split_rows(batch: TrainBatch, parts: int, row_multiple: int) -> list[TrainBatch]:
    """``batch`` as ``parts`` blocks of whole groups: groups ``[p*n/parts, (p+1)*n/parts)`` (by
    ``group_index``, in order) go to block ``p`` with local group indices from 0; every block
    has the same ``[rows, L]``, rows the largest block's rows rounded up to ``row_multiple``
    (at least one multiple), padded with padding rows. Pure numpy."""
    _check_unconstrained(batch)
    gi = np.asarray(batch.group_index)
    groups = int(gi.max()) + 1 if (gi >= 0).any() else 0
    bounds = [p * groups // parts for p in range(parts + 1)]
    picks = [np.flatnonzero((gi >= bounds[p]) & (gi < bounds[p + 1])) for p in range(parts)]
    rows = max(row_multiple, -(-max(len(p) for p in picks) // row_multiple) * row_multiple)
    blocks = []
    for p, pick in enumerate(picks):
        fields: dict[str, Any] = {}
        for name, dtype, _ in _FIELDS + ((("advantages", np.float32, 2),) if batch.advantages is not None else ()):
            value = np.asarray(getattr(batch, name))
            out = np.full((rows, *value.shape[1:]), _PAD.get(name, 0), dtype)
            out[: len(pick)] = value[pick]
            fields[name] = out
        fields["group_index"][: len(pick)] -= bounds[p]
        blocks.append(TrainBatch(temperature=batch.temperature, **fields))
    return blocks


class HostBatchSource:
    """Every process's :class:`~asyncrl.rollout.batch.BatchSource` in a multi-process run: its own
    source's block of each batch (its executor's groups, or its block of an SFT batch), padded to
    the rows and length every process agrees on, so the trainer assembles the global batch from
    the blocks (a process short of rows is topped up with padding rows, never waits for more).

    Each call of :meth:`next_batch` is one exchange (the same number on every process): each
    process posts a header through the key-value store (``status``: ``batch`` with its rows and
    length, ``abandoned`` with the exit code, or ``failed`` with its error) and reads everyone's;
    a failed or abandoned header anywhere ends the exchange the same way on every process. The
    :class:`PreparedBatch` keeps this process's groups and metrics (reported to process 0 after
    the step)."""

    def __init__(self, hosts: Hosts, source: Any):
        self.hosts, self.source = hosts, source

    def next_batch(self, version: int, timeout: Optional[float] = None, *,
                   abandon_if: Optional[Callable[[], bool]] = None) -> PreparedBatch:
        key = _BATCH_KEY.format(self.hosts.next_seq())
        client = coordination_client()
        mine = f"{key}{self.hosts.index}"
        try:
            got = self.source.next_batch(version, timeout, abandon_if=abandon_if)
        except BatchAbandoned:
            client.key_value_set(mine, json.dumps({"status": "abandoned", "code": self.hosts.abandon_code()}))
            self._headers(key, version)
            raise
        except BaseException as err:
            client.key_value_set(mine, json.dumps({"status": "failed", "error": f"{type(err).__name__}: {err}"}))
            raise
        rows, length = got.batch.input_ids.shape
        client.key_value_set(mine, json.dumps({"status": "batch", "rows": int(rows), "length": int(length)}))
        headers = self._headers(key, version)
        failed = [(p, h["error"]) for p, h in enumerate(headers) if h["status"] == "failed"]
        if failed:
            raise RolloutError(f"process {failed[0][0]} could not make its part of the batch of step {version + 1}: "
                               f"{failed[0][1]}")
        abandoned = [int(h["code"]) for h in headers if h["status"] == "abandoned"]
        if abandoned:
            self.hosts._code = self.hosts._code or abandoned[0]
            raise BatchAbandoned(f"a process abandoned the batch of step {version + 1} (a stop was requested)")
        common = (max(int(h["rows"]) for h in headers), max(int(h["length"]) for h in headers))
        return PreparedBatch(batch=pad_block(got.batch, *common), groups=got.groups, sample_ids=got.sample_ids,
                             metrics=got.metrics)

    def _headers(self, key: str, version: int) -> list[dict]:
        """Every process's header of this exchange, in process order (bounded polls). Process 0 then
        deletes the previous exchange's keys: every process has read them, since it posted this one."""
        headers = [json.loads(_wait_key(f"{key}{p}", self.hosts.index, f"process {p}'s part of the batch of step "
                                                                           f"{version + 1}")) for p in range(self.hosts.count)]
        if self.hosts.is_main:
            seq = int(key.rstrip("/").rsplit("/", 1)[-1])
            client = coordination_client()
            for p in range(self.hosts.count if seq > 1 else 0):
                client.key_value_delete(f"{_BATCH_KEY.format(seq - 1)}{p}")
        return headers

    def set_version(self, version: int) -> None:
        self.source.set_version(version)

    def state_dict(self) -> Any:
        return self.source.state_dict()

    def checkpoint_state(self) -> Any:
        return self.source.checkpoint_state()

    def close(self) -> None:
        self.source.close()


def _wait_key(key: str, index: int, what: str) -> str:
    """The value of ``key`` once another process has set it. Waits in bounded polls (the other
    process may be generating or evaluating for long); a lost coordinator ends the wait with an error."""
    client = coordination_client()
    started = last_log = time.monotonic()
    while True:
        try:
            return client.blocking_key_value_get(key, _WAIT_POLL_MS)
        except Exception as err:
            if not _is_deadline(err):
                raise AsyncRLError(f"process {index}: lost contact with the coordinator while waiting for {what} "
                                   f"({err})") from None
        if time.monotonic() - last_log >= _WAIT_LOG_S:
            last_log = time.monotonic()
            log.info("process %d: waiting %.0f s for %s", index, last_log - started, what)


class EvalBlocks:
    """What :func:`asyncrl.run.sft.eval_loss` reads of an ``SFTData`` eval split, with each batch
    replaced by this process's block of it (:func:`split_rows`). Every process builds the same
    split from the task, so nothing is sent: each takes its own rows of the same batches."""

    def __init__(self, data: Any, hosts: Hosts, row_multiple: int):
        self.data, self.hosts, self.row_multiple = data, hosts, row_multiple

    @property
    def cfg(self) -> Any:
        return self.data.cfg

    @property
    def skipped_too_long(self) -> int:
        return self.data.skipped_too_long

    def batches_once(self, limit: Optional[int] = None) -> Iterator[TrainBatch]:
        for batch in self.data.batches_once(limit):
            yield split_rows(batch, self.hosts.count, self.row_multiple)[self.hosts.index]


class OwnBlocks:
    """A :class:`~asyncrl.rollout.batch.BatchSource` that every process builds alike (an SFT
    stage's ``SFTData``: the same data, position and draws everywhere), whose batches are this
    process's blocks of them (:func:`split_rows`): nothing is sent, each takes its own rows."""

    def __init__(self, source: Any, hosts: Hosts, row_multiple: int):
        self.source, self.hosts, self.row_multiple = source, hosts, row_multiple

    def next_batch(self, version: int, timeout: Optional[float] = None, *,
                   abandon_if: Optional[Callable[[], bool]] = None) -> PreparedBatch:
        got = self.source.next_batch(version, timeout, abandon_if=abandon_if)
        block = split_rows(got.batch, self.hosts.count, self.row_multiple)[self.hosts.index]
        return PreparedBatch(batch=block, groups=got.groups, sample_ids=got.sample_ids, metrics=got.metrics)

    def set_version(self, version: int) -> None:
        self.source.set_version(version)

    def state_dict(self) -> Any:
        return self.source.state_dict()

    def checkpoint_state(self) -> Any:
        return self.source.checkpoint_state()

    def close(self) -> None:
        self.source.close()
