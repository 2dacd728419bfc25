"""``asyncrl launch`` and failure detection across processes (asyncrl/cluster/launch.py, asyncrl/cluster/distributed.py).

The launcher runs small stand-in children (``python -c``); the failure tests run two JAX
processes on loopback with gloo collectives. Everything runs in spawned subprocesses under
hard timeouts.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from asyncrl.cluster.distributed import EXIT_PEER_FAILED, EXIT_PEER_LOST, Watchdog
from asyncrl.cluster.launch import Launcher
from tests.helpers import REPO_ROOT, subprocess_env

# ---------------------------------------------------------------- the launcher, with stand-in children

PRINT_ENV = """
import os
print("env", os.environ["JAX_PROCESS_ID"], os.environ["JAX_NUM_PROCESSES"], os.environ["JAX_COORDINATOR_ADDRESS"],
      os.environ.get("XLA_FLAGS", ""))
"""

# Process 1 fails with code 3; process 0 stops on SIGTERM (143); process 2 ignores SIGTERM (then SIGKILL).
ONE_FAILS = """
import os, signal, sys, time
pid = int(os.environ["JAX_PROCESS_ID"])
if pid == 1:
    time.sleep(0.5)
    sys.exit(3)
def on_term(signum, frame):
    print("got SIGTERM", flush=True)
    sys.exit(143 if pid == 0 else 0)
signal.signal(signal.SIGTERM, on_term if pid == 0 else signal.SIG_IGN)
print("waiting", flush=True)
time.sleep(60)
"""


def _launcher(code: str, nproc: int, **kwargs) -> tuple[Launcher, io.StringIO]:
    out = io.StringIO()
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)
    return Launcher(lambda pid: [sys.executable, "-c", textwrap.dedent(code)], nproc, out=out, env=env, **kwargs), out


@pytest.mark.timeout(30)
def test_each_process_gets_its_id_count_coordinator_and_cpu_devices():
    launcher, out = _launcher(PRINT_ENV, 3, cpu_devices=2)
    assert launcher.run() == 0
    lines = sorted(line for line in out.getvalue().splitlines() if " env " in line)
    assert len(lines) == 3, out.getvalue()
    coordinators = set()
    for pid, line in enumerate(lines):
        prefix, _, pid_seen, count, coordinator, flags = line.split(" ", 5)
        assert (prefix, pid_seen, count) == (f"[p{pid}]", str(pid), "3"), line
        assert coordinator.startswith("127.0.0.1:") and flags == "--xla_force_host_platform_device_count=2", line
        coordinators.add(coordinator)
    assert len(coordinators) == 1


@pytest.mark.timeout(30)
def test_first_failure_is_named_and_returned_and_the_others_are_stopped():
    launcher, out = _launcher(ONE_FAILS, 3, grace_s=0.5)
    start = time.monotonic()
    code = launcher.run()
    text = out.getvalue()
    assert code == 3, text
    assert "asyncrl launch: process 1 failed first (exit code 3); stopping the other 2" in text, text
    assert "[p0] got SIGTERM" in text, text  # SIGTERM after the grace period
    assert [p.returncode for p in launcher.procs] == [143, 3, -signal.SIGKILL], text  # p2 ignored it: killed
    assert time.monotonic() - start < 15


LAUNCHER_PROCESS = """
import sys
from asyncrl.cluster.launch import Launcher, run_with_signals
child = '''
import os, signal, sys, time
def on_term(signum, frame):
    print("child", os.environ["JAX_PROCESS_ID"], "got", signal.Signals(signum).name, flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(60)
'''
sys.exit(run_with_signals(Launcher(lambda pid: [sys.executable, "-c", child], 2, grace_s=5)))
"""


@pytest.mark.timeout(30)
def test_sigterm_to_the_launcher_reaches_every_process():
    env = subprocess_env()
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LAUNCHER_PROCESS)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT)
    try:
        lines = []
        assert proc.stdout is not None
        while sum("ready" in line for line in lines) < 2:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    text = "".join(lines) + rest
    assert proc.returncode == 143, text
    assert "[p0] child 0 got SIGTERM" in text and "[p1] child 1 got SIGTERM" in text, text
    assert "SIGTERM: forwarded to every process" in text, text


@pytest.mark.timeout(60)
def test_cli_launches_asyncrl_commands_and_refuses_bad_usage():
    run = lambda *args: subprocess.run([sys.executable, "-m", "asyncrl.cli", "launch", *args], capture_output=True,  # noqa: E731
                                       text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=50)
    ok = run("--nproc", "2", "--", "version")
    assert ok.returncode == 0, ok.stderr
    assert sorted(line.split()[0] for line in ok.stdout.splitlines() if "asyncrl 0" in line) == ["[p0]", "[p1]"]
    bad = run("--nproc", "0", "--", "version")
    assert bad.returncode == 2 and "--nproc N >= 1" in bad.stderr, bad.stderr
    none = run("--nproc", "2")
    assert none.returncode == 2 and "the command after --" in none.stderr, none.stderr


@pytest.mark.timeout(60)
def test_cli_launch_in_process_prints_through_sys_stdout(capsys, monkeypatch):
    """As tests/test_doc_commands.py runs documented commands: ``main`` in this process, output captured."""
    from asyncrl.cli import main

    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    assert main(["launch", "--nproc", "2", "--", "version"]) == 0
    out = capsys.readouterr().out
    assert "asyncrl launch: 2 processes" in out and "[p0] asyncrl " in out and "[p1] asyncrl " in out, out


# ---------------------------------------------------------------- the watchdog, on a fake key-value store


class FakeClient:
    """The distributed client's key-value calls the watchdog uses; ``down`` makes them fail."""

    def __init__(self):
        self.kv: dict[str, str] = {}
        self.down = False
        self.fail_once: set[str] = set()  # prefixes whose next read fails (a transient error)

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        if self.down or prefix in self.fail_once:
            self.fail_once.discard(prefix)
            raise RuntimeError("UNAVAILABLE: Socket closed")
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


