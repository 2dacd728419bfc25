"""Checkpoints that lose nothing: atomic writes, verified reads, no pickle, exact resume.

A checkpoint of trainer step ``k`` is one directory ``<run.output_dir>/checkpoints/step_<k>``
(``k`` zero-padded to 8 digits, so lexical order is step order)::

    params.safetensors       one safetensors file per array tree (names chosen by the caller);
    opt_state.safetensors    keys are the pytree paths joined by "/" ("layers/0/mlp/kernel")
    state.json               the caller's JSON state: version, trainer counters, stage index, ...
    rollout.json, .npz       the executor's state_dict(), via asyncrl.rollout.save_state
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

This module imports no jax; a tree that holds jax arrays or non-builtin pytree nodes (optax
states, ``nnx.State``) makes it import ``jax.tree_util`` on demand.
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

from asyncrl.checkpoint_schema import Manifest
from asyncrl.config import Config, load_config
from asyncrl.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
"""Version of the directory layout; a checkpoint of another format is not complete to this code."""
CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "MANIFEST.json"
STATE_FILE = "state.json"
CONFIG_FILE = "config.yaml"
ROLLOUT_PREFIX = "rollout"
ARRAYS_SUFFIX = ".safetensors"
KEY_SEPARATOR = "/"

RESUME_MUTABLE_FIELDS = ("logging", "run.total_steps", "eval", "checkpoint")
"""Dotted config paths (a section or a field) that may differ between a checkpoint and its resume."""

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


# --------------------------------------------------------------------------- pytrees <-> flat dicts


def flatten_tree(tree: Any, *, where: str = "tree") -> dict[str, np.ndarray]:
    """``{path: contiguous numpy array}`` of a pytree's leaves; the path joins the keys by "/".

    Dicts (str or int keys), lists, tuples and namedtuples are walked here; any other pytree
    node (optax states, ``nnx.State``) through ``jax.tree_util``, with the same key spelling.
    ``None`` is an empty subtree. Leaves are numpy or jax arrays, numpy scalars, or Python
    ``bool``/``int``/``float``; anything else is a :class:`CheckpointError` naming its path.
    """
    flat: dict[str, np.ndarray] = {}
    for path, leaf in _leaves_with_path(tree, ()):
        key = _join_key(path, where)
        if key in flat:
            raise CheckpointError(f"{where}: two leaves have the key {key!r} (dict keys 1 and '1'?)")
        flat[key] = _to_numpy(leaf, f"{where}[{key!r}]")
    return flat


def unflatten_into(template: Any, flat: Mapping[str, np.ndarray], *, where: str = "tree") -> Any:
    """The tree of ``template``'s structure with its leaves taken from ``flat`` (by path).

    Every template leaf must have an entry of the same shape and dtype, and every entry must
    be used; all mismatches are reported together. A leaf comes back like the template's:
    a ``jax.Array`` (or ``jax.ShapeDtypeStruct``) is placed with the template's sharding, a
    numpy array stays numpy, a Python scalar comes back as that scalar type.
    """
    problems: list[str] = []
    used: set[str] = set()

    def fill(path: tuple, leaf: Any) -> Any:
        key = _join_key(path, where)
        used.add(key)
        if key not in flat:
            problems.append(f"missing {key!r}")
            return leaf
        value = flat[key]
        shape, dtype = _leaf_shape_dtype(leaf)
        if shape is not None and tuple(value.shape) != shape:
            problems.append(f"{key!r} has shape {tuple(value.shape)}, the template {shape}")
            return leaf
        if dtype is not None and value.dtype != dtype:
            problems.append(f"{key!r} has dtype {value.dtype}, the template {dtype}")
            return leaf
        return _like(leaf, value)

    result = _map_with_path(template, (), fill)
    unexpected = sorted(set(flat) - used)
    if unexpected:
        problems.append(f"not in the template: {', '.join(repr(k) for k in unexpected[:20])}"
                        + (f" and {len(unexpected) - 20} more" if len(unexpected) > 20 else ""))
    if problems:
        raise CheckpointError(f"{where} does not match its template: " + "; ".join(problems))
    return result


def unflatten_nested(flat: Mapping[str, np.ndarray]) -> Any:
    """Nested dicts (str keys) from ``{"a/b/c": array}``; a lone ``""`` key is the bare array.

    Without a template, lists, tuples and int keys come back as dicts with str keys
    ("0", "1", ...), and empty containers are gone; pass a template to get the exact tree.
    """
    if set(flat) == {""}:
        return flat[""]
    root: dict[str, Any] = {}
    for key in sorted(flat):
        parts = key.split(KEY_SEPARATOR)
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = flat[key]
    return root


_BUILTIN_SEQUENCES = (list, tuple)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_leaf_value(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, bool, int, float)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__array__")
    )


def _leaves_with_path(tree: Any, prefix: tuple) -> list[tuple[tuple, Any]]:
    if tree is None:
        return []
    if isinstance(tree, dict):
        out = []
        for key in sorted(tree, key=lambda k: (str(type(k)), k)):
            out.extend(_leaves_with_path(tree[key], prefix + (key,)))
        return out
    if _is_namedtuple(tree):
        out = []
        for name in type(tree)._fields:
            out.extend(_leaves_with_path(getattr(tree, name), prefix + (name,)))
        return out
    if isinstance(tree, _BUILTIN_SEQUENCES):
        out = []
        for i, item in enumerate(tree):
            out.extend(_leaves_with_path(item, prefix + (i,)))
        return out
    if _is_leaf_value(tree):
        return [(prefix, tree)]
    # A registered pytree node of some library (optax, flax): let jax walk it.
    import jax

    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    if len(leaves) == 1 and leaves[0][1] is tree:
        where = _join_key(prefix, "tree") if prefix else "the root"
        raise CheckpointError(f"cannot store a {type(tree).__name__} at {where!r}: leaves must be arrays or numbers")
    out = []
    for path, leaf in leaves:
        out.extend(_leaves_with_path(leaf, prefix + tuple(_jax_key_part(entry) for entry in path)))
    return out


def _map_with_path(tree: Any, prefix: tuple, fn: Callable[[tuple, Any], Any]) -> Any:
    if tree is None:
        return None
    if isinstance(tree, dict):
        items = [(key, _map_with_path(value, prefix + (key,), fn)) for key, value in tree.items()]
        return dict(items) if type(tree) is dict else type(tree)(items)
    if _is_namedtuple(tree):
        return type(tree)(*(_map_with_path(getattr(tree, n), prefix + (n,), fn) for n in type(tree)._fields))
    if isinstance(tree, _BUILTIN_SEQUENCES):
        return type(tree)(_map_with_path(item, prefix + (i,), fn) for i, item in enumerate(tree))
    if _is_leaf_value(tree) or _is_abstract_array(tree):
        return fn(prefix, tree)
    import jax

    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_abstract_array)
    if len(leaves) == 1 and leaves[0][1] is tree:
        raise CheckpointError(f"template: cannot restore into a {type(tree).__name__}")
    new = [_map_with_path(leaf, prefix + tuple(_jax_key_part(e) for e in path), fn) for path, leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, new)


def _is_abstract_array(x: Any) -> bool:
    return type(x).__name__ == "ShapeDtypeStruct" and hasattr(x, "shape") and hasattr(x, "dtype")


def _jax_key_part(entry: Any) -> Any:
    for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


def _join_key(path: tuple, where: str) -> str:
    parts = []
    for part in path:
        text = str(part)
        if not isinstance(part, (str, int, np.integer)) or KEY_SEPARATOR in text or text == "":
            raise CheckpointError(
                f"{where}: key {part!r} at {KEY_SEPARATOR.join(parts) or 'the root'!r} cannot be stored "
                f"(keys are non-empty str or int without {KEY_SEPARATOR!r})"
            )
        parts.append(text)
    return KEY_SEPARATOR.join(parts)


def _to_numpy(leaf: Any, where: str) -> np.ndarray:
    if isinstance(leaf, (np.ndarray, np.generic, bool, int, float)):
        array = np.asarray(leaf)
    else:
        if getattr(leaf, "is_fully_addressable", True) is False:
            raise CheckpointError(f"{where}: a jax array sharded over several hosts cannot be checkpointed here")
        array = np.asarray(leaf)
    if array.dtype == object:
        raise CheckpointError(f"{where}: object arrays cannot be stored without pickle")
    # safetensors writes raw memory: a strided view would be stored as garbage. (Not
    # np.ascontiguousarray: it turns 0-d arrays into shape (1,).)
    return array if array.flags.c_contiguous else array.copy(order="C")


def _leaf_shape_dtype(leaf: Any) -> tuple[Optional[tuple], Optional[np.dtype]]:
    if isinstance(leaf, (bool, int, float)):
        return (), None  # Python scalars: any numeric dtype converts
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    return None, None


def _like(template_leaf: Any, value: np.ndarray) -> Any:
    if isinstance(template_leaf, bool):
        return bool(value.item())
    if isinstance(template_leaf, int):
        return int(value.item())
    if isinstance(template_leaf, float):
        return float(value.item())
    if isinstance(template_leaf, np.generic):
        return value[()]
    if isinstance(template_leaf, np.ndarray):
        return value
    import jax

    sharding = getattr(template_leaf, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else jax.numpy.asarray(value)


# --------------------------------------------------------------------------- safetensors without pickle


def _safetensors_dtypes() -> dict[str, Any]:
    import ml_dtypes

    return {
        "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
        "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
        "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
        "BOOL": np.bool_, "C64": np.complex64,
    }


def _decode_safetensors(data: bytes, where: str) -> dict[str, np.ndarray]:
    """Arrays of a safetensors blob; ``safetensors.numpy.load`` lacks bfloat16, so map dtypes here."""
    import safetensors

    dtypes = _safetensors_dtypes()
    try:
        views = safetensors.deserialize(data)
    except Exception as err:  # the Rust parser raises its own error type
        raise CheckpointError(f"{where}: not a readable safetensors file ({err})") from err
    out = {}
    for name, view in views:
        if view["dtype"] not in dtypes:
            raise CheckpointError(f"{where}: tensor {name!r} has unsupported dtype {view['dtype']}")
        out[name] = np.frombuffer(view["data"], dtype=dtypes[view["dtype"]]).reshape(view["shape"])
    return out


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


def _save_safetensors(flat: dict[str, np.ndarray], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.numpy.save_file``, whose I/O failures (a Rust error type) come back as the
    ``OSError`` they are, errno included, so disk-full is reported like every other write."""
    import safetensors.numpy

    try:
        safetensors.numpy.save_file(flat, path, metadata=metadata)
    except Exception as err:
        found = re.search(r"os error (\d+)", str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from err


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
        rollout_state: the executor's ``state_dict()`` (written by ``asyncrl.rollout.save_state``).
        keep: keep the newest this many complete checkpoints (None: all); older ones are
            deleted only after the new one is in place.

    An existing ``step_<k>`` (from an earlier attempt at the same step) is replaced.
    Raises :class:`CheckpointError` before anything is written if a value cannot be stored.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"save_checkpoint: step must be a non-negative int (given {step!r})")
    step = int(step)
    if keep is not None and keep < 1:
        raise CheckpointError(f"save_checkpoint: keep must be >= 1 or None (given {keep})")
    # Everything that can be refused is checked before the first byte is written.
    flats: dict[str, dict[str, np.ndarray]] = {}
    for name, tree in arrays.items():
        if not isinstance(name, str) or not _TREE_NAME.match(name):
            raise CheckpointError(f"save_checkpoint: array tree name {name!r} is not a plain file name")
        flats[name] = flatten_tree(tree, where=f"arrays[{name!r}]")
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
            _save_safetensors(flat, path, {"asyncrl_tree": name, "asyncrl_step": str(step)})
            files[path.name] = _fsync_and_describe(path)
            _stage(path.name)
        for filename, text in ((STATE_FILE, state_text + "\n"), (CONFIG_FILE, config_yaml)):
            _write_bytes(tmp / filename, text.encode("utf-8"))
            files[filename] = _fsync_and_describe(tmp / filename)
            _stage(filename)
        if rollout_state is not None:
            from asyncrl.rollout.executor import save_state

            save_state(rollout_state, tmp, prefix=ROLLOUT_PREFIX)
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


