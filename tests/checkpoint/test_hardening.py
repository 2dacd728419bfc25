"""Hardening: damaged logs never block a resume, a checkpoint's contents are validated
before they are trusted, disk-full and I/O errors are survivable (also when Orbax's
background writes fail), and resource use is logged.

Runs go through the CLI (``asyncrl.cli.main`` in-process) on the ``tiny`` model. One real run
of two steps (:func:`trained_run`, module scope) is copied by each test that resumes it; the
checkpoints of the validation tests are written by hand with :func:`asyncrl.checkpoint.save_checkpoint`
(a valid manifest around contents that disagree), so those tests never train.
Budget (2-core CPU, warm compilation cache): about 35 s.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from asyncrl import cli, pytree
from asyncrl.checkpoint import store as ck
from asyncrl.checkpoint.load import Checkpoint, latest_checkpoint, load_checkpoint
from asyncrl.config import dump_config, load_config

TINY: dict[str, Any] = {
    "run": {"name": "hardening", "seed": 1, "total_steps": 2, "output_dir": "run"},
    "model": {"path": "tiny"},
    "data": {"dataset": "copy"},
    "rollout": {"batch_size": 2, "group_size": 2, "max_staleness": 0, "max_concurrent": 4, "max_new_tokens": 4},
    "engine": {"slots": 8},
    "eval": {"every_steps": 0},
    "checkpoint": {"every_steps": 1, "keep": 5},
    "logging": {"dump_every_steps": 1, "dump_groups": 2},
}


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if line.startswith("asyncrl:")]
    assert len(lines) == 1 and "Traceback" not in "\n".join(err), err
    return lines[0]


def rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


# --------------------------------------------------------------------------- a real run to resume


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A finished two-step run in ``<dir>/run`` (relative output_dir: copy ``<dir>`` and chdir)."""
    home = tmp_path_factory.mktemp("trained")
    write_yaml(home / "config.yaml", TINY)
    cwd = os.getcwd()
    os.chdir(home)
    try:
        assert cli.main(["train", "config.yaml"]) == 0
    finally:
        os.chdir(cwd)
    return home


@pytest.fixture
def run_copy(trained_run, tmp_path, monkeypatch) -> Path:
    """A private copy of the trained run; the test's working directory is its home."""
    home = tmp_path / "home"
    shutil.copytree(trained_run, home)
    monkeypatch.chdir(home)
    return home / "run"


def test_resume_skips_damaged_log_lines_with_one_warning_per_file(run_copy, caplog):
    """Junk, non-UTF-8, step-less and torn lines in both logs; --resume goes on."""
    for name in ("metrics.jsonl", "trajectories.jsonl"):
        path = run_copy / name
        good = path.read_bytes().splitlines(keepends=True)
        damaged = [good[0], b"not json at all\n", b"\xff\xfe\xfa broken bytes\n", b'{"no_step": 1}\n', *good[1:],
                   b'{"step": 3, "loss/to']  # torn: a kill in the middle of writing step 3's row
        path.write_bytes(b"".join(damaged))
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        assert cli.main(["train", "config.yaml", "--resume", "--set", "run.total_steps=3"]) == 0
    for name in ("metrics.jsonl", "trajectories.jsonl"):
        warnings = [r.getMessage() for r in caplog.records if name in r.getMessage() and "unreadable" in r.getMessage()]
        assert len(warnings) == 1 and "skipped 4 unreadable line(s) (first: line 2" in warnings[0], warnings
    assert [r["step"] for r in rows(run_copy) if "loss/total" in r] == [1, 2, 3]
    assert sorted({r["step"] for r in rows(run_copy, "trajectories.jsonl")}) == [1, 2, 3]


