"""Finding and reading checkpoints: the newest complete one (:func:`latest_checkpoint`, every
process agreeing on it), a :class:`Checkpoint` whose array trees are read on demand onto any
mesh (:func:`load_checkpoint`), and the loop's resume (:func:`resume_checkpoint`). The layout
and the atomic write are in :mod:`asyncrl.checkpoint.store`; nothing here unpickles."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import numpy as np

import asyncrl.checkpoint.files as checkpoint_files
from asyncrl import pytree
from asyncrl.checkpoint.layout import (
    _TMP_PREFIX,
    ARRAYS_DIR,
    CONFIG_FILE,
    STATE_FILE,
    _file_problem,
    _my_share,
    _process,
    _read_manifest,
    _refuse_other_format,
    _step_dirs,
    checkpoint_problems,
    checkpoints_root,
)
from asyncrl.checkpoint.schema import check_resume_compatible, saved_config
from asyncrl.config import Config
from asyncrl.errors import CheckpointError

log = logging.getLogger("asyncrl.checkpoint.store")  # the logger of checkpoints before the split: filters keep working

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
    rollout_states: tuple[dict[str, Any], ...]
    """The executors' ``{"meta", "arrays"}`` for ``WorkflowExecutor.load_state_dict``, one per process
    that wrote the checkpoint (a resume on another count redistributes them:
    :func:`~asyncrl.rollout.redistribute.redistribute_states`); empty if not saved."""
    processes: int = 1
    """How many processes wrote it (any number may restore it)."""

    @property
    def rollout_state(self) -> Optional[dict[str, Any]]:
        """The one rollout state of a checkpoint one process wrote (None if not saved, or written by several)."""
        return self.rollout_states[0] if len(self.rollout_states) == 1 else None

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

    processes = int(manifest["processes"])
    rollout = checkpoint_files.rollout_files(processes) if manifest.get("rollout") else []
    small = {STATE_FILE, CONFIG_FILE, *(f"{prefix}.{ext}" for prefix, _ in rollout for ext in ("json", "npz"))}
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
    rollout_states = []
    for prefix, _ in rollout:
        for filename in (f"{prefix}.json", f"{prefix}.npz"):
            read(filename)  # verified against the manifest before it is parsed
        try:
            rollout_states.append(checkpoint_files.load_rollout_state(path, prefix))
        except (ValueError, OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: the rollout state is unreadable ({prefix}.json/.npz: {err})") from err
    return Checkpoint(path=path, step=int(manifest["step"]), arrays=SavedTrees(path, manifest["trees"]), state=state,
                      config_yaml=config_yaml, rollout_states=tuple(rollout_states), processes=processes)


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