class Exited(Exception):
    pass


def _watchdogs(n=3, timeout_s=5.0):
    client, now = FakeClient(), [0.0]

    def exit_fn(code):
        raise Exited(code)

    dogs = [Watchdog(client, p, n, timeout_s, interval_s=1.0, clock=lambda: now[0], exit_fn=exit_fn,
                     leave_wait_s=0) for p in range(n)]
    for dog in dogs:
        dog._seen = {p: ("", 0.0) for p in range(n) if p != dog.process_id}
    return client, now, dogs


def test_watchdog_names_the_process_whose_heartbeat_stopped(capfd):
    client, now, (d0, d1, d2) = _watchdogs()
    for t in range(1, 5):  # all beat
        now[0] = t
        for dog in (d0, d1, d2):
            dog.poll()
    for t in range(5, 10):  # process 2 is gone; 0 and 1 keep beating
        now[0] = t
        d1.poll()
        if t < 9:
            d0.poll()
    now[0] = 10  # process 2's last beat reached process 0 at t=5: 5 s ago, not more
    d0.poll()
    now[0] = 10.5
    with pytest.raises(Exited) as ended:
        d0.poll()
    assert ended.value.args == (EXIT_PEER_LOST,)
    err = capfd.readouterr().err
    assert "asyncrl: error: lost process 2 of 3: no heartbeat for 5 s" in err and "stopping process 0 (exit 69)" in err


def test_watchdog_stops_on_a_failure_notice_and_acknowledges_it(capfd):
    client, now, (d0, d1, d2) = _watchdogs()
    d2.announce_failure(1, "TrainerError: bad batch")
    with pytest.raises(Exited) as ended:
        d0.poll()
    assert ended.value.args == (EXIT_PEER_FAILED,)
    assert "process 2 of 3 failed (exit code 1): TrainerError: bad batch" in capfd.readouterr().err
    assert not d2.wait_for_acknowledgements(0)  # process 1 has not seen it yet
    with pytest.raises(Exited):
        d1.poll()
    assert d2.wait_for_acknowledgements(0)