def test_a_write_failure_in_a_checkpoint_stops_the_run_and_a_log_failure_does_not(run_copy, monkeypatch, capsys, caplog):
    """Through the CLI: ENOSPC while writing step 3's state.json stops the run with one
    line (path, errno), step 2 stays the newest complete checkpoint; a resume while every
    metrics.jsonl append fails with EIO warns and finishes, checkpoint complete."""
    real_write = ck._write_bytes

    def full_disk(path, data):
        if path.name == "state.json" and "step_00000003" in str(path.parent):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, data)

    monkeypatch.setattr(ck, "_write_bytes", full_disk)
    assert cli.main(["train", "config.yaml", "--resume", "--set", "run.total_steps=3"]) == 1
    line = one_line_error(capsys)
    assert "[Errno 28] No space left on device" in line and "state.json" in line and "checkpoints" in line, line
    assert latest_checkpoint(run_copy).name == "step_00000002"
    assert not [p for p in (run_copy / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.setattr(ck, "_write_bytes", real_write)

    import asyncrl.run.metrics as metrics

    real_os_write = os.write

    def broken_metrics(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_os_write(fd, data)

    monkeypatch.setattr(metrics.os, "write", broken_metrics)
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        assert cli.main(["train", "config.yaml", "--resume", "--set", "run.total_steps=3"]) == 0
    warned = [r.getMessage() for r in caplog.records if "cannot write to" in r.getMessage()]
    assert len(warned) == 1 and "metrics.jsonl: [Errno 5]" in warned[0], warned
    final = load_checkpoint(latest_checkpoint(run_copy))
    assert final.step == 3 and final.rollout_state["meta"]["ledger"]["terminal"]["trained"] == 3 * 2


@pytest.mark.parametrize("code", [errno.ENOSPC, pytest.param(errno.EIO, marks=pytest.mark.slow)])  # EIO: the same path
def test_a_failed_asynchronous_save_stops_the_run_at_the_next_step(run_copy, capsys, monkeypatch, code):
    """The resumed run saves at steps 4 and 6; step 4's arrays fail in the background. The run
    stops at the end of the step in which the write failed (step 5: before, it trained on to the
    next save, and on a real full disk hung there on tensorboardX's dead writer thread) with
    exit 1 and one line."""
    from asyncrl.run import loop
    from tests.checkpoint.test_save_failures import failing_array_writes

    publish = loop.Run.publish

    def publish_once_the_write_ended(run, trainer):  # makes "the write failed during step 5" certain
        publish(run, trainer)
        deadline = time.monotonic() + 30
        while run.version == 5 and run.pending_checkpoint is not None and not run.pending_checkpoint.done():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    monkeypatch.setattr(loop.Run, "publish", publish_once_the_write_ended)
    with failing_array_writes(code, 4):
        started = time.monotonic()
        assert cli.main(["train", "config.yaml", "--resume", "--set", "run.total_steps=8",
                         "--set", "checkpoint.every_steps=2"]) == 1
        elapsed = time.monotonic() - started
    line = one_line_error(capsys)
    out = run_copy
    # (run.output_dir is relative: the test's working directory is the run's home)
    assert line == (f"asyncrl: error: cannot write the checkpoint of step 4 in {Path('run', 'checkpoints')}: [Errno {code}] "
                    f"{os.strerror(code)} (the previous complete checkpoint, step_00000002, is intact; free the "
                    "space or fix the device, then resume)"), line
    trained = [r["step"] for r in rows(out) if "loss/total" in r]
    assert trained == [1, 2, 3, 4, 5], trained  # stopped at the step after the failed save, not at step 6's save
    assert latest_checkpoint(out).name == "step_00000002"
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert elapsed < 60, elapsed


# --------------------------------------------------------------------------- checkpoint write stages


STAGES = ["state.json", "config.yaml", "rollout", "arrays", "hashes", "MANIFEST.json",
          "fsync-dir", "renamed", "pruned"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("stage", STAGES)
def test_an_io_error_at_any_stage_of_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, stage, code):
    """The error at every durable stage of a save is one CheckpointError naming the
    directory and the errno; the previous checkpoint stays complete; a later save works."""

    def save(step: int) -> Path:
        return ck.save_checkpoint(tmp_path, step, arrays={"params": {"w": np.full(8, step, np.float32)},
                                                           "opt_state": {"m": np.zeros(2)}},
                                  state={"version": step}, config_yaml="{}\n",
                                  rollout_state={"meta": {"format": 1}, "arrays": {"a": np.arange(3)}}, keep=2)

    save(1)

    def fail(name: str) -> None:
        if name == stage:
            raise OSError(code, os.strerror(code), str(tmp_path / "checkpoints" / name))

    monkeypatch.setattr(ck, "_stage_hook", fail)
    with pytest.raises(ck.CheckpointError, match=rf"step 2 .*\[Errno {code}\] {os.strerror(code)}"):
        save(2)
    monkeypatch.setattr(ck, "_stage_hook", None)
    newest = latest_checkpoint(tmp_path)
    # Past the rename the new checkpoint is complete: the failure came after it was in place.
    assert newest.name == ("step_00000002" if stage in ("renamed", "pruned") else "step_00000001")
    assert load_checkpoint(newest).state == {"version": int(newest.name[5:])}
    assert not [p for p in newest.parent.iterdir() if p.name.startswith(".tmp-")]
    assert load_checkpoint(save(3)).step == 3


def test_a_full_small_filesystem_keeps_the_previous_checkpoint_and_logs_go_on(tmp_path, caplog):
    """A write failure on a real full file system (a 1 MiB tmpfs; skipped where mounting is not allowed)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        from asyncrl.run.metrics import JsonlSink, TensorBoardSink
        from tests.helpers import read_tensorboard_scalars

        arrays = {"params": {"w": np.ones(64 * 1024, np.float32)}}  # 256 KiB
        ck.save_checkpoint(mount, 1, arrays=arrays, state={"version": 1}, config_yaml="{}\n", keep=5)
        tensorboard = TensorBoardSink(mount / "tb")
        filler = mount / "filler"
        with open(filler, "wb") as handle:  # fill the rest
            try:
                while True:
                    handle.write(b"\0" * 65536)
                    handle.flush()
            except OSError:
                pass
        with pytest.raises(ck.CheckpointError, match=r"\[Errno 28\] No space left on device"):
            ck.save_checkpoint(mount, 2, arrays=arrays, state={"version": 2}, config_yaml="{}\n", keep=5)
        assert latest_checkpoint(mount).name == "step_00000001"
        sink = JsonlSink(mount / "metrics.jsonl")
        with caplog.at_level(logging.WARNING, logger="asyncrl"):
            for step in range(200):
                sink.write(step, {"x": 1.0})
                tensorboard.write(step, {"x": 1.0})  # never blocks (tensorboardX's writer thread died here)
        assert any("No space left on device" in r.getMessage() and "metrics.jsonl" in r.getMessage()
                   for r in caplog.records)
        assert any("cannot write TensorBoard events" in r.getMessage() for r in caplog.records)
        filler.unlink()  # space freed: all go on
        sink.write(200, {"x": 2.0})
        sink.close()
        tensorboard.write(200, {"x": 2.0})
        tensorboard.close()
        assert json.loads((mount / "metrics.jsonl").read_text().splitlines()[-1]) == {"step": 200, "x": 2.0}
        assert read_tensorboard_scalars(mount / "tb")["x"][-1] == (200, 2.0)
        assert load_checkpoint(ck.save_checkpoint(mount, 2, arrays=arrays, state={"version": 2},
                                                     config_yaml="{}\n", keep=5)).step == 2
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


# --------------------------------------------------------------------------- checkpoint contents


STAGED = {**{k: v for k, v in TINY.items() if k != "run"},
          "run": {"name": "staged", "seed": 1, "output_dir": "run"},
          "stages": [{"name": "sft", "type": "sft", "total_steps": 2}, {"name": "rl", "type": "rl", "total_steps": 3}]}


def valid_contents(cfg) -> dict[str, Any]:
    """What the loop would save at step 3 of STAGED (stage 1, its first step), with the real
    tiny model's parameters."""
    from asyncrl.model import load_model

    _, params = load_model(cfg.model).split()
    ledger = {"version": 3, "next_ticket": 2, "next_sample_id": 2, "consumed": 6, "batch_size": 2, "done_seq": 0,
              "entries": [], "reissue": [], "terminal": {"trained": 2}, "reissued_total": 0}
    return {
        "arrays": {"params": pytree.tree_to_host(params), "opt_state": {"x": np.zeros(1)}},
        "state": {"format": 1, "version": 3, "stage_index": 1, "stage_step": 1, "final_eval": {}, "engine_counters": {},
                  "trainer": {"step": 3, "skipped_updates_total": 0, "consecutive_nonfinite": 0, "update_count": 1}},
        "rollout_state": {"meta": {"format": 1, "ledger": ledger, "groups": {}}, "arrays": {}},
    }


def _stage_index_changed(c):
    c["state"]["stage_index"] = 0


def _unknown_state_field(c):
    c["state"]["bogus"] = 1


def _trainer_step(c):
    c["state"]["trainer"]["step"] = 2


def _ledger_key_missing(c):
    del c["rollout_state"]["meta"]["ledger"]["next_ticket"]


def _ledger_version(c):
    c["rollout_state"]["meta"]["ledger"]["version"] = 2


def _stray_rollout_array(c):
    c["rollout_state"]["arrays"]["g5_t0_input_ids"] = np.arange(3, dtype=np.int32)


def _misnamed_rollout_array(c):
    """Beside a valid queued group 2, an array whose name only looks like one of its arrays."""
    from tests.rollout_fakes import make_group

    meta, arrays = make_group(group_size=2).pack()
    ledger = c["rollout_state"]["meta"]["ledger"]
    ledger.update(next_ticket=3, next_sample_id=3, entries=[[2, 2, "queued", 3, 3, 1]])
    c["rollout_state"]["meta"]["groups"] = {"2": meta}
    c["rollout_state"]["arrays"] = {f"g2_{name}": array for name, array in arrays.items()}
    c["rollout_state"]["arrays"]["x2_t0_input_ids"] = arrays["t0_input_ids"]


def _queued_group_breaks_a_rule(c):
    from tests.rollout_fakes import make_group

    meta, arrays = make_group(group_size=2).pack()
    arrays["t1_loss_mask"] = arrays["t1_loss_mask"].copy()
    arrays["t1_loss_mask"][0] = True  # the first token has no log-prob: never trained
    ledger = c["rollout_state"]["meta"]["ledger"]
    ledger.update(next_ticket=3, next_sample_id=3, entries=[[2, 2, "queued", 3, 3, 1]])
    c["rollout_state"]["meta"]["groups"] = {"2": meta}
    c["rollout_state"]["arrays"] = {f"g2_{name}": array for name, array in arrays.items()}


def _param_shape(c):
    first = min(pytree.keyed_leaves(c["arrays"]["params"]))
    c["arrays"]["params"] = pytree.map_with_path(
        c["arrays"]["params"],
        lambda path, leaf: np.zeros(leaf.shape + (2,), leaf.dtype) if pytree.key_of(path) == first else leaf)


@pytest.mark.parametrize("edit, file, field", [
    (_stage_index_changed, "state.json", "field stage_step"),
    (_unknown_state_field, "state.json", "field bogus: Extra inputs are not permitted"),
    (_trainer_step, "state.json", "field trainer.step"),
    (_ledger_key_missing, "rollout.json", "field ledger.next_ticket: Field required"),
    (_ledger_version, "rollout.json", "field ledger.version"),
    (_stray_rollout_array, "rollout.npz", "field g5_t0_input_ids"),
    (_misnamed_rollout_array, "rollout.npz", "field x2_t0_input_ids: not part of any group"),
    (_queued_group_breaks_a_rule, "rollout.npz", "field groups.2: group 2, trajectory 1: field 'loss_mask' breaks "
                                                 "schema rule 'first_token_trained'"),
    (_param_shape, "arrays/params", "field "),
])
def test_a_checkpoint_whose_files_disagree_is_refused_in_one_line(tmp_path, monkeypatch, capsys, edit, file, field):
    """Files that pass the manifest's hashes but disagree with each other, the config's
    stages or the model are refused before anything is trained, naming directory, file and field."""
    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "config.yaml", STAGED)
    cfg = load_config(config)
    contents = valid_contents(cfg)
    edit(contents)
    path = ck.save_checkpoint(tmp_path / "run", 3, config_yaml=dump_config(cfg), **contents)
    assert cli.main(["train", "config.yaml", "--resume"]) == 1
    line = one_line_error(capsys)
    assert f"checkpoint {path.relative_to(tmp_path)}: {file}: {field}" in line, line
    assert not (tmp_path / "run" / "hf").exists()


def test_an_optimizer_state_that_does_not_fit_names_the_key_and_the_likely_cause(tmp_path, monkeypatch, capsys):
    """A checkpoint whose opt_state does not fit this trainer's (same config) is refused at
    resume naming the file and key, with the hint that the model or optimizer config changed."""
    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "config.yaml", STAGED)
    cfg = load_config(config)
    contents = valid_contents(cfg)
    first = min(pytree.keyed_leaves(contents["arrays"]["opt_state"]))
    contents["arrays"]["opt_state"] = pytree.map_with_path(
        contents["arrays"]["opt_state"],
        lambda path, leaf: np.zeros(np.shape(leaf) + (2,), np.asarray(leaf).dtype) if pytree.key_of(path) == first else leaf)
    path = ck.save_checkpoint(tmp_path / "run", 3, config_yaml=dump_config(cfg), **contents)
    assert cli.main(["train", "config.yaml", "--resume"]) == 1
    line = one_line_error(capsys)
    assert f"checkpoint {path.relative_to(tmp_path)}: arrays/opt_state: field " in line, line
    assert line.endswith("(model or optimizer config changed?)"), line


def test_the_unedited_hand_built_checkpoint_passes_the_checks():
    """The control of the test above: the same contents, unedited, are accepted."""
    from asyncrl.checkpoint.schema import check_checkpoint_params, check_run_checkpoint
    from asyncrl.model import load_model

    cfg = load_config(data=STAGED)
    contents = valid_contents(cfg)
    contents["arrays"] = {name: pytree.flatten(tree) for name, tree in contents["arrays"].items()}  # as loaded
    contents["rollout_states"] = (contents.pop("rollout_state"),)
    checkpoint = Checkpoint(path=Path("step_00000003"), step=3, config_yaml="", **contents)
    assert check_run_checkpoint(checkpoint, cfg).stage_step == 1
    check_checkpoint_params(checkpoint, load_model(cfg.model).split()[1])


def test_process_metrics_are_logged_every_step(trained_run):
    """Host RSS and live threads in every trained row (device memory where reported)."""
    trained = [r for r in rows(trained_run / "run") if "loss/total" in r]
    assert trained and all(0.05 < r["perf/host_rss_gb"] < 64 and r["perf/threads"] >= 2 for r in trained)
    import jax

    assert ("perf/device_mem_gb" in trained[0]) == bool(jax.devices()[0].memory_stats())


# --------------------------------------------------------------------------- bad input, refused at start-up


def start_in(tmp_path: Path, monkeypatch, raw: dict) -> Path:
    monkeypatch.chdir(tmp_path)
    return write_yaml(tmp_path / "config.yaml", raw)


def assert_nothing_trained(home: Path) -> None:
    run = home / "run"
    assert not (run / "checkpoints").exists()
    assert not (run / "metrics.jsonl").exists() or not [r for r in rows(run) if "loss/total" in r]


def test_a_config_file_that_is_not_utf8_names_the_file_and_line(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_bytes(b"run:\n  name: caf\xe9\n")
    assert cli.main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}:2: not UTF-8 text (byte 0xe9" in err and "Traceback" not in err, err


def test_a_binary_dataset_file_names_the_file_and_line(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"prompt": "a", "answer": "1"}\n\x89PNG\r\n\x1a\n\x00\x00')
    config = start_in(tmp_path, monkeypatch, {**TINY, "data": {"dataset": {"target": "jsonl", "kwargs": {
        "path": str(data), "eval_size": 0}}}})
    assert cli.main(["train", str(config)]) == 1
    assert f"{data}:2: not UTF-8 text" in one_line_error(capsys)


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    config = start_in(tmp_path, monkeypatch, TINY)
    (tmp_path / "run").write_text("not a directory")
    assert cli.main(["train", str(config)]) == 1
    line = one_line_error(capsys)
    assert "run.output_dir run is an existing file" in line, line


def test_a_later_stage_bad_dataset_is_found_before_the_first_step(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "missing.jsonl"
    raw = {**STAGED, "stages": [STAGED["stages"][0], {**STAGED["stages"][1], "data": {
        "dataset": {"target": "jsonl", "kwargs": {"path": str(missing)}}}}]}
    config = start_in(tmp_path, monkeypatch, raw)
    assert cli.main(["train", str(config)]) == 1
    line = one_line_error(capsys)
    assert line == f"asyncrl: error: stages.1 (rl): {missing}: no such data file", line
    assert_nothing_trained(tmp_path)


def test_a_stage_that_changes_the_dataset_target_takes_only_its_own_kwargs(tmp_path):
    raw = {**STAGED, "data": {"dataset": {"target": "copy", "kwargs": {"train_size": 64}}},
           "stages": [STAGED["stages"][0], {**STAGED["stages"][1], "data": {
               "dataset": {"target": "jsonl", "kwargs": {"path": "x.jsonl"}}}}]}
    cfg = load_config(data=raw)
    assert cfg.stage_config(1).data.dataset.model_dump() == {"target": "jsonl", "kwargs": {"path": "x.jsonl"}}
    # the same target keeps merging kwargs
    raw["stages"][1]["data"] = {"dataset": {"target": "copy", "kwargs": {"eval_size": 8}}}
    merged = load_config(data=raw).stage_config(1).data.dataset.kwargs
    assert merged == {"train_size": 64, "eval_size": 8}


def test_a_negative_dataset_size_names_the_field(tmp_path, monkeypatch, capsys):
    config = start_in(tmp_path, monkeypatch, {**TINY, "data": {"dataset": {"target": "copy", "kwargs": {
        "train_size": -5}}}})
    assert cli.main(["train", str(config)]) == 1
    line = one_line_error(capsys)
    assert line == "asyncrl: error: data.dataset (copy): train_size must be >= 1 (given -5)", line


def test_a_dataset_without_a_usable_prompt_fails_at_start_up_with_the_counts(tmp_path, monkeypatch, capsys):
    config = start_in(tmp_path, monkeypatch, {**TINY, "data": {"dataset": {"target": "copy", "kwargs": {
        "train_size": 300}}, "max_prompt_tokens": 3}, "rollout": {**TINY["rollout"], "batch_timeout_s": 20}})
    assert cli.main(["train", str(config)]) == 1
    line = one_line_error(capsys)
    assert "data.dataset (copy): no usable prompt: 0 of 300 train prompts checked (of 300) fit " \
           "data.max_prompt_tokens = 3" in line, line
    assert_nothing_trained(tmp_path)


def test_sigint_during_start_up_exits_130_with_one_line(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import REPO_ROOT, subprocess_env

    config = write_yaml(tmp_path / "config.yaml", {**TINY, "run": {**TINY["run"], "output_dir": str(tmp_path / "run")}})
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "train", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO_ROOT)
    time.sleep(0.5)  # inside the imports (jax, the model), before the run's signal handler exists
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.startswith("asyncrl:")]
    assert proc.returncode == 130 and "Traceback" not in err and len(lines) == 1, err


# --------------------------------------------------------------------------- the preemption drill


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_drill_on_tiny_loses_nothing_and_matches_the_uninterrupted_weights(tmp_path):
    """scripts/chaos.py with a small N: SIGKILL/SIGTERM at random, resumes to the end; its JSON
    line reports no lost or duplicated step or sample and bit-equal final weights."""
    import shlex
    import subprocess
    import sys

    from tests.helpers import REPO_ROOT, subprocess_env

    raw = {**TINY, "run": {**TINY["run"], "total_steps": 5}, "checkpoint": {"every_steps": 1, "keep": 3}}
    raw["run"].pop("output_dir")
    config = write_yaml(tmp_path / "config.yaml", raw)
    launch = f"{shlex.quote(sys.executable)} -m asyncrl.cli"
    proc = subprocess.run([sys.executable, "scripts/chaos.py", str(config), "--kills", "3", "--seed", "2",
                           "--max-delay", "0.3", "--launch", launch, "--out", str(tmp_path / "drill")],
                          capture_output=True, text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=580)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kills"] == 3 and result["resumes"] == 3 and result["errors"] == [], result
    assert result["steps"] == 5 and result["steps_missing"] == result["steps_duplicated"] == 0, result
    assert result["samples_lost"] == result["samples_trained_twice"] == 0 and result["samples_trained"] == 5 * 2
    assert result["weights_equal"] is True, result


def test_a_run_that_ends_short_of_its_steps_never_counts_as_finished():
    """The validation's last rule, as a unit: whatever skipped steps, ending short is an error."""
    from types import SimpleNamespace

    from asyncrl.errors import AsyncRLError
    from asyncrl.run.loop import _check_all_steps_ran

    cfg = load_config(data=STAGED)
    _check_all_steps_ran(SimpleNamespace(version=5, resumed=None), cfg)
    with pytest.raises(AsyncRLError, match="stopped at step 3 of 5 without an error"):
        _check_all_steps_ran(SimpleNamespace(version=3, resumed=None), cfg)
