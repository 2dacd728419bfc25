"""The asynchronous loop across processes (JAX's multi-controller runtime).

``asyncrl train CONFIG`` started as N processes (``mesh.distributed``, or the environment
variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) runs one
program in every process; this module holds everything in it that differs by process, so the
loop (:mod:`asyncrl.run.loop`) reads the same with one process or many:

* **Start** (:func:`~asyncrl.cluster.distributed.initialize_distributed`): ``jax.distributed.initialize``
  first thing, before anything touches a device; on with ``mesh.distributed.enabled`` or when
  all three variables above are set, null fields read from them.
* **Roles** (:class:`Hosts`): process 0 runs the executor, the workflows and the engine on
  its own devices and writes every file of the run; every process runs the trainer step on
  the global mesh.
* **Batches** (:class:`HostBatchSource`): process 0's source makes the step's batch; its
  groups are split into one contiguous block of whole groups per process (:func:`split_rows`,
  every block padded to the same rows); a small JSON header goes through the coordinator's
  key-value store (the others wait for it in bounded polls), then each block goes to its
  process alone (:func:`send_blocks`: a point-to-point ``ppermute`` per process), so a process
  receives and holds its own block, never the whole batch.
* **Stop agreement**: a signal on any process makes all of them stop at the same step
  boundary. Process 0 learns of another process's signal from the key-value store while it
  waits for a batch (the header then says "abandoned", with the exit code); after each step
  every process's flag is combined by a tiny all-gather (:meth:`Hosts.agree_stop`), which also
  carries whether each process's part of the checkpoint in flight has failed, so a failed
  asynchronous write stops every process at the same step.
* **Publishing** (:meth:`Hosts.engine_copy`): the trainer's global params are all-gathered
  in groups of at most :data:`~asyncrl.engine.device_copy.COPY_GROUP_BYTES` (a jitted identity
  with replicated outputs per group: device to device), and process 0 keeps one single-device
  copy of each group for its engine, which moves it onto its own shardings; so a device holds at
  most one group beyond its shards, never a whole copy of the model. With ``engine.remote`` every
  process instead writes its share of the published files (:mod:`asyncrl.engine.publish`).
* **Checkpoints**: every process writes its own shards of the trainer state (Orbax, never
  gathered), process 0 the JSON files, then all meet at a barrier with a timeout
  (``checkpoint.barrier_timeout_s``). A checkpoint records its process count; a resume may use
  another count or mesh (:mod:`asyncrl.checkpoint.arrays` reads onto the current shardings).

Every cross-process wait is bounded (key-value waits in polls that end when the coordinator
is lost, barriers with timeouts) or is a collective that JAX's failure detection ends.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np

from asyncrl.cluster.distributed import DistributedError, coordination_client, wait_at_barrier
from asyncrl.errors import AsyncRLError, RolloutError
from asyncrl.rollout.batch import BatchAbandoned, PreparedBatch
from asyncrl.rollout.trajectory import TrainBatch

log = logging.getLogger(__name__)

_STOP_DIR = "asyncrl/stop/"
_BATCH_KEY = "asyncrl/batch/{}"
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
        """Process 0: runs the executor, the workflows and the engine, and writes the run's files."""
        self.barrier_timeout_s = barrier_timeout_s
        self.guard: Any = None
        self._code: Optional[int] = None
        self._seq = 0
        self._last_poll = 0.0
        self._closed = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ signals

    def watch(self, guard: Any) -> None:
        """Follow ``guard`` (the run's ShutdownGuard). On a process other than 0 a daemon thread
        posts its first signal to the key-value store, where process 0 sees it while it waits
        for a batch (this process's main thread may be blocked in a collective meanwhile)."""
        self.guard = guard
        if self.multi and not self.is_main:
            self._watcher = threading.Thread(target=self._post_signal, name="asyncrl-stop-poster", daemon=True)
            self._watcher.start()

    def _post_signal(self) -> None:
        while not self._closed.is_set():
            if self.guard.wait(0.5):
                try:
                    coordination_client().key_value_set(f"{_STOP_DIR}{self.index}", str(self.guard.exit_code))
                except Exception as err:  # the coordinator is gone: the collectives fail too
                    log.warning("process %d: cannot post the stop request to process 0 (%s)", self.index, err)
                return

    def stop_requested(self) -> bool:
        """Whether to abandon the wait for a batch: a signal here, or (process 0) on any process."""
        if self.guard.requested:
            self._code = self._code or self.guard.exit_code
            return True
        if self.multi and self.is_main and time.monotonic() - self._last_poll >= _STOP_POLL_S:
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

    # ------------------------------------------------------------------ weights

    def engine_copy(self, params: Any) -> Any:
        """The weights as process 0's engine takes them. Every process must call this (an
        all-gather over the trainer mesh when the params span processes,
        :func:`~asyncrl.engine.device_copy.local_copy`); returns process 0's single-device
        copies, None on the other processes, ``params`` itself with one process."""
        if not self.multi:
            return params
        import jax

        from asyncrl.engine.device_copy import local_copy

        leaves, treedef = jax.tree.flatten(params)
        copies = local_copy(leaves)
        return jax.tree.unflatten(treedef, copies) if self.is_main else None

    def batch_source(self, source: Any, row_multiple: int) -> Any:
        """``source`` (process 0's; None elsewhere) as every process's BatchSource."""
        if not self.multi:
            return source
        return HostBatchSource(self, source, row_multiple)

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


