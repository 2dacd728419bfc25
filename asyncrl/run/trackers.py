"""Experiment trackers beside ``metrics.jsonl``: Weights & Biases and MLflow.

``logging.trackers: [tensorboard, wandb, mlflow]`` adds W&B and MLflow to the run's sinks.
Each gets the same rows as ``metrics.jsonl`` (one per committed step), the resolved config
and ``provenance.json`` as the run's config/params, the stage being trained as a tag, and
the trajectories of every ``logging.dump_every_steps`` dump as a table. Only process 0 has
trackers (it alone writes the run's logs).

Nothing here may slow or stop training:

* :class:`TrackerSinks` hands rows to one daemon thread through a bounded queue
  (``logging.tracker_queue_size``); :meth:`~TrackerSinks.write` never waits (a full queue
  drops the row and warns once). The thread starts each tracker (``wandb.init`` may take
  seconds, or fail without a network) and sends the rows in order.
* A tracker that raises (no network, a bad API key, a closed server) is warned about once
  with the cause and sends nothing more; the other sinks and the run go on.
* :meth:`~TrackerSinks.close` (the end of the run, also after SIGINT/SIGTERM: the loop
  checkpoints, then closes its sinks) sends what is queued, waiting at most
  ``logging.tracker_flush_timeout_s``.

Resume: a checkpoint's ``state.json`` keeps each tracker's run id (``trackers``), and
``--resume`` continues that run. The interrupted run may have logged steps after its last
checkpoint; the resumed run trains them again, but a tracker's curve must not hold a step
twice (W&B refuses a step lower than its last, MLflow would plot both values). So the thread
records the last step each tracker received in ``trackers.json`` (``{name: {run_id,
last_step}}``, rewritten atomically after each row), and the resumed run sends only later
steps: the curves continue without a gap or a repeated step, with the interrupted run's
values for the steps trained twice (``metrics.jsonl`` holds the resumed run's).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import queue
import re
import secrets
import string
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence

from asyncrl.errors import ConfigError

_log = logging.getLogger(__name__)

EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}
"""Tracker name -> the module it needs (and the ``asyncrl[...]`` extra that installs it)."""

LEDGER = "trackers.json"
"""Under ``run.output_dir``: each tracker's run id and the last step it received."""


def check_trackers_installed(trackers: Sequence[str]) -> None:
    """A tracker configured but not installed is a one-line error naming the extra (checked
    before anything slow starts)."""
    for name in trackers:
        module = EXTRAS.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"logging.trackers: {name} is configured but the {module} package is not installed: "
                              f"pip install 'asyncrl[{name}]' (or remove {name} from logging.trackers)")


class Tracker(Protocol):
    """One experiment tracker, driven by :class:`TrackerSinks`' thread only."""

    name: str
    run_id: Optional[str]
    """Known once :meth:`start` returned (W&B: chosen before)."""

    def start(self) -> None: ...

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_trajectories(self, step: int, records: list[dict]) -> None: ...

    def set_stage(self, stage: str) -> None: ...

    def finish(self, status: str) -> None:
        """``status``: ``finished``, ``killed`` (a signal) or ``failed`` (an error)."""


# ---------------------------------------------------------------------------- W&B


def _new_wandb_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbTracker:
    """A W&B run (``wandb.init(id=..., resume="allow")``): rows via ``run.log(step=...)``,
    trajectories as a ``wandb.Table`` under ``trajectories``."""

    name = "wandb"

    def __init__(self, settings: Any, run_name: str, out: Path, config: dict, run_id: Optional[str] = None):
        self.settings, self.run_name, self.out, self.config = settings, run_name, out, config
        self.run_id: Optional[str] = run_id or _new_wandb_id()
        self._run: Any = None

    def start(self) -> None:
        import wandb

        self._run = wandb.init(
            project=self.settings.project, entity=self.settings.entity, group=self.settings.group,
            name=self.run_name, id=self.run_id, resume="allow", config=self.config, tags=list(self.settings.tags),
            dir=str(self.out), mode=self.settings.mode,
            # The console is asyncrl's (progress bar, summary line): W&B does not capture it.
            settings=wandb.Settings(console="off"),
        )

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def log_trajectories(self, step: int, records: list[dict]) -> None:
        import wandb

        columns, rows = _table(records)
        self._run.log({"trajectories": wandb.Table(columns=list[Any](columns), data=rows)}, step=step)

    def set_stage(self, stage: str) -> None:
        tag = f"stage:{stage}"
        if tag not in self._run.tags:
            self._run.tags = (*self._run.tags, tag)

    def finish(self, status: str) -> None:
        self._run.finish(exit_code=0 if status == "finished" else 1)


# ---------------------------------------------------------------------------- MLflow

MLFLOW_PARAM_MAX = 6000
"""MLflow's limit on a param value's length (longer values are cut, ending in ``...``)."""
MLFLOW_BATCH = 1000
"""Metrics per ``log_batch`` call (MLflow's limit)."""
_MLFLOW_BAD_KEY = re.compile(r"[^\w\-. /:]")


