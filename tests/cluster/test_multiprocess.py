"""``asyncrl train`` as two JAX processes on loopback (gloo collectives, 2 forced CPU devices
each) against one process with 4 devices (the same global mesh): the same losses and rewards,
one checkpoint across processes, a resume after SIGKILL, stop agreement on SIGTERM.

Processes are started here with the standard environment variables (``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``), each in its own session with a hard timeout, and
killed in a ``finally``. The pure parts (the auto-enable rule, the split of a batch into whole
groups, the packing of each block) are tested in-process.

Budget (2-core CPU shared with other work, warm compilation cache): the default selection of
this file is one 2-process run of 2 steps beside its 1-process reference (the pure tests take
well under a second); the 10-step acceptance with SIGKILL and resume and the SIGTERM tests are
``slow``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from asyncrl.checkpoint import checkpoint_problems, checkpoints_root, latest_checkpoint, load_checkpoint, step_dir_name
from asyncrl.cluster.distributed import resolved_distributed
from asyncrl.config.sections import DistributedConfig
from asyncrl.errors import ConfigError
from asyncrl.run.multihost import pad_block, split_rows
from tests.helpers import start_jax_processes, stop_processes
from tests.trainer_fixtures import make_batch

BASE: dict[str, Any] = {
    "run": {"name": "mp", "seed": 3, "total_steps": 2},
    "model": {"path": "tiny:layers=1"},
    "data": {"dataset": "copy"},
    "workflow": "single_turn",
    "algo": {"kl_coef": 0.05},
    "rollout": {"batch_size": 4, "group_size": 4, "max_staleness": 0, "max_concurrent": 8, "temperature": 1.0,
                "max_new_tokens": 8},
    "engine": {"slots": 16},
    "eval": {"every_steps": 0},
    "checkpoint": {"every_steps": 0, "keep": None},
    "logging": {"level": "INFO", "dump_every_steps": 0},
}

PROCESS_TIMEOUT_S = 240
# tests/helpers.py FAST_COMPILE as XLA flags (about half the compile time of these tiny programs);
# every run of a comparison uses them. Process 1 of a run compiles its own programs: JAX's
# persistent cache serves process 0 only here.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


# ---------------------------------------------------------------------------- pure parts


def test_the_three_variables_turn_it_on_and_fill_the_null_fields():
    dist = DistributedConfig()
    assert dist.enabled is False
    assert resolved_distributed(dist, {}).enabled is False
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    on = resolved_distributed(dist, env)
    assert (on.enabled, on.coordinator_address, on.num_processes, on.process_id) == (True, "10.0.0.1:1234", 4, 3)
    assert resolved_distributed(dist, {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}).enabled is False  # all three
    mine = resolved_distributed(DistributedConfig(process_id=1), env)  # a config field wins over the variable
    assert mine.process_id == 1
    slurm = resolved_distributed(DistributedConfig(enabled=True), {})  # JAX's cluster detection fills the rest
    assert slurm.enabled and slurm.num_processes is None
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES='two' is not an integer >= 1"):
        resolved_distributed(dist, {**env, "JAX_NUM_PROCESSES": "two"})
    with pytest.raises(ConfigError, match="process_id .* = 4 is not below num_processes"):
        resolved_distributed(dist, {**env, "JAX_PROCESS_ID": "4"})


def test_split_keeps_groups_whole_and_pads_every_block_alike_and_a_block_pads_to_the_common_shape():
    batch = make_batch(rows=24, padding_rows=4, group_size=4, seed=5)  # 5 groups of 4, then 4 padding rows
    blocks = split_rows(batch, parts=2, row_multiple=4)
    gi = np.asarray(batch.group_index)
    assert [b.input_ids.shape for b in blocks] == [(12, batch.input_ids.shape[1])] * 2  # 8 and 12 real rows -> 12
    for block, groups in zip(blocks, ([0, 1], [2, 3, 4])):
        rows = np.flatnonzero(np.isin(gi, groups))
        real = len(rows)
        np.testing.assert_array_equal(block.input_ids[:real], batch.input_ids[rows])
        np.testing.assert_array_equal(block.behavior_logprobs[:real], batch.behavior_logprobs[rows])
        np.testing.assert_array_equal(block.group_index[:real], gi[rows] - groups[0])  # local group indices
        assert (block.group_index[real:] == -1).all() and not block.attention_mask[real:].any()
        assert (block.versions[real:] == -1).all()
    length = batch.input_ids.shape[1]
    padded = pad_block(blocks[0], 16, length + 8)  # a process short of rows and length: topped up with padding
    assert padded.input_ids.shape == (16, length + 8) and padded.rewards.shape == (16,)
    for name in ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "versions"):
        np.testing.assert_array_equal(getattr(padded, name)[:12, :length], getattr(blocks[0], name))
        assert getattr(padded, name).dtype == getattr(blocks[0], name).dtype
    assert (padded.group_index[12:] == -1).all() and (padded.versions[:, length:] == -1).all()
    assert not padded.attention_mask[12:].any() and not padded.loss_mask[:, length:].any()
    assert pad_block(blocks[1], 12, length) is blocks[1]


# ---------------------------------------------------------------------------- runs



def _config(tmp_path: Path, name: str, **sections: Any) -> Path:
    cfg = {key: dict(value) for key, value in BASE.items() if isinstance(value, dict)}
    cfg.update({k: v for k, v in BASE.items() if not isinstance(v, dict)})
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    cfg["run"]["output_dir"] = str(tmp_path / name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start(config: Path, processes: int, devices: int, *args: str) -> list[subprocess.Popen]:
    """``asyncrl train CONFIG`` as ``processes`` JAX processes of ``devices`` CPU devices each."""
    return start_jax_processes(lambda pid: ["-m", "asyncrl.cli", "train", str(config), *args],
                               [config.with_suffix(f".p{pid}.log") for pid in range(processes)], devices=devices,
                               xla_flags=FAST_COMPILE_FLAGS)


def _wait(procs: list[subprocess.Popen], config: Path, timeout: float = PROCESS_TIMEOUT_S) -> list[int | None]:
    return stop_processes(procs, timeout)


def _kill(procs: list[subprocess.Popen]) -> None:
    stop_processes(procs)


def _logs(config: Path, processes: int) -> str:
    return "\n".join(f"--- process {p}\n" + config.with_suffix(f".p{p}.log").read_text() for p in range(processes))


def _rows(out: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), f"a step logged twice (two writers?): {steps}"
    return {row["step"]: row for row in rows}


def _assert_same_steps(one: dict, two: dict, steps: range) -> None:
    for step in steps:
        a, b = one[step], two[step]
        assert a["reward/mean"] == b["reward/mean"] and a["reward/std"] == b["reward/std"], (step, a, b)
        for name in ("loss/total", "loss/pg", "loss/kl", "train/kl_ref"):
            assert abs(a[name] - b[name]) < 1e-5, (step, name, a[name], b[name])
        assert a["train/trained_tokens"] == b["train/trained_tokens"], step


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
@pytest.mark.timeout(PROCESS_TIMEOUT_S + 60)
def test_two_processes_train_like_one_process_on_the_same_global_mesh(tmp_path):
    """2 processes x 2 devices = 1 process x 4 devices: same rewards (exactly) and losses (1e-5)
    for 2 seeded max_staleness-0 steps; process 0 alone writes the run's files."""
    one_cfg, two_cfg = _config(tmp_path, "one"), _config(tmp_path, "two")
    one = _start(one_cfg, 1, 4)  # the reference runs beside the two processes
    two = _start(two_cfg, 2, 2)
    codes_two = _wait(two, two_cfg)
    codes_one = _wait(one, one_cfg)
    assert codes_two == [0, 0], _logs(two_cfg, 2)
    assert codes_one == [0], _logs(one_cfg, 1)
    _assert_same_steps(_rows(tmp_path / "one"), _rows(tmp_path / "two"), range(1, 3))
    checkpoint = latest_checkpoint(tmp_path / "two")
    assert checkpoint is not None and checkpoint.name == step_dir_name(2)
    assert load_checkpoint(checkpoint).state["process_count"] == 2
    assert "training completed" in _logs(two_cfg, 1) and "training completed" not in _logs(two_cfg, 2).split(
        "--- process 1")[1]


