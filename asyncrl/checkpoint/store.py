"""Checkpoints that lose nothing: atomic writes, verified reads, no pickle, exact resume.

A checkpoint of trainer step ``k`` is one directory ``<run.output_dir>/checkpoints/step_<k>``
(``k`` zero-padded to 8 digits, so lexical order is step order)::

    params.safetensors       one safetensors file per array tree (names chosen by the caller);
    opt_state.safetensors    keys are the pytree paths joined by "/" (asyncrl.pytree: "layers/0/mlp/kernel",
                             "1/0/mu/layers/0/mlp/kernel" for an optax chain's Adam moment)
    state.json               the caller's JSON state: version, trainer counters, stage index, ...
    rollout.json, .npz       the rollout executor's state: JSON plus named arrays (asyncrl.checkpoint.files)
    config.yaml              the resolved config of the run
    MANIFEST.json            written last: step, trees, and every file's size and sha256

How a write stays atomic: everything goes into a temporary sibling ``.tmp-step_<k>-...``;
every file is fsynced, then ``MANIFEST.json`` is written and fsynced, then the directory, then
it is renamed to ``step_<k>`` and the parent directory is fsynced. Only then are checkpoints
beyond ``keep`` deleted. A directory is *complete* when its manifest parses, names its own
step, and every file it lists exists with the recorded size (and, when checked, sha256).
:func:`latest_checkpoint` returns the newest complete one and logs every one it skips, with
the reason; temporary directories left by a crash are never candidates and are deleted by
the next save.

Nothing on the load path unpickles: arrays come from ``safetensors.deserialize`` (bfloat16 and
float8 through ``ml_dtypes``), the executor's arrays from ``np.load(allow_pickle=False)``,
everything else from JSON and YAML (``yaml.safe_load``).

Loading returns plain arrays and JSON: each tree as its flat ``{key: numpy array}``, which
:meth:`Checkpoint.tree` puts into a template (the live params, the optimizer state) key by
key, naming the file and the key of every mismatch. Restoring the rollout executor from
``rollout_state`` is the caller's job (``WorkflowExecutor.load_state_dict``).

This module imports no jax; a tree that holds jax arrays or non-builtin pytree nodes (optax
states, ``nnx.State``) makes :mod:`asyncrl.pytree` import it on demand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np

from pydantic import ValidationError

from asyncrl import pytree
import asyncrl.checkpoint.files as checkpoint_files
from asyncrl.checkpoint.schema import (  # noqa: F401 - the config checks a resume runs, importable from here
    RESUME_MUTABLE_FIELDS,
    Manifest,
    check_resume_compatible,
    saved_config,
)
from asyncrl.config import Config
from asyncrl.errors import CheckpointError

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2
"""Version of the directory layout. 2: every tree keyed by :mod:`asyncrl.pytree` paths (format 1
keyed the optimizer state by dotted jax paths, ``1.0..mu.layers.0...``). A checkpoint of another
format is refused on resume with the reason, never silently skipped."""
CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "MANIFEST.json"
STATE_FILE = "state.json"
CONFIG_FILE = "config.yaml"
ROLLOUT_PREFIX = checkpoint_files.ROLLOUT_PREFIX
ARRAYS_SUFFIX = ".safetensors"

_STEP_DIGITS = 8
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_TREE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HASH_CHUNK = 1 << 22

# Called with a stage name after each durable stage of a save ("params.safetensors", ...,
# "MANIFEST.json", "fsync-dir", "renamed", "trashed step_<k>", "pruned"). Only tests set it (to kill a writer at
# a chosen point); it is never set by library code.
_stage_hook: Optional[Callable[[str], None]] = None


# --------------------------------------------------------------------------- layout


def checkpoints_root(out_dir: str | Path) -> Path:
    """``<out_dir>/checkpoints``: where the step directories of a run live."""
    return Path(out_dir) / CHECKPOINTS_DIR


def step_dir_name(step: int) -> str:
    return f"step_{step:0{_STEP_DIGITS}d}"


def _step_of(path: Path) -> Optional[int]:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_<k>`` directory under ``root``, oldest first (by number, not by name)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = _step_of(child)
        if step is not None and child.is_dir():
            found.append((step, child))
    return sorted(found)


def checkpoint_due(cfg: Config, step: int, total_steps: Optional[int] = None) -> bool:
    """Whether the loop writes a checkpoint after ``step``: every ``checkpoint.every_steps``
    and after the last step (``total_steps``, default ``run.total_steps``)."""
    last = cfg.run.total_steps if total_steps is None else total_steps
    every = cfg.checkpoint.every_steps
    return step >= last or (every > 0 and step % every == 0)


# --------------------------------------------------------------------------- durable file operations


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_and_describe(path: Path) -> dict[str, Any]:
    """fsync a written file and return its manifest entry (size and sha256, read back once)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
        os.fsync(handle.fileno())
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _stage(name: str) -> None:
    if _stage_hook is not None:
        _stage_hook(name)