def mlflow_key(name: str) -> str:
    """``name`` as MLflow accepts a metric or param key (word characters, ``-. /:``, at most
    250): a workflow's ``episode/<name>`` may hold others, and one bad key fails a whole batch."""
    return _MLFLOW_BAD_KEY.sub("_", name)[:250]


class MlflowTracker:
    """An MLflow run through ``MlflowClient`` (no global active run): rows via ``log_batch``,
    the config and provenance as dotted params (a resumed run adds only new ones: MLflow params
    never change) plus the whole of them as the ``config.json`` artifact (rewritten by a resume),
    trajectories as ``trajectories/step_<k>.json`` tables (``mlflow.log_table``'s format), the
    stage as the tag ``stage``."""

    name = "mlflow"
    STATUS = {"finished": "FINISHED", "killed": "KILLED", "failed": "FAILED"}

    def __init__(self, settings: Any, run_name: str, out: Path, config: dict, run_id: Optional[str] = None):
        self.settings, self.run_name, self.out, self.config = settings, run_name, out, config
        self.run_id: Optional[str] = run_id
        self._client: Any = None

    def start(self) -> None:
        import os

        from mlflow.tracking import MlflowClient

        uri = self.settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        local = uri is None
        self._client = client = MlflowClient(tracking_uri=uri or f"sqlite:///{self.out.resolve() / 'mlflow.db'}")
        if self.run_id is not None:  # --resume: the same run, running again
            logged = set(client.get_run(self.run_id).data.params)  # raises if the store does not have it
            client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = client.get_experiment_by_name(self.settings.experiment)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:  # a local store keeps its artifacts in the run directory, not in the working directory
                location = (self.out.resolve() / "mlartifacts").as_uri() if local else None
                experiment_id = client.create_experiment(self.settings.experiment, artifact_location=location)
            self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
            logged = set()
        self._log_params({k: v for k, v in _flatten(self.config).items() if mlflow_key(k) not in logged})
        client.log_dict(self.run_id, self.config, "config.json")

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(mlflow_key(k), v if len(v) <= MLFLOW_PARAM_MAX else v[: MLFLOW_PARAM_MAX - 3] + "...")
                 for k, v in params.items()]
        for first in range(0, len(items), 100):  # MLflow's limit of params per batch
            self._client.log_batch(self.run_id, params=items[first:first + 100])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        items = [Metric(mlflow_key(k), float(v), stamp, step) for k, v in metrics.items()]
        for first in range(0, len(items), MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=items[first:first + MLFLOW_BATCH])

    def log_trajectories(self, step: int, records: list[dict]) -> None:
        columns, rows = _table(records)
        self._client.log_table(self.run_id, {c: [row[i] for row in rows] for i, c in enumerate(columns)},
                               f"trajectories/step_{step:08d}.json")

    def set_stage(self, stage: str) -> None:
        self._client.set_tag(self.run_id, "stage", stage)

    def finish(self, status: str) -> None:
        self._client.set_terminated(self.run_id, self.STATUS[status])


