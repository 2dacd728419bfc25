"""What may change when a run is resumed: a staged run is
extended by raising the current or a later stage's ``total_steps`` (never below the steps a
stage has done, never a finished stage's), and a run directory moved or copied elsewhere resumes."""

from __future__ import annotations

import shutil

import pytest

from asyncrl.errors import ConfigError
from tests.checkpoint.test_resume import SFT_THEN_RL, read_rows, run_in_process, write_config

STAGES = {**SFT_THEN_RL, "checkpoint": {"every_steps": 1, "keep": 2}}


@pytest.mark.slow  # 32 s cold (two runs compiling a rematerialised step); the resume tests in test_resume.py stay
def test_a_run_whose_remat_policy_auto_was_resolved_resumes(tmp_path):
    """``model.remat_policy: auto`` is resolved at a run's start (from its devices' memory), but a
    checkpoint keeps it ``auto``, as ``engine.slots: auto``: a resume chooses again on its own
    devices instead of being refused for a config that differs from the one it was given."""
    out = tmp_path / "remat"
    config = write_config(tmp_path, out, run={"total_steps": 1}, model={"remat": True},
                          checkpoint={"every_steps": 1, "keep": 1})
    run_in_process(config)
    run_in_process(config, "checkpoint.resume=auto", "run.total_steps=2")
    assert [r["step"] for r in read_rows(out)] == [1, 2]


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_a_finished_staged_run_is_extended_by_raising_its_last_stage(tmp_path):
    out = tmp_path / "staged"
    config = write_config(tmp_path, out, **STAGES)
    run_in_process(config)
    assert [(r["step"], r["stage"]) for r in read_rows(out)] == [(1, "sft"), (2, "sft"), (3, "rl"), (4, "rl")]

    run_in_process(config, "checkpoint.resume=auto", "stages.1.total_steps=4")
    assert [(r["step"], r["stage"]) for r in read_rows(out)] == [
        (1, "sft"), (2, "sft"), (3, "rl"), (4, "rl"), (5, "rl"), (6, "rl")]

    # A finished stage's length is history: changing it is refused, naming the field.
    with pytest.raises(ConfigError, match=r"stages\.0\.total_steps: stage 0 \(sft\) is finished"):
        run_in_process(config, "checkpoint.resume=auto", "stages.0.total_steps=3", "stages.1.total_steps=4")
    # The current stage cannot end before the step it is at.
    with pytest.raises(ConfigError, match=r"stages\.1\.total_steps: 3 is below the 4 steps stage 1 \(rl\) has done"):
        run_in_process(config, "checkpoint.resume=auto", "stages.1.total_steps=3")


@pytest.mark.slow  # 14 s cold; resume is tested in test_resume.py by default
def test_a_run_directory_moved_elsewhere_resumes_there(tmp_path):
    first = tmp_path / "first"
    config = write_config(tmp_path, first, **STAGES)
    run_in_process(config)
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(str(first), str(moved))
    config_moved = write_config(tmp_path, moved, **{**STAGES, "stages": [
        STAGES["stages"][0], {**STAGES["stages"][1], "total_steps": 3}]})
    run_in_process(config_moved, "checkpoint.resume=auto")
    assert [r["step"] for r in read_rows(moved)] == [1, 2, 3, 4, 5]
    assert not first.exists()