def latest_checkpoint(out_dir: str | Path, *, checksums: bool = True) -> Optional[Path]:
    """The newest complete checkpoint under ``<out_dir>/checkpoints``, or None.

    Every newer directory that is skipped is logged (warning) with the reason; unfinished
    temporary writes are never candidates.
    """
    root = checkpoints_root(out_dir)
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.name.startswith(_TMP_PREFIX):
                log.info("ignoring %s: an unfinished checkpoint write", child)
    for step, path in reversed(_step_dirs(root)):
        problems = checkpoint_problems(path, checksums=checksums)
        if not problems:
            return path
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: everything :func:`save_checkpoint` was given."""

    path: Path
    step: int
    arrays: dict[str, Any]
    """``{tree name: tree}``: the template's structure where one was given, else nested dicts."""
    state: dict[str, Any]
    """The JSON state as saved."""
    config_yaml: str
    """The resolved config of the run that wrote it."""
    rollout_state: Optional[dict[str, Any]]
    """The executor's ``{"meta", "arrays"}`` for ``WorkflowExecutor.load_state_dict`` (None if not saved)."""

    def config(self) -> Config:
        """The saved config, validated by this asyncrl's schema."""
        return saved_config(self.config_yaml, where=str(self.path / CONFIG_FILE))


def load_checkpoint(
    path: str | Path, templates: Optional[Mapping[str, Any]] = None, *, verify: bool = True
) -> Checkpoint:
    """Read a checkpoint directory, checking every file against the manifest (size and, with
    ``verify``, sha256) as it is read; never unpickles anything.

    ``templates``: ``{tree name: pytree}`` to rebuild a tree in that exact structure (and
    placement, for jax arrays); trees without a template come back as nested dicts.
    Raises :class:`CheckpointError` naming the file at fault.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    manifest, problem = _read_manifest(path)
    if problem:
        raise CheckpointError(f"{path}: not a complete checkpoint: {problem}")
    assert manifest is not None
    files = manifest["files"]
    templates = dict(templates or {})
    unknown = sorted(set(templates) - set(manifest["trees"]))
    if unknown:
        raise CheckpointError(f"{path}: templates given for trees it does not hold: {unknown} (it holds {manifest['trees']})")

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

    arrays: dict[str, Any] = {}
    for name in manifest["trees"]:
        filename = f"{name}{ARRAYS_SUFFIX}"
        flat = _decode_safetensors(read(filename), f"{path / filename}")
        if name in templates:
            arrays[name] = unflatten_into(templates[name], flat, where=f"{path / filename}")
        else:
            arrays[name] = unflatten_nested(flat)
    try:
        state = json.loads(read(STATE_FILE).decode("utf-8"))
        config_yaml = read(CONFIG_FILE).decode("utf-8")
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: {STATE_FILE} or {CONFIG_FILE} is unreadable ({err})") from err
    rollout_state = None
    if manifest.get("rollout"):
        for filename in (f"{ROLLOUT_PREFIX}.json", f"{ROLLOUT_PREFIX}.npz"):
            read(filename)  # verified against the manifest before the executor's reader parses it
        from asyncrl.rollout.executor import load_state

        try:
            rollout_state = load_state(path, prefix=ROLLOUT_PREFIX)
        except (ValueError, OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: the rollout state is unreadable ({err})") from err
    return Checkpoint(path=path, step=int(manifest["step"]), arrays=arrays, state=state,
                      config_yaml=config_yaml, rollout_state=rollout_state)


# --------------------------------------------------------------------------- resuming


def saved_config(config_yaml: str, *, where: str = "checkpoint config.yaml") -> Config:
    """Validate a checkpoint's ``config.yaml`` with this asyncrl's schema."""
    import yaml

    try:
        raw = yaml.safe_load(config_yaml)
    except yaml.YAMLError as err:
        raise CheckpointError(f"{where}: not valid YAML ({err})") from err
    try:
        return load_config(data=raw if raw is not None else {})
    except ConfigError as err:
        raise ConfigError([f"{where}: the checkpoint's config is no longer valid:", *err.problems]) from err


def _mutable_on_resume(dotted: str) -> bool:
    return any(dotted == p or dotted.startswith(p + ".") for p in RESUME_MUTABLE_FIELDS)


def _config_differences(a: Any, b: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in list(a) + [k for k in b if k not in a]:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            out.extend(_config_differences(a.get(key, _ABSENT), b.get(key, _ABSENT), dotted))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out.extend(_config_differences(x, y, f"{prefix}.{i}"))
        return out
    return [] if a == b else [(prefix, a, b)]


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, _Absent) else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_resume_compatible(saved: Config, new: Config, *, where: str = "the checkpoint") -> None:
    """Refuse a resume whose config changes anything but ``logging.*``, ``run.total_steps``,
    ``eval.*`` and ``checkpoint.*``: a :class:`ConfigError` lists every differing dotted
    field with the checkpoint's value and the new one."""
    diffs = _config_differences(saved.model_dump(mode="json"), new.model_dump(mode="json"), "")
    refused = [(dotted, a, b) for dotted, a, b in diffs if not _mutable_on_resume(dotted)]
    if refused:
        allowed = ", ".join(f"{p}.*" if "." not in p else p for p in RESUME_MUTABLE_FIELDS)
        raise ConfigError(
            [f"cannot resume from {where}: the config differs in fields that must not change on resume "
             f"(only {allowed} may):"]
            + [f"{dotted}: checkpoint has {_show(a)}, this config has {_show(b)}" for dotted, a, b in refused]
        )


def resume_checkpoint(cfg: Config, templates: Optional[Mapping[str, Any]] = None) -> Optional[Checkpoint]:
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
    checkpoint = load_checkpoint(path, templates)
    log.info("resuming from %s (step %d)", path, checkpoint.step)
    return checkpoint