def _fail_in(dog, now, monkeypatch, during_wait=lambda: None):
    """``exit_after_failure(1, ...)`` of ``dog``'s process on the fake clock ``now``: each of the
    wait's sleeps advances it and runs ``during_wait`` (what the other processes do meanwhile).
    Returns the exit code."""
    from asyncrl.cluster import distributed

    def sleep(seconds):
        now[0] += seconds
        during_wait()

    monkeypatch.setattr(distributed, "_WATCHDOG", dog)
    monkeypatch.setattr(distributed.time, "sleep", sleep)
    with pytest.raises(Exited) as ended:
        distributed.exit_after_failure(1, "XlaRuntimeError: Gloo all-reduce failed")
    return ended.value.args[0]


def test_a_failure_whose_notice_a_silent_peer_never_answers_ends_naming_that_peer_lost(monkeypatch, capfd):
    """A killed peer makes this process's collective fail at once (loopback resets the connection):
    its failure path and the thread's silence check then race. After a wait for acknowledgements
    longer than the heartbeat timeout, a peer that neither answered nor beat is the root cause;
    one that beat (busy), acknowledged or left is not."""
    client, now, (d0, d1, d2, d3, d4) = _watchdogs(n=5)
    beats = iter(range(10**6))

    def others():
        client.key_value_set(d1._key("heartbeat", 1), str(next(beats)))  # alive and busy: no acknowledgement yet
        d2._acknowledge()  # saw the notice, without a heartbeat since

    with pytest.raises(Exited):
        d3.leave(EXIT_PEER_LOST, (4,))  # left before the failure (its own watchdog ended it)
    assert _fail_in(d0, now, monkeypatch, others) == EXIT_PEER_LOST
    assert now[0] >= 5  # named only after a whole heartbeat timeout
    err = capfd.readouterr().err
    assert "asyncrl: error: lost process 4 of 5: no heartbeat for 5 s" in err, err
    assert err.count("lost process") == 1, err


def test_a_failure_whose_wait_is_cut_short_names_nobody_lost(monkeypatch, capfd):
    """A failed read of the store ends the wait at once: that proves no peer silent, so the process
    exits with its own code instead of naming live peers lost."""
    client, now, (d0, d1) = _watchdogs(n=2)
    client.fail_once.add("asyncrl/watchdog/ack/")
    assert _fail_in(d0, now, monkeypatch) == 1
    assert "lost process" not in capfd.readouterr().err


def test_processes_that_all_failed_do_not_wait_for_each_others_acknowledgement():
    """A config error fails on every process at once: nobody is left to acknowledge, and
    waiting for it would hold each process for the whole heartbeat timeout."""
    client, now, (d0, d1) = _watchdogs(n=2)
    d0.announce_failure(1, "ConfigError: placement.engine")
    assert not d0.wait_for_acknowledgements(0)  # process 1 is still working: it must see the notice
    d1.announce_failure(1, "ConfigError: placement.engine")
    assert d0.wait_for_acknowledgements(0) and d1.wait_for_acknowledgements(0)


def test_watchdog_ignores_finished_processes_and_reports_a_lost_coordinator(capfd):
    client, now, (d0, d1) = _watchdogs(n=2)
    d1.mark_exiting()  # done with its work, waiting at JAX's shutdown barrier
    now[0] = 60
    d0.poll()  # not stale: it is exiting
    client.down = True
    d0.mark_exiting()
    d0.poll()  # the coordinator shutting down after a normal end is no error
    with pytest.raises(Exited) as ended:
        d1._exiting = False
        d1.poll()
    assert ended.value.args == (EXIT_PEER_LOST,)
    assert "lost the coordinator, process 0 of 2" in capfd.readouterr().err


def test_a_normal_exit_waits_until_every_peer_is_exiting_then_stops_watching():
    """:meth:`Watchdog.finish` at exit: the thread (running, in a real process) is stopped and
    joined only once every peer is past its work, so none of its client calls is in flight when
    the interpreter finalizes; a peer still working holds the exit until the bound."""
    client, now, (d0, d1) = _watchdogs(n=2)
    d1.start()  # its thread polls every second; finish() must end it
    d1.mark_exiting()
    assert not d1.finish(0)  # process 0 is still working: not done by the (zero) bound
    assert not d1._thread.is_alive()
    d0.mark_exiting()
    assert d0.finish(0)  # process 1 is exiting already
    down, _, (late, _) = _watchdogs(n=2)
    down.down = True
    assert not late.finish(5)  # a coordinator gone at exit ends the wait at once (the clock here stands still)


