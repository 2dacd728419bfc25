"""Checkpoints that lose nothing: atomic, sharded, asynchronous writes, verified reads, no
pickle, exact resume, resharding onto any mesh.

A checkpoint of trainer step ``k`` is one directory ``<run.output_dir>/checkpoints/step_<k>``
(``k`` zero-padded to 8 digits, so lexical order is step order)::

    arrays/<tree>/           one Orbax item per array tree (params, opt_state, ...), keyed by the
                             asyncrl.pytree paths ("layers/0/mlp/kernel", "1/0/mu/layers/0/mlp/kernel");
                             every process writes its own shards (asyncrl.checkpoint.arrays)
    hashes/process_<i>.json  size and sha256 of the array files process i wrote, hashed by process i
    state.json               the caller's JSON state: version, trainer counters, stage index, ...
    rollout.json, .npz       the rollout executor's state: JSON plus named arrays (asyncrl.checkpoint.files);
                             written by several processes, rollout_<i>.json/.npz, each process's own
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
import hashlib
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

import asyncrl.checkpoint.files as checkpoint_files
from asyncrl.checkpoint.layout import (
    _HASH_CHUNK,
    _HASHES_DIR,
    _TMP_PREFIX,
    _TRASH_PREFIX,
    _TREE_NAME,
    CHECKPOINT_FORMAT,
    CONFIG_FILE,
    MANIFEST_FILE,
    ROLLOUT_PREFIX,
    STATE_FILE,
    _process,
    _step_dirs,
    checkpoint_problems,
    checkpoints_root,
    step_dir_name,
)
from asyncrl.errors import CheckpointError

log = logging.getLogger(__name__)
_FAILED_KEY = "asyncrl/checkpoint-failed"  # + /<step>/<process>: a process's failed part of a write

# Called with a stage name after each durable stage of a save ("params.safetensors", ...,
# "MANIFEST.json", "fsync-dir", "renamed", "trashed step_<k>", "pruned"). Only tests set it (to kill a writer at
# a chosen point); it is never set by library code.
_stage_hook: Optional[Callable[[str], None]] = None


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
    writes its own shards and its own ``rollout_state`` (``rollout_<i>.json``/``.npz``, listed in
    its hashes); ``state`` and ``config_yaml`` are written by process 0 alone (the other
    processes' are ignored).

    Args:
        out_dir: the run's output directory (``cfg.run.resolved_output_dir``).
        step: completed trainer steps (= the version of the saved weights).
        arrays: ``{tree name: pytree of arrays}``, e.g. ``{"params": ..., "opt_state": ...}``;
            each becomes ``arrays/<name>/``. Names are ``[A-Za-z0-9][A-Za-z0-9_.-]*``.
            ``jax.Array`` leaves are written shard by shard, never gathered.
        state: JSON-serialisable (no NaN): version, trainer counters, stage index, ...
        config_yaml: the resolved config (``dump_config(cfg)``).
        rollout_state: ``{"meta": JSON, "arrays": {name: 1-d numpy array}}``, this process's
            executor's ``state_dict()`` (written by :func:`save_rollout_state`); every process
            passes one or none does.
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
                checkpoint_files.save_rollout_state(rollout_state, tmp, checkpoint_files.rollout_files(processes)[0][0])
                _stage(ROLLOUT_PREFIX)
        # Orbax's own barrier keeps the other processes from writing before process 0 made tmp.
        checkpointer = checkpoint_arrays.start_save(tmp / checkpoint_arrays.ARRAYS_DIR, trees) if trees else None
        if rollout_state is not None and process > 0:
            pending._wait_for(tmp.is_dir, "process 0's temporary directory")
            checkpoint_files.save_rollout_state(rollout_state, tmp, checkpoint_files.rollout_files(processes)[process][0])
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
        if self.manifest_head["rollout"] and self.processes > 1:  # this process's own rollout state
            prefix = checkpoint_files.rollout_files(self.processes)[self.process][0]
            files.update({f"{prefix}.{ext}": _fsync_and_describe(self.tmp / f"{prefix}.{ext}") for ext in ("json", "npz")})
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
        log.info("checkpoint of step %d written to %s", self.step, self.final)  # as it completes, not at the next wait


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
