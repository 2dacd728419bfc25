"""Where a run's checkpoints live and what makes one complete: the directory names, the manifest
and the check of every file it lists (:func:`checkpoint_problems`). Shared by the writer
(:mod:`asyncrl.checkpoint.store`) and the reader (:mod:`asyncrl.checkpoint.load`); the layout
itself is described in :mod:`asyncrl.checkpoint.store`. Imports no jax."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import ValidationError

import asyncrl.checkpoint.files as checkpoint_files
from asyncrl.checkpoint.schema import Manifest
from asyncrl.config import Config
from asyncrl.errors import CheckpointError

CHECKPOINT_FORMAT = 3
"""Version of the directory layout. 3: array trees on Orbax, written shard by shard by every
process. A checkpoint of another format is refused on resume with the reason and what to do,
never silently skipped (format 2 can be converted: :mod:`asyncrl.checkpoint.convert`)."""
_FORMATS = {
    1: "format 1 keyed the optimizer state by dotted paths",
    2: "format 2 held each tree as one safetensors file written by process 0",
}
CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "MANIFEST.json"
STATE_FILE = "state.json"
CONFIG_FILE = "config.yaml"
ROLLOUT_PREFIX = checkpoint_files.ROLLOUT_PREFIX
ARRAYS_DIR = "arrays"
_HASHES_DIR = "hashes"

_STEP_DIGITS = 8
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_TREE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ORBAX_NAME = re.compile(r"^_[A-Za-z0-9][A-Za-z0-9_.-]*$")  # Orbax's _METADATA, _sharding, ...
_HASH_CHUNK = 1 << 22

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

def _process() -> tuple[int, int]:
    """``(process index, process count)`` of this JAX run (jax is imported by Orbax anyway)."""
    import jax

    return jax.process_index(), jax.process_count()


# --------------------------------------------------------------------------- completeness


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
        if not all(_TREE_NAME.match(part) or _ORBAX_NAME.match(part) for part in filename.split("/")) \
                or not isinstance(entry, dict):
            return None, f"{MANIFEST_FILE} has a malformed entry {filename!r}"
    if manifest.get("format") != CHECKPOINT_FORMAT:
        return None, f"format {manifest.get('format')!r}, this asyncrl reads {CHECKPOINT_FORMAT}"
    step = _step_of(path)
    if step is not None and manifest.get("step") != step:
        return None, f"{MANIFEST_FILE} is of step {manifest.get('step')!r}, the directory of step {step}"
    required = {STATE_FILE, CONFIG_FILE, *(f"{ARRAYS_DIR}/{t}/_METADATA" for t in manifest.get("trees", []))}
    if manifest.get("rollout"):
        processes = manifest.get("processes", 1)
        for prefix, _ in checkpoint_files.rollout_files(processes if isinstance(processes, int) and processes > 0 else 1):
            required |= {f"{prefix}.json", f"{prefix}.npz"}
    missing = sorted(required - set(manifest["files"]))
    if missing:
        return None, f"{MANIFEST_FILE} does not list {', '.join(missing)}"
    try:
        Manifest.model_validate_json(json.dumps(manifest))  # every field of the right type, no unknown ones
    except ValidationError as err:
        first = err.errors()[0]
        return None, f"{MANIFEST_FILE}: field {'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return manifest, None


def _file_problem(path: Path, name: str, entry: Mapping[str, Any], data: Optional[bytes] = None,
                  checksums: bool = True) -> Optional[str]:
    if data is None:
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
    else:
        size = len(data)
    if size != entry.get("bytes"):
        return f"{name} has {size} bytes, the manifest says {entry.get('bytes')} (truncated or overwritten)"
    if checksums:
        digest = hashlib.sha256(data).hexdigest() if data is not None else _sha256_file(path)
        if digest != entry.get("sha256"):
            return f"{name} does not match its sha256 in the manifest (corrupt)"
    return None


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _my_share(files: list[str], share: Optional[tuple[int, int]]) -> set[str]:
    """The files whose sha256 this process checks: all of them, or with ``share=(i, n)`` every
    n-th by size (so the n processes of a run each read about 1/n of the checkpoint)."""
    if share is None or share[1] <= 1:
        return set(files)
    index, count = share
    return {name for position, name in enumerate(sorted(files)) if position % count == index}


def checkpoint_problems(path: str | Path, *, checksums: bool = True,
                        share: Optional[tuple[int, int]] = None) -> list[str]:
    """Why ``path`` is not a complete checkpoint (empty list: it is complete).

    Checks the manifest, that every listed file exists with its recorded size, and, with
    ``checksums``, its sha256 (reads every byte; with ``share=(i, n)``, process ``i`` of ``n``
    reads only its share of the files).
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path} is not a directory"]
    manifest, problem = _read_manifest(path)
    if problem:
        return [problem]
    assert manifest is not None
    mine = _my_share(list(manifest["files"]), share) if checksums else set()
    problems = []
    for filename, entry in manifest["files"].items():
        found = _file_problem(path / filename, filename, entry, checksums=filename in mine)
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
        how = (f"convert it with `python -m asyncrl.checkpoint.convert {path.parent.parent}`, or finish that run with "
               "the asyncrl that wrote it") if found == 2 else "finish that run with the asyncrl that wrote it"
        raise CheckpointError(
            f"checkpoint {path}: MANIFEST.json: field format: {found}, this asyncrl reads format {CHECKPOINT_FORMAT} "
            f"({_FORMATS.get(found, 'an unknown layout')}); {how}, or start a new run in another run.output_dir"
        )
