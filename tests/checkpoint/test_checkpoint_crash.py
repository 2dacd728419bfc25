"""A writer killed with SIGKILL at any point of a save never leaves a directory that looks complete.

Each test runs the writer in a subprocess: first at every named stage of a save (the
subprocess stops there and is killed), then at random moments while it writes checkpoints
back to back (so kills land inside file writes, fsyncs, renames and deletions).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from asyncrl.checkpoint import store as ck
from asyncrl.checkpoint.layout import _step_of
from asyncrl.checkpoint.load import latest_checkpoint, load_checkpoint
from tests.helpers import REPO_ROOT, subprocess_env

WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from asyncrl.checkpoint import store as ck

    out, stop_at, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rollout = {"meta": {"format": 1, "ledger": {"version": 0}, "groups": {}},
               "arrays": {"g0_t0_input_ids": np.arange(size // 64, dtype=np.int32)}}

    def save(step):
        rng = np.random.default_rng(step)
        arrays = {"params": {"w": rng.standard_normal(size).astype(np.float32), "b": np.full(3, step)},
                  "opt_state": {"mu": rng.standard_normal(size // 2).astype(np.float32)}}
        ck.save_checkpoint(out, step, arrays=arrays, state={"version": step}, config_yaml="{}\\n",
                           rollout_state=rollout, keep=2)

    save(1)
    save(2)
    def hook(stage):
        if stage == stop_at:
            print("AT", stage, flush=True)
            time.sleep(60)
    ck._stage_hook = hook
    print("READY", flush=True)
    for step in range(3, 10_000):
        save(step)
    """
)

STAGES = ["state.json", "config.yaml", "rollout", "arrays", "hashes", "MANIFEST.json",
          "fsync-dir", "renamed", "trashed step_00000001", "pruned"]


def start_writer(out, stop_at: str, size: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(out), stop_at, str(size)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO_ROOT)


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"writer never printed {prefix!r}; stderr:\n{proc.stderr.read()}")


def assert_crash_consistent(out) -> int:
    """Every step directory is complete (checksums included); returns the newest step."""
    root = ck.checkpoints_root(out)
    steps = []
    for step, path in ck._step_dirs(root):
        assert ck.checkpoint_problems(path) == [], f"{path} looks like a checkpoint but is not complete"
        steps.append(step)
    latest = latest_checkpoint(out)
    assert latest is not None and _step_of(latest) == max(steps)
    loaded = load_checkpoint(latest)
    assert loaded.state == {"version": loaded.step} and int(loaded.arrays["params"]["b"][0]) == loaded.step
    return loaded.step


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.timeout(90)
def test_sigkill_at_every_stage_of_a_save_leaves_only_complete_checkpoints(tmp_path):
    # all writers start together (their imports overlap), each stops at its own stage
    writers = {stage: start_writer(tmp_path / stage.replace(" ", "_"), stage, 4096) for stage in STAGES}
    try:
        check_each_stage(tmp_path, writers)
    finally:
        for proc in writers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def check_each_stage(tmp_path, writers) -> None:
    for stage, proc in writers.items():
        out = tmp_path / stage.replace(" ", "_")
        wait_for_line(proc, f"AT {stage}")
        kill(proc)
        newest = assert_crash_consistent(out)
        renamed = STAGES.index(stage) >= STAGES.index("renamed")
        assert newest == (3 if renamed else 2), stage
        leftovers = [p.name for p in ck.checkpoints_root(out).iterdir() if p.name.startswith((".tmp-", ".trash-"))]
        assert bool(leftovers) == (not renamed or stage.startswith("trashed")), (stage, leftovers)
        # the next save (a resumed run) removes what the crash left and keeps going
        ck.save_checkpoint(out, 4, arrays={"params": {"b": [4, 4, 4]}}, state={"version": 4}, config_yaml="{}\n", keep=2)
        names = sorted(p.name for p in ck.checkpoints_root(out).iterdir())
        assert names == [f"step_{newest:08d}", "step_00000004"], (stage, names)


@pytest.mark.timeout(90)
@pytest.mark.slow  # a kill at every stage of a save stays in the default selection
def test_sigkill_at_random_moments_while_saving_never_leaves_a_complete_looking_partial_checkpoint(tmp_path):
    rng = random.Random(9)
    out = tmp_path / "run"
    newest_seen = []
    for attempt in range(4):
        proc = start_writer(out, "never", 200_000)  # ~1.2 MB per checkpoint: kills land inside writes
        if attempt == 0:
            wait_for_line(proc, "READY")
        time.sleep(rng.uniform(0.8, 1.6))
        kill(proc)
        mid_save = any(p.name.startswith((".tmp-", ".trash-")) for p in ck.checkpoints_root(out).iterdir())
        print(f"attempt {attempt}: killed {'inside' if mid_save else 'between'} saves")
        newest_seen.append(assert_crash_consistent(out))
    assert newest_seen[0] >= 2
