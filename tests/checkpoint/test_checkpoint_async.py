"""Asynchronous checkpoint saves: the caller goes on while the write finishes; a kill at any
point of the background write leaves the previous checkpoint usable; a save in flight when
SIGTERM arrives is completed before the run exits 143; format-2 checkpoints are refused with
the way on, and converted by ``python -m asyncrl.checkpoint.convert``."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from asyncrl.checkpoint import store as ck
from asyncrl.checkpoint.load import latest_checkpoint, load_checkpoint
from asyncrl.errors import CheckpointError
from tests.helpers import REPO_ROOT, subprocess_env


def _arrays(step: int) -> dict:
    return {"params": {"w": np.full((4, 4), step, np.float32), "b": np.arange(3) + step},
            "opt_state": {"mu": np.full(5, 0.5 * step, np.float32)}}


def test_an_asynchronous_save_returns_before_the_write_is_complete(tmp_path):
    ck.save_checkpoint(tmp_path, 1, arrays=_arrays(1), state={"version": 1}, config_yaml="{}\n")
    release = threading.Event()

    def hook(stage: str) -> None:
        if stage == "hashes":
            release.wait(30)

    ck._stage_hook = hook
    try:
        pending = ck.start_checkpoint(tmp_path, 2, arrays=_arrays(2), state={"version": 2}, config_yaml="{}\n",
                                      keep=1)
        time.sleep(0.2)
        assert not pending.done() and latest_checkpoint(tmp_path).name == "step_00000001"  # still the previous
        release.set()
        assert pending.wait() == tmp_path / "checkpoints" / "step_00000002"
    finally:
        ck._stage_hook = None
        release.set()
    assert [s for s, _ in ck._step_dirs(ck.checkpoints_root(tmp_path))] == [2]  # pruned once complete
    assert load_checkpoint(latest_checkpoint(tmp_path)).arrays["params"]["b"].tolist() == [2, 3, 4]


def test_an_asynchronous_save_says_it_is_written_when_it_completes_not_at_the_next_wait(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="asyncrl.checkpoint.store"):
        pending = ck.start_checkpoint(tmp_path, 3, arrays=_arrays(3), state={"version": 3}, config_yaml="{}\n")
        deadline = time.monotonic() + 30
        while not pending.done() and time.monotonic() < deadline:
            time.sleep(0.02)
        written = [r.getMessage() for r in caplog.records if "written to" in r.getMessage()]
        assert written == [f"checkpoint of step 3 written to {tmp_path / 'checkpoints' / 'step_00000003'}"]  # nobody waited
        pending.wait()
    assert len([r for r in caplog.records if "written to" in r.getMessage()]) == 1


def test_a_failing_asynchronous_save_raises_in_the_waiting_thread(tmp_path, monkeypatch):
    import errno

    ck.save_checkpoint(tmp_path, 1, arrays=_arrays(1), state={"version": 1}, config_yaml="{}\n")

    def full(stage: str) -> None:
        if stage == "MANIFEST.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "MANIFEST.json")

    monkeypatch.setattr(ck, "_stage_hook", full)
    pending = ck.start_checkpoint(tmp_path, 2, arrays=_arrays(2), state={"version": 2}, config_yaml="{}\n")
    with pytest.raises(CheckpointError, match=r"step 2 .*\[Errno 28\] No space left on device.*previous complete"):
        pending.wait()
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert not [p for p in ck.checkpoints_root(tmp_path).iterdir() if p.name.startswith(".tmp-")]


# The writer: step 2 complete, then an asynchronous save of step 3 whose background write stops
# at STAGE (the main thread meanwhile "trains" and says so), killed there by the test.
WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from asyncrl.checkpoint import store as ck
    out, stop_at = sys.argv[1], sys.argv[2]
    def arrays(step):
        return {"params": {"w": np.full(50_000, step, np.float32)}, "opt_state": {"mu": np.full(10, step, np.float32)}}
    for step in (1, 2):
        ck.save_checkpoint(out, step, arrays=arrays(step), state={"version": step}, config_yaml="{}\\n", keep=2)
    def hook(stage):
        if stage == stop_at:
            print("AT", stage, flush=True)
            time.sleep(60)
    ck._stage_hook = hook
    pending = ck.start_checkpoint(out, 3, arrays=arrays(3), state={"version": 3}, config_yaml="{}\\n", keep=2)
    print("TRAINING", flush=True)  # the caller goes on while the write is in flight
    pending.wait()
    """
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["arrays", "hashes", "MANIFEST.json", "fsync-dir"])
def test_a_kill_during_an_asynchronous_save_leaves_the_previous_checkpoint_usable(tmp_path, stage):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), stage], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO_ROOT)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while not any(line.startswith("AT") for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
            lines.append(line)
            assert time.monotonic() < deadline
        assert "TRAINING\n" in lines or proc.stdout.readline() == "TRAINING\n"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000002" and ck.checkpoint_problems(latest) == []
    assert load_checkpoint(latest).arrays["params"]["w"][0] == 2.0
    # the next save removes the leftover and completes
    ck.save_checkpoint(tmp_path, 3, arrays={"params": {"w": np.zeros(2)}}, state={"version": 3}, config_yaml="{}\n")
    assert sorted(p.name for p in ck.checkpoints_root(tmp_path).iterdir()) == [
        "step_00000001", "step_00000002", "step_00000003"]


# A training run whose checkpoint writes each stall 1.5 s in the background (after the arrays).
TRAIN_CHILD = textwrap.dedent(
    """
    import sys, time
    from asyncrl.checkpoint import store as ck
    def hook(stage):
        if stage == "hashes":
            print("SAVING", flush=True)
            time.sleep(1.5)
    ck._stage_hook = hook
    from asyncrl.cli import main
    sys.exit(main(["train", *sys.argv[1:]]))
    """
)


@pytest.mark.slow  # a training child: ~100 s on the loaded 2-core machine
@pytest.mark.timeout(300)
def test_a_save_in_flight_at_sigterm_is_completed_before_the_run_exits(tmp_path):
    from tests.checkpoint.test_resume import read_rows, write_config

    out = tmp_path / "run"
    config = write_config(tmp_path, out, run={"total_steps": 500}, checkpoint={"every_steps": 1, "keep": 2})
    proc = subprocess.Popen([sys.executable, "-c", TRAIN_CHILD, str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 200
        while len(read_rows(out)) < 2 or not any(p.name.startswith(".tmp-") for p in ck.checkpoints_root(out).iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)  # a write is in flight
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stderr[-3000:]
    latest = latest_checkpoint(out)
    assert ck.checkpoint_problems(latest) == []
    assert load_checkpoint(latest).step == max(row["step"] for row in read_rows(out))  # the last step trained
    assert not [p for p in ck.checkpoints_root(out).iterdir() if p.name.startswith(".tmp-")]


# --------------------------------------------------------------------------- format 2


def _format_2_checkpoint(out, step: int) -> dict:
    """A checkpoint as asyncrl wrote it before Orbax: one safetensors file per tree."""
    from asyncrl.checkpoint import files

    path = ck.checkpoints_root(out) / ck.step_dir_name(step)
    path.mkdir(parents=True)
    flat: dict[str, dict[str, np.ndarray]] = {"params": {"layers/0/w": np.arange(6, dtype=np.float32).reshape(2, 3), "norm": np.ones(3, np.float32)},
            "opt_state": {"1/0/mu/layers/0/w": np.full((2, 3), 0.25, np.float32), "1/0/count": np.array(7, np.int32)}}
    for tree, arrays in flat.items():
        files.save_safetensors(arrays, path / f"{tree}.safetensors", {"asyncrl_tree": tree})
    (path / "state.json").write_text(json.dumps({"version": step}))
    (path / "config.yaml").write_text("{}\n")
    entries = {f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
               for f in sorted(path.iterdir())}
    (path / "MANIFEST.json").write_text(json.dumps({"format": 2, "step": step, "trees": sorted(flat),
                                                    "rollout": False, "files": entries}))
    return flat


def test_a_format_2_checkpoint_is_refused_with_the_way_on_and_converted(tmp_path, capsys):
    from asyncrl.checkpoint import convert

    flat = _format_2_checkpoint(tmp_path, 4)
    with pytest.raises(CheckpointError) as err:
        latest_checkpoint(tmp_path)
    message = str(err.value)
    assert "\n" not in message and "MANIFEST.json: field format: 2, this asyncrl reads format 3" in message
    assert f"python -m asyncrl.checkpoint.convert {tmp_path}" in message

    assert convert.main([str(tmp_path)]) == 0
    assert "converted" in capsys.readouterr().out
    loaded = load_checkpoint(latest_checkpoint(tmp_path))
    assert loaded.step == 4 and loaded.state == {"version": 4}
    for tree, arrays in flat.items():
        for key, array in arrays.items():
            got = loaded.arrays[tree][key]
            assert got.dtype == array.dtype and got.tobytes() == array.tobytes(), (tree, key)
    assert convert.main([str(tmp_path)]) == 0 and "no format-2 checkpoint" in capsys.readouterr().out


def test_a_damaged_format_2_checkpoint_is_not_converted(tmp_path, capsys):
    from asyncrl.checkpoint import convert

    _format_2_checkpoint(tmp_path, 4)
    params = ck.checkpoints_root(tmp_path) / ck.step_dir_name(4) / "params.safetensors"
    params.write_bytes(params.read_bytes()[:-4])
    assert convert.main([str(tmp_path)]) == 1
    assert "params.safetensors has" in capsys.readouterr().err
