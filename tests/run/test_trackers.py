"""W&B and MLflow trackers: the real packages, offline.

W&B runs in offline mode (its run directory under ``run.output_dir/wandb/`` holds the
history and config, read back from the transaction log by :func:`tests.helpers.read_wandb_records`);
MLflow uses a local SQLite store in ``tmp_path`` (``mlflow.search_runs`` and the client read the
metrics back). The environment is set so that neither library opens a connection: W&B
offline without error reporting, MLflow with telemetry off. The rest of the tests drive
:class:`~asyncrl.run.trackers.TrackerSinks` with small fake trackers (failures, a full queue,
the flush at close).
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import load_config
from asyncrl.errors import ConfigError
from asyncrl.run import trackers as trackers_module
from asyncrl.run.trackers import TrackerSinks, check_trackers_installed, read_ledger
from tests.helpers import read_wandb_records

BASE: dict[str, Any] = {
    "run": {"name": "trackers-test", "seed": 3, "total_steps": 4},
    "model": {"path": "tiny"},
    "data": {"dataset": "copy"},
    "rollout": {"batch_size": 4, "group_size": 4, "max_staleness": 0, "max_concurrent": 8, "max_new_tokens": 8},
    "engine": {"slots": 16},
    "eval": {"every_steps": 0},
    "checkpoint": {"every_steps": 2, "keep": 10},
    "logging": {"dump_every_steps": 2, "dump_groups": 1, "trackers": ["tensorboard", "wandb", "mlflow"],
                "tracker_flush_timeout_s": 60},
}


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    """One local MLflow store for the module (creating its tables takes seconds); each test
    logs to an experiment of its own."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def offline(tmp_path, monkeypatch, mlflow_store):
    """Environment of a run whose trackers never reach a network; returns the MLflow
    experiment of this test (named after its ``tmp_path``) in the module's store."""
    uri = mlflow_store
    for name, value in {
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "WANDB_DIR": str(tmp_path / "wandb-dir"),
        "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    from mlflow.tracking import MlflowClient

    # Artifacts in tmp_path (a database store would put them in ./mlruns, inside the checkout).
    MlflowClient(uri).create_experiment(tmp_path.name, artifact_location=(tmp_path / "mlartifacts").as_uri())
    return tmp_path.name


def train_run(out: Path, experiment: str, **logging_overrides: Any) -> Any:
    from asyncrl.run.loop import train

    raw = json.loads(json.dumps(BASE))
    raw["run"]["output_dir"] = str(out)
    raw["logging"]["mlflow"] = {"experiment": experiment}
    raw["logging"].update(logging_overrides)
    return raw, train(load_config(data=raw), console=io.StringIO())


def jsonl_rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row.pop("step"): row for row in rows}


