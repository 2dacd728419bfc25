"""Every host generates: ``asyncrl train`` as several JAX processes on loopback (gloo), each with an
engine of its own on its own forced CPU devices, its own executor over its share of the prompts,
and its block of every batch; against one process on the same devices.

The default selection runs one short 2-process synchronous run: each step's sample ids are the
one-process ids, ``engine/hosts_generating`` = 2 with each host's requests in balance, each
process's rollout state is in the checkpoint. The comparison with a 1-process run on the same
devices (the same sample ids, tokens and rewards, the same final weights), the 4-process launch,
the resumes on another process count, ``engine.remote`` and the SIGKILL of a generating process
are ``slow`` (run by name).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from asyncrl.checkpoint import checkpoints_root, latest_checkpoint, load_checkpoint, step_dir_name
from tests.cluster.test_multiprocess import PROCESS_TIMEOUT_S, _config, _kill, _logs, _rows, _start, _wait, _wait_for
from tests.helpers import REPO_ROOT, start_jax_processes, subprocess_env

SYNC = {"logging": {"level": "INFO", "dump_every_steps": 1, "dump_groups": 4}}
"""Every step's every group in trajectories.jsonl: its sample id, tokens and rewards."""


def _steps(out: Path) -> dict[int, list[tuple]]:
    """Per step, each trained trajectory as ``(sample id, completion, reward)``, in batch order."""
    steps: dict[int, list[tuple]] = {}
    for line in (out / "trajectories.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], []).append(
            (record["metadata"]["sample_id"], record["completion"], record["reward"]))
    return steps


def _weights(out: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(out / "hf" / "model.safetensors"))


def _assert_every_host_generated(rows: dict, processes: int, steps) -> None:
    for step in steps:
        row = rows[step]
        assert row["engine/hosts_generating"] == processes, (step, row["engine/hosts_generating"])
    last = rows[max(steps)]
    shares = [last[f"engine/host{i}/requests"] for i in range(processes)]
    assert sum(shares) == last["engine/requests"]
    assert max(abs(s / (sum(shares) / processes) - 1) for s in shares) <= 0.2, shares


@pytest.mark.timeout(PROCESS_TIMEOUT_S + 60)
def test_two_processes_each_generate_their_block_of_every_step(tmp_path):
    """The default selection's one run: 2 processes x 1 device, 2 synchronous steps. Each step
    trains the ids one process would (0-3, then 4-7), process 0's block first; both engines
    finish requests at every step, in balance; each process's rollout state is in the checkpoint."""
    cfg = _config(tmp_path, "two", **SYNC)
    assert _wait(_start(cfg, 2, 1), cfg) == [0, 0], _logs(cfg, 2)
    steps = _steps(tmp_path / "two")
    for step in (1, 2):
        assert [s for s, _, _ in steps[step][::4]] == list(range(4 * (step - 1), 4 * step)), steps[step]
    _assert_every_host_generated(_rows(tmp_path / "two"), 2, (1, 2))
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path / "two"))
    assert checkpoint.processes == 2 and [s["meta"]["ledger"]["batch_size"] for s in checkpoint.rollout_states] == [2, 2]


