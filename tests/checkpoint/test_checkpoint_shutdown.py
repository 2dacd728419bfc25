"""ShutdownGuard: the first SIGINT/SIGTERM sets a flag (the loop checkpoints and exits 130/143), a
second signal exits at once even while the main thread is stuck in native code, a grace
deadline ends a shutdown that hangs, and handlers are restored on exit. Signals are sent to
subprocesses; in-process tests only cover what needs no signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from asyncrl.run.shutdown import EXIT_SIGINT, EXIT_SIGTERM, ShutdownGuard
from tests.helpers import REPO_ROOT, subprocess_env

# A miniature training loop: steps until the guard asks it to stop, then "writes a checkpoint"
# (a marker file) inside the guard and exits with the guard's code.
LOOP = textwrap.dedent(
    """
    import signal, sys, time
    from asyncrl.run.shutdown import ShutdownGuard

    marker = sys.argv[1]
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    with ShutdownGuard() as guard:
        assert guard.installed
        print("READY", flush=True)
        steps = 0
        deadline = time.monotonic() + 30
        while not guard.requested and time.monotonic() < deadline:
            time.sleep(0.005)  # one "step"
            steps += 1
        print("REQUESTED", guard.signum, guard.exit_code, steps > 0, flush=True)
        for _ in range(400):  # the watcher thread arms the deadline just after setting the flag
            if guard.remaining_s() is not None:
                break
            time.sleep(0.005)
        print("GRACE LEFT", 25 < (guard.remaining_s() or 0) <= 30, flush=True)
        with open(marker, "w") as handle:
            handle.write("checkpoint")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert signal.set_wakeup_fd(-1) == -1
    print("RESTORED", guard.remaining_s(), flush=True)
    sys.exit(guard.exit_code)
    """
)

# The main thread is stuck in native code that never returns to Python: SIGINT is blocked in
# it, so the signal goes to another thread and the Python-level handler cannot run until the
# sleep ends. Only the wakeup-fd watcher can react.
STUCK = textwrap.dedent(
    """
    import signal, sys, time
    from asyncrl.run.shutdown import ShutdownGuard

    with ShutdownGuard(grace_s=float(sys.argv[1])) as guard:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        print("READY", flush=True)
        time.sleep(60)
    print("SLEPT THROUGH", flush=True)
    """
)


def start(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=subprocess_env(), cwd=REPO_ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise AssertionError(f"child not ready: {line!r}\n{proc.stderr.read()}")
    return proc


def read_stderr_until(proc: subprocess.Popen, fragment: str, timeout: float = 20) -> str:
    seen = []
    result = {}

    def reader():
        for line in proc.stderr:
            seen.append(line)
            if fragment in line:
                result["line"] = line
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout)
    assert "line" in result, f"child never logged {fragment!r}; stderr so far:\n{''.join(seen)}"
    return result["line"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_first_signal_sets_the_flag_and_the_loop_checkpoints_then_exits_with_128_plus_signum(tmp_path, signum, code):
    marker = tmp_path / "checkpoint"
    proc = start(LOOP, str(marker))
    time.sleep(0.1)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, (out, err)
    assert f"REQUESTED {int(signum)} {code} True" in out and "GRACE LEFT True" in out and "RESTORED None" in out
    assert marker.read_text() == "checkpoint"
    name = signal.Signals(signum).name
    assert f"{name} received: finishing the current step, writing a checkpoint, then exiting with status {code}" in err


@pytest.mark.timeout(60)
def test_second_sigint_exits_at_once_while_the_main_thread_is_stuck_in_native_code():
    proc = start(STUCK, "30")
    try:
        proc.send_signal(signal.SIGINT)
        read_stderr_until(proc, "SIGINT received")
        time.sleep(0.3)
        assert proc.poll() is None  # the first signal only asks
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        assert time.monotonic() - t0 < 5
        assert proc.returncode == EXIT_SIGINT == 130
        rest = proc.stderr.read()
        assert "second SIGINT: exiting at once without a checkpoint" in rest
        assert "SLEPT THROUGH" not in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.timeout(60)
def test_a_shutdown_that_hangs_is_ended_after_the_grace_period():
    proc = start(STUCK, "1.0")
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        elapsed = time.monotonic() - t0
        assert proc.returncode == EXIT_SIGTERM == 143
        assert 0.9 <= elapsed < 15
        assert "shutdown did not finish within 1 s of the signal: exiting now" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_guard_restores_handlers_and_request_works_without_signals():
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with ShutdownGuard() as guard:
        assert guard.installed and not guard.requested
        assert signal.getsignal(signal.SIGINT) == guard._handler
        assert not guard.wait(0.01)
        guard.request(signal.SIGTERM)
        assert guard.requested and guard.wait(0) and guard.exit_code == 143
        guard.request(signal.SIGINT)  # the first request wins
        assert guard.signum == signal.SIGTERM
    assert not guard.installed
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == previous
    assert signal.set_wakeup_fd(-1) == -1
    assert not any(t.name == "asyncrl-shutdown-watcher" for t in threading.enumerate())
    plain = ShutdownGuard()
    plain.request()
    assert plain.exit_code == 130
    with pytest.raises(RuntimeError, match="only once"):
        with guard:
            pass


def test_guard_off_the_main_thread_installs_nothing(caplog):
    previous = signal.getsignal(signal.SIGINT)
    seen = {}

    def body():
        with ShutdownGuard() as guard:
            seen["installed"] = guard.installed
            seen["handler"] = signal.getsignal(signal.SIGINT)
            guard.request()
            seen["requested"] = guard.requested

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    assert seen == {"installed": False, "handler": previous, "requested": True}
    assert "not handled here" in caplog.text


def test_a_signal_while_the_command_is_exiting_exits_at_once_without_a_traceback():
    """After ``main`` has returned (the final checkpoint written), the process still runs exit work
    (JAX's atexit callbacks, thread joins): a SIGINT there gives one line and 130, not a
    KeyboardInterrupt traceback from an exit callback."""
    code = textwrap.dedent("""
        import atexit, os, signal, sys, time
        def slow_exit_work():  # stands in for JAX's atexit shutdown
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        atexit.register(slow_exit_work)
        sys.argv = ["asyncrl", "version"]
        from asyncrl.cli import entry
        entry()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=subprocess_env(), cwd=REPO_ROOT)
    assert proc.returncode == EXIT_SIGINT, proc.stderr
    assert proc.stdout.startswith("asyncrl ")
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == ("asyncrl: interrupted (SIGINT) while exiting; the command had finished (exit "
                                   "status 0) and checkpoints already written are intact"), proc.stderr


@pytest.mark.parametrize("remaining, budget", [(None, 60.0), (20.0, 8.0), (5.0, 0.0)])
def test_the_run_waits_for_its_threads_only_within_the_grace_left(remaining, budget, caplog):
    """After a signal :meth:`Run.close` stops waiting for its threads (one inside an XLA compile
    cannot be interrupted) early enough to close its logs and exit with its own status and line
    before the guard's deadline ends the process; without a signal it waits ``THREAD_JOIN_S``."""
    from types import SimpleNamespace

    from asyncrl.run.run_state import SIGNAL_CLOSE_S, THREAD_JOIN_S, Run

    assert (THREAD_JOIN_S, SIGNAL_CLOSE_S) == (60.0, 12.0)
    given = []
    run = SimpleNamespace(guard=SimpleNamespace(remaining_s=lambda: remaining),
                          _thread_joins=[lambda timeout: given.append(timeout) or ["asyncrl-engine"]])
    Run._join_threads(run)
    assert budget - 0.5 <= given[0] <= budget and run._thread_joins == []
    assert f"still running {budget:.0f} s after the run stopped (asyncrl-engine)" in caplog.text