def wandb_history(out: Path) -> tuple[list[str], list[tuple[int, dict]], dict, list[list[str]]]:
    """The offline W&B runs under ``out/wandb`` in the order they ran: their ids, every
    history row ``(step, {key: value})``, the last config seen and the tags of each run."""
    ids, history, config, tags = [], [], {}, []
    for run_dir in sorted((out / "wandb").glob("offline-run-*")):
        run_tags: list[str] = []
        run_id = ""
        for record in read_wandb_records(next(run_dir.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":  # the run's record again after each change (tags, config)
                run_id, run_tags = record.run.run_id, list(record.run.tags)
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                history.append((record.history.step.num, items))
        ids.append(run_id)
        tags.append(run_tags)
    return ids, history, config, tags


def mlflow_run(experiment: str) -> tuple[Any, Any]:
    """The one run of ``experiment`` in the store of ``$MLFLOW_TRACKING_URI``, and a client."""
    import os

    import mlflow
    from mlflow.tracking import MlflowClient

    uri = os.environ["MLFLOW_TRACKING_URI"]
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=[experiment])
    assert len(runs) == 1, runs
    return runs.iloc[0], MlflowClient(uri)


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_wandb_and_mlflow_get_the_run_and_resume_continues_it_without_a_repeated_step(offline, tmp_path):
    out = tmp_path / "run"
    raw, _ = train_run(out, offline)
    rows = jsonl_rows(out)
    assert sorted(rows) == [1, 2, 3, 4]

    # W&B: each step's row as in metrics.jsonl, the resolved config and provenance, the stage tag,
    # a trajectory table at the dump steps (2 and 4) holding the dumped completions.
    ids, history, config, tags = wandb_history(out)
    assert len(ids) == 1 and tags == [["stage:rl"]]
    assert [step for step, _ in history] == [1, 2, 3, 4]
    for step, items in history:
        for name, value in rows[step].items():
            assert items[name] == pytest.approx(value), (step, name)
    assert config["run"]["seed"] == 3 and config["logging"]["trackers"] == raw["logging"]["trackers"]
    assert config["provenance"]["packages"]["jax"]
    dumps = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    for step, items in history:
        assert ("trajectories/_type" in items) == (step in (2, 4))
        if step in (2, 4):
            table = json.loads((next((out / "wandb").glob("offline-run-*")) / "files" / items["trajectories/path"]).read_text())
            completion = table["columns"].index("completion")
            assert [row[completion] for row in table["data"]] == [d["completion"] for d in dumps if d["step"] == step]

    # MLflow: one finished run with the stage tag, the config as dotted params and the same rows.
    run, client = mlflow_run(offline)
    assert run["status"] == "FINISHED" and run["tags.stage"] == "rl"
    assert run["params.run.seed"] == "3" and run["params.provenance.git_sha"] is not None
    for name in set().union(*rows.values()):
        got = {m.step: m.value for m in client.get_metric_history(run["run_id"], name)}
        want = {step: row[name] for step, row in rows.items() if row.get(name) is not None}
        assert got == pytest.approx(want), name
    assert [f.path for f in client.list_artifacts(run["run_id"], "trajectories")] == [
        "trajectories/step_00000002.json", "trajectories/step_00000004.json"]

    # The checkpoint names the runs started by then (W&B's id is chosen up front; MLflow's store
    # may still be creating its tables in so short a run); trackers.json names both and says each
    # received step 4.
    state = json.loads((out / "checkpoints" / "step_00000004" / "state.json").read_text())
    assert state["trackers"]["wandb"] == ids[0] and state["trackers"].get("mlflow", run["run_id"]) == run["run_id"]
    assert {name: entry["run_id"] for name, entry in read_ledger(out / "trackers.json").items()} == {
        "wandb": ids[0], "mlflow": run["run_id"]}
    assert {name: entry["last_step"] for name, entry in read_ledger(out / "trackers.json").items()} == {
        "wandb": 4, "mlflow": 4}

    # Killed after step 4 was logged but before its checkpoint: resume from step 2 and train to 6.
    # Steps 3 and 4 are trained again; the trackers already have them and get 5 and 6 only.
    shutil.rmtree(out / "checkpoints" / "step_00000004")
    raw["run"]["total_steps"] = 6
    raw["checkpoint"]["resume"] = "auto"
    from asyncrl.run.loop import train

    train(load_config(data=raw), console=io.StringIO())
    resumed_rows = jsonl_rows(out)
    assert sorted(resumed_rows) == [1, 2, 3, 4, 5, 6]
    ids, history, _, tags = wandb_history(out)
    assert ids == [ids[0], ids[0]] and tags == [["stage:rl"], ["stage:rl"]]  # the same W&B run, continued
    assert [step for step, _ in history] == [1, 2, 3, 4, 5, 6]
    for step, items in history[4:]:
        assert items["reward/mean"] == pytest.approx(resumed_rows[step]["reward/mean"])
    run, client = mlflow_run(offline)  # still one run
    assert run["status"] == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run["run_id"], "reward/mean")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [f.path for f in client.list_artifacts(run["run_id"], "trajectories")][-1] == "trajectories/step_00000006.json"


@pytest.mark.slow  # compiles the SFT step too (about 40 s)
def test_each_stage_is_tagged(offline, tmp_path):
    """An SFT then RL run: W&B's run carries both stages' tags, MLflow's ``stage`` tag names the
    stage being trained (the last one at the end), and the global step goes on across stages."""
    out = tmp_path / "run"
    raw = json.loads(json.dumps(BASE))
    del raw["run"]["total_steps"]
    raw["run"]["output_dir"] = str(out)
    raw["stages"] = [{"name": "sft", "type": "sft", "total_steps": 1}, {"name": "rl", "type": "rl", "total_steps": 1}]
    raw["logging"]["mlflow"] = {"experiment": offline}
    from asyncrl.run.loop import train

    train(load_config(data=raw), console=io.StringIO())
    _, history, _, tags = wandb_history(out)
    assert tags == [["stage:sft", "stage:rl"]] and [step for step, _ in history] == [1, 2]
    run, _ = mlflow_run(offline)
    assert run["tags.stage"] == "rl" and run["status"] == "FINISHED"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # 17 s cold; the sinks' own failure tests stay
