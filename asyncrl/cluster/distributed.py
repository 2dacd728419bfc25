"""JAX's multi-process runtime for asyncrl: start-up, failure detection and barriers.

What JAX 0.10.2 does by itself, measured with two CPU processes on loopback (gloo
collectives, ``heartbeat_timeout_seconds=5``) when one process is SIGKILLed:

- the survivor's collective (a jitted psum, ``broadcast_one_to_all``) raises at once on
  loopback ("Gloo all-reduce failed ... Connection reset by peer"); across hosts whose
  link just goes quiet it would wait;
- the coordination service (inside process 0) notices a dead process after the heartbeat
  timeout (about 3-4 s of 5) and aborts every other process with SIGABRT and a C++ stack
  trace ("the JAX distributed service detected fatal errors"), naming no process to the
  user; whatever the survivor was doing (collective, idle, a coordination barrier);
- when process 0 (the coordinator) dies, the others abort within 0.1 s;
- a process that ends with a *Python* error leaves the others inside their collective:
  its graceful shutdown barrier waits for them until ``shutdown_timeout_seconds`` (300 s
  by default), a hang as far as a user can tell.

So asyncrl adds a :class:`Watchdog` (a daemon thread per process): heartbeats through the
coordinator's key-value store, checked against ``mesh.distributed.heartbeat_timeout_s``
(JAX's own heartbeat timeout is set longer, as a backstop), and a failure notice that a
process publishes before it exits with an error (:func:`exit_after_failure`), so the
others stop within about a second instead of waiting for the shutdown barrier. Either way
the process stops with one line naming the process at fault and a distinct exit code:
:data:`EXIT_PEER_LOST` or :data:`EXIT_PEER_FAILED`.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional

from asyncrl.errors import AsyncRLError, ConfigError, TrainerError

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 69
"""Exit code of a process stopped because another process stopped sending heartbeats (sysexits' EX_UNAVAILABLE)."""
EXIT_PEER_FAILED = 70
"""Exit code of a process stopped because another process reported an error and exited."""

SIGNAL_EXIT_CODES = (130, 143)
"""Exits after SIGINT/SIGTERM: the training loop agrees on them across processes, so they are not failures."""

_PREFIX = "asyncrl/watchdog"
LEAVE_WAIT_S = 3.0
"""How long process 0 (the coordinator) waits for the others to leave before it exits after a failure."""
_EXITING = "exiting"  # a heartbeat value: this process is past its work; do not watch it any more


ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
"""The launcher's environment (``asyncrl launch`` sets all three per process). JAX 0.10.2 reads only
the coordinator address itself; asyncrl fills ``num_processes`` / ``process_id`` from the others."""


def resolved_distributed(dist: Any, environ: Mapping[str, str] = os.environ) -> Any:
    """``mesh.distributed`` with ``enabled`` decided and null fields taken from the environment.

    On with ``enabled: true``, or when ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID`` are all set (as a launcher sets them); then a null
    ``coordinator_address`` / ``num_processes`` / ``process_id`` is read from its variable
    when set (else JAX's cluster detection fills it: SLURM, Open MPI, ...). Pure: reads no device.
    """
    launched = all(environ.get(name) for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID))
    enabled = dist.enabled or launched
    if not enabled:
        return dist.model_copy(update={"enabled": False})
    update: dict[str, Any] = {"enabled": True}
    if dist.coordinator_address is None and environ.get(ENV_COORDINATOR):
        update["coordinator_address"] = environ[ENV_COORDINATOR]
    for field, name, low in (("num_processes", ENV_NUM_PROCESSES, 1), ("process_id", ENV_PROCESS_ID, 0)):
        text = environ.get(name)
        if getattr(dist, field) is not None or text is None:
            continue
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < low:
            raise ConfigError([f"environment variable {name}={text!r} is not an integer >= {low}; set it (or "
                               f"mesh.distributed.{field}) to this process's value"])
        update[field] = value
    num, pid = update.get("num_processes", dist.num_processes), update.get("process_id", dist.process_id)
    if num is not None and pid is not None and pid >= num:
        raise ConfigError([f"mesh.distributed.process_id ({ENV_PROCESS_ID}) = {pid} is not below num_processes "
                           f"({ENV_NUM_PROCESSES}) = {num}; process ids are 0 .. num_processes - 1"])
    return dist.model_copy(update=update)


