"""Checkpoints that lose nothing: atomic, sharded, asynchronous writes, verified reads, no
pickle, exact resume, resharding onto any mesh.

A checkpoint of trainer step ``k`` is one directory ``<run.output_dir>/checkpoints/step_<k>``
(``k`` zero-padded to 8 digits, so lexical order is step order)::

    arrays/<tree>/           one Orbax item per array tree (params, opt_state, ...), keyed by the
                             asyncrl.pytree paths ("layers/0/mlp/kernel", "1/0/mu/layers/0/mlp/kernel");
                             every process writes its own shards (asyncrl.checkpoint.arrays)
    hashes/process_<i>.json  size and sha256 of the array files process i wrote, hashed by process i
    state.json               the caller's JSON state: version, trainer counters, stage index, ...
    rollout.json, .npz       the rollout executor's state: JSON plus named arrays (asyncrl.checkpoint.files)
    config.yaml              the resolved config of the run
    MANIFEST.json            written last, by process 0: step, trees, writers, every file's size and sha256

How a write stays atomic: everything goes into a temporary sibling ``.tmp-step_<k>``. Every
process writes its shards there through Orbax (which returns once the arrays are off the
devices; the rest of the write may finish in a background thread, :class:`PendingSave`), then
fsyncs and hashes its own files; process 0 writes the small JSON files, waits for every
process's hashes, writes ``MANIFEST.json``, fsyncs everything, renames the directory to
``step_<k>`` and fsyncs the parent. Only then are checkpoints beyond ``keep`` deleted. A
directory is *complete* when its manifest parses, names its own step, and every file it lists
exists with the recorded size (and, when checked, sha256). :func:`latest_checkpoint` returns
the newest complete one and logs every one it skips, with the reason; temporary directories
left by a crash are never candidates and are deleted by the next save.

Nothing on the load path unpickles: arrays come from Orbax (tensorstore chunks, JSON
metadata), the executor's arrays from ``np.load(allow_pickle=False)``, everything else from
JSON and YAML (``yaml.safe_load``).

Loading reads the JSON; arrays are read on demand: :meth:`Checkpoint.tree` straight onto a
template's shardings (the live params, the optimizer state: any mesh, any process count),
naming the tree and the key of every mismatch, or :attr:`Checkpoint.arrays` as flat numpy
trees. Restoring the rollout executor from ``rollout_state`` is the caller's job
(``WorkflowExecutor.load_state_dict``).

Importing this module imports no jax; saving and reading arrays import jax and Orbax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np
from pydantic import ValidationError

import asyncrl.checkpoint.files as checkpoint_files
from asyncrl import pytree
from asyncrl.checkpoint.schema import (  # noqa: F401 - the config checks a resume runs, importable from here
    RESUME_MUTABLE_FIELDS,
    Manifest,
    check_resume_compatible,
    saved_config,
)
from asyncrl.config import Config
from asyncrl.errors import CheckpointError

log = logging.getLogger(__name__)

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
_FAILED_KEY = "asyncrl/checkpoint-failed"  # + /<step>/<process>: a process's failed part of a write

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


def _process() -> tuple[int, int]:
    """``(process index, process count)`` of this JAX run (jax is imported by Orbax anyway)."""
    import jax

    return jax.process_index(), jax.process_count()


def save_checkpoint(out_dir: str | Path, step: int, **kwargs: Any) -> Path:
    """Write the checkpoint of trainer ``step`` and wait until it is complete; returns
    ``<out_dir>/checkpoints/step_<k>``. Arguments as :func:`start_checkpoint`."""
    return start_checkpoint(out_dir, step, asynchronous=False, **kwargs).wait()


def start_checkpoint(
    out_dir: str | Path,
    step: int,
    *,
    arrays: Mapping[str, Any],
    state: Mapping[str, Any],
    config_yaml: str,
    rollout_state: Optional[Mapping[str, Any]] = None,
    keep: Optional[int] = None,
    asynchronous: bool = True,
    timeout_s: float = 600.0,
) -> "PendingSave":
    """Start writing the checkpoint of trainer ``step``; its :meth:`PendingSave.wait` returns
    ``<out_dir>/checkpoints/step_<k>`` once it is complete (the module docstring says how).

    Every process of a multi-process run calls this with the same global ``arrays``; each
    writes its own shards. ``state``, ``config_yaml`` and ``rollout_state`` are written by
    process 0 alone (the other processes' are ignored).

    Args:
        out_dir: the run's output directory (``cfg.run.resolved_output_dir``).
        step: completed trainer steps (= the version of the saved weights).
        arrays: ``{tree name: pytree of arrays}``, e.g. ``{"params": ..., "opt_state": ...}``;
            each becomes ``arrays/<name>/``. Names are ``[A-Za-z0-9][A-Za-z0-9_.-]*``.
            ``jax.Array`` leaves are written shard by shard, never gathered.
        state: JSON-serialisable (no NaN): version, trainer counters, stage index, ...
        config_yaml: the resolved config (``dump_config(cfg)``).
        rollout_state: ``{"meta": JSON, "arrays": {name: 1-d numpy array}}``, the executor's
            ``state_dict()`` (written by :func:`save_rollout_state`).
        keep: keep the newest this many complete checkpoints (None: all); older ones are
            deleted only after the new one is in place.
        asynchronous: return once the arrays are copied off the devices and finish the write
            in a background thread (``False``: finish it before returning).
        timeout_s: how long process 0 waits for the other processes' part of the write.

    An existing ``step_<k>`` (from an earlier attempt at the same step) is replaced.
    Raises :class:`CheckpointError` before anything is written if a value cannot be stored.
    """
    # Everything that can be refused is checked before the first byte is written.
    step, trees, state_text = _checked_inputs(step, arrays, state, config_yaml, rollout_state, keep)
    process, processes = _process()
    root = checkpoints_root(out_dir)
    pending = PendingSave(root, step, process, processes, keep, timeout_s)
    tmp = root / f"{_TMP_PREFIX}{step_dir_name(step)}"
    pending.tmp = tmp
    import asyncrl.checkpoint.arrays as checkpoint_arrays

    with pending.reporting_io_errors():
        if process == 0:
            if not root.is_dir():
                root.mkdir(parents=True, exist_ok=True)
                _fsync_dir(root.parent)
            remove_stale_writes(root.parent)
            tmp.mkdir()
            # The small files first: a failure here leaves no array write running into tmp.
            for filename, text in ((STATE_FILE, state_text + "\n"), (CONFIG_FILE, config_yaml)):
                _write_bytes(tmp / filename, text.encode("utf-8"))
                _stage(filename)
            if rollout_state is not None:
                checkpoint_files.save_rollout_state(rollout_state, tmp)
                _stage(ROLLOUT_PREFIX)
        # Orbax's own barrier keeps the other processes from writing before process 0 made tmp.
        checkpointer = checkpoint_arrays.start_save(tmp / checkpoint_arrays.ARRAYS_DIR, trees) if trees else None
    pending.manifest_head = {"format": CHECKPOINT_FORMAT, "step": step, "trees": sorted(trees),
                             "rollout": rollout_state is not None, "processes": processes}
    pending.start(checkpointer, asynchronous)
    return pending


class PendingSave:
    """A checkpoint being written: the Orbax write of the arrays, then (in a daemon thread when
    asynchronous) each process hashing its own files, and process 0 writing the manifest,
    renaming the directory into place and pruning. :meth:`wait` ends it and re-raises a
    failure in the caller's thread; :meth:`failed` tells without waiting.

    With several processes a process whose part of the write fails posts its error to the
    coordinator's key-value store, so that the others' :meth:`wait` ends at once with it
    instead of waiting ``timeout_s`` for files that will never come."""

    def __init__(self, root: Path, step: int, process: int, processes: int, keep: Optional[int],
                 timeout_s: float) -> None:
        self.root, self.step, self.process, self.processes = root, step, process, processes
        self.keep, self.timeout_s = keep, timeout_s
        self.final = root / step_dir_name(step)
        self.tmp = root
        self.manifest_head: dict[str, Any] = {}
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._waited = False
        self._abandoned = threading.Event()

    def start(self, checkpointer: Any, asynchronous: bool) -> None:
        if not asynchronous:
            self._finish(checkpointer)
            return
        self._thread = threading.Thread(target=self._finish, args=(checkpointer,), daemon=True,
                                        name=f"asyncrl-checkpoint-{self.step}")
        self._thread.start()

    def done(self) -> bool:
        """Whether the write has ended (completed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def failed(self) -> bool:
        """Whether this process's part of the write has already failed (never blocks; :meth:`wait`
        raises the error)."""
        return self.done() and self._error is not None

    def wait(self, timeout_s: Optional[float] = None) -> Path:
        """Block until the checkpoint is complete and return its directory; raises the write's
        :class:`CheckpointError` (disk full, ..., or another process's part of it failed) here,
        in the caller's thread."""
        if self._thread is not None:
            limit = self.timeout_s * 2 if timeout_s is None else timeout_s
            deadline = time.monotonic() + limit
            while self._thread.is_alive():
                self._thread.join(max(0.0, min(0.25, deadline - time.monotonic())))
                if self._thread.is_alive() and self.processes > 1:
                    peer = self.peer_failure()
                    if peer is not None:
                        self.abandon()
                        raise CheckpointError(peer)
                if self._thread.is_alive() and time.monotonic() >= deadline:
                    raise CheckpointError(f"the checkpoint of step {self.step} in {self.root} did not finish within "
                                          f"{limit:.0f} s (a stuck file system or process?); the previous complete "
                                          "checkpoint is intact")
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if not self._waited:
            self._waited = True
            if self.process == 0:
                log.info("checkpoint of step %d written to %s", self.step, self.final)
        return self.final

    def abandon(self) -> None:
        """Stop this process's part of the write without waiting for it (another process's part
        failed): a wait for the other processes' files ends at once; what Orbax still has in
        flight ends on its own. The temporary directory is removed by the next save or resume."""
        self._abandoned.set()

    def peer_failure(self) -> Optional[str]:
        """The one-line error another process posted for its part of this write, or None."""
        from asyncrl.cluster.distributed import coordination_client

        try:
            posted = coordination_client().key_value_dir_get(f"{_FAILED_KEY}/{self.step}/")
        except Exception:  # noqa: BLE001 - the coordinator is gone: the watchdog ends this process
            return None
        theirs = sorted((int(key.rsplit("/", 1)[-1]), text) for key, text in posted)
        theirs = [(process, text) for process, text in theirs if process != self.process]
        if not theirs:
            return None
        process, text = theirs[0]
        return (f"process {process} of {self.processes} failed to write its part of the checkpoint of step "
                f"{self.step}, so every process stops: {text}")

    def reporting_io_errors(self) -> Any:
        return _reporting_io_errors(self)

    def _finish(self, checkpointer: Any) -> None:
        try:
            try:
                with self.reporting_io_errors():
                    if checkpointer is not None:
                        try:
                            checkpointer.wait_until_finished()
                        finally:
                            checkpointer.close()
                        _stage("arrays")
                    self._write_own_hashes()
                    if self.process == 0:
                        self._commit()
            except CheckpointError:
                raise
            except Exception as err:  # noqa: BLE001 - whatever failed in the write, the run gets one line
                raise CheckpointError(_cannot_write(self, f"{type(err).__name__}: {_first_line(err)}")) from err
        except BaseException as err:  # reaches the caller through wait()
            self._error = err
            if self.processes > 1 and not self._abandoned.is_set():
                self._post_failure(str(err))

    def _post_failure(self, text: str) -> None:
        from asyncrl.cluster.distributed import coordination_client

        try:
            coordination_client().key_value_set(f"{_FAILED_KEY}/{self.step}/{self.process}", text.splitlines()[0])
        except Exception:  # noqa: BLE001 - the coordinator is gone: the others stop through the watchdog
            log.warning("process %d: cannot tell the other processes that its part of the checkpoint of step %d "
                        "failed", self.process, self.step)

    def _write_own_hashes(self) -> None:
        """This process's files of ``arrays/`` with their sizes and sha256, as ``hashes/process_<i>.json``."""
        import asyncrl.checkpoint.arrays as checkpoint_arrays

        arrays_dir = self.tmp / checkpoint_arrays.ARRAYS_DIR
        files = {}
        if self.manifest_head["trees"]:
            self._wait_for(lambda: (arrays_dir / "_CHECKPOINT_METADATA").is_file(), "Orbax's commit of the arrays")
            prefix = checkpoint_arrays.ARRAYS_DIR + "/"
            files = {prefix + rel: _fsync_and_describe(arrays_dir / rel)
                     for rel in checkpoint_arrays.files_written_by(arrays_dir, self.process)}
        hashes = self.tmp / _HASHES_DIR
        hashes.mkdir(exist_ok=True)
        scratch = hashes / f".process_{self.process}.json.tmp"
        _write_bytes(scratch, json.dumps(files, indent=1).encode("utf-8"))
        os.replace(scratch, hashes / f"process_{self.process}.json")
        _stage("hashes")

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if self._abandoned.is_set():
                raise CheckpointError(f"the checkpoint of step {self.step} in {self.root}: abandoned while waiting "
                                      f"for {what} (another process's part of it failed)")
            if time.monotonic() > deadline:
                raise CheckpointError(f"the checkpoint of step {self.step} in {self.root}: {what} did not happen "
                                      f"within checkpoint.barrier_timeout_s={self.timeout_s:.0f} s")
            time.sleep(0.02)

    def _commit(self) -> None:
        """Process 0: the manifest (every process's hashes, then its own small files), the rename, pruning."""
        tmp, hashes = self.tmp, self.tmp / _HASHES_DIR
        self._wait_for(lambda: all((hashes / f"process_{i}.json").is_file() for i in range(self.processes)),
                       "every process's hashes/process_<i>.json")
        files: dict[str, dict[str, Any]] = {}
        for i in range(self.processes):
            files.update(json.loads((hashes / f"process_{i}.json").read_text(encoding="utf-8")))
        for filename in (STATE_FILE, CONFIG_FILE, f"{ROLLOUT_PREFIX}.json", f"{ROLLOUT_PREFIX}.npz"):
            if (tmp / filename).is_file():
                files[filename] = _fsync_and_describe(tmp / filename)
        manifest = {**self.manifest_head, "files": dict(sorted(files.items()))}
        _write_bytes(tmp / MANIFEST_FILE, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))
        _stage(MANIFEST_FILE)
        for directory in sorted({(tmp / rel).parent for rel in files}, key=lambda p: -len(p.parts)):
            _fsync_dir(directory)
        _fsync_dir(hashes)
        _fsync_dir(tmp)
        _stage("fsync-dir")
        replaced = None
        if self.final.exists():
            # The old directory steps aside only for the instant between two renames; it is
            # deleted once the new one is in place.
            log.warning("replacing the existing checkpoint %s", self.final)
            replaced = self.root / f"{_TRASH_PREFIX}{self.final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(self.final, replaced)
        os.rename(tmp, self.final)
        _fsync_dir(self.root)
        _stage("renamed")
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        if self.keep is not None:
            _prune(self.root, self.keep)
            _stage("pruned")


@contextlib.contextmanager
def _reporting_io_errors(pending: "PendingSave") -> Iterator[None]:
    """Disk full, an I/O error, a read-only file system: the write is abandoned and every complete
    checkpoint stays as it was; one line says so. A one-process run removes the temporary
    directory; with several processes it is left to the next save or resume, which removes it
    (the other processes may still be writing into it)."""
    try:
        yield
    except BaseException as err:
        if pending.processes == 1 and pending.tmp != pending.root and pending.tmp.exists():
            shutil.rmtree(pending.tmp, ignore_errors=True)
        oserror = err if isinstance(err, OSError) else None if isinstance(err, CheckpointError) else _as_oserror(err)
        if oserror is None:
            raise
        raise CheckpointError(_cannot_write(pending, f"[Errno {oserror.errno}] {oserror.strerror}"
                                                     f"{f': {oserror.filename}' if oserror.filename else ''}")) from err


def _cannot_write(pending: "PendingSave", cause: str) -> str:
    """The one line of a failed write: the step, the directory, the cause and the checkpoint a
    resume would continue from."""
    previous = _newest_complete(pending.root)
    where = (f"the previous complete checkpoint, {previous.name}, is intact" if previous is not None else
             "no complete checkpoint was written before it, so a resume starts fresh")
    return (f"cannot write the checkpoint of step {pending.step} in {pending.root}: {cause} ({where}; free the space "
            "or fix the device, then resume)")


def _newest_complete(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (sizes checked, no hashing), or None."""
    try:
        for _, path in reversed(_step_dirs(root)):
            if not checkpoint_problems(path, checksums=False):
                return path
    except OSError:  # the device that failed the write may fail this too
        pass
    return None


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_REPORTED_ERRNOS = ("ENOSPC", "EIO", "EROFS", "EDQUOT", "EACCES", "EPERM", "ENOENT", "ESTALE", "ENOTCONN", "ENODEV",
                    "ENXIO")


def _as_oserror(err: BaseException) -> Optional[OSError]:
    """The ``OSError`` a tensorstore/Orbax error reports in its message: the errno tensorstore
    names (``[os_error_code='28']``), else a known ``strerror`` text (``No space left on device``)."""
    import errno as errno_codes

    text = str(err)
    found = _OS_ERROR_CODE.search(text)
    if found is not None:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    for name in _REPORTED_ERRNOS:
        known: Optional[int] = getattr(errno_codes, name, None)
        if known is not None and os.strerror(known) in text:
            return OSError(known, os.strerror(known))
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else repr(err)


def _checked_inputs(step: Any, arrays: Mapping[str, Any], state: Mapping[str, Any], config_yaml: Any,
                    rollout_state: Optional[Mapping[str, Any]], keep: Optional[int]) -> tuple[int, dict, str]:
    """``(step, {tree name: {key: leaf}}, state JSON text)``, or the :class:`CheckpointError`
    that refuses the save."""
    import asyncrl.checkpoint.arrays as checkpoint_arrays

    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"save_checkpoint: step must be a non-negative int (given {step!r})")
    if keep is not None and keep < 1:
        raise CheckpointError(f"save_checkpoint: keep must be >= 1 or None (given {keep})")
    trees = {}
    for name, tree in arrays.items():
        if not isinstance(name, str) or not _TREE_NAME.match(name):
            raise CheckpointError(f"save_checkpoint: array tree name {name!r} is not a plain file name")
        trees[name] = checkpoint_arrays.storable_leaves(tree, f"save_checkpoint: arrays[{name!r}]")
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
    return int(step), trees, state_text


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


def latest_checkpoint(out_dir: str | Path, *, checksums: bool = True,
                      share: Optional[tuple[int, int]] = None, timeout_s: float = 600.0) -> Optional[Path]:
    """The newest complete checkpoint under ``<out_dir>/checkpoints``, or None.

    Every newer directory that is skipped is logged (warning) with the reason; unfinished
    temporary writes are never candidates. A finished checkpoint of another
    :data:`CHECKPOINT_FORMAT` is a :class:`CheckpointError`. ``share=(i, n)``: process ``i`` of
    a run of ``n`` hashes only its share of the files (:func:`checkpoint_problems`), and the
    ``n`` processes exchange what they found through the coordination service (waiting at most
    ``timeout_s`` for each other), so that all of them skip the same checkpoints, each naming
    every damaged file, and return the same one; every process of the run must call it.
    """
    root = checkpoints_root(out_dir)
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.name.startswith(_TMP_PREFIX):
                log.info("ignoring %s: an unfinished checkpoint write", child)
    exchange = share is not None and share[1] > 1
    for path in [*(path for _, path in reversed(_step_dirs(root))), None]:
        problems = []
        if path is not None:
            _refuse_other_format(path)
            problems = checkpoint_problems(path, checksums=checksums, share=share)
        if exchange:
            assert share is not None
            problems = _problems_everywhere(root, path, problems, share, timeout_s)
        if path is None:
            return None
        if not problems:
            return path
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


_exchange_rounds = itertools.count()


def _problems_everywhere(root: Path, path: Optional[Path], problems: list[str], share: tuple[int, int],
                         timeout_s: float) -> list[str]:
    """Every process's problems with candidate ``path`` (None: this process has no candidate
    left), each once, in process order: what each found in its share of the files, exchanged
    through the coordinator's key-value store. Processes that see different candidates (no
    shared ``run.output_dir``) get a :class:`CheckpointError` saying so."""
    from asyncrl.cluster.distributed import coordination_client

    index, count = share
    client = coordination_client()
    prefix = f"asyncrl/checkpoint-check/{next(_exchange_rounds)}/"
    mine: dict[str, Any] = {"checkpoint": None if path is None else path.name, "problems": problems}
    client.key_value_set(prefix + str(index), json.dumps(mine))
    found: list[str] = []
    for other in range(count):
        theirs = mine
        if other != index:
            try:
                theirs = json.loads(client.blocking_key_value_get(prefix + str(other), int(timeout_s * 1000)))
            except Exception as err:  # jaxlib raises its own error type
                raise CheckpointError(
                    f"{root}: process {other} did not report its check of {mine['checkpoint'] or 'the checkpoints'} "
                    f"within {timeout_s:g} s ({str(err).strip().splitlines()[0] if str(err).strip() else err!r}); "
                    "every process of a run checks the checkpoints together (checkpoint.barrier_timeout_s)"
                ) from None
        if theirs["checkpoint"] != mine["checkpoint"]:
            raise CheckpointError(
                f"{root}: process {index} sees {mine['checkpoint'] or 'no further checkpoint'} where process {other} "
                f"sees {theirs['checkpoint'] or 'none'}; every process must see the same run.output_dir (a shared "
                "file system)"
            )
        found += [problem for problem in theirs["problems"] if problem not in found]
    return found


class SavedTrees(Mapping[str, dict[str, np.ndarray]]):
    """``{tree name: {key: numpy array}}`` of a checkpoint, each tree read (whole, to this host)
    on first access; ``in`` and iteration read nothing. A run restores onto its devices with
    :meth:`Checkpoint.tree` instead, which reads only this process's shards."""

    def __init__(self, path: Path, names: list[str]) -> None:
        self.path, self.names = path, list(names)
        self._read: dict[str, dict[str, np.ndarray]] = {}

    def __getitem__(self, name: str) -> dict[str, np.ndarray]:
        if name not in self.names:
            raise KeyError(name)
        if name not in self._read:
            import asyncrl.checkpoint.arrays as checkpoint_arrays

            directory = self.path / ARRAYS_DIR
            saved = checkpoint_arrays.saved_arrays(directory, name)
            self._read[name] = {key: np.asarray(value) for key, value in
                                checkpoint_arrays.restore(directory, name, saved).items()}
        return self._read[name]

    def __contains__(self, name: object) -> bool:
        # Mapping's own ``in`` indexes the tree, which read it whole to this host and kept it:
        # every restore (Checkpoint.tree checks the name first) held the whole tree beside its shards.
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its JSON as saved, its arrays read on demand."""

    path: Path
    step: int
    arrays: Mapping[str, dict[str, np.ndarray]]
    """``{tree name: {key: numpy array}}``, the keys as :func:`asyncrl.pytree.flatten` spells them
    (a tree is read to this host when first indexed; :meth:`tree` reads onto devices instead)."""
    state: dict[str, Any]
    """The JSON state as saved."""
    config_yaml: str
    """The resolved config of the run that wrote it."""
    rollout_state: Optional[dict[str, Any]]
    """The executor's ``{"meta", "arrays"}`` for ``WorkflowExecutor.load_state_dict`` (None if not saved)."""
    processes: int = 1
    """How many processes wrote it (any number may restore it)."""

    def config(self) -> Config:
        """The saved config, validated by this asyncrl's schema."""
        return saved_config(self.config_yaml, where=str(self.path / CONFIG_FILE))

    def saved(self, name: str) -> dict[str, Any]:
        """``{key: SavedArray}`` (shape, dtype) of tree ``name``, from Orbax's metadata alone."""
        import asyncrl.checkpoint.arrays as checkpoint_arrays

        self._check_name(name)
        if not isinstance(self.arrays, SavedTrees):  # built by hand from arrays in memory
            return dict(self.arrays[name])
        return checkpoint_arrays.saved_arrays(self.path / ARRAYS_DIR, name)

    def _check_name(self, name: str) -> None:
        if name not in self.arrays:
            raise CheckpointError(f"checkpoint {self.path}: holds no tree {name!r} (it holds {sorted(self.arrays)})")

    def tree(self, name: str, template: Any) -> Any:
        """Tree ``name`` in ``template``'s structure, each leaf read straight onto the
        template's sharding (a ``jax.Array``: this process reads only the shards it holds, on
        whatever mesh and process count the run has now) or as the template's numpy/Python
        type. Every missing, extra or mis-shaped key is a :class:`CheckpointError` naming this
        directory, the tree and the key, before any array is read."""
        import asyncrl.checkpoint.arrays as checkpoint_arrays

        where = f"checkpoint {self.path}: {ARRAYS_DIR}/{name}"
        problems = pytree.mismatches(template, self.saved(name), where=where)
        if problems:
            raise CheckpointError(str(pytree.TreeError(where, problems)))
        values = checkpoint_arrays.restore(self.path / ARRAYS_DIR, name, pytree.keyed_leaves(template, where))
        try:
            return pytree.fill(template, values, where=where)
        except pytree.TreeError as err:
            raise CheckpointError(str(err)) from None