@pytest.mark.slow  # about 40 s on the 2-core machine: the same 2 steps beside a 1-process reference
@pytest.mark.timeout(PROCESS_TIMEOUT_S + 60)
def test_two_generating_processes_train_the_one_process_samples_tokens_and_rewards(tmp_path):
    one_cfg, two_cfg = _config(tmp_path, "one", **SYNC), _config(tmp_path, "two", **SYNC)
    one = _start(one_cfg, 1, 2)  # the reference, beside the two processes: 2 devices in both runs
    two = _start(two_cfg, 2, 1)
    assert _wait(two, two_cfg) == [0, 0], _logs(two_cfg, 2)
    assert _wait(one, one_cfg) == [0], _logs(one_cfg, 1)
    reference, every_host = _steps(tmp_path / "one"), _steps(tmp_path / "two")
    assert sorted(reference) == sorted(every_host) == [1, 2]
    for step in reference:  # the same samples, in the same order, the same tokens and rewards
        assert every_host[step] == reference[step], step
        assert sorted({s for s, _, _ in reference[step]}) == list(range(4 * (step - 1), 4 * step))
    one_rows, two_rows = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    _assert_every_host_generated(two_rows, 2, (1, 2))
    for step in (1, 2):
        assert one_rows[step]["reward/mean"] == two_rows[step]["reward/mean"]
        assert one_rows[step]["engine/requests"] == two_rows[step]["engine/requests"]
    one_weights, two_weights = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert max(float(np.max(np.abs(one_weights[k] - two_weights[k]))) for k in one_weights) < 1e-5
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path / "two"))
    assert checkpoint.processes == 2 and [s["meta"]["ledger"]["batch_size"] for s in checkpoint.rollout_states] == [2, 2]
    assert "training completed" in _logs(two_cfg, 1)


@pytest.mark.slow  # about a minute and a half: four processes start and compile on two cores
@pytest.mark.timeout(2 * PROCESS_TIMEOUT_S)
@pytest.mark.parametrize("staleness", [0, 1])
def test_asyncrl_launch_four_processes_every_host_generates_its_share(tmp_path, staleness):
    """``asyncrl launch --nproc 4 --cpu-devices 1``: every process's engine finishes requests at every
    RL step after the first, and each host's share of ``engine/requests`` is within 20% of equal."""
    cfg = _config(tmp_path, "four", run={"total_steps": 6}, rollout={"batch_size": 8, "max_staleness": staleness})
    env = subprocess_env(JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "launch", "--nproc", "4", "--cpu-devices", "1", "--",
                           "train", str(cfg)], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=2 * PROCESS_TIMEOUT_S - 30)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = _rows(tmp_path / "four")
    _assert_every_host_generated(rows, 4, range(2, 7))


