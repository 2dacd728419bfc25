"""One scoring queue per reward model: token sequences from any thread, scored in jitted batches.

Rollout threads (through the ``reward_model`` reward, :mod:`asyncrl.rollout.reward_model`)
:meth:`RewardModelScorer.submit` a token sequence (prompt + completion ids, in the reward
model's vocabulary) and get a :class:`~concurrent.futures.Future` of its float score. One
daemon thread owns every device call: it takes whatever is waiting (up to ``batch_size``
sequences), pads them into one of a few fixed shapes, runs the jitted
:func:`~asyncrl.model.reward_model.reward_scores` once and completes the futures; sequences
submitted while a batch runs form the next one (continuous batching, as the engine admits
requests between decode chunks). Shapes come from two small sets, so few programs compile:
rows are a power of two (at least the device count, at most ``batch_size``) and the length is
the smallest ``length_buckets`` entry that holds the longest sequence.

Placement: the reward model's parameters are replicated on its ``devices`` (one 1-D mesh,
axis ``data``) and each batch's rows are split over them. Nothing here needs the inference
engine, so scoring works the same with the in-process and the remote engine.

Failures reach the caller: a sequence longer than the largest bucket, or empty, fails its own
future at submit; a device call that raises fails every future of its batch (the thread goes
on with the next); :meth:`close` fails what is still waiting and wakes every waiter.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Optional, Sequence

import numpy as np

from asyncrl.errors import RolloutError

log = logging.getLogger(__name__)

DEFAULT_LENGTH_BUCKETS = (64, 128, 256, 512, 1024, 2048)
"""Padded sequence lengths of the scoring programs (tokens, prompt and completion together)."""
_POLL_S = 0.5
"""How often the idle scoring thread checks whether it was closed."""
_CLOSE_JOIN_S = 10.0
"""How long :meth:`RewardModelScorer.close` waits for a batch on the device to finish (the thread is a daemon)."""


class RewardModelClosed(RolloutError):
    """The scorer was closed: raised by later submits and by the requests it failed."""


@dataclasses.dataclass
class _Request:
    token_ids: np.ndarray  # int32 [length]
    future: Future


class RewardModelScorer:
    """A reward model behind one scoring queue (see the module docstring).

    Args:
        model: a :class:`~asyncrl.model.reward_model.LoadedRewardModel`.
        devices: the devices that hold it and score (default: the first local device).
        batch_size: most sequences per device call; rounded up to a multiple of the devices.
        length_buckets: padded sequence lengths; a longer sequence is an error of its request.
        name: names the thread and the errors (e.g. ``rewards.0 (reward_model)``).
        pack: pack each batch's sequences first-fit decreasing into as few rows of its length bucket
            as hold them (``rollout.pack``; :func:`~asyncrl.model.reward_model.packed_reward_scores`):
            the same scores, fewer padded positions.
        pack_max_segments: the most sequences a packed row holds (``rollout.pack_max_segments``).
    """

    def __init__(self, model: Any, *, devices: Optional[Sequence[Any]] = None, batch_size: int = 64,
                 length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS, name: str = "reward_model", pack: bool = False,
                 pack_max_segments: int = 16):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        if batch_size < 1:
            raise ValueError(f"{name}: batch_size must be >= 1 (given {batch_size})")
        if not length_buckets or min(length_buckets) < 1:
            raise ValueError(f"{name}: length_buckets need at least one entry, all >= 1 (given {list(length_buckets)})")
        self.name = name
        self.model = model
        self.pack = pack
        self.pack_max_segments = pack_max_segments
        self.devices = tuple(devices) if devices else (jax.local_devices()[0],)
        count = len(self.devices)
        self.batch_size = -(-batch_size // count) * count
        self.row_buckets = _row_buckets(count, self.batch_size)
        self.length_buckets = tuple(sorted(set(int(b) for b in length_buckets)))
        mesh = Mesh(np.array(self.devices, dtype=object), ("data",))
        self._rows_sharding = NamedSharding(mesh, PartitionSpec("data"))
        replicated = NamedSharding(mesh, PartitionSpec())
        self._params = jax.device_put(model.params, replicated)
        self._score_weight = jax.device_put(model.score_weight, replicated)
        self._pad_id = np.int32(model.pad_id)
        self._inbox: "queue.SimpleQueue[Optional[_Request]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.batches = 0
        self.scored = 0
        self.device_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"reward-scorer-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers

    def submit(self, token_ids: Sequence[int]) -> Future:
        """Queue one sequence; a Future of its float score (its exception: why it was not scored)."""
        future: Future = Future()
        ids = np.asarray(list(token_ids), dtype=np.int32)
        if ids.ndim != 1 or ids.size == 0:
            future.set_exception(RolloutError(f"{self.name}: nothing to score (an empty token sequence)"))
            return future
        if ids.size > self.length_buckets[-1]:
            future.set_exception(RolloutError(
                f"{self.name}: a sequence of {ids.size} tokens is longer than the largest length bucket "
                f"({self.length_buckets[-1]}); raise the reward's max_tokens"
            ))
            return future
        vocab = self.model.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            future.set_exception(RolloutError(f"{self.name}: token id {int(ids.max())} is outside the reward model's vocabulary ({vocab})"))
            return future
        with self._lock:
            if self._closed:
                raise RewardModelClosed(f"{self.name}: the reward-model scorer is closed")
            self._inbox.put(_Request(ids, future))
        return future

    def score(self, batch: Sequence[Sequence[int]], timeout_s: Optional[float] = None) -> list[float]:
        """Scores of several sequences (submitted together, so they share batches)."""
        futures = [self.submit(ids) for ids in batch]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return [f.result(None if deadline is None else max(0.0, deadline - time.monotonic())) for f in futures]

    def warm_up(self) -> None:
        """Compile the smallest program now (start-up), so a first reward call does not wait for it."""
        self.score([[0]], timeout_s=None)

    def close(self) -> None:
        """Stop the thread; requests still waiting fail with :class:`RewardModelClosed`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(None)
        # What waits in the queue fails now (its callers wake); a batch on the device finishes.
        self._fail_waiting(RewardModelClosed(f"{self.name}: the reward-model scorer was closed"))
        self._thread.join(timeout=_CLOSE_JOIN_S)

    @property
    def closed(self) -> bool:
        return self._closed

    def metrics(self) -> dict[str, float]:
        """Batches run, sequences scored, and their mean rows per batch."""
        with self._lock:
            batches, scored = self.batches, self.scored
        return {"reward_model/batches": float(batches), "reward_model/scored": float(scored),
                "reward_model/mean_batch": scored / batches if batches else 0.0}

    # ------------------------------------------------------------------ scoring thread

    def _loop(self) -> None:
        while True:
            try:
                first = self._inbox.get(timeout=_POLL_S)
            except queue.Empty:
                if self._closed:
                    return
                continue
            if first is None or self._closed:
                if first is not None and first.future.set_running_or_notify_cancel():
                    first.future.set_exception(RewardModelClosed(f"{self.name}: the reward-model scorer was closed"))
                if first is None:
                    return
                continue
            batch = [first]
            while len(batch) < self.batch_size:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._inbox.put(None)  # seen again once this batch is done
                    break
                batch.append(item)
            batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if batch:
                self._run(batch)

    def _run(self, batch: list[_Request]) -> None:
        import jax

        from asyncrl.model.reward_model import reward_scores_jit

        longest = max(r.token_ids.size for r in batch)
        length = next(b for b in self.length_buckets if b >= longest)
        rows = next(b for b in self.row_buckets if b >= len(batch))
        start = time.perf_counter()
        try:
            if self.pack:
                scores = self._run_packed(batch, length, rows)
            else:
                ids = np.zeros((rows, length), np.int32)
                mask = np.zeros((rows, length), bool)
                for row, request in enumerate(batch):
                    ids[row, : request.token_ids.size] = request.token_ids
                    mask[row, : request.token_ids.size] = True
                ids_on, mask_on = jax.device_put((ids, mask), self._rows_sharding)
                scores = np.asarray(jax.device_get(reward_scores_jit(
                    self.model.graphdef, self._params, self._score_weight, ids_on, mask_on, self._pad_id)))
        except Exception as err:  # noqa: BLE001 - every request of the batch gets the cause
            error = RolloutError(f"{self.name}: scoring a batch of {len(batch)} failed: {type(err).__name__}: {err}")
            log.debug("%s: scoring failed\n%s", self.name, traceback.format_exc())
            for request in batch:
                request.future.set_exception(error)
            return
        with self._lock:
            self.batches += 1
            self.scored += len(batch)
            self.device_seconds += time.perf_counter() - start
        for row, request in enumerate(batch):
            request.future.set_result(float(scores[row]))

    def _run_packed(self, batch: list[_Request], length: int, rows: int) -> np.ndarray:
        """float32 [rows] scores of ``batch`` packed into the fewest rows of ``length`` (a row
        bucket); request n's score is entry n. Each sequence is scored where unpacked it would be:
        its rightmost token that is not the pad id (its first when all are)."""
        import jax

        from asyncrl.model.reward_model import NO_PAD_ID, packed_reward_scores_jit
        from asyncrl.rollout.packing import first_fit_decreasing

        bins = first_fit_decreasing([r.token_ids.size for r in batch], length, self.pack_max_segments)
        packed_rows = next(b for b in self.row_buckets if b >= len(bins))
        ids = np.zeros((packed_rows, length), np.int32)
        segments = np.zeros((packed_rows, length), np.int32)
        score_row = np.zeros(rows, np.int32)  # padding entries score row 0, position 0: unread
        score_at = np.zeros(rows, np.int32)
        for p, members in enumerate(bins):
            at = 0
            for segment, n in enumerate(members, start=1):
                tokens = batch[n].token_ids
                ids[p, at:at + tokens.size] = tokens
                segments[p, at:at + tokens.size] = segment
                counted = np.nonzero(tokens != self._pad_id)[0] if self._pad_id != NO_PAD_ID else np.arange(tokens.size)
                score_row[n], score_at[n] = p, at + (int(counted[-1]) if counted.size else 0)
                at += tokens.size
        ids_on, segments_on = jax.device_put((ids, segments), self._rows_sharding)
        return np.asarray(jax.device_get(packed_reward_scores_jit(
            self.model.graphdef, self._params, self._score_weight, ids_on, segments_on, score_row, score_at,
            segments=self.pack_max_segments)))

    def _fail_waiting(self, error: Exception) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._inbox.put(None)  # the thread's stop signal stays for it
                return
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(error)


def _row_buckets(devices: int, batch_size: int) -> tuple[int, ...]:
    """Row counts of the scoring programs: ``devices * 2**k`` below ``batch_size``, then ``batch_size``."""
    out, rows = [], devices
    while rows < batch_size:
        out.append(rows)
        rows *= 2
    out.append(batch_size)
    return tuple(out)
