"""``asyncrl launch``: N processes of one asyncrl command on this host, for development and tests.

Each process gets ``JAX_COORDINATOR_ADDRESS`` (a free port on 127.0.0.1),
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, which :func:`asyncrl.cluster.distributed.initialize_distributed`
reads; optionally ``K`` forced CPU devices (``XLA_FLAGS``). Output lines are prefixed with
``[p<i>]``. SIGINT/SIGTERM to the launcher are forwarded to every process (a second one
kills them). When a process fails, the launcher names it and its exit code, gives the
others ``grace_s`` to stop by themselves (their watchdog ends them when a process is lost or
failed), then SIGTERM, then after another ``grace_s`` SIGKILL; it returns the first non-zero
exit code (``128 + signal`` for a process killed by a signal). On a cluster, start one
process per host with the cluster's own launcher instead (``docs/scaling.md``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Optional, Sequence

from asyncrl.cluster.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, EXIT_PEER_FAILED, EXIT_PEER_LOST

POLL_S = 0.1
"""How often the launcher looks at its processes (every wait is this bounded)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the coordinator binds it moments later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def child_env(base: dict[str, str], process_id: int, nproc: int, coordinator: str,
              cpu_devices: Optional[int]) -> dict[str, str]:
    """The environment of process ``process_id``: the launcher's plus JAX's multi-process variables."""
    env = dict(base)
    env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(nproc), ENV_PROCESS_ID: str(process_id)})
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the launcher as they are printed
    if cpu_devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={cpu_devices}"])
    return env


def exit_code(returncode: int) -> int:
    """A shell-style exit code: ``128 + signal`` for a process a signal ended."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} (exit {exit_code(returncode)})"
    return f"exit code {returncode}"


def _prctl() -> Optional[Callable[..., int]]:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl() if sys.platform == "linux" else None  # looked up here: the forked child only calls it


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the launcher dies, so no process is orphaned."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Launcher:
    """Start, watch and stop ``nproc`` processes; :meth:`run` returns the exit code."""

    def __init__(self, argv_of: Callable[[int], list[str]], nproc: int, *, cpu_devices: Optional[int] = None,
                 grace_s: float = 10.0, out: Optional[IO[str]] = None, env: Optional[dict[str, str]] = None):
        if nproc < 1:
            raise ValueError(f"asyncrl launch: --nproc must be at least 1 (given {nproc})")
        self.argv_of, self.nproc, self.cpu_devices, self.grace_s = argv_of, nproc, cpu_devices, grace_s
        self.out = sys.stdout if out is None else out  # looked up now: tests replace sys.stdout
        self.env = dict(os.environ if env is None else env)
        self.procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()  # one line at a time on `out`
        self._signals: list[int] = []  # signals received, forwarded by the main loop

    def say(self, line: str) -> None:
        with self._lock:
            try:
                self.out.write(line + "\n")
                self.out.flush()
            except (OSError, ValueError):  # output closed (e.g. piped into head): keep draining the children
                pass

    def start(self) -> None:
        coordinator = f"127.0.0.1:{free_port()}"
        self.say(f"asyncrl launch: {self.nproc} processes, coordinator {coordinator}")
        for pid in range(self.nproc):
            proc = subprocess.Popen(
                self.argv_of(pid), env=child_env(self.env, pid, self.nproc, coordinator, self.cpu_devices),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                errors="replace", start_new_session=True, preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
            self.procs.append(proc)
        for pid, proc in enumerate(self.procs):  # threads after the forks: nothing is locked in a forked child
            threading.Thread(target=self._pump, args=(pid, proc), name=f"launch-p{pid}", daemon=True).start()

    def _pump(self, pid: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when the process closes its output (exits)
            self.say(f"[p{pid}] {line.rstrip()}")

    def on_signal(self, signum: int, frame: object = None) -> None:
        self._signals.append(signum)

    def run(self) -> int:
        """Start the processes and wait for all of them; the first non-zero exit code (0 if none)."""
        try:
            self.start()
        except BaseException:
            self._signal_alive(signal.SIGKILL)  # none left behind when a later one cannot start
            raise
        first_failure: Optional[tuple[int, int]] = None  # (process, returncode)
        stop_at: Optional[float] = None  # when to escalate (SIGTERM, then SIGKILL) after a failure
        escalations = 0
        forwarded = 0
        while True:
            forwarded = self._forward_signals(forwarded)
            codes = [proc.poll() for proc in self.procs]
            if first_failure is None:
                failed = [(pid, code) for pid, code in enumerate(codes) if code not in (None, 0)]
                if failed:
                    # Exits 69/70 are processes the watchdog stopped because of another one: when
                    # they are seen in the same poll as the root cause, name the root cause.
                    failed.sort(key=lambda f: f[1] in (EXIT_PEER_LOST, EXIT_PEER_FAILED))
                    first_failure = failed[0]
                    alive = sum(code is None for code in codes)
                    verb = "ended" if self._signals else "failed"
                    self.say(f"asyncrl launch: process {first_failure[0]} {verb} first ({describe_exit(first_failure[1])})"
                             + (f"; stopping the other {alive} (SIGTERM after {self.grace_s:g} s, then SIGKILL)" if alive else ""))
                    stop_at = time.monotonic() + self.grace_s
            if all(code is not None for code in codes):
                break
            if stop_at is not None and time.monotonic() >= stop_at:
                escalations += 1
                self._signal_alive(signal.SIGTERM if escalations == 1 else signal.SIGKILL)
                stop_at = time.monotonic() + self.grace_s
            time.sleep(POLL_S)
        self._drain()
        if first_failure is None:
            return 0
        return exit_code(first_failure[1])

    def _forward_signals(self, forwarded: int) -> int:
        while forwarded < len(self._signals):
            signum = self._signals[forwarded]
            forwarded += 1
            if forwarded == 1:
                self.say(f"asyncrl launch: {signal.Signals(signum).name}: forwarded to every process "
                         "(they checkpoint and stop; send it again to kill them)")
                self._signal_alive(signum)
            else:
                self.say(f"asyncrl launch: {signal.Signals(signum).name} again: killing every process")
                self._signal_alive(signal.SIGKILL)
        return forwarded

    def _signal_alive(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def _drain(self, timeout_s: float = 5.0) -> None:
        """Let the output threads print what the processes wrote last (bounded)."""
        deadline = time.monotonic() + timeout_s
        for thread in threading.enumerate():
            if thread.name.startswith("launch-p"):
                thread.join(max(0.0, deadline - time.monotonic()))


def launch(command: Sequence[str], nproc: int, *, cpu_devices: Optional[int] = None, grace_s: float = 10.0,
           python: str = sys.executable) -> int:
    """Run ``python -m asyncrl.cli COMMAND`` as ``nproc`` processes; returns the exit code (see the module doc)."""
    if not command:
        raise ValueError("asyncrl launch: give the command after --, e.g. asyncrl launch --nproc 2 -- train CONFIG")
    launcher = Launcher(lambda pid: [python, "-m", "asyncrl.cli", *command], nproc, cpu_devices=cpu_devices,
                        grace_s=grace_s)
    return run_with_signals(launcher)


def run_with_signals(launcher: Launcher) -> int:
    """:meth:`Launcher.run` with SIGINT/SIGTERM forwarded (handlers restored after)."""
    previous = {s: signal.signal(s, launcher.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return launcher.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