def split_rows(batch: TrainBatch, parts: int, row_multiple: int) -> list[TrainBatch]:
    """``batch`` as ``parts`` blocks of whole groups: groups ``[p*n/parts, (p+1)*n/parts)`` (by
    ``group_index``, in order) go to block ``p`` with local group indices from 0; every block
    has the same ``[rows, L]``, rows the largest block's rows rounded up to ``row_multiple``
    (at least one multiple), padded with padding rows. Pure numpy."""
    if batch.constraint_nodes is not None:
        raise NotImplementedError("rollout.decoding.constraint: multi-process training does not carry constraint nodes to "
                                  "the other processes yet; train constrained rollouts in one process")
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


def pack_block(block: TrainBatch) -> np.ndarray:
    """One block's arrays as one int32 buffer (field by field), padded to a power of two of words
    so that its transfer compiles for few sizes."""
    names = [f[0] for f in _FIELDS] + (["advantages"] if block.advantages is not None else [])
    raw = b"".join(np.ascontiguousarray(getattr(block, name)).tobytes() for name in names)
    words = max(1024, 1 << (max(1, -(-len(raw) // 4)) - 1).bit_length())
    buffer = np.zeros(words * 4, np.uint8)
    buffer[: len(raw)] = np.frombuffer(raw, np.uint8)
    return buffer.view(np.int32)


def unpack_block(buffer: np.ndarray, header: Mapping[str, Any]) -> TrainBatch:
    """The block :func:`pack_block` packed (shapes from the header)."""
    raw = np.ascontiguousarray(buffer).view(np.uint8)
    rows, length = int(header["rows"]), int(header["length"])
    specs = _FIELDS + ((("advantages", np.float32, 2),) if header["advantages"] else ())
    offset = 0
    fields: dict[str, Any] = {}
    for name, dtype, ndim in specs:
        shape = (rows, length) if ndim == 2 else (rows,)
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        fields[name] = np.frombuffer(raw[offset: offset + size].tobytes(), dtype).reshape(shape)
        offset += size
    return TrainBatch(temperature=float(header["temperature"]), **fields)


def send_blocks(buffers: Optional[list[np.ndarray]], index: int, count: int, words: int) -> Optional[np.ndarray]:
    """Process 0's ``buffers[p]`` (``words`` int32 each) to process ``p``, for every ``p`` >= 1: one
    point-to-point transfer per process (a jitted ``ppermute`` from process 0's first device to
    ``p``'s), so each process receives its own block only. Every process calls it (``buffers`` on
    process 0, None elsewhere); returns this process's block (None on process 0)."""
    import jax

    devices = _first_devices(count)
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("process",)),
                                          jax.sharding.PartitionSpec("process"))
    mine = None
    for dest in range(1, count):
        local = buffers[dest] if buffers is not None else np.zeros(words, np.int32)
        array = jax.make_array_from_single_device_arrays(
            (count, words), sharding, [jax.device_put(local.reshape(1, words), devices[index])])
        received = _send_program(dest, count)(array)
        if index == dest:
            mine = np.asarray(received.addressable_shards[0].data).reshape(words)
        del received
    return mine


def _first_devices(count: int) -> list:
    """Each process's first device (by id), in process order."""
    import jax

    firsts: dict[int, Any] = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        firsts.setdefault(device.process_index, device)
    return [firsts[p] for p in range(count)]


_SEND_PROGRAMS: dict[tuple[int, int], Any] = {}


def _send_program(dest: int, count: int) -> Any:
    """A jitted ``ppermute`` of process 0's row to process ``dest`` (the other rows get zeros)."""
    if (dest, count) not in _SEND_PROGRAMS:
        import jax

        mesh = jax.sharding.Mesh(np.array(_first_devices(count)), ("process",))
        spec = jax.sharding.PartitionSpec("process")
        _SEND_PROGRAMS[dest, count] = jax.jit(jax.shard_map(
            lambda a: jax.lax.ppermute(a, "process", [(0, dest)]), mesh=mesh, in_specs=spec, out_specs=spec))
    return _SEND_PROGRAMS[dest, count]


class HostBatchSource:
    """Every process's :class:`~asyncrl.rollout.batch.BatchSource` in a multi-process run:
    process 0 wraps the stage's real source and sends each batch on; the others receive.

    Each call of :meth:`next_batch` is one exchange (the same number on every process): a
    header through the key-value store (``status``: ``batch``, ``abandoned`` with the exit
    code, or ``failed`` with process 0's error), then for a batch each process's block through
    :func:`send_blocks`. Process 0's :class:`PreparedBatch` keeps the step's groups and
    metrics (it alone logs them); its ``batch``, like every process's, is its own block.
    """

    def __init__(self, hosts: Hosts, source: Any, row_multiple: int):
        if hosts.is_main == (source is None):
            raise AsyncRLError("HostBatchSource: process 0 wraps the stage's source, the others pass None")
        self.hosts, self.source, self.row_multiple = hosts, source, row_multiple

    def next_batch(self, version: int, timeout: Optional[float] = None, *,
                   abandon_if: Optional[Callable[[], bool]] = None) -> PreparedBatch:
        key = _BATCH_KEY.format(self.hosts.next_seq())
        if self.hosts.is_main:
            return self._send(key, version, timeout, abandon_if)
        return self._receive(key, version, timeout)

    def _send(self, key: str, version: int, timeout: Optional[float],
              abandon_if: Optional[Callable[[], bool]]) -> PreparedBatch:
        client = coordination_client()
        try:
            got = self.source.next_batch(version, timeout, abandon_if=abandon_if)
        except BatchAbandoned:
            client.key_value_set(key, json.dumps({"status": "abandoned", "code": self.hosts.abandon_code()}))
            raise
        except BaseException as err:
            client.key_value_set(key, json.dumps({"status": "failed", "error": f"{type(err).__name__}: {err}"}))
            raise
        blocks = split_rows(got.batch, self.hosts.count, self.row_multiple)
        rows, length = blocks[0].input_ids.shape
        header = {"status": "batch", "rows": rows, "length": length, "advantages": blocks[0].advantages is not None,
                  "temperature": float(got.batch.temperature)}
        buffers = [pack_block(block) for block in blocks]  # every block has the same shape: the same words
        header["words"] = int(buffers[0].size)
        client.key_value_set(key, json.dumps(header))
        send_blocks(buffers, 0, self.hosts.count, header["words"])
        client.key_value_delete(key)  # every process has read it: each joined the transfers
        return PreparedBatch(batch=blocks[0], groups=got.groups, sample_ids=got.sample_ids, metrics=got.metrics)

    def _receive(self, key: str, version: int, timeout: Optional[float]) -> PreparedBatch:
        header = _wait_header(key, self.hosts.index, version)
        if header["status"] == "abandoned":
            self.hosts._code = int(header["code"])
            raise BatchAbandoned(f"process 0 abandoned the batch of step {version + 1} (a stop was requested)")
        if header["status"] == "failed":
            raise RolloutError(f"process 0 could not make the batch of step {version + 1}: {header['error']}")
        buffer = send_blocks(None, self.hosts.index, self.hosts.count, int(header["words"]))
        assert buffer is not None
        return PreparedBatch(batch=unpack_block(buffer, header))

    def set_version(self, version: int) -> None:
        if self.source is not None:
            self.source.set_version(version)

    def state_dict(self) -> Any:
        """Process 0's source state (the others have none: process 0 writes the checkpoint)."""
        return self.source.state_dict() if self.source is not None else None

    def checkpoint_state(self) -> Any:
        """Process 0's source state as of the last publish (None on the other processes)."""
        return self.source.checkpoint_state() if self.source is not None else None

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def _wait_header(key: str, index: int, version: int) -> dict:
    """Process 0's header for this exchange. Waits in bounded polls (process 0 may be
    generating or evaluating for long); a lost coordinator ends the wait with an error."""
    client = coordination_client()
    started = last_log = time.monotonic()
    while True:
        try:
            return json.loads(client.blocking_key_value_get(key, _WAIT_POLL_MS))
        except Exception as err:
            if not _is_deadline(err):
                raise AsyncRLError(f"process {index}: lost contact with process 0 while waiting for the batch of "
                                   f"step {version + 1} ({err})") from None
        if time.monotonic() - last_log >= _WAIT_LOG_S:
            last_log = time.monotonic()
            log.info("process %d: waiting %.0f s for process 0's batch of step %d", index,
                     last_log - started, version + 1)


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