def _remove_dir(path: Path) -> None:
    """Delete a directory so that a crash half-way never leaves a ``step_<k>`` with some files:
    rename it to a ``.trash-`` name first (which no reader looks at), then delete."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    _fsync_dir(path.parent)
    _stage(f"trashed {path.name}")
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale_writes(out_dir: str | Path) -> list[Path]:
    """Delete the temporary directories that interrupted saves and deletions left behind.

    One run writes one checkpoints directory at a time; do not call this while another
    process saves into the same ``out_dir``.
    """
    root = checkpoints_root(out_dir)
    removed = []
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                log.info("removing %s left by an interrupted checkpoint write", child)
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    return removed


# --------------------------------------------------------------------------- saving


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    *,
    arrays: Mapping[str, Any],
    state: Mapping[str, Any],
    config_yaml: str,
    rollout_state: Optional[Mapping[str, Any]] = None,
    keep: Optional[int] = None,
) -> Path:
    """Write the checkpoint of trainer ``step`` atomically; returns ``<out_dir>/checkpoints/step_<k>``.

    Args:
        out_dir: the run's output directory (``cfg.run.resolved_output_dir``).
        step: completed trainer steps (= the version of the saved weights).
        arrays: ``{tree name: pytree of arrays}``, e.g. ``{"params": ..., "opt_state": ...}``;
            each becomes ``<name>.safetensors``. Names are ``[A-Za-z0-9][A-Za-z0-9_.-]*``.
        state: JSON-serialisable (no NaN): version, trainer counters, stage index, ...
        config_yaml: the resolved config (``dump_config(cfg)``).
        rollout_state: ``{"meta": JSON, "arrays": {name: 1-d numpy array}}``, the executor's
            ``state_dict()`` (written by :func:`save_rollout_state`).
        keep: keep the newest this many complete checkpoints (None: all); older ones are
            deleted only after the new one is in place.

    An existing ``step_<k>`` (from an earlier attempt at the same step) is replaced.
    Raises :class:`CheckpointError` before anything is written if a value cannot be stored.
    """
    # Everything that can be refused is checked before the first byte is written.
    step, flats, state_text = _checked_inputs(step, arrays, state, config_yaml, rollout_state, keep)
    root = checkpoints_root(out_dir)
    try:
        final = _write_checkpoint(root, step, flats, state_text, config_yaml, rollout_state)
        if keep is not None:
            _prune(root, keep)
            _stage("pruned")
    except OSError as err:
        # Disk full, an I/O error, a read-only file system: the write is abandoned (its temporary
        # directory removed) and every complete checkpoint stays as it was.
        raise CheckpointError(
            f"cannot write the checkpoint of step {step} in {root}: [Errno {err.errno}] {err.strerror}"
            f"{f': {err.filename}' if err.filename else ''} (the previous complete checkpoint is intact; free the "
            "space or fix the device, then resume)"
        ) from err
    log.info("checkpoint of step %d written to %s", step, final)
    return final


def _checked_inputs(step: Any, arrays: Mapping[str, Any], state: Mapping[str, Any], config_yaml: Any,
                    rollout_state: Optional[Mapping[str, Any]], keep: Optional[int]) -> tuple[int, dict, str]:
    """``(step, {tree name: flat arrays}, state JSON text)``, or the :class:`CheckpointError`
    that refuses the save."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"save_checkpoint: step must be a non-negative int (given {step!r})")
    if keep is not None and keep < 1:
        raise CheckpointError(f"save_checkpoint: keep must be >= 1 or None (given {keep})")
    flats: dict[str, dict[str, np.ndarray]] = {}
    for name, tree in arrays.items():
        if not isinstance(name, str) or not _TREE_NAME.match(name):
            raise CheckpointError(f"save_checkpoint: array tree name {name!r} is not a plain file name")
        try:
            flats[name] = pytree.flatten(tree, where=f"save_checkpoint: arrays[{name!r}]")
        except pytree.TreeError as err:
            raise CheckpointError(str(err)) from None
    try:
        state_text = json.dumps(dict(state), allow_nan=False, indent=1, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"save_checkpoint: state is not JSON-serialisable without NaN/inf: {err}") from err
    if rollout_state is not None:
        if set(rollout_state) != {"meta", "arrays"}:
            raise CheckpointError("save_checkpoint: rollout_state must be WorkflowExecutor.state_dict() ({meta, arrays})")
        try:
            json.dumps(rollout_state["meta"], allow_nan=False)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"save_checkpoint: rollout_state['meta'] is not JSON-serialisable: {err}") from err
        for key, array in rollout_state["arrays"].items():
            if np.asarray(array).dtype == object:
                raise CheckpointError(f"save_checkpoint: rollout_state['arrays'][{key!r}] is an object array")
    if not isinstance(config_yaml, str):
        raise CheckpointError("save_checkpoint: config_yaml must be the YAML text of the resolved config")
    return int(step), flats, state_text