def _flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}`` (lists and scalars as JSON)."""
    if isinstance(tree, dict) and tree:
        out: dict[str, str] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree if isinstance(tree, str) else json.dumps(tree)}


def _table(records: list[dict]) -> tuple[list[str], list[list[Any]]]:
    """Trajectory dump records as a table: scalars as they are, anything else as JSON text."""
    columns = list(records[0]) if records else ["step"]
    rows = [[value if isinstance(value, (str, int, float, bool)) or value is None else json.dumps(value, default=str)
             for value in (record.get(c) for c in columns)] for record in records]
    return columns, rows


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


# ---------------------------------------------------------------------------- the thread

_STOP = object()


class TrackerSinks:
    """The trackers of a run behind one bounded queue and one daemon thread (a metrics
    :class:`~asyncrl.run.metrics.Sink` for :class:`~asyncrl.run.metrics.StatsTracker`).

    Args:
        trackers: started by the thread, in order, before the first row.
        ledger: ``trackers.json``: rewritten after each row with each tracker's run id and
            last step; also the steps a resumed run skips.
        skip_through: ``{name: step}``: rows of steps up to this one are not sent to that
            tracker (it received them from the interrupted run).
    """

    def __init__(self, trackers: list[Any], ledger: Path, *, skip_through: Optional[Mapping[str, int]] = None,
                 queue_size: int = 1000, flush_timeout_s: float = 10.0):
        self.trackers = list(trackers)
        self.ledger = ledger
        self.flush_timeout_s = flush_timeout_s
        self._skip = {t.name: -1 for t in self.trackers}
        self._skip.update(skip_through or {})
        self._last = dict(self._skip)
        self._failed: dict[str, str] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="asyncrl-trackers", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the training thread's side

    def run_ids(self) -> dict[str, str]:
        """Each working tracker's run id known so far (saved in checkpoints)."""
        return {t.name: t.run_id for t in self.trackers if t.run_id is not None and t.name not in self._failed}

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._put(("metrics", step, dict(metrics)))

    def log_trajectories(self, step: int, records: list[dict]) -> None:
        if records:
            self._put(("trajectories", step, records))

    def set_stage(self, stage: str) -> None:
        self._put(("stage", -1, stage))

    def _put(self, item: tuple) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:  # the trackers are slower than training: never make a step wait
            if not self._dropped:
                _log.warning("the tracker queue is full (logging.tracker_queue_size=%d): W&B/MLflow are slower than "
                             "training, rows are dropped (metrics.jsonl has them all)", self._queue.maxsize)
            self._dropped += 1

    def close(self, status: str = "finished") -> None:
        """Send what is queued and finish each tracker's run, waiting at most ``flush_timeout_s``."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.flush_timeout_s
        try:
            self._queue.put((_STOP, status), timeout=self.flush_timeout_s)
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            _log.warning("the trackers did not send their last %d queued item(s) within "
                         "logging.tracker_flush_timeout_s=%.0f s; they are lost to W&B/MLflow (metrics.jsonl has "
                         "every row)", self._queue.qsize(), self.flush_timeout_s)
        if self._dropped:
            _log.warning("%d row(s) were dropped because the tracker queue was full", self._dropped)

    # ------------------------------------------------------------------ the thread

    def _work(self) -> None:
        try:
            self._send_all()
        except Exception:  # a bug here, not in a tracker: the trackers stop, training goes on
            _log.exception("the tracker thread failed; W&B/MLflow get nothing more in this run")

    def _send_all(self) -> None:
        for tracker in self.trackers:
            self._call(tracker, "start")
        self._save_ledger()
        while True:
            item = self._queue.get()
            if item[0] is _STOP:
                for tracker in self.trackers:
                    self._call(tracker, "finish", item[1])
                return
            kind, step, payload = item
            for tracker in self.trackers:
                if kind == "stage":
                    self._call(tracker, "set_stage", payload)
                elif step > self._skip[tracker.name]:
                    if self._call(tracker, "log_metrics" if kind == "metrics" else "log_trajectories", step, payload):
                        self._last[tracker.name] = max(self._last[tracker.name], step)
            if kind == "metrics":
                self._save_ledger()

    def _call(self, tracker: Any, method: str, *args: Any) -> bool:
        """``tracker.method(*args)``; a tracker that raises is warned about once and left out from then on."""
        if tracker.name in self._failed:
            return False
        try:
            getattr(tracker, method)(*args)
            return True
        except Exception as err:  # any failure of a tracker library: the run goes on without it
            cause = f"{type(err).__name__}: {err}".splitlines()[0]
            self._failed[tracker.name] = cause
            _log.warning("tracker %s failed in %s (%s); it logs nothing more in this run, training goes on "
                         "(metrics.jsonl and TensorBoard are unaffected)", tracker.name, method, cause)
            return False

    def _save_ledger(self) -> None:
        from asyncrl.run.provenance import atomic_write_text

        record = {t.name: {"run_id": t.run_id, "last_step": self._last[t.name]}
                  for t in self.trackers if t.run_id is not None}
        try:
            atomic_write_text(self.ledger, json.dumps(record, indent=1) + "\n")
        except OSError as err:
            _log.debug("cannot write %s: %s", self.ledger, err)


def read_ledger(path: Path) -> dict[str, dict]:
    """``trackers.json`` (empty if missing or unreadable: a resume then sends every row)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def open_trackers(logging_cfg: Any, run_name: str, out: Path, config: dict,
                  saved_ids: Optional[Mapping[str, str]] = None, resumed_step: Optional[int] = None) -> Optional[TrackerSinks]:
    """The run's W&B/MLflow trackers (None if ``logging.trackers`` names neither).

    ``saved_ids``/``resumed_step``: a resumed run's checkpoint ``trackers`` and step; each
    tracker continues its run (its id from the checkpoint, else from ``trackers.json``)
    and skips the steps ``trackers.json`` says it already received.
    """
    names = [n for n in logging_cfg.trackers if n in TRACKERS]
    if not names:
        return None
    ledger_path = out / LEDGER
    ledger = read_ledger(ledger_path) if resumed_step is not None else {}
    trackers: list[Any] = []
    skip: dict[str, int] = {}
    for name in names:
        found = ledger.get(name)
        entry: dict = found if isinstance(found, dict) else {}
        run_id = (saved_ids or {}).get(name) or (entry.get("run_id") if resumed_step is not None else None)
        settings = getattr(logging_cfg, name)
        trackers.append(TRACKERS[name](settings, run_name, out, config, run_id=run_id))
        last = entry.get("last_step") if entry.get("run_id") == run_id else None
        if resumed_step is not None and isinstance(last, int):
            skip[name] = max(last, resumed_step)
            if last > resumed_step:
                _log.info("%s run %s already has steps %d..%d from the interrupted run: the resumed run sends steps "
                          "after %d only (metrics.jsonl holds the resumed values)", name, run_id, resumed_step + 1,
                          last, last)
    return TrackerSinks(trackers, ledger_path, skip_through=skip, queue_size=logging_cfg.tracker_queue_size,
                        flush_timeout_s=logging_cfg.tracker_flush_timeout_s)
