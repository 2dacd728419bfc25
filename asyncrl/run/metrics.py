"""Observability: one tracker any part records into, committed once per step to every sink.

Parts record scalars, distributions and timers under slash names (``reward/mean``,
``rollout/lag_max``, ``perf/step_time``), each name recorded by the one part that makes
the quantity under its final name (the trainer's ``loss/*`` and ``perf/train_time``, the
executor's ``rollout/*``, the loop's ``perf/step_time``; nothing is renamed afterwards);
:meth:`StatsTracker.commit` reduces what was
recorded since the last commit into one flat ``{name: float}`` and hands it to each
sink: ``metrics.jsonl`` (one object per step), TensorBoard event files (tensorboardX's protobufs), and the
console. Recording is thread-safe (rollout threads record too).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

_log = logging.getLogger(__name__)


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class StatsTracker:
    """Collects values between commits. Reductions: ``mean`` (default), ``sum``, ``last``, ``max``."""

    def __init__(self, sinks: Iterable[Sink] = ()):
        self._sinks = list(sinks)
        self._lock = threading.Lock()
        self._values: dict[str, list[float]] = {}
        self._reduce: dict[str, str] = {}

    def scalar(self, name: str, value: float, reduce: str = "mean") -> None:
        if reduce not in ("mean", "sum", "last", "max"):
            raise ValueError(f"unknown reduction {reduce!r} for metric {name!r}")
        with self._lock:
            self._values.setdefault(name, []).append(float(value))
            self._reduce[name] = reduce

    def scalars(self, values: dict[str, float], reduce: str = "mean", prefix: str = "") -> None:
        for name, value in values.items():
            self.scalar(prefix + name, value, reduce)

    def commit(self, step: int) -> dict[str, float]:
        """Reduce everything recorded since the last commit, send it to every sink, reset."""
        with self._lock:
            values, reduce = self._values, self._reduce
            self._values, self._reduce = {}, {}
        metrics = {name: _reduce(vals, reduce[name]) for name, vals in sorted(values.items())}
        for sink in self._sinks:
            sink.write(step, metrics)
        return metrics

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def merge_producers(**producers: Mapping[str, float]) -> dict[str, float]:
    """One step's metrics from several producers (``trainer=..., rollout=..., loop=...``), each
    name from exactly one of them: a name two producers report is a bug (the tracker would
    average two different quantities), raised as a ``ValueError`` naming both."""
    merged: dict[str, float] = {}
    owner: dict[str, str] = {}
    for producer, metrics in producers.items():
        for name, value in metrics.items():
            if name in owner:
                raise ValueError(f"metric {name!r} is produced by both {owner[name]} and {producer}: give one of "
                                 "them another name (one name, one quantity)")
            owner[name] = producer
            merged[name] = float(value)
    return merged


_HOST_MAX = ("_max", "_max_s", "/version", "/lag_p90", "/wait_s", "/consecutive_failures")
_HOST_MEAN = ("_rate", "_occupancy", "_share", "/lag_mean", "_p50_s", "_p90_s", "latency_s", "_ms_per_step",
              "/queue_wait_s", "/logprob_gap")


def host_reduction(name: str) -> str:
    """How :func:`combine_hosts` combines a metric over the hosts of a multi-process run: ``max``
    for maxima, the served version, the p90 lag and the batch wait (the step waits for the slowest
    host); ``mean`` for ratios, shares, mean lags and per-host latencies; ``sum`` for everything
    else: counts, token and request counters, seconds spent, and throughputs (``*_per_s``: hosts
    generate side by side)."""
    if name.endswith("_per_s"):
        return "sum"
    if name.endswith(_HOST_MAX):
        return "max"
    if name.endswith(_HOST_MEAN):
        return "mean"
    return "sum"


def combine_hosts(per_host: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One row of every host's metrics (:func:`host_reduction` per name; a name only some hosts
    report combines over those)."""
    values: dict[str, list[float]] = {}
    for metrics in per_host:
        for name, value in metrics.items():
            values.setdefault(name, []).append(float(value))
    return {name: _reduce(vals, host_reduction(name)) for name, vals in values.items()}


def _reduce(values: list[float], how: str) -> float:
    if how == "sum":
        return float(sum(values))
    if how == "last":
        return values[-1]
    if how == "max":
        return max(values)
    return float(sum(values) / len(values))


