"""scripts/runlib.py, what the run drivers share: a child process's step lines and exit, and
metrics.jsonl read back (a torn last line of a file still being written, a broken line named)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import runlib  # noqa: E402

PYTHON = (sys.executable, "-c")


def test_child_run_timestamps_each_step_once_and_keeps_the_tail(tmp_path):
    script = "print('loading'); print('step 1/2 loss 1'); print('[rl] step 2/2'); print('step 2/2 again')"
    run = runlib.ChildRun([script], runlib.child_env(), launch=PYTHON, log=tmp_path / "console.log", keep_lines=2)
    assert run.finish(timeout=60) == 0
    assert sorted(run.step_times) == [1, 2] and run.step_times[1] <= run.step_times[2]
    assert run.output == "[rl] step 2/2\nstep 2/2 again\n"  # the last two lines
    assert (tmp_path / "console.log").read_text().splitlines()[0] == "loading"  # the log has every line


def test_child_run_failure_and_timeout_raise_with_the_output():
    with pytest.raises(RuntimeError, match=r"exited 3:\nboom"):
        runlib.ChildRun(["print('boom'); raise SystemExit(3)"], runlib.child_env(), launch=PYTHON).expect_success(60)
    with pytest.raises(TimeoutError, match="ran over 0.5 s"):
        runlib.ChildRun(["import time; time.sleep(60)"], runlib.child_env(), launch=PYTHON,
                        new_session=True).expect_success(0.5)


def test_child_env_puts_the_checkout_first_and_the_cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_COMPILE_CACHE", "0")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
    env = runlib.child_env(compile_cache=tmp_path, XLA_FLAGS="--x")
    assert env["PYTHONPATH"].split(":")[0] == str(REPO_ROOT) and env["XLA_FLAGS"] == "--x"
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path) and "ASYNCRL_COMPILE_CACHE" not in env
    assert runlib.child_env(compile_cache=tmp_path, keep_cache=True)["JAX_COMPILATION_CACHE_DIR"] == "/elsewhere"


def test_read_metrics_reads_a_run_directory_and_names_a_broken_line(tmp_path):
    rows = [{"step": 1, "loss/total": 0.5}, {"step": 2, "loss/total": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n" + '{"step": 3, "lo')
    with pytest.raises(ValueError, match=r"metrics.jsonl:4: not valid JSON"):
        runlib.read_metrics(tmp_path)
    assert runlib.read_metrics(tmp_path, torn_tail_ok=True) == rows  # a file still being appended to
    with pytest.raises(FileNotFoundError, match="no such file"):
        runlib.read_metrics(tmp_path / "missing")
    assert runlib.train_argv("c.yaml", ["a=1", "b=2"], "--resume") == ["train", "c.yaml", "--set", "a=1", "--set", "b=2",
                                                                       "--resume"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_a_child_started_while_pinned_runs_on_those_cores_and_the_parent_gets_its_own_back():
    before = os.sched_getaffinity(0)
    first, second = runlib.split_cpus(sorted(before)) if len(before) > 1 else ([min(before)], [min(before)])
    with runlib.pinned(second):
        run = runlib.ChildRun(["import os; print(sorted(os.sched_getaffinity(0)))"], runlib.child_env(), launch=PYTHON)
    assert run.finish(timeout=60) == 0 and json.loads(run.output) == second
    assert os.sched_getaffinity(0) == before
    if len(before) > 1:
        assert first and not set(first) & set(second) and sorted(first + second) == sorted(before)
    with pytest.raises(RuntimeError, match="at least 2"):
        runlib.split_cpus([0])