def _wait_for(predicate, timeout: float, procs: list[subprocess.Popen], what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            _kill(procs)
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow  # about 3 minutes on the 2-core machine: four runs of 10 steps
@pytest.mark.timeout(4 * PROCESS_TIMEOUT_S)
def test_ten_steps_match_and_a_sigkilled_two_process_run_resumes_exactly(tmp_path):
    """The acceptance: 10 seeded steps of 2 processes match 1 process; a 2-process run killed
    (SIGKILL, both) after its step-5 checkpoint resumes with 2 processes and its steps 6-10
    match the uninterrupted run."""
    ten = {"run": {"total_steps": 10}, "checkpoint": {"every_steps": 5}}
    one_cfg, two_cfg, killed_cfg = (_config(tmp_path, name, **ten) for name in ("one", "two", "killed"))
    one, two = _start(one_cfg, 1, 4), _start(two_cfg, 2, 2)
    assert _wait(two, two_cfg) == [0, 0], _logs(two_cfg, 2)
    assert _wait(one, one_cfg) == [0], _logs(one_cfg, 1)
    reference = _rows(tmp_path / "two")
    _assert_same_steps(_rows(tmp_path / "one"), reference, range(1, 11))

    killed = _start(killed_cfg, 2, 2)
    step5 = checkpoints_root(tmp_path / "killed") / step_dir_name(5)
    _wait_for(lambda: step5.is_dir(), PROCESS_TIMEOUT_S, killed, "the step-5 checkpoint")
    for proc in killed:
        os.killpg(proc.pid, signal.SIGKILL)
    _kill(killed)
    assert not (checkpoints_root(tmp_path / "killed") / step_dir_name(10)).exists()
    assert checkpoint_problems(step5) == []
    resumed = _start(killed_cfg, 2, 2, "--resume")
    assert _wait(resumed, killed_cfg) == [0, 0], _logs(killed_cfg, 2)
    assert "resuming from" in _logs(killed_cfg, 2)
    _assert_same_steps(reference, _rows(tmp_path / "killed"), range(6, 11))


@pytest.mark.slow  # about a minute: one 2-process run stopped by a signal, then a 1-process resume of one step
@pytest.mark.timeout(2 * PROCESS_TIMEOUT_S)
@pytest.mark.parametrize("signalled", [0, 1])
def test_sigterm_to_one_process_stops_both_with_one_checkpoint_and_143(tmp_path, signalled):
    """SIGTERM to process 0, or to process 1 while process 0 waits for rollouts (a reward that
    takes a second per call): both stop at the same step with one checkpoint, exit 143."""
    slow = {"rewards": [{"fn": "tests.multiprocess_rewards:slow_copy_match"}]} if signalled else {}
    cfg = _config(tmp_path, "stop", run={"total_steps": 200}, **slow)
    procs = _start(cfg, 2, 2)
    out = tmp_path / "stop"
    _wait_for(lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2,
              PROCESS_TIMEOUT_S, procs, "two trained steps")
    if signalled:
        time.sleep(0.5)  # both processes are past the step's stop agreement: process 0 waits for the batch
    procs[signalled].send_signal(signal.SIGTERM)
    sent = time.monotonic()
    codes = _wait(procs, cfg, timeout=60)
    assert codes == [143, 143], _logs(cfg, 2)
    assert time.monotonic() - sent < 30
    steps = [step for step, _ in [(int(p.name[5:]), p) for p in checkpoints_root(out).iterdir()
                                  if p.name.startswith("step_")]]
    assert len(steps) == 1, steps  # one checkpoint, no temporary leftovers counted
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None and checkpoint_problems(checkpoint) == []
    assert load_checkpoint(checkpoint).state["process_count"] == 2
    assert max(_rows(out)) == steps[0]  # the checkpoint is of the last step trained
    if signalled:
        assert "process 1 received a signal: abandoning the wait for the batch" in _logs(cfg, 1)
    else:
        # One process (4 devices: the same global mesh) resumes it: the arrays are read onto its shardings.
        single = _start(cfg, 1, 4, "--resume", "--set", f"run.total_steps={steps[0] + 1}")
        assert _wait(single, cfg, timeout=120) == [0], _logs(cfg, 1)
        assert "resuming from" in _logs(cfg, 1) and max(_rows(out)) == steps[0] + 1