class LogAppender:
    """Appends whole lines to a run log and survives I/O errors (disk full, EIO).

    Each call is one ``os.write`` of complete lines to an ``O_APPEND`` descriptor, so rows of
    different calls never interleave. A failed write loses those lines (the checkpoint, not
    the log, is the source of truth): it logs one warning naming the path and the errno when
    writes start failing, and the run goes on; the next write that succeeds first ends any
    line the failure left half-written (a resume skips such a line) and says how many calls
    were lost.
    """

    def __init__(self, path: str | Path, *, create: bool = True):
        """``create=False``: the file is created by the first append (none if nothing is logged)."""
        self.path = Path(path)
        self._fd = -1
        self._failed_writes = 0
        self._lock = threading.Lock()
        if create:
            self._open()

    def _open(self) -> None:
        if self._fd < 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, text: str) -> bool:
        """Append ``text`` (whole lines); False if it could not be written (warned)."""
        data = text.encode("utf-8")
        with self._lock:
            if self._failed_writes:
                data = b"\n" + data  # end a line the failed write may have torn
            try:
                self._open()
                _write_all(self._fd, data)
            except OSError as err:
                if not self._failed_writes:
                    _log.warning("cannot write to %s: [Errno %s] %s; these log lines are lost and the run goes on "
                                 "(the checkpoints are unaffected)", self.path, err.errno, err.strerror)
                self._failed_writes += 1
                return False
            if self._failed_writes:
                _log.warning("writing to %s works again; %d write(s) were lost", self.path, self._failed_writes)
                self._failed_writes = 0
            return True

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class JsonlSink:
    """``metrics.jsonl``: one JSON object per step (``step`` plus every metric), written per line.

    A write that fails (disk full, I/O error) is warned about and skipped: see :class:`LogAppender`."""

    def __init__(self, path: str | Path, extra: dict | None = None):
        self.path = Path(path)
        self._appender = LogAppender(self.path)
        self.tags = dict(extra or {})

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **self.tags, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self._appender.append(json.dumps(record) + "\n")

    def close(self) -> None:
        self._appender.close()


def _tensorboard_protos() -> tuple[type, type, object]:
    """tensorboardX's ``Event`` and ``Summary`` protobufs and its ``masked_crc32c``, imported
    without importing torch.

    tensorboardX's package imports its writer module, which imports torch whenever it is
    installed, only for a type alias (``numpy_compatible``), and that import was seconds of every
    run's start-up; the sink logs plain floats. So while tensorboardX first loads (once per
    process), ``import torch`` fails for it; torch imports normally afterwards. Where torch is
    already imported this changes nothing."""
    from asyncrl.imports import import_without

    import_without("tensorboardX", "torch")
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.record_writer import masked_crc32c

    return Event, Summary, masked_crc32c