def _write_checkpoint(root: Path, step: int, flats: dict, state_text: str, config_yaml: str,
                      rollout_state: Optional[Mapping[str, Any]]) -> Path:
    """Write ``step_<k>`` through a temporary directory (see the module docstring); returns it."""
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        _fsync_dir(root.parent)
    remove_stale_writes(root.parent)
    final = root / step_dir_name(step)
    tmp = root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files: dict[str, dict[str, Any]] = {}
        for name, flat in flats.items():
            path = tmp / f"{name}{ARRAYS_SUFFIX}"
            checkpoint_files.save_safetensors(flat, path, {"asyncrl_tree": name, "asyncrl_step": str(step)})
            files[path.name] = _fsync_and_describe(path)
            _stage(path.name)
        for filename, text in ((STATE_FILE, state_text + "\n"), (CONFIG_FILE, config_yaml)):
            _write_bytes(tmp / filename, text.encode("utf-8"))
            files[filename] = _fsync_and_describe(tmp / filename)
            _stage(filename)
        if rollout_state is not None:
            checkpoint_files.save_rollout_state(rollout_state, tmp)
            for filename in (f"{ROLLOUT_PREFIX}.json", f"{ROLLOUT_PREFIX}.npz"):
                files[filename] = _fsync_and_describe(tmp / filename)
            _stage(ROLLOUT_PREFIX)
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "trees": sorted(flats),
            "rollout": rollout_state is not None,
            "files": dict(sorted(files.items())),
        }
        _write_bytes(tmp / MANIFEST_FILE, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))
        _stage(MANIFEST_FILE)
        _fsync_dir(tmp)
        _stage("fsync-dir")
        replaced = None
        if final.exists():
            # The old directory steps aside only for the instant between two renames; it is
            # deleted once the new one is in place.
            log.warning("replacing the existing checkpoint %s", final)
            replaced = root / f"{_TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, replaced)
        os.rename(tmp, final)
        _fsync_dir(root)
        _stage("renamed")
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _prune(root: Path, keep: int) -> None:
    """Delete every step directory older than the oldest of the newest ``keep`` complete ones."""
    complete = [(step, path) for step, path in _step_dirs(root) if not checkpoint_problems(path, checksums=False)]
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep][0]
    for step, path in _step_dirs(root):
        if step < oldest_kept:
            log.info("deleting old checkpoint %s (checkpoint.keep=%d)", path, keep)
            _remove_dir(path)


# --------------------------------------------------------------------------- finding and loading