def test_an_unreachable_tracker_warns_once_and_training_goes_on(offline, tmp_path, monkeypatch, caplog):
    # Nothing listens on the port: MLflow's first request fails (no retries), the run ends normally.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    out = tmp_path / "run"
    caplog.set_level(logging.WARNING, logger="asyncrl.run.trackers")
    _, result = train_run(out, offline, trackers=["mlflow"], mlflow={"tracking_uri": f"http://127.0.0.1:{closed_port()}"})
    assert result.steps == 4 and sorted(jsonl_rows(out)) == [1, 2, 3, 4]
    warnings = [r.getMessage() for r in caplog.records if r.name == "asyncrl.run.trackers"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("tracker mlflow failed in start (") and "training goes on" in warnings[0]
    assert "trackers" not in json.loads((out / "checkpoints" / "step_00000004" / "state.json").read_text())
    assert not (out / "tensorboard").exists()  # logging.trackers without tensorboard


def test_mlflow_takes_any_metric_name_and_long_config_values(offline, tmp_path):
    """One key MLflow refuses fails a whole batch: names are made acceptable, long values cut."""
    from asyncrl.config.sections import MlflowConfig
    from asyncrl.run.trackers import MLFLOW_PARAM_MAX, MlflowTracker

    config = {"run": {"name": "x"}, "workflow": {"kwargs": {"system prompt?": "y" * 7000}}}
    tracker = MlflowTracker(MlflowConfig(experiment=offline), "odd", tmp_path, config)
    sinks = TrackerSinks([tracker], tmp_path / "trackers.json", flush_timeout_s=60)  # a new store takes seconds
    sinks.write(1, {"episode/tool calls (ok)?": 2.0, "reward/mean": float("nan")})
    sinks.close()
    run, client = mlflow_run(offline)
    assert run["status"] == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run["run_id"], "episode/tool calls _ok__")] == [(1, 2.0)]
    assert len(run["params.workflow.kwargs.system prompt_"]) == MLFLOW_PARAM_MAX


CHILD = """
import sys, threading
from asyncrl.cli import main
code = main(["train", sys.argv[1]])
print("TRACKER_THREAD_ALIVE", any(t.name == "asyncrl-trackers" and t.is_alive() for t in threading.enumerate()), flush=True)
sys.exit(code)
"""


@pytest.mark.slow
def test_sigterm_flushes_the_trackers_and_marks_the_mlflow_run_killed(offline, tmp_path):
    """SIGTERM mid-run: the loop checkpoints and exits 143, and on the way out the trackers send
    every row metrics.jsonl has (the flush at close); the MLflow run ends KILLED."""
    import signal
    import subprocess
    import sys

    import yaml

    from tests.helpers import REPO_ROOT, subprocess_env

    out = tmp_path / "run"
    raw = json.loads(json.dumps(BASE))
    raw["run"].update(output_dir=str(out), total_steps=500)
    raw["logging"]["mlflow"] = {"experiment": offline}
    raw["checkpoint"]["every_steps"] = 0
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = subprocess_env()  # the offline fixture's WANDB_*/MLFLOW_* settings included (os.environ)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 90
        while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    assert "TRACKER_THREAD_ALIVE False" in stdout
    rows = jsonl_rows(out)
    _, history, _, _ = wandb_history(out)
    assert [step for step, _ in history] == sorted(rows)
    run, client = mlflow_run(offline)
    assert run["status"] == "KILLED"
    assert [m.step for m in client.get_metric_history(run["run_id"], "reward/mean")] == sorted(rows)


@pytest.mark.slow  # a 2-process run of 2 steps: about a minute
@pytest.mark.timeout(400)
def test_only_process_0_logs_to_the_trackers(offline, tmp_path):
    """Two JAX processes on loopback: one W&B run and one MLflow run, written by process 0."""
    from tests.cluster.test_multiprocess import _config, _logs, _start, _wait

    config = _config(tmp_path, "two", logging={"level": "INFO", "dump_every_steps": 0, "trackers": ["wandb", "mlflow"],
                                                "mlflow": {"experiment": offline}, "tracker_flush_timeout_s": 60})
    assert _wait(_start(config, 2, 2), config) == [0, 0], _logs(config, 2)
    ids, history, _, _ = wandb_history(tmp_path / "two")
    assert len(ids) == 1 and [step for step, _ in history] == [1, 2]
    run, client = mlflow_run(offline)
    assert [m.step for m in client.get_metric_history(run["run_id"], "reward/mean")] == [1, 2]


# ---------------------------------------------------------------------------- TrackerSinks