class DistributedError(AsyncRLError):
    """A cross-process wait (barrier) that timed out or failed; the message names it and the timeout."""


def initialize_distributed(mesh_cfg: Any) -> None:
    """``jax.distributed.initialize`` from ``mesh.distributed`` and start the :class:`Watchdog`.

    No-op when disabled or already done. Fields left null come from ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (which also turn it on without ``enabled``),
    else from JAX's cluster detection (SLURM, Open MPI, Kubernetes, Cloud TPU, ...). On CPU,
    collectives go through gloo (set before the backend starts; it only affects the CPU client).
    """
    dist = resolved_distributed(mesh_cfg.distributed)
    if not dist.enabled:
        return
    import jax

    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timer = _startup_timer(dist)
    try:
        jax.distributed.initialize(
            coordinator_address=dist.coordinator_address,
            num_processes=dist.num_processes,
            process_id=dist.process_id,
            initialization_timeout=dist.initialization_timeout_s,
            heartbeat_timeout_seconds=jax_heartbeat_timeout(dist.heartbeat_timeout_s),
            shutdown_timeout_seconds=dist.shutdown_timeout_s,
        )
    except (RuntimeError, ValueError) as err:
        raise TrainerError(
            f"mesh.distributed: jax.distributed.initialize failed ({err}); it must run before anything else "
            "uses JAX (call asyncrl.cluster.distributed.initialize_distributed(cfg.mesh) first thing in every process), every "
            f"process must reach the coordinator within mesh.distributed.initialization_timeout_s "
            f"({dist.initialization_timeout_s} s), and the address, process count and ids must agree"
        ) from err
    finally:
        timer.cancel()
    log.info("jax.distributed: process %d of %d, %d local devices",
             jax.process_index(), jax.process_count(), jax.local_device_count())
    if jax.process_count() > 1:
        start_watchdog(coordination_client(), jax.process_index(), jax.process_count(), dist.heartbeat_timeout_s,
                       dist.shutdown_timeout_s)


def _startup_timer(dist: Any) -> threading.Timer:
    """Ends the process with one line when start-up outlasts ``initialization_timeout_s``.

    JAX itself aborts (SIGABRT, a C++ stack trace) some seconds later (measured: the timeout
    plus 6-7 s), naming neither the setting nor what is missing.
    """
    address = dist.coordinator_address or "(cluster detection)"
    count = dist.num_processes or "(cluster detection)"

    def give_up() -> None:
        _say(f"asyncrl: error: mesh.distributed: not all {count} processes reached the coordinator {address} within "
             f"mesh.distributed.initialization_timeout_s = {dist.initialization_timeout_s} s; start every process "
             "with the same coordinator address and process count (process 0 hosts the coordinator), or raise the "
             f"timeout (exit {EXIT_PEER_LOST})")
        os._exit(EXIT_PEER_LOST)

    timer = threading.Timer(dist.initialization_timeout_s, give_up)
    timer.daemon = True
    timer.start()
    return timer