def _read_manifest(path: Path) -> tuple[Optional[dict], Optional[str]]:
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return None, f"no {MANIFEST_FILE} (the write did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{MANIFEST_FILE} is unreadable ({err})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, f"{MANIFEST_FILE} is not a manifest"
    for filename, entry in manifest["files"].items():
        if not _TREE_NAME.match(filename) or not isinstance(entry, dict):
            return None, f"{MANIFEST_FILE} has a malformed entry {filename!r}"
    if manifest.get("format") != CHECKPOINT_FORMAT:
        return None, f"format {manifest.get('format')!r}, this asyncrl reads {CHECKPOINT_FORMAT}"
    step = _step_of(path)
    if step is not None and manifest.get("step") != step:
        return None, f"{MANIFEST_FILE} is of step {manifest.get('step')!r}, the directory of step {step}"
    required = {STATE_FILE, CONFIG_FILE, *(f"{t}{ARRAYS_SUFFIX}" for t in manifest.get("trees", []))}
    if manifest.get("rollout"):
        required |= {f"{ROLLOUT_PREFIX}.json", f"{ROLLOUT_PREFIX}.npz"}
    missing = sorted(required - set(manifest["files"]))
    if missing:
        return None, f"{MANIFEST_FILE} does not list {', '.join(missing)}"
    try:
        Manifest.model_validate_json(json.dumps(manifest))  # every field of the right type, no unknown ones
    except ValidationError as err:
        first = err.errors()[0]
        return None, f"{MANIFEST_FILE}: field {'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return manifest, None


def _file_problem(path: Path, entry: Mapping[str, Any], data: Optional[bytes] = None, checksums: bool = True) -> Optional[str]:
    if data is None:
        if not path.is_file():
            return f"{path.name} is missing"
        size = path.stat().st_size
    else:
        size = len(data)
    if size != entry.get("bytes"):
        return f"{path.name} has {size} bytes, the manifest says {entry.get('bytes')} (truncated or overwritten)"
    if checksums:
        digest = hashlib.sha256(data).hexdigest() if data is not None else _sha256_file(path)
        if digest != entry.get("sha256"):
            return f"{path.name} does not match its sha256 in the manifest (corrupt)"
    return None


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_problems(path: str | Path, *, checksums: bool = True) -> list[str]:
    """Why ``path`` is not a complete checkpoint (empty list: it is complete).

    Checks the manifest, that every listed file exists with its recorded size, and, with
    ``checksums``, its sha256 (reads every byte).
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path} is not a directory"]
    manifest, problem = _read_manifest(path)
    if problem:
        return [problem]
    assert manifest is not None
    problems = []
    for filename, entry in manifest["files"].items():
        found = _file_problem(path / filename, entry, checksums=checksums)
        if found:
            problems.append(found)
    return problems


def _refuse_other_format(path: Path) -> None:
    """A finished checkpoint of another layout version is not skipped (a resume would start
    fresh over the run): it is a :class:`CheckpointError` saying what to do."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # unfinished or damaged: skipped with its reason like any incomplete checkpoint
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if isinstance(found, int) and found != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path}: MANIFEST.json: field format: {found}, this asyncrl reads format {CHECKPOINT_FORMAT} "
            f"(format 1 keyed the optimizer state by dotted paths); finish that run with the asyncrl that wrote it, "
            f"or start a new run in another run.output_dir"
        )


def latest_checkpoint(out_dir: str | Path, *, checksums: bool = True) -> Optional[Path]:
    """The newest complete checkpoint under ``<out_dir>/checkpoints``, or None.

    Every newer directory that is skipped is logged (warning) with the reason; unfinished
    temporary writes are never candidates. A finished checkpoint of another
    :data:`CHECKPOINT_FORMAT` is a :class:`CheckpointError`.
    """
    root = checkpoints_root(out_dir)
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.name.startswith(_TMP_PREFIX):
                log.info("ignoring %s: an unfinished checkpoint write", child)
    for step, path in reversed(_step_dirs(root)):
        _refuse_other_format(path)
        problems = checkpoint_problems(path, checksums=checksums)
        if not problems:
            return path
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: everything :func:`save_checkpoint` was given, as plain arrays and JSON."""

    path: Path
    step: int
    arrays: dict[str, dict[str, np.ndarray]]
    """``{tree name: {key: numpy array}}``, the keys as :func:`asyncrl.pytree.flatten` spells them."""
    state: dict[str, Any]
    """The JSON state as saved."""
    config_yaml: str
    """The resolved config of the run that wrote it."""
    rollout_state: Optional[dict[str, Any]]
    """The executor's ``{"meta", "arrays"}`` for ``WorkflowExecutor.load_state_dict`` (None if not saved)."""

    def config(self) -> Config:
        """The saved config, validated by this asyncrl's schema."""
        return saved_config(self.config_yaml, where=str(self.path / CONFIG_FILE))

    def tree(self, name: str, template: Any) -> Any:
        """Tree ``name`` in ``template``'s structure, each leaf placed like the template's
        (:func:`asyncrl.pytree.fill`: a ``jax.Array`` on its sharding). Every missing, extra
        or mis-shaped key is a :class:`CheckpointError` naming this directory, the file and the key."""
        if name not in self.arrays:
            raise CheckpointError(f"checkpoint {self.path}: holds no tree {name!r} (it holds {sorted(self.arrays)})")
        try:
            return pytree.fill(template, self.arrays[name], where=f"checkpoint {self.path}: {name}{ARRAYS_SUFFIX}")
        except pytree.TreeError as err:
            raise CheckpointError(str(err)) from None