# ---------------------------------------------------------------- two JAX processes on loopback

COLLECTIVES = """
import os, sys, time
import numpy as np
from asyncrl.config.sections import MeshConfig
from asyncrl.cluster.distributed import initialize_distributed
initialize_distributed(MeshConfig(distributed={"heartbeat_timeout_s": int(sys.argv[1])}))
import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
pid = jax.process_index()
mesh = Mesh(np.array(jax.devices()), ("x",))
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
ones = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones((1,), np.float32))
assert float(total(ones)) == 2.0
from asyncrl.cluster.distributed import DistributedError, wait_at_barrier
if pid == 0:  # a barrier process 1 never reaches times out with an error naming it (and the run goes on)
    try:
        wait_at_barrier("lonely", 0.5)
    except DistributedError as err:
        print("barrier error:", err, flush=True)
wait_at_barrier("both", 30)
print("ready", pid, flush=True)
mode = sys.argv[2]
while True:
    if mode == "psum":
        total(ones)
    elif mode == "raise" and pid == 1:
        time.sleep(0.5)
        raise ValueError("bad thing in process 1")
    else:
        multihost_utils.broadcast_one_to_all(np.ones(3))
"""


def _two_jax_processes(mode: str, heartbeat_s: int) -> list[subprocess.Popen]:
    from asyncrl.cluster.launch import child_env, free_port

    env = subprocess_env()
    env.pop("XLA_FLAGS", None)
    coordinator = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, "-c", textwrap.dedent(COLLECTIVES), str(heartbeat_s), mode],
                             env=child_env(env, pid, 2, coordinator, None), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for pid in range(2)]


def _wait_ready(procs: list[subprocess.Popen], timeout_s: float = 60) -> list[str]:
    """Until every process printed ``ready`` (the test's hard timeout bounds a silent one); what each printed."""
    deadline = time.monotonic() + timeout_s
    printed = []
    for proc in procs:
        assert proc.stdout is not None
        lines: list[str] = []
        while not lines or not lines[-1].startswith("ready"):
            assert time.monotonic() < deadline, "processes did not start"
            lines.append(proc.stdout.readline())
            assert lines[-1], f"process exited before it was ready ({proc.poll()}): {''.join(lines)}"
        printed.append("".join(lines))
    return printed