def jax_heartbeat_timeout(heartbeat_timeout_s: int) -> int:
    """JAX's own heartbeat timeout: longer than asyncrl's, so the watchdog names the lost process first."""
    return heartbeat_timeout_s + max(10, heartbeat_timeout_s // 2)


def watch_interval(heartbeat_timeout_s: float) -> float:
    """Seconds between heartbeats: a tenth of the timeout, within [0.25, 5] (light on the coordinator)."""
    return min(max(heartbeat_timeout_s / 10, 0.25), 5.0)


def coordination_client() -> Any:
    """This process's client of the coordination service (key-value store and barriers)."""
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise DistributedError("jax.distributed is not initialized (mesh.distributed.enabled is false?)")
    return client


class Watchdog:
    """Heartbeats and failure notices through the coordinator's key-value store.

    Every ``interval_s`` it writes this process's heartbeat counter and reads everyone's
    heartbeats and failure notices (two directory reads). It ends this process (one line on
    stderr, then ``exit_fn(code)``; ``os._exit`` skips JAX's shutdown barrier, which would
    wait for the lost process) when:

    - a process's heartbeat has not changed for ``timeout_s``: :data:`EXIT_PEER_LOST`;
    - a process published a failure notice: :data:`EXIT_PEER_FAILED` (acknowledged first);
    - the coordinator cannot be reached (process 0 is gone): :data:`EXIT_PEER_LOST`.

    A process past its work (exiting normally) marks its heartbeat ``exiting`` and is no
    longer watched; an unreachable coordinator is then expected, not an error.
    """

    def __init__(self, client: Any, process_id: int, num_processes: int, timeout_s: float, *,
                 interval_s: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
                 exit_fn: Callable[[int], Any] = os._exit, leave_wait_s: float = LEAVE_WAIT_S):
        self.client, self.process_id, self.num_processes = client, process_id, num_processes
        self.timeout_s = timeout_s
        self.interval_s = watch_interval(timeout_s) if interval_s is None else interval_s
        self.clock, self.exit_fn, self.leave_wait_s = clock, exit_fn, leave_wait_s
        self._beat = 0
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last heartbeat value, when it changed)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one poll at a time (the thread's, or mark_exiting's at exit)
        self._exiting = False
        self._failed = False  # this process published a failure notice
        self._thread = threading.Thread(target=self._run, name="asyncrl-watchdog", daemon=True)

    def start(self) -> None:
        now = self.clock()
        self._seen = {p: ("", now) for p in range(self.num_processes) if p != self.process_id}
        self.poll()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def _key(self, kind: str, process: int) -> str:
        return f"{_PREFIX}/{kind}/{process}"

    def _dir(self, kind: str) -> dict[int, str]:
        return {int(key.rsplit("/", 1)[1]): value for key, value in self.client.key_value_dir_get(f"{_PREFIX}/{kind}/")}

    def poll(self) -> None:
        """One heartbeat and one check of everyone else (the thread's loop body; also called at exit)."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        self._beat += 1
        beat = _EXITING if self._exiting else str(self._beat)
        try:
            self.client.key_value_set(self._key("heartbeat", self.process_id), beat, allow_overwrite=True)
            beats, failures = self._dir("heartbeat"), self._dir("failed")
        except Exception as err:  # the coordinator (in process 0) is unreachable
            if self._exiting or self._failed:
                self.stop()
                return
            self._end(EXIT_PEER_LOST, f"lost the coordinator, process 0 of {self.num_processes} (it crashed, was "
                                      f"killed, or its host is down or unreachable: {_first_line(err)})")
            return
        others = {p: v for p, v in failures.items() if p != self.process_id}
        if others and not self._failed:
            first = min(others)
            code, _, reason = others[first].partition(" ")
            self._acknowledge()
            self._end(EXIT_PEER_FAILED, f"process {first} of {self.num_processes} failed (exit code {code}): {reason}")
            return
        lost = self._stale(beats, self.clock())
        if lost:
            self._end_lost(lost)

    def _end_lost(self, lost: list[int]) -> None:
        names = ", ".join(str(p) for p in lost)
        self._end(EXIT_PEER_LOST, f"lost process {names} of {self.num_processes}: no heartbeat for "
                                  f"{self.timeout_s:g} s (it crashed, was killed, or its host is down or "
                                  "unreachable; see its log)", tuple(lost))

    def _stale(self, beats: dict[int, str], now: float) -> list[int]:
        lost = []
        for peer, (value, since) in self._seen.items():
            current = beats.get(peer, "")
            if current == _EXITING:
                continue
            if current != value:
                self._seen[peer] = (current, now)
            elif now - since > self.timeout_s:
                lost.append(peer)
        return lost

    def _acknowledge(self) -> None:
        try:
            self.client.key_value_set(self._key("ack", self.process_id), "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the failed process waits for acks only within a bound
            pass

    def _end(self, code: int, message: str, lost: tuple[int, ...] = ()) -> None:
        self.stop()
        _say(f"asyncrl: error: {message}; stopping process {self.process_id} (exit {code})")
        self.leave(code, lost)

    def leave(self, code: int, lost: tuple[int, ...] = ()) -> None:
        """Exit with ``code``. Process 0 hosts the coordinator, whose end aborts the others
        (SIGABRT) before they print why they stop: it first waits (bounded) until every
        process not ``lost`` has said it is leaving."""
        try:
            self.client.key_value_set(self._key("gone", self.process_id), str(code), allow_overwrite=True)
            if self.process_id == 0:
                waiting = set(self._seen) - set(lost)
                deadline = time.monotonic() + self.leave_wait_s
                while not waiting <= set(self._dir("gone")) and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(min(0.2, self.leave_wait_s))  # from their "gone" to their exit
        except Exception:  # noqa: BLE001 - the coordinator is gone already
            pass
        self.exit_fn(code)

    def mark_exiting(self) -> None:
        """This process finished its work: stop counting it as alive or dead; keep watching the others."""
        self._exiting = True
        self.poll()

    def finish(self, timeout_s: float) -> bool:
        """At a normal exit, after :meth:`mark_exiting`: wait (at most ``timeout_s``) until every
        other process is past its work too, still watching them, then stop the thread and join it.

        Why: the thread spends its life in the coordination client's C++ calls. Were one in flight
        when the interpreter finalizes, CPython would end the daemon thread on its way back
        (a forced unwind through C++ frames that swallow it: "FATAL: exception not rethrown",
        SIGABRT, a failed exit of a run that finished; seen once in two 2-process runs). Once every
        peer is exiting, JAX's shutdown barrier has nobody left to wait for and the watch can stop.
        True when every peer was seen exiting (or gone) in time."""
        deadline = self.clock() + timeout_s
        done = False
        while not self._stop.is_set():
            try:
                beats, gone = self._dir("heartbeat"), self._dir("gone")
            except Exception:  # noqa: BLE001 - the coordinator is shutting down: everyone is past it
                break
            if all(beats.get(peer) == _EXITING or peer in gone for peer in self._seen):
                done = True
                break
            if self.clock() >= deadline:
                break
            time.sleep(min(0.05, self.interval_s))
        self.stop()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 5.0)
        return done

    def announce_failure(self, exit_code: int, reason: str) -> None:
        """Publish this process's failure so the others stop (they acknowledge, then exit)."""
        self._failed = True
        try:
            self.client.key_value_set(self._key("failed", self.process_id), f"{exit_code} {reason}", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - coordinator gone: the others are stopping anyway
            pass

    def heartbeats(self) -> Optional[dict[int, str]]:
        """Every process's heartbeat value now; None when the coordinator is unreachable."""
        return self._read("heartbeat")

    def _read(self, kind: str) -> Optional[dict[int, str]]:
        try:
            return self._dir(kind)
        except Exception:  # noqa: BLE001 - coordinator gone
            return None

    def end_if_silent(self, before: Optional[dict[int, str]], since: float) -> None:
        """After a failure notice went unacknowledged for a whole heartbeat timeout: end with
        :data:`EXIT_PEER_LOST` naming the peers whose heartbeat did not change since ``before``,
        read at ``since`` (this watchdog's clock). Nothing when less than ``timeout_s`` has passed
        since then (a wait cut short by a failed read of the store proves no silence).

        Why: a collective fails at once when its peer is killed (loopback resets the connection),
        so this process reaches its failure path about when the thread would notice the silence;
        whichever came first decided the exit code. A live peer beats every ``interval_s``, so a
        heartbeat unchanged across a wait longer than ``timeout_s`` means that peer is gone: the
        root cause, which the exit code and the line should name."""
        if self.clock() - since < self.timeout_s:
            return
        now = self.heartbeats()
        if before is None or now is None:
            return
        with self._lock:
            # A peer that acknowledged, failed too, or left (its own watchdog ended it) is not the lost one.
            answered = {p for kind in ("ack", "failed", "gone") for p in self._read(kind) or {}}
            silent = [p for p in sorted(self._seen) if p not in answered and now.get(p) != _EXITING
                      and now.get(p, "") == before.get(p, "")]
            if silent:
                self._end_lost(silent)

    def wait_for_acknowledgements(self, timeout_s: float) -> bool:
        """Until every other process acknowledged the failure notice (bounded); True when all did."""
        deadline = self.clock() + timeout_s
        while True:
            try:
                # A peer that failed too is not going to acknowledge: it is exiting as well (a config
                # error, say, fails on every process at once).
                acked = set(self._dir("ack")) | set(self._dir("failed"))
            except Exception:  # noqa: BLE001 - coordinator gone
                return False
            if acked >= set(self._seen):
                return True
            if self.clock() >= deadline:
                return False
            time.sleep(min(0.1, self.interval_s))


_WATCHDOG: Optional[Watchdog] = None


_SHUTDOWN_TIMEOUT_S = [300.0]
"""``mesh.distributed.shutdown_timeout_s`` of this process: how long its exit waits for the others."""


def start_watchdog(client: Any, process_id: int, num_processes: int, timeout_s: float,
                   shutdown_timeout_s: float = 300.0) -> Watchdog:
    """Start this process's :class:`Watchdog` (one per process); at interpreter exit it marks this
    process exiting and waits for the others (:meth:`Watchdog.finish`)."""
    global _WATCHDOG
    _SHUTDOWN_TIMEOUT_S[0] = shutdown_timeout_s
    if _WATCHDOG is None:
        _WATCHDOG = Watchdog(client, process_id, num_processes, timeout_s)
        _WATCHDOG.start()
        # atexit runs handlers last-in first-out: this runs before JAX's own shutdown barrier.
        atexit.register(_at_exit)
    return _WATCHDOG


def _at_exit() -> None:
    watchdog = _WATCHDOG
    if watchdog is None:
        return
    uncaught = getattr(sys, "last_value", None)  # set when an uncaught exception ends the program
    if isinstance(uncaught, BaseException):
        exit_after_failure(1, f"{type(uncaught).__name__}: {_first_line(uncaught)}")
    watchdog.mark_exiting()
    watchdog.finish(_SHUTDOWN_TIMEOUT_S[0])


def exit_after_failure(exit_code: int, reason: str = "see its log") -> None:
    """End a failed process of a multi-process run now, telling the others first.

    Publishes the failure notice, waits (at most the heartbeat timeout plus one interval) until
    every other process acknowledged it or failed too, then ``os._exit(exit_code)``: JAX's graceful shutdown barrier
    would wait for processes stuck in a collective with this one. No-op (returns) in a
    single-process run. When the failure was caused by a lost process (the root cause), the
    process ends with :data:`EXIT_PEER_LOST` naming it instead: the watchdog's thread may see the
    silence first, or, at the end of the wait, a peer that neither answered nor beat is lost.
    """
    watchdog = _WATCHDOG
    if watchdog is None:
        return
    watchdog.announce_failure(exit_code, reason)
    before, since = watchdog.heartbeats(), watchdog.clock()
    if not watchdog.wait_for_acknowledgements(watchdog.timeout_s + watchdog.interval_s):
        watchdog.end_if_silent(before, since)
    watchdog.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    watchdog.leave(exit_code)


def wait_at_barrier(name: str, timeout_s: float, process_ids: Optional[list[int]] = None) -> None:
    """Wait until every process (or ``process_ids``) reaches barrier ``name``, at most ``timeout_s``.

    A coordination-service barrier (no device collective); each ``name`` may be used once
    per run. Raises :class:`DistributedError` naming the barrier and the timeout when it
    fails or times out. No-op in a single-process run.
    """
    import jax

    if jax.process_count() == 1:
        return
    try:
        coordination_client().wait_at_barrier(name, int(timeout_s * 1000), process_ids)
    except Exception as err:  # jaxlib raises its own runtime error type
        raise DistributedError(
            f"barrier {name!r}: not every process arrived within {timeout_s:g} s ({_first_line(err)}); "
            "another process is stuck, slower than the timeout, or gone (see the other processes' logs)"
        ) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _say(line: str) -> None:
    """One line on stderr, written directly (the process may end right after)."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed stdout must not stop the message
        pass
    os.write(2, (line + "\n").encode())
