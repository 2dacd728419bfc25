"""What the run drivers share (bench_rl, bench_vs_trl, bench_placement, bench_async,
staleness_sweep, soak, chaos, plot_metrics): a child ``asyncrl train`` (or ``asyncrl serve``)
started with this checkout on the path, optionally pinned to some cores, its console lines read
(and each step line timestamped) as they come, a server's ``/health`` awaited, and a run's
``metrics.jsonl`` read back.

    env = child_env(compile_cache=work / "jax-cache")
    run = ChildRun(train_argv(config, ["run.overwrite=true"]), env)
    run.expect_success(timeout=3600)          # raises with the output's tail otherwise
    rows = read_metrics(out)                  # one dict per logged step
    run.step_times[1]                         # seconds from the start to step 1's console line
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

from asyncrl.cluster.launch import free_port  # noqa: F401  (the bench scripts take it from here)

REPO_ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"(?:\[\w+\] )?step (\d+)/(\d+)")
"""A run's per-step console line (``step 3/12 ...``, ``[rl] step 3/12 ...`` in a staged run)."""


def child_env(compile_cache: Optional[Path] = None, *, keep_cache: bool = False, **variables: str) -> dict[str, str]:
    """This process's environment with this checkout first on ``PYTHONPATH`` and ``variables`` set.

    ``compile_cache``: JAX's persistent compilation cache for the child, switched on
    (``ASYNCRL_COMPILE_CACHE`` dropped); ``keep_cache``: a ``JAX_COMPILATION_CACHE_DIR`` already
    in the environment wins over it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    if compile_cache is not None:
        if not (keep_cache and env.get("JAX_COMPILATION_CACHE_DIR")):
            env["JAX_COMPILATION_CACHE_DIR"] = str(Path(compile_cache).resolve())
        env.pop("ASYNCRL_COMPILE_CACHE", None)
    env.update(variables)
    return env


def train_argv(config: Union[str, Path], overrides: Iterable[str] = (), *flags: str) -> list[str]:
    """``train CONFIG --set A --set B ... FLAGS``: the arguments of one ``asyncrl train``."""
    return ["train", str(config), *[arg for item in overrides for arg in ("--set", item)], *flags]


ASYNCRL = (sys.executable, "-m", "asyncrl.cli")
"""The default launcher: ``asyncrl`` of this interpreter (the checkout first on the path, via :func:`child_env`)."""


class ChildRun:
    """One ``<launch> ARGV`` process: its output read on a daemon thread, kept (the last
    ``keep_lines``), optionally copied to ``log``, and each step line timestamped.

    ``new_session``: the child leads its own process group, and :meth:`signal` signals the whole
    group (a launcher and the processes it starts)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], *, launch: Sequence[str] = ASYNCRL,
                 cwd: Union[str, Path] = REPO_ROOT, log: Optional[Path] = None, new_session: bool = False,
                 keep_lines: Optional[int] = None):
        self.argv = [*launch, *argv]
        self.started = time.perf_counter()
        self.step_times: dict[int, float] = {}  # step -> seconds since the start at its first console line
        self.lines: list[str] = []
        self.updates: "queue.Queue[str]" = queue.Queue()  # every line, then "" at the end of the output
        self._keep = keep_lines
        self._group = new_session
        self._log: Optional[IO[str]] = log.open("w") if log is not None else None
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(env), cwd=cwd, start_new_session=new_session)
        self._reader = threading.Thread(target=self._read, name="runlib-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:  # ends when the child closes its output
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = STEP_LINE.search(line)
            if match:
                self.step_times.setdefault(int(match.group(1)), time.perf_counter() - self.started)
            self.lines.append(line)
            if self._keep is not None and len(self.lines) > self._keep:
                del self.lines[0]
            if self._log is not None:
                self._log.write(line)
            self.updates.put(line)
        self.updates.put("")

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_steps(self, count: int, timeout: float) -> bool:
        """Until ``count`` more step lines were printed (False: the output ended or ``timeout`` s passed first)."""
        seen, deadline = 0, time.monotonic() + timeout
        while seen < count and time.monotonic() < deadline:
            try:
                line = self.updates.get(timeout=1.0)
            except queue.Empty:
                continue
            if line == "":
                return False
            seen += bool(STEP_LINE.search(line))
        return seen >= count

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the child (its whole group with ``new_session``); a gone child is fine."""
        try:
            if self._group:
                os.killpg(self.proc.pid, signum)
            else:
                self.proc.send_signal(signum)
        except ProcessLookupError:
            pass

    def finish(self, timeout: Optional[float]) -> int:
        """The exit status, waiting at most ``timeout`` s (then SIGKILL; None: no limit); the output is read to its end."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            code = self.proc.wait(timeout=60)
        self._reader.join(timeout=60)
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def expect_success(self, timeout: float) -> "ChildRun":
        """Wait for the child; one still running after ``timeout`` s (killed) or a failed one raises
        with the output's tail."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.finish(0)
            raise TimeoutError(f"{self.describe()} ran over {timeout} s:\n{self.output[-3000:]}") from None
        code = self.finish(60)
        if code != 0:
            raise RuntimeError(f"{self.describe()} exited {code}:\n{self.output[-3000:]}")
        return self

    def describe(self) -> str:
        return " ".join(self.argv[3:] if tuple(self.argv[:3]) == ASYNCRL else self.argv)


def run_train(argv: Sequence[str], env: Mapping[str, str], timeout: float) -> ChildRun:
    """``asyncrl ARGV`` (in the repository root) to its successful end: see :meth:`ChildRun.expect_success`."""
    return ChildRun(argv, env).expect_success(timeout)


@contextlib.contextmanager
def pinned(cpus: Optional[Iterable[int]]) -> Iterator[None]:
    """The calling thread runs on ``cpus`` until the block ends (None: unchanged), so a process
    started inside the block inherits that CPU affinity from its first instruction on (XLA sizes
    its thread pools from the affinity it finds at start-up). Linux only (``os.sched_setaffinity``)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def split_cpus(cpus: Optional[Iterable[int]] = None) -> tuple[list[int], list[int]]:
    """``cpus`` (default: those this process may run on) as two halves, the first half the
    smaller when the count is odd; fewer than 2 raises (nothing to split)."""
    available = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(available) < 2:
        raise RuntimeError(f"splitting the cores needs at least 2, this process may run on {available}")
    half = len(available) // 2
    return available[:half], available[half:]


def wait_for_health(url: str, proc: subprocess.Popen, timeout: float, output: Callable[[], str],
                    headers: Optional[Mapping[str, str]] = None) -> None:
    """Poll ``GET {url}/health`` until it answers 200. The server process ``proc`` exiting first, or
    ``timeout`` s passing, raises with ``output()`` (its console so far)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited {proc.returncode} before answering /health:\n{output()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", headers=dict(headers or {}), timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer /health within {timeout} s:\n{output()[-3000:]}")


# --------------------------------------------------------------------------- metrics.jsonl


def read_jsonl(path: Path, *, torn_tail_ok: bool = False) -> list[dict]:
    """The JSON objects of a JSON-lines file, blank lines skipped. A line that is not JSON raises
    ValueError naming ``file:line``; ``torn_tail_ok``: a broken last line (a file still being
    appended to) is left out instead."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if torn_tail_ok and number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    return rows


def read_metrics(run: Path, *, torn_tail_ok: bool = False) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` (``run``: the run directory or the file itself),
    one dict per logged step, as written. A missing file raises FileNotFoundError naming it."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (is this a run directory?)")
    return read_jsonl(path, torn_tail_ok=torn_tail_ok)

