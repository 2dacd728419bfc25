"""Helpers shared by tests: running Python in fresh subprocesses, alone or as JAX processes on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

from asyncrl.cluster.launch import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("ASYNCRL_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")
"""The shared data (GSM8K) beside the checkout; ``$ASYNCRL_SHARED_DATA`` for a checkout elsewhere (a worktree)."""


TEST_XLA_FLAGS = ["--xla_backend_optimization_level=0"]
"""XLA flags of every test process (``tests/conftest.py``) and child (:func:`subprocess_env`): the
tiny programs of the tests run for milliseconds, so LLVM's optimisation passes, most of a CPU
compile's time, cost more than they save. Numbers are unchanged: no fast-math either way."""


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python: this checkout first on the path; a given ``XLA_FLAGS``
    keeps :data:`TEST_XLA_FLAGS`."""
    from asyncrl.engine.platform import merge_xla_flags

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    if "XLA_FLAGS" in extra:
        env["XLA_FLAGS"] = merge_xla_flags(extra["XLA_FLAGS"], TEST_XLA_FLAGS)
    return env


def documented_cpu_commands(config: Path) -> list[list[str]]:
    """The commands a config's header gives under its ``# On a CPU ...:`` paragraph, as argv lists:
    the indented comment lines (``#   ...``) after the line that ends the paragraph with a colon, a
    trailing backslash continuing a command."""
    import shlex

    lines = config.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("# On a CPU")), None)
    if start is None:
        return []
    while start < len(lines) and not lines[start].endswith(":"):
        start += 1
    commands: list[str] = []
    joined = ""
    for line in lines[start + 1:]:
        if line.strip() == "#" and not commands and not joined:
            continue  # the blank comment line between the heading and the commands
        if not line.startswith("#   "):
            break
        joined += " " + line[1:].strip().rstrip("\\").strip()
        if not line.rstrip().endswith("\\"):
            commands.append(joined.strip())
            joined = ""
    return [shlex.split(command) for command in commands]


def run_python(code: str, *, timeout: float = 110, env: dict[str, str] | None = None, args=()) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter; fail with its output if it exits non-zero."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or subprocess_env(),
        cwd=REPO_ROOT,
    )
    if proc.returncode != 0:
        raise AssertionError(f"subprocess exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def start_jax_processes(argv: Callable[[int], list[str]], logs: list[Path], *, devices: int | None = None,
                        xla_flags: str = "", **env: str) -> list[subprocess.Popen]:
    """Python ``argv(pid)`` as ``len(logs)`` JAX processes on a loopback coordinator (one process:
    no coordinator), ``devices`` forced CPU devices each, stdout and stderr to ``logs[pid]``.

    Each runs in a session of its own, so :func:`stop_processes` can kill what it started too.
    Output goes to files, not pipes: a chatty process cannot block on a full pipe while the test
    waits on its peer.
    """
    flags = " ".join(f for f in (f"--xla_force_host_platform_device_count={devices}" if devices else "", xla_flags) if f)
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for pid, log_path in enumerate(logs):
        child_env = subprocess_env(JAX_PLATFORMS="cpu", **({"XLA_FLAGS": flags} if flags else {}), **env)
        if len(logs) > 1:
            child_env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(len(logs)),
                             JAX_PROCESS_ID=str(pid))
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen([sys.executable, *argv(pid)], env=child_env, cwd=REPO_ROOT, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def stop_processes(procs: list[subprocess.Popen], timeout: float = 0.0) -> list[int | None]:
    """Wait up to ``timeout`` seconds in all for ``procs`` to exit, then kill the session of each
    one still running (SIGKILL; its exit code is then negative); the exit codes."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.01, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    return [proc.returncode for proc in procs]


def run_jax_processes(log_dir: Path, argv: Callable[[int], list[str]], processes: int, *, timeout: float,
                      devices: int | None = None, xla_flags: str = "", **env: str) -> tuple[list[int | None], list[str]]:
    """:func:`start_jax_processes` with logs ``log_dir/p<pid>.log``, then :func:`stop_processes`:
    the exit codes and the logs' text."""
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = [log_dir / f"p{pid}.log" for pid in range(processes)]
    codes = stop_processes(start_jax_processes(argv, logs, devices=devices, xla_flags=xla_flags, **env), timeout)
    return codes, [log.read_text() for log in logs]


# Compiler options for tests whose time is mostly XLA compiling small programs: LLVM's
# optimisation passes are most of a CPU compile and buy nothing for arrays this small
# (about half the compile time). Pass as ``jax.jit(f, compiler_options=FAST_COMPILE)``;
# an outer jit's options apply to the jitted library functions it calls, too.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def read_tensorboard_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars from the TensorBoard event files under ``logdir``: ``{tag: [(step, value)]}``.

    Reads the TFRecord framing directly (8-byte length, 4-byte CRC, payload, 4-byte CRC)
    with tensorboardX's protobufs, so checking what a run logged needs no TensorBoard.
    """
    import struct

    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            payload = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            if len(payload) < length:
                break  # a record still being written
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def read_wandb_records(path: str | Path) -> list:
    """The records of a W&B run's transaction log (``run-<id>.wandb`` of an offline run) as
    ``wandb_internal_pb2.Record`` protobufs.

    The file is W&B's 7-byte header (``:W&B``, magic, version) followed by LevelDB's log
    format (32 KiB blocks; each chunk a 4-byte CRC, 2-byte length and 1-byte type: full,
    first, middle or last); wandb ships the protobufs but, since its Go core, no Python reader.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    block, offset, pending, records = 32768, 7, b"", []
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        chunk = data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind == 0:  # zero padding
            offset += block - offset % block if offset % block else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated protobuf, no stubs
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records