class TensorBoardSink:
    """TensorBoard event files under ``logdir`` (``tensorboard --logdir <run.output_dir>``).

    Each step's scalars are one event, framed as a TFRecord and appended by the calling thread
    with one ``os.write``. (tensorboardX's ``SummaryWriter`` hands events to a writer thread
    through a queue of ten: when a write of that thread failed, a full disk say, the thread died,
    and the loop's next step blocked forever on the full queue, as did the exit.) A failed write
    warns once, like :class:`LogAppender`, and the run goes on; the file is cut back to its last
    whole record (or, where that fails too, the next write starts a new event file: TensorBoard
    reads every file of the directory), so a torn record is never followed by others."""

    def __init__(self, logdir: str | Path):
        self._logdir = Path(logdir)
        self._event, self._summary, self._crc = _tensorboard_protos()
        self._fd = -1
        self._size = 0  # bytes of whole records in the open file
        self._files = 0
        self._failed_writes = 0
        self._open()

    def _record(self, event: object) -> bytes:
        """One TFRecord: length, its masked crc32c, the serialised event, its masked crc32c."""
        data = event.SerializeToString()  # type: ignore[attr-defined]
        header = struct.pack("<Q", len(data))
        return header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data))  # type: ignore[operator]

    def _open(self) -> None:
        self._files += 1
        self._logdir.mkdir(parents=True, exist_ok=True)
        suffix = f".{self._files}" if self._files > 1 else ""
        path = self._logdir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}{suffix}"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._size = 0
        self._append(self._record(self._event(wall_time=time.time(), file_version="brain.Event:2")))

    def _append(self, record: bytes) -> None:
        _write_all(self._fd, record)
        self._size += len(record)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        values = [self._summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]  # type: ignore[attr-defined]
        record = self._record(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))
        try:
            if self._fd < 0:
                self._open()
            self._append(record)
        except OSError as err:  # disk full or I/O error: the event file is a log, the run goes on
            if not self._failed_writes:
                _log.warning("cannot write TensorBoard events to %s: [Errno %s] %s; these steps are lost from "
                             "TensorBoard and the run goes on", self._logdir, err.errno, err.strerror)
            self._failed_writes += 1
            self._cut_torn_record()
            return
        if self._failed_writes:
            _log.warning("writing TensorBoard events to %s works again; %d step(s) were lost", self._logdir,
                         self._failed_writes)
            self._failed_writes = 0

    def _cut_torn_record(self) -> None:
        """After a failed write: back to the last whole record, or a new file next time."""
        if self._fd < 0:
            return
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            self._close_file()

    def _close_file(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    def close(self) -> None:
        self._close_file()


class ConsoleSink:
    """Progress on the console: a tqdm bar on a terminal, one plain line per step otherwise.

    Shows step/total, then the fields of :data:`SHOWN` (and ``extra``: names from
    ``logging.console_metrics``) in that order whatever arrived first, so a resumed run's line
    has the columns of a fresh one: reward, the last eval with the step it was taken at
    (``eval@50 0.812``: a line between evals never passes an old eval off as the current one),
    version lag, trained tokens per second of the whole step (``perf/trained_tokens_per_s``, the
    loop's: batch wait, train and publish); then the ETA, from this process's own pace: the time
    since the first step it wrote (start-up and compiles are not a step's cost, and a resumed run
    does not count the steps it did not run).

    While the bar is up, log records go through ``tqdm.write`` (tqdm's logging redirect) so a
    line never lands in the middle of the bar.
    """

    SHOWN = (
        ("reward", "reward/mean", "{:.3f}"),
        ("eval", "eval/reward", "{:.3f}"),
        ("lag", "rollout/lag_max", "{:.0f}"),
        ("tok/s", "perf/trained_tokens_per_s", "{:.0f}"),
    )

    def __init__(self, total_steps: int, start_step: int = 0, stream=None, use_bar: bool | None = None, prefix: str = "",
                 extra: Iterable[str] = ()):
        self._stream = stream or sys.stderr
        self._total = total_steps
        self.prefix = prefix
        self._fields = [*self.SHOWN, *((name.rsplit("/", 1)[-1], name, "{:.3g}") for name in extra)]
        self._last: dict[str, str] = {}
        self._eval_step = 0
        self._pace_from: tuple[int, float] | None = None
        """``(step, time)`` of the first step this process wrote: the ETA's pace is measured from it."""
        self._use_bar = self._stream.isatty() if use_bar is None else use_bar
        self._bar: Any = None
        self._redirect: Any = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for label, name, fmt in self._fields:
            if name in metrics and math.isfinite(metrics[name]):
                self._last[label] = fmt.format(metrics[name])
                if label == "eval":
                    self._eval_step = step
        fields = " ".join(f"{label}@{self._eval_step} {self._last[label]}" if label == "eval" else f"{label} {self._last[label]}"
                          for label, _, _ in self._fields if label in self._last)
        if self._pace_from is None:
            self._pace_from = (step, time.monotonic())
        if self._use_bar:
            bar = self._bar if self._bar is not None else self._open_bar(step)
            bar.set_description_str(self.prefix.strip() or None, refresh=False)  # the stage, as it changes
            bar.set_postfix_str(fields, refresh=False)
            bar.update(step - bar.n)
            bar.refresh()  # update() skips redraws within tqdm's mininterval: show this step's values now
            return
        first_step, first_time = self._pace_from
        done = step - first_step
        eta = (time.monotonic() - first_time) / done * (self._total - step) if done > 0 else float("nan")
        eta_text = f"{eta:.0f}s" if math.isfinite(eta) else "?"
        print(f"{self.prefix}step {step}/{self._total} {fields} eta {eta_text}", file=self._stream, flush=True)

    def _open_bar(self, step: int) -> Any:
        """The bar, from the first step written (its clock, and so its rate and ETA, start there),
        with log records redirected through it for as long as it is up."""
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=self._total, initial=step, file=self._stream, dynamic_ncols=True)
        self._redirect = logging_redirect_tqdm()
        self._redirect.__enter__()
        return self._bar

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None


def process_metrics(device: object = None) -> dict[str, float]:
    """Resource use of this process, logged every step so leaks show in the curves:

    * ``perf/host_rss_gb``: resident host memory (``VmRSS`` of /proc/self/status; elsewhere
      the peak RSS from ``getrusage``, the best a portable call gives);
    * ``perf/threads``: live OS threads (``Threads`` of /proc/self/status: XLA's and the
      libraries' native threads too), or Python's ``threading.active_count()`` elsewhere;
    * ``perf/device_mem_gb``: memory in use on ``device`` (a jax device) where its backend
      reports it (GPUs, TPUs; the CPU backend does not, and the metric is then absent).
    """
    out: dict[str, float] = {}
    status = _proc_self_status()
    if status is not None and "VmRSS" in status and "Threads" in status:
        out["perf/host_rss_gb"] = int(status["VmRSS"].split()[0]) * 1024 / 1e9
        out["perf/threads"] = float(int(status["Threads"].split()[0]))
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        out["perf/host_rss_gb"] = (peak if sys.platform == "darwin" else peak * 1024) / 1e9
        out["perf/threads"] = float(threading.active_count())
    stats = _device_memory_stats(device)
    if stats and "bytes_in_use" in stats:
        out["perf/device_mem_gb"] = float(stats["bytes_in_use"]) / 1e9
    return out


def _proc_self_status() -> dict[str, str] | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _device_memory_stats(device: object) -> dict | None:
    if device is None:
        return None
    try:
        return device.memory_stats()  # type: ignore[attr-defined]
    except Exception:  # backends without the call raise (or return None): no metric then
        return None