def _end(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.timeout(60)
def test_a_process_alone_at_start_ends_after_the_initialization_timeout_naming_the_setting():
    """Process 1 of 2 never starts: JAX would abort some seconds after the timeout with a C++ stack trace."""
    from asyncrl.cluster.launch import child_env, free_port

    code = ("from asyncrl.config.sections import MeshConfig\n"
            "from asyncrl.cluster.distributed import initialize_distributed\n"
            "initialize_distributed(MeshConfig(distributed={'initialization_timeout_s': 1}))\n")
    env = child_env(subprocess_env(), 0, 2, f"127.0.0.1:{free_port()}", None)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == EXIT_PEER_LOST, proc.stderr[-3000:]
    assert "not all 2 processes reached the coordinator 127.0.0.1:" in proc.stderr, proc.stderr[-3000:]
    assert "mesh.distributed.initialization_timeout_s = 1 s" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(90)
def test_sigkill_of_process_1_ends_process_0_naming_it_within_the_heartbeat_timeout():
    """Process 0 loops in a jitted cross-process sum; process 1 is SIGKILLed: process 0's
    collective fails (loopback resets the connection), and its watchdog ends it with exit 69
    naming process 1 within the heartbeat timeout (3 s here; JAX's own abort would come later)."""
    procs = _two_jax_processes("psum", heartbeat_s=3)
    try:
        output = _wait_ready(procs)[0]
        killed = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        output += procs[0].communicate(timeout=30)[0]
        took = time.monotonic() - killed
    finally:
        _end(procs)
    assert procs[0].returncode == EXIT_PEER_LOST, output[-3000:]
    assert "asyncrl: error: lost process 1 of 2: no heartbeat for 3 s" in output, output[-3000:]
    assert took < 3 + 3, took  # the timeout plus one heartbeat interval, and slack for a loaded machine
    assert "barrier error: barrier 'lonely': not every process arrived within 0.5 s" in output, output[-3000:]


@pytest.mark.slow  # 10 s: the same two-process start-up again
@pytest.mark.timeout(90)
def test_a_python_error_in_process_1_ends_process_0_at_once_naming_it():
    """Without the failure notice, process 0 would wait in its broadcast until JAX's shutdown
    timeout (300 s by default): process 1's graceful shutdown waits for it."""
    procs = _two_jax_processes("raise", heartbeat_s=30)
    try:
        _wait_ready(procs)
        failed = time.monotonic()
        outputs = [proc.communicate(timeout=30)[0] for proc in procs]
        took = time.monotonic() - failed
    finally:
        _end(procs)
    assert procs[1].returncode == 1 and "ValueError: bad thing in process 1" in outputs[1], outputs[1][-3000:]
    assert procs[0].returncode == EXIT_PEER_FAILED, outputs[0][-3000:]
    assert "process 1 of 2 failed (exit code 1): ValueError: bad thing in process 1" in outputs[0], outputs[0][-3000:]
    assert took < 10, took


# ---------------------------------------------------------------- end to end: `asyncrl train` as 2 processes

QUICKSTART = REPO_ROOT / "configs" / "quickstart.yaml"


def _tiny_run(out_dir, rl_steps: int, *extra: str) -> list[str]:
    """``train`` arguments for the quickstart shortened on the tiny model (2 SFT steps, then RL)."""
    sets = [f"run.output_dir={out_dir}", "stages.0.total_steps=2", f"stages.1.total_steps={rl_steps}",
            "eval.every_steps=0", "checkpoint.every_steps=0", "rollout.max_staleness=0", *extra]
    return ["train", str(QUICKSTART), *[arg for s in sets for arg in ("--set", s)]]


def _train_processes(args: list[str], nproc: int = 2, cpu_devices: int = 2) -> list[subprocess.Popen]:
    """``python -m asyncrl.cli ARGS`` as ``nproc`` processes, each with the launcher's environment."""
    from asyncrl.cluster.launch import child_env, free_port

    coordinator = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *args], cwd=REPO_ROOT, text=True,
                             env=child_env(subprocess_env(), pid, nproc, coordinator, cpu_devices),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for pid in range(nproc)]


def _wait_for_step(out_dir, step: int, procs: list[subprocess.Popen], timeout_s: float = 240) -> None:
    """Until process 0 logged trainer step ``step`` in metrics.jsonl (fails if a process ends first)."""
    import json

    metrics = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(proc.poll() is None for proc in procs), [proc.returncode for proc in procs]
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
            if any(row.get("step", 0) >= step for row in rows):
                return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} in {metrics} within {timeout_s} s")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_launch_two_processes_trains_to_the_end(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "launch", "--nproc", "2", "--cpu-devices", "2", "--",
                           *_tiny_run(out, 3)], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=380)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert (out / "hf" / "config.json").is_file()
    assert "[p0]" in proc.stdout and "[p1]" in proc.stdout


# SIGTERM to either process: tests/cluster/test_multiprocess.py::test_sigterm_to_one_process_stops_both_with_one_checkpoint_and_143


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigkill_of_process_1_ends_the_training_process_0_naming_it(tmp_path):
    out = tmp_path / "run"
    procs = _train_processes(_tiny_run(out, 500, "mesh.distributed.heartbeat_timeout_s=5"))
    try:
        _wait_for_step(out, 3, procs)
        killed = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        output = procs[0].communicate(timeout=60)[0]
        took = time.monotonic() - killed
    finally:
        _end(procs)
    assert procs[0].returncode == EXIT_PEER_LOST, output[-4000:]
    assert "asyncrl: error: lost process 1 of 2: no heartbeat for 5 s" in output, output[-4000:]
    assert took < 5 + 3, took  # the heartbeat timeout, one interval, and the time to print and exit