def load_checkpoint(path: str | Path, *, verify: bool = True, share: Optional[tuple[int, int]] = None) -> Checkpoint:
    """Read a checkpoint directory's JSON, checking every file against the manifest (size and,
    with ``verify``, sha256; ``share``: as :func:`checkpoint_problems`); never unpickles anything.

    Arrays are read later, on demand (:attr:`Checkpoint.arrays` to the host,
    :meth:`Checkpoint.tree` onto devices). Raises :class:`CheckpointError` naming the file at fault.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    manifest, problem = _read_manifest(path)
    if problem:
        raise CheckpointError(f"{path}: not a complete checkpoint: {problem}")
    assert manifest is not None
    files = manifest["files"]
    mine = _my_share(list(files), share) if verify else set()

    def read(filename: str) -> bytes:
        file = path / filename
        try:
            data = file.read_bytes()
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read {filename} ({err})") from err
        found = _file_problem(file, filename, files[filename], data=data, checksums=filename in mine)
        if found:
            raise CheckpointError(f"{path}: {found}")
        return data

    small = {STATE_FILE, CONFIG_FILE, f"{ROLLOUT_PREFIX}.json", f"{ROLLOUT_PREFIX}.npz"}
    for filename, entry in files.items():
        if filename not in small:  # the arrays' files: checked here, read by Orbax later
            found = _file_problem(path / filename, filename, entry, checksums=filename in mine)
            if found:
                raise CheckpointError(f"{path}: {found}")
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
    return Checkpoint(path=path, step=int(manifest["step"]), arrays=SavedTrees(path, manifest["trees"]), state=state,
                      config_yaml=config_yaml, rollout_state=rollout_state, processes=int(manifest["processes"]))


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
    # Each process hashes its share of the files; they agree on what they found.
    path = latest_checkpoint(out, share=_process(), timeout_s=cfg.checkpoint.barrier_timeout_s)
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
    checkpoint = load_checkpoint(path, verify=False)  # verified just now
    log.info("resuming from %s (step %d)", path, checkpoint.step)
    return checkpoint
