"""The run directory: a fresh run gets one that holds no run, a resumed run cuts its logs
(``metrics.jsonl``, ``trajectories.jsonl``) back to the checkpoint's step."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Optional

from asyncrl.config import Config
from asyncrl.errors import AsyncRLError

log = logging.getLogger(__name__)


class RunDirError(AsyncRLError):
    """The output directory already holds a run."""


RUN_LOGS = ("metrics.jsonl", "trajectories.jsonl")


def prepare_output_dir(cfg: Config, resume_step: Optional[int]) -> Path:
    """A fresh run needs a run directory that holds no run (or ``run.overwrite``); a resumed run
    keeps its logs up to the checkpoint's step and drops the rows written after it, which the
    resumed run writes again.

    A directory whose ``metrics.jsonl`` has no completed training step (step >= 1) and which
    has no checkpoint holds no run: a run that failed while starting up (a config mistake
    found when its components were built) is simply started again there."""
    out = cfg.run.resolved_output_dir
    if resume_step is not None:
        for name in RUN_LOGS:
            _truncate_log(out / name, resume_step)
        return out
    if _holds_a_run(out) and not cfg.run.overwrite and cfg.checkpoint.resume == "never":
        raise RunDirError(
            f"run.output_dir {out} already holds a run (metrics.jsonl with completed steps); choose another run.name "
            "or run.output_dir, resume it with --resume, or set run.overwrite: true to replace it"
        )
    out.mkdir(parents=True, exist_ok=True)
    for name in RUN_LOGS:
        (out / name).unlink(missing_ok=True)
    if not cfg.run.overwrite:
        # The event files of a run that never completed a step (its step-0 eval at most).
        shutil.rmtree(out / "tensorboard", ignore_errors=True)
    return out


def _holds_a_run(out: Path) -> bool:
    """True when ``out`` has a checkpoint or a ``metrics.jsonl`` row of a completed step (step >= 1)."""
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return True
    path = out / "metrics.jsonl"
    if not path.exists():
        return False
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            step = json.loads(line).get("step", 0)
        except (json.JSONDecodeError, AttributeError):
            continue  # a damaged line is no evidence of a completed step
        if isinstance(step, int) and step >= 1:
            return True
    return False


def check_output_dir_path(cfg: Config) -> None:
    """``run.output_dir`` (or a directory above it) must not be an existing file."""
    out = cfg.run.resolved_output_dir
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            what = f"run.output_dir {out}" if path == out else f"{path} (a parent of run.output_dir {out})"
            raise RunDirError(f"{what} is an existing file, not a directory: choose another run.output_dir "
                              f"(or run.name) or move the file")


def _truncate_log(path: Path, last_step: int) -> None:
    """Cut a run log (JSON lines with a ``step``) back to the rows of steps <= ``last_step``.

    Logs are not the source of truth (the checkpoint is): a line that cannot be read (junk, a
    line torn by a kill during a write, bytes that are not UTF-8, an object without an integer
    ``step``) is dropped with one warning naming the file, the first such line and the count."""
    if not path.exists():
        return
    from asyncrl.run.provenance import atomic_write_text

    kept, bad = [], []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        step = _log_line_step(raw)
        if step is None:
            bad.append(number)
        elif step <= last_step:
            kept.append(raw.decode("utf-8"))
    if bad:
        log.warning("%s: skipped %d unreadable line(s) (first: line %d; junk, torn by a kill, not UTF-8, or without "
                    "a step) while cutting the log back to step %d", path, len(bad), bad[0], last_step)
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def _log_line_step(raw: bytes) -> Optional[int]:
    """The ``step`` of one log line, or None if the line is unreadable."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
