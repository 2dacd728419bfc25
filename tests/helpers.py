"""Helpers shared by tests: running Python in a fresh (spawned) subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python: this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


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


# Compiler options for tests whose time is mostly XLA compiling small programs: LLVM's
# optimisation passes are most of a CPU compile and buy nothing for arrays this small
# (about half the compile time). Pass as ``jax.jit(f, compiler_options=FAST_COMPILE)``;
# an outer jit's options apply to the jitted library functions it calls, too.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
