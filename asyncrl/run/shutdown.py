"""Graceful shutdown on SIGINT/SIGTERM: finish (or abandon) the step, checkpoint, exit.

The training loop runs inside a :class:`ShutdownGuard`::

    with ShutdownGuard() as guard:
        for step in ...:
            ...one trainer step...
            if guard.requested:
                break                      # finish or abandon the step in progress
        save_checkpoint(...); executor.close(); engine.shutdown()
    if guard.requested:
        sys.exit(guard.exit_code)          # 130 after SIGINT, 143 after SIGTERM

Semantics:

* the first SIGINT or SIGTERM only sets :attr:`ShutdownGuard.requested` (and logs what will
  happen); the loop notices it, writes a checkpoint, stops its threads and exits with
  :attr:`ShutdownGuard.exit_code` = 128 + the signal number (``EXIT_SIGINT`` 130,
  ``EXIT_SIGTERM`` 143, the shell's convention);
* a second signal exits at once with ``os._exit(128 + signum)``: no checkpoint, no cleanup
  (a checkpoint being written is left as a temporary directory that no resume takes);
* if the process is still alive ``grace_s`` (default 30 s) after the first signal, it exits
  the same way, so a stuck step or thread can never keep it running.

Both of the last two work even while the main thread is blocked in native code (an XLA
computation, a C call that does not return to Python): the signals are read from
``signal.set_wakeup_fd`` by a daemon watcher thread, not only by the Python-level handler,
which runs on the main thread when it next executes bytecode. Handlers, the wakeup fd and
the watcher are all removed on leaving the ``with`` block.

Signals can only be handled on the main thread: entered on another thread, the guard
installs nothing (it logs a warning) and only :meth:`ShutdownGuard.request` sets the flag.

How the command's process ends, whatever ended the run (:func:`end_process`): the run first stops
its threads and joins those that call into the runtime (the engine's scheduler, the rollout
workers, the train step's background compile: ``Run.close``); a failed or interrupted command
then exits with its status without the interpreter's finalization, which would stop any thread
still inside native code where it stands and abort the process (SIGABRT) instead.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import types
from typing import Any, NoReturn, Optional, Sequence

log = logging.getLogger(__name__)

EXIT_SIGINT = 128 + signal.SIGINT  # 130
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143
DEFAULT_GRACE_S = 30.0

_STOP_WATCHER = 0  # byte the guard writes to end its watcher (no signal has number 0)


class ShutdownGuard:
    """Turns SIGINT/SIGTERM into a flag the loop polls; see the module docstring.

    Args:
        signals: the signals handled (default SIGINT and SIGTERM).
        grace_s: after the first signal the process exits (``os._exit``) if still alive
            this many seconds later; None disables the deadline.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM), *, grace_s: Optional[float] = DEFAULT_GRACE_S):
        self.signals = tuple(int(s) for s in signals)
        self.grace_s = grace_s
        self.installed = False
        """True while the handlers are installed (entered on the main thread)."""
        self._event = threading.Event()
        self._signum: Optional[int] = None
        self._previous: dict[int, Any] = {}  # what signal.signal returned: a handler, SIG_DFL/SIG_IGN or None
        self._previous_wakeup_fd = -1
        self._pipe: Optional[tuple[int, int]] = None
        self._watcher: Optional[threading.Thread] = None
        self._deadline: Optional[threading.Timer] = None
        self._deadline_at: Optional[float] = None  # time.monotonic() when the deadline fires
        self._entered = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ what the loop reads

    @property
    def requested(self) -> bool:
        """True once a shutdown was requested (first signal, or :meth:`request`)."""
        return self._event.is_set()

    @property
    def signum(self) -> Optional[int]:
        """The signal that requested the shutdown (None before one, or after a plain :meth:`request`)."""
        return self._signum

    @property
    def exit_code(self) -> int:
        """The status to exit with: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + (self._signum if self._signum is not None else int(signal.SIGINT))

    def remaining_s(self) -> Optional[float]:
        """Seconds left before the deadline armed by the first signal exits the process, or None
        when none is armed: what the run's own shutdown (joining its threads) may still spend."""
        with self._lock:
            return None if self._deadline_at is None else max(0.0, self._deadline_at - time.monotonic())

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until a shutdown is requested or ``timeout`` passes; returns :attr:`requested`."""
        return self._event.wait(timeout)

    def request(self, signum: Optional[int] = None) -> None:
        """Request a shutdown from code (tests, a failing component): sets the flag, no deadline."""
        self._record(signum)

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> "ShutdownGuard":
        if self._entered:
            raise RuntimeError("a ShutdownGuard can be entered only once")
        self._entered = True
        if threading.current_thread() is not threading.main_thread():
            log.warning("ShutdownGuard entered outside the main thread: SIGINT/SIGTERM are not handled here")
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd requires it
        self._pipe = (read_fd, write_fd)
        self._watcher = threading.Thread(target=self._watch, name="asyncrl-shutdown-watcher", daemon=True)
        self._watcher.start()
        try:
            self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handler)
        except BaseException:
            self._uninstall()
            raise
        self.installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._uninstall()

    def _uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._pipe is not None:
            read_fd, write_fd = self._pipe
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            try:
                os.write(write_fd, bytes([_STOP_WATCHER]))
            except BlockingIOError:  # pipe full of signal bytes: closing ends the read as well
                pass
            if self._watcher is not None:
                self._watcher.join(timeout=2.0)
            os.close(write_fd)
            os.close(read_fd)
            self._pipe = None
        with self._lock:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
                self._deadline_at = None
        self.installed = False

    # ------------------------------------------------------------------ signal handling

    def _record(self, signum: Optional[int]) -> bool:
        """Set the flag; True if this call was the one that set it."""
        with self._lock:
            if self._event.is_set():
                return False
            self._signum = signum
            self._event.set()
            return True

    def _handler(self, signum: int, frame: Optional[types.FrameType]) -> None:
        # Runs on the main thread when it next executes bytecode. The watcher thread counts
        # signals and logs (logging from a signal handler can deadlock); this only makes sure
        # the flag is set by the time the interrupted main-thread code resumes.
        self._record(signum)

    def _watch(self) -> None:
        assert self._pipe is not None
        read_fd = self._pipe[0]
        received = 0
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum == _STOP_WATCHER:
                    return
                if signum not in self.signals:
                    continue  # another signal with a Python handler also writes to the wakeup fd
                received += 1
                name = signal.Signals(signum).name
                if received == 1:
                    self._record(signum)
                    log.warning(
                        "%s received: finishing the current step, writing a checkpoint, then exiting with status %d "
                        "(send it again to exit at once without a checkpoint)", name, 128 + signum,
                    )
                    self._arm_deadline(128 + signum)
                else:
                    _exit_now(128 + signum, f"asyncrl: second {name}: exiting at once without a checkpoint\n")

    def _arm_deadline(self, code: int) -> None:
        if self.grace_s is None:
            return
        message = f"asyncrl: shutdown did not finish within {self.grace_s:g} s of the signal: exiting now\n"
        with self._lock:
            self._deadline = threading.Timer(self.grace_s, _exit_now, args=(code, message))
            self._deadline_at = time.monotonic() + self.grace_s
            self._deadline.daemon = True
            self._deadline.start()


def _exit_now(code: int, message: str) -> None:
    try:
        os.write(2, message.encode())
    finally:
        os._exit(code)


def join_threads(threads: Sequence[threading.Thread], timeout: float) -> list[str]:
    """Wait at most ``timeout`` seconds in all for ``threads`` to end; returns the names of those
    still running."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    return [thread.name for thread in threads if thread.is_alive()]


def end_process(code: int) -> NoReturn:
    """End the command's process with status ``code``.

    Status 0 exits as usual (``sys.exit``: atexit callbacks, finalization). Any other status (an
    error, a signal) flushes the streams and logs and ends the process at once (``os._exit``):
    the run has already closed its files, checkpoints and trackers and joined its threads
    (``Run.close``), but a thread it could not wait for (a compile in flight, a workflow that does
    not return) would be stopped by the interpreter's finalization wherever it stands, and one
    inside native code (XLA, a tokenizer) ends the process with SIGABRT ("terminate called after
    throwing an instance of ''", "FATAL: exception not rethrown", status 134) instead of ``code``.
    """
    if code == 0:
        sys.exit(0)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
    logging.shutdown()
    os._exit(code)