def load_checkpoint(path: str | Path, *, verify: bool = True) -> Checkpoint:
    """Read a checkpoint directory, checking every file against the manifest (size and, with
    ``verify``, sha256) as it is read; never unpickles anything.

    Arrays come back flat (``{key: array}`` per tree); :meth:`Checkpoint.tree` puts one into
    its template. Raises :class:`CheckpointError` naming the file at fault.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    manifest, problem = _read_manifest(path)
    if problem:
        raise CheckpointError(f"{path}: not a complete checkpoint: {problem}")
    assert manifest is not None
    files = manifest["files"]

    def read(filename: str) -> bytes:
        file = path / filename
        try:
            data = file.read_bytes()
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read {filename} ({err})") from err
        found = _file_problem(file, files[filename], data=data, checksums=verify)
        if found:
            raise CheckpointError(f"{path}: {found}")
        return data

    arrays = {name: checkpoint_files.decode_safetensors(read(f"{name}{ARRAYS_SUFFIX}"), f"{path / name}{ARRAYS_SUFFIX}")
              for name in manifest["trees"]}
    try:
        state = json.loads(read(STATE_FILE).decode("utf-8"))
        config_yaml = read(CONFIG_FILE).decode("utf-8")
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: {STATE_FILE} or {CONFIG_FILE} is unreadable ({err})") from err
    rollout_state = None
    if manifest.get("rollout"):
        for filename in (f"{ROLLOUT_PREFIX}.json", f"{ROLLOUT_PREFIX}.npz"):
            read(filename)  # verified against the manifest before it is parsed
        try:
            rollout_state = checkpoint_files.load_rollout_state(path)
        except (ValueError, OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: the rollout state is unreadable ({err})") from err
    return Checkpoint(path=path, step=int(manifest["step"]), arrays=arrays, state=state,
                      config_yaml=config_yaml, rollout_state=rollout_state)


# --------------------------------------------------------------------------- resuming


def resume_checkpoint(cfg: Config) -> Optional[Checkpoint]:
    """What the loop calls at start: the checkpoint to resume from, or None to start fresh.

    None when ``checkpoint.resume`` is ``never`` or ``run.output_dir`` holds no complete
    checkpoint (incomplete ones are logged and skipped). Otherwise the newest complete one,
    after :func:`check_resume_compatible` against ``cfg`` (checked before any array is read).
    """
    if cfg.checkpoint.resume == "never":
        return None
    out = cfg.run.resolved_output_dir
    path = latest_checkpoint(out)
    if path is None:
        if (Path(out) / "metrics.jsonl").exists():
            # An earlier run that never finished a checkpoint: say so loudly, its logs are replaced.
            log.warning("checkpoint.resume=auto: no complete checkpoint in %s, starting fresh (the earlier run's "
                        "metrics and trajectory logs there are replaced)", checkpoints_root(out))
        else:
            log.info("checkpoint.resume=auto: no complete checkpoint in %s, starting fresh", checkpoints_root(out))
        return None
    config_text = (path / CONFIG_FILE).read_text(encoding="utf-8")
    check_resume_compatible(saved_config(config_text, where=str(path / CONFIG_FILE)), cfg, where=str(path))
    checkpoint = load_checkpoint(path)
    log.info("resuming from %s (step %d)", path, checkpoint.step)
    return checkpoint
