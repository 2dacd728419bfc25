"""Every way a run fails ends the process with its status and one error line, never SIGABRT.

Each failure kind is ``asyncrl train`` on the quickstart's task, shortened, failing in one place
(tests/failing_components.py): a workflow in training and in eval, an engine request, a reward,
a config mistake found after the engine started, Ctrl-C. The runs go side by side with a busy
process beside them, so the failure lands while other threads are inside the runtime (the train
step's background compile, rollout workers in the engine), where an exit that does not first
stop them aborts the process: ``terminate called after throwing an instance of ''`` / ``FATAL:
exception not rethrown``, status 134. The default selection runs two kinds once (a failing
workflow, Ctrl-C); the slow tests run every kind six times, and a failing tracker, whose run goes
on and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, subprocess_env

SHORT = ["--set", "stages=[{name: rl, type: rl, total_steps: 3}]", "--set", "checkpoint.every_steps=0",
         "--set", "data.dataset.kwargs.train_size=64", "--set", "data.dataset.kwargs.eval_size=4",
         "--set", "rollout.max_consecutive_failures=2", "--set", "eval.every_steps=0"]
"""The quickstart's RL stage, three steps, no eval unless a kind turns it on."""


@dataclass(frozen=True)
class Kind:
    overrides: tuple[str, ...]
    code: int
    line: str
    """What one of the last lines says (the error line)."""
    also: tuple[str, ...] = ()
    """What the output holds besides (a workflow's traceback)."""


def _kinds(tmp: Path) -> dict[str, Kind]:
    no_responses = tmp / "no_responses.jsonl"
    no_responses.write_text("".join(json.dumps({"prompt": f"C:{n}", "answer": str(n)}) + "\n" for n in range(100, 140)))
    return {
        "train_workflow": Kind(("workflow=tests.failing_components:RaisingWorkflow",), 1,
                               "asyncrl: error: 2 episodes failed in a row",
                               ("Traceback", "RuntimeError: this workflow fails on purpose")),
        "eval_workflow": Kind(("workflow=tests.failing_components:RaisingWorkflow", "eval.every_steps=2"), 1,
                              "asyncrl: error: eval: workflow 'RaisingWorkflow' failed on eval sample"),
        "engine_request": Kind(("workflow=tests.failing_components:LongPromptWorkflow",), 1,
                               "exceeds engine.kv_capacity"),
        "reward": Kind(("rewards=[{fn: 'tests.failing_components:raising_reward'}]",
                        "rollout.max_consecutive_reward_failures=2"), 1, "raising_reward"),
        # An SFT stage after the RL one (the engine has run) whose data has no reference responses.
        "config_after_engine": Kind(("stages=[{name: rl, type: rl, total_steps: 1}, {name: sft, type: sft, total_steps: 1}]",
                                     f"data.dataset={{target: jsonl, kwargs: {{path: '{no_responses}', eval_size: 4}}}}",
                                     "rewards=[{fn: positional_match}]"), 1,
                                    "asyncrl: error: SFT: sample has no 'response' field"),
        "sigint": Kind(("workflow=tests.failing_components:InterruptingWorkflow",), 130,
                       "asyncrl: training interrupted (exit 130)"),
    }


def _start(name: str, kind: Kind, tmp: Path, **env: str) -> subprocess.Popen:
    sets = [arg for override in kind.overrides for arg in ("--set", override)]
    log = (tmp / f"{name}.log").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl", "train", "configs/quickstart.yaml", *SHORT,
         "--set", f"run.output_dir={tmp / name}", *sets],
        cwd=REPO_ROOT, env=subprocess_env(**env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )


def _busy() -> subprocess.Popen:
    """A process that keeps one core busy until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _run_kinds(tmp: Path, names: list[str], repeats: int, parallel: int, **env: str) -> list[str]:
    """Run each named kind ``repeats`` times, ``parallel`` at once, beside a busy process;
    returns one problem per run that did not end as its kind should."""
    kinds = _kinds(tmp)
    queue = [(name, i) for i in range(repeats) for name in names]
    running: list[tuple[str, subprocess.Popen]] = []
    problems = []
    busy = _busy()
    try:
        while queue or running:
            while queue and len(running) < parallel:
                name, i = queue.pop(0)
                running.append((f"{name}-{i}", _start(f"{name}-{i}", kinds[name], tmp, **env)))
            time.sleep(0.2)
            for label, proc in [r for r in running if r[1].poll() is not None]:
                running.remove((label, proc))
                kind = kinds[label.rsplit("-", 1)[0]]
                output = (tmp / f"{label}.log").read_text()
                lines = [line for line in output.splitlines() if line.strip()]
                problem = None
                if proc.returncode != kind.code:
                    problem = f"exit {proc.returncode}, expected {kind.code}"
                elif "terminate called" in output or "FATAL" in output:
                    problem = "an abort message"
                elif not any(kind.line in line for line in lines[-12:]):
                    problem = f"no line with {kind.line!r} at the end"
                elif "training completed" in output or not all(text in output for text in kind.also):
                    problem = f"'training completed', or not all of {kind.also}"
                if problem:
                    problems.append(f"{label}: {problem}; output ends:\n" + "\n".join(lines[-15:]))
    finally:
        busy.kill()
        busy.wait()
        for _, proc in running:
            proc.kill()
            proc.wait()
    return problems


ALL_KINDS = ["train_workflow", "eval_workflow", "engine_request", "reward", "config_after_engine", "sigint"]


@pytest.mark.timeout(300)
def test_a_failing_workflow_and_ctrl_c_exit_with_their_status_and_one_line_never_an_abort(tmp_path):
    problems = _run_kinds(tmp_path, ["train_workflow", "sigint"], repeats=1, parallel=2)
    assert not problems, "\n\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_failure_kind_repeatedly_with_the_cpu_saturated(tmp_path):
    problems = _run_kinds(tmp_path, ALL_KINDS, repeats=6, parallel=4)
    assert not problems, "\n\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_failing_tracker_warns_and_the_run_exits_0(tmp_path):
    """MLflow pointed at a server that is not there: the tracker warns, the run finishes, exit 0."""
    from asyncrl.cluster.launch import free_port

    kind = Kind(("logging.trackers=[mlflow]", f"logging.mlflow.tracking_uri=http://127.0.0.1:{free_port()}"), 0,
                "training completed")
    for i in range(3):
        proc = _start(f"tracker-{i}", kind, tmp_path, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
                      MLFLOW_HTTP_REQUEST_TIMEOUT="2")
        assert proc.wait(timeout=300) == 0, (tmp_path / f"tracker-{i}.log").read_text()[-3000:]
        output = (tmp_path / f"tracker-{i}.log").read_text()
        assert "training completed" in output and "terminate called" not in output
        assert "mlflow" in output.lower()