def _resume_on(tmp_path: Path, name: str, first: int, then: int) -> Path:
    """2 synchronous steps on ``first`` processes, then steps 3-4 resumed on ``then`` (2 devices in all)."""
    cfg = _config(tmp_path, name, run={"total_steps": 2}, checkpoint={"every_steps": 2}, **SYNC)
    assert _wait(_start(cfg, first, 2 // first), cfg) == [0] * first, _logs(cfg, first)
    resumed = _start(cfg, then, 2 // then, "--resume", "--set", "run.total_steps=4")
    assert _wait(resumed, cfg) == [0] * then, _logs(cfg, then)
    assert "resuming from" in _logs(cfg, then)
    return tmp_path / name


@pytest.mark.slow  # about two minutes: an uninterrupted run and two runs resumed on another process count
@pytest.mark.timeout(4 * PROCESS_TIMEOUT_S)
def test_a_synchronous_run_resumed_on_another_process_count_trains_what_the_uninterrupted_run_trains(tmp_path):
    reference_cfg = _config(tmp_path, "reference", run={"total_steps": 4}, **SYNC)
    assert _wait(_start(reference_cfg, 1, 2), reference_cfg) == [0], _logs(reference_cfg, 1)
    reference = _steps(tmp_path / "reference")
    reference_rows = _rows(tmp_path / "reference")
    for first, then in ((2, 1), (1, 2)):
        out = _resume_on(tmp_path, f"from{first}to{then}", first, then)
        got = _steps(out)
        assert [got[step] for step in (1, 2, 3, 4)] == [reference[step] for step in (1, 2, 3, 4)], (first, then)
        rows = _rows(out)
        for step in (3, 4):
            assert rows[step]["reward/mean"] == reference_rows[step]["reward/mean"], (first, then, step)
            assert abs(rows[step]["loss/total"] - reference_rows[step]["loss/total"]) < 1e-5, (first, then, step)


@pytest.mark.slow  # about two minutes: a run whose process 1 is killed while it generates, then its resume
@pytest.mark.timeout(4 * PROCESS_TIMEOUT_S)
def test_a_process_killed_while_generating_stops_the_run_in_one_line_and_the_resume_trains_every_sample_once(tmp_path):
    """SIGKILL of process 1 while its episodes wait on a slow reward: process 0 stops naming it
    (exit 69) within the heartbeat timeout; resumed, every step is logged once and every sample id
    is trained exactly once, as in an uninterrupted run (synchronous, so the ids are 0..4N-1)."""
    total = 6
    cfg = _config(tmp_path, "killed", run={"total_steps": total}, checkpoint={"every_steps": 1},
                  rewards=[{"fn": "tests.multiprocess_rewards:slow_copy_match"}],
                  mesh={"distributed": {"heartbeat_timeout_s": 10}}, **SYNC)
    procs = _start(cfg, 2, 1)
    out = tmp_path / "killed"
    step2 = checkpoints_root(out) / step_dir_name(2)
    _wait_for(lambda: step2.is_dir(), PROCESS_TIMEOUT_S, procs, "the step-2 checkpoint")
    time.sleep(0.5)  # both processes are generating the next batch (its rewards take a second a call)
    os.killpg(procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    codes = _wait(procs, cfg, timeout=60)
    assert codes[0] == 69, _logs(cfg, 2)
    assert time.monotonic() - killed < 10 + 20
    lost = [line for line in _logs(cfg, 1).splitlines() if "lost process 1 of 2" in line]
    assert len(lost) == 1, _logs(cfg, 1)
    last = latest_checkpoint(out)
    assert last is not None and int(last.name[5:]) < total
    resumed = _start(cfg, 2, 1, "--resume")
    assert _wait(resumed, cfg) == [0, 0], _logs(cfg, 2)
    rows = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, total + 1)), rows  # every step once (the log cut back to the checkpoint)
    trained = _steps(out)
    ids = Counter(sample for step in range(1, total + 1) for sample, _, _ in trained[step])
    # every sample once (its group of 4 trajectories): none lost, none trained twice
    assert sorted(ids) == list(range(4 * total)) and set(ids.values()) == {4}, ids
    _kill(resumed)


@pytest.mark.slow  # about two minutes: two asyncrl serve servers start, then a 2-process run on them
@pytest.mark.timeout(4 * PROCESS_TIMEOUT_S)
def test_with_engine_remote_every_process_generates_on_servers_of_its_own(tmp_path):
    """engine.remote with two servers and two processes: process p drives server p (every process
    writes its share of each version, then loads it on its own server), and the metrics row names
    each server by its place in engine.remote.urls."""
    from tests.remote_helpers import API_KEY, servers

    with servers(tmp_path, 2) as started:
        remote = {"urls": [s.url for s in started], "weights_dir": str(tmp_path / "weights" / "run"),
                  "api_key_env": "ASYNCRL_TEST_API_KEY", "health_check_every_s": 0}
        cfg = _config(tmp_path, "remote", run={"total_steps": 3}, model={"path": "tiny"}, engine={"remote": remote},
                      rollout={"max_staleness": 1})
        procs = start_jax_processes(lambda pid: ["-m", "asyncrl.cli", "train", str(cfg)],
                                    [cfg.with_suffix(f".p{pid}.log") for pid in range(2)], devices=1,
                                    ASYNCRL_TEST_API_KEY=API_KEY)
        assert _wait(procs, cfg) == [0, 0], _logs(cfg, 2)
    rows = _rows(tmp_path / "remote")
    last = rows[3]
    assert last["engine/healthy_servers"] == 2
    assert last["engine/server0/requests"] > 0 and last["engine/server1/requests"] > 0
    assert all(rows[step]["engine/hosts_generating"] == 2 for step in (2, 3))