class FakeTracker:
    def __init__(self, name: str, fail_in: str = "", delay_s: float = 0.0):
        self.name, self.fail_in, self.delay_s = name, fail_in, delay_s
        self.run_id = f"{name}-id"
        self.calls: list[tuple] = []

    def _record(self, method: str, *args: Any) -> None:
        time.sleep(self.delay_s)
        if method == self.fail_in:
            raise ConnectionError(f"{self.name} cannot reach its server\nsecond line")
        self.calls.append((method, *args))

    def start(self) -> None:
        self._record("start")

    def log_metrics(self, step, metrics) -> None:
        self._record("log_metrics", step, dict(metrics))

    def log_trajectories(self, step, records) -> None:
        self._record("log_trajectories", step, len(records))

    def set_stage(self, stage) -> None:
        self._record("set_stage", stage)

    def finish(self, status) -> None:
        self._record("finish", status)


def test_a_failing_tracker_warns_once_and_the_others_get_every_row(tmp_path, caplog):
    good, broken, late = FakeTracker("good"), FakeTracker("broken", fail_in="start"), FakeTracker("late", "log_trajectories")
    sinks = TrackerSinks([good, broken, late], tmp_path / "trackers.json")
    sinks.set_stage("rl")
    for step in (1, 2, 3):
        sinks.write(step, {"reward/mean": float(step)})
        sinks.log_trajectories(step, [{"completion": "x"}])
    sinks.close("killed")
    assert good.calls == [("start",), ("set_stage", "rl"),
                          *[c for s in (1, 2, 3) for c in (("log_metrics", s, {"reward/mean": float(s)}),
                                                            ("log_trajectories", s, 1))], ("finish", "killed")]
    assert late.calls == [("start",), ("set_stage", "rl"), ("log_metrics", 1, {"reward/mean": 1.0})]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "tracker broken failed in start (ConnectionError: broken cannot reach its server); it logs nothing more in "
        "this run, training goes on (metrics.jsonl and TensorBoard are unaffected)",
        "tracker late failed in log_trajectories (ConnectionError: late cannot reach its server); it logs nothing "
        "more in this run, training goes on (metrics.jsonl and TensorBoard are unaffected)"]
    assert sinks.run_ids() == {"good": "good-id"}
    assert read_ledger(tmp_path / "trackers.json") == {"good": {"run_id": "good-id", "last_step": 3},
                                                       "broken": {"run_id": "broken-id", "last_step": -1},
                                                       "late": {"run_id": "late-id", "last_step": 1}}


def test_a_slow_tracker_never_blocks_a_step_and_close_waits_a_bounded_time(tmp_path, caplog):
    slow = FakeTracker("slow", delay_s=0.5)
    sinks = TrackerSinks([slow], tmp_path / "trackers.json", queue_size=2, flush_timeout_s=0.5)
    started = time.monotonic()
    for step in range(1, 21):
        sinks.write(step, {"x": 1.0})
    assert time.monotonic() - started < 0.25  # 20 rows behind a tracker taking 0.5 s per call: none waited
    started = time.monotonic()
    sinks.close()
    assert time.monotonic() - started < 1.5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0].startswith("the tracker queue is full (logging.tracker_queue_size=2)")
    assert warnings[1].startswith("the trackers did not send their last")
    assert len(warnings) == 3 and warnings[2].endswith("row(s) were dropped because the tracker queue was full")
    assert all(t.daemon for t in threading.enumerate() if t.name == "asyncrl-trackers")


def test_a_resumed_tracker_skips_the_steps_it_already_has(tmp_path):
    tracker = FakeTracker("t")
    sinks = TrackerSinks([tracker], tmp_path / "trackers.json", skip_through={"t": 4})
    for step in (3, 4, 5):
        sinks.write(step, {"x": float(step)})
    sinks.close()
    assert [c[1] for c in tracker.calls if c[0] == "log_metrics"] == [5]
    assert read_ledger(tmp_path / "trackers.json")["t"]["last_step"] == 5


def test_a_configured_tracker_that_is_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setattr(trackers_module.importlib.util, "find_spec", lambda name: None)
    check_trackers_installed(["tensorboard"])
    with pytest.raises(ConfigError, match=r"^logging.trackers: wandb is configured but the wandb package is not "
                                          r"installed: pip install 'asyncrl\[wandb\]' \(or remove wandb"):
        check_trackers_installed(["tensorboard", "wandb"])


def test_a_tracker_listed_twice_is_a_config_error():
    with pytest.raises(ConfigError, match="logging.trackers: .*wandb listed more than once"):
        load_config(data={"logging": {"trackers": ["wandb", "mlflow", "wandb"]}})
