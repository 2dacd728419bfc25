"""What a checkpoint's JSON files must hold, and the cross-checks a resume runs before it
trusts them.

A checkpoint that passes its manifest's hashes can still be wrong: a directory copied from
another run, a hand-edited ``state.json``, a file written by a buggy older version. Each
JSON file is therefore parsed into a versioned pydantic model (``extra="forbid"``, strict
types), and :func:`check_run_checkpoint` cross-checks them with each other, with the
config's stages and with the model's parameter shapes. Any disagreement is a
:class:`~asyncrl.errors.CheckpointError` of one line naming the checkpoint directory, the
file and the field.

Extending the format: a new optional section is a new field with a default of ``None``
(older checkpoints, which lack it, still parse); a change that older readers would misread
bumps :data:`RUN_STATE_FORMAT`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asyncrl.errors import CheckpointError

RUN_STATE_FORMAT = 1
"""Version of ``state.json`` as the training loop writes it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# --------------------------------------------------------------------------- MANIFEST.json


class ManifestFile(_Strict):
    """One file of a checkpoint, as recorded when it was written."""

    bytes: int = Field(ge=0)
    """Size in bytes."""
    sha256: str
    """Hex digest of the contents."""


class Manifest(_Strict):
    """``MANIFEST.json``: written last; a directory without a valid one is not a checkpoint."""

    format: int
    """Layout version (:data:`asyncrl.checkpoint.CHECKPOINT_FORMAT`)."""
    step: int = Field(ge=0)
    """Completed trainer steps; equals the directory's ``step_<k>``."""
    trees: list[str]
    """Array trees, one ``<tree>.safetensors`` each."""
    rollout: bool
    """Whether ``rollout.json`` / ``rollout.npz`` are part of it."""
    files: dict[str, ManifestFile]
    """Every file of the checkpoint with its size and hash."""


# --------------------------------------------------------------------------- state.json


class TrainerCounters(_Strict):
    """The trainer's counters (``Trainer.state_dict()`` without the arrays)."""

    step: int = Field(ge=0)
    skipped_updates_total: int = Field(ge=0)
    consecutive_nonfinite: int = Field(ge=0)
    update_count: int = Field(ge=0)


class SFTPosition(_Strict):
    """Where an SFT stage's data stream is (``SFTData.state_dict()``)."""

    position: int = Field(ge=0)
    skipped_too_long: int = Field(ge=0)


class LoraBase(_Strict):
    """What a LoRA run's checkpoint records of the frozen base its adapters belong to."""

    base_model_path: str
    base_hash: str
    """Content hash of the base weights (:func:`asyncrl.model.lora.params_hash`)."""


class RunState(_Strict):
    """``state.json`` as the training loop writes it."""

    format: Literal[1] = RUN_STATE_FORMAT
    """Version of this file (absent in checkpoints written before it was recorded: 1)."""
    version: int = Field(ge=0)
    """Completed trainer steps over all stages: the served weights' version."""
    stage_index: int = Field(ge=0)
    """The stage the checkpoint was taken in (index into ``stages``; 0 without stages)."""
    stage_step: int = Field(ge=0)
    """Completed steps of that stage."""
    trainer: TrainerCounters
    final_eval: dict[str, float] = Field(default_factory=dict)
    """The last evaluation's metrics."""
    engine_counters: dict[str, float] = Field(default_factory=dict)
    """Cumulative engine counters, continued by the resumed run."""
    sft: Optional[SFTPosition] = None
    """The data position, in an SFT stage."""
    lora: Optional[LoraBase] = None
    """A ``model.lora`` run's base model (its params and optimizer state are adapters only)."""


# --------------------------------------------------------------------------- rollout.json


class LedgerSnapshot(_Strict):
    """The staleness ledger (``StalenessLedger.snapshot()``)."""

    version: int = Field(ge=0)
    next_ticket: int = Field(ge=0)
    next_sample_id: int = Field(ge=0)
    consumed: int = Field(ge=0)
    batch_size: int = Field(ge=1)
    done_seq: int = Field(ge=0)
    entries: list[tuple[int, int, Literal["in_flight", "queued"], int, int, int]]
    """``[ticket, sample_id, state, admit_version, min_version, done_seq]`` of live tickets."""
    reissue: list[tuple[int, int, int]]
    """``[ticket, sample_id, admit_version]`` to generate again first."""
    terminal: dict[str, int]
    """Counts of samples that reached a final category (``trained``, ``dropped:...``)."""
    reissued_total: int = Field(ge=0)


class QueuedTrajectory(_Strict):
    temperature: float
    reward: float
    reward_components: dict[str, float]
    stop_reason: str
    metadata: dict[str, Any]
    advantages: bool


class QueuedGroup(_Strict):
    metadata: dict[str, Any]
    trajectories: list[QueuedTrajectory]


class RolloutMeta(_Strict):
    """``rollout.json``: the executor's ledger and queued groups (their arrays are in ``rollout.npz``)."""

    format: Literal[1]
    ledger: LedgerSnapshot
    groups: dict[str, QueuedGroup]


# --------------------------------------------------------------------------- parsing and cross-checks


def parse(model: type[BaseModel], data: Any, where: Path, filename: str) -> Any:
    """``data`` (the file's JSON, already decoded) as ``model``; one line naming the first bad field."""
    import json

    try:
        return model.model_validate_json(json.dumps(data))
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(the whole file)"
        more = f" (and {err.error_count() - 1} more problems)" if err.error_count() > 1 else ""
        raise CheckpointError(f"checkpoint {where}: {filename}: field {field}: {first['msg']}{more}") from None


def refuse(where: Path, filename: str, field: str, message: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {where}: {filename}: field {field}: {message}")


def check_run_checkpoint(checkpoint: Any, cfg: Any) -> RunState:
    """Validate the JSON files of a loaded :class:`~asyncrl.checkpoint.Checkpoint` of the
    training loop against each other and ``cfg``'s stages; returns its state. (The arrays
    are checked against the model by :func:`check_checkpoint_params` once it is loaded.)

    Raises :class:`CheckpointError` naming the directory, the file and the field."""
    where = checkpoint.path
    state: RunState = parse(RunState, checkpoint.state, where, "state.json")
    _check_position(state, checkpoint.step, cfg, where)
    if (state.lora is None) != (cfg.model.lora is None):
        held, configured = ("adapters", "no model.lora") if state.lora is not None else ("full weights", "model.lora")
        raise refuse(where, "state.json", "lora", f"the checkpoint holds {held}, but the config has {configured}; "
                     "resume with the config the run was started with")
    stage = cfg.stage_configs()[state.stage_index][0]
    if stage.type == "sft" and state.sft is None:
        raise refuse(where, "state.json", "sft", f"stage {state.stage_index} ({stage.name}) is an SFT stage, "
                     "but the checkpoint has no SFT data position")
    if stage.type == "rl":
        if state.sft is not None:
            raise refuse(where, "state.json", "sft", f"stage {state.stage_index} ({stage.name}) is an RL stage")
        if checkpoint.rollout_state is None:
            raise refuse(where, "MANIFEST.json", "rollout", f"stage {state.stage_index} ({stage.name}) is an RL "
                         "stage, but the checkpoint has no rollout state")
        _check_rollout(checkpoint.rollout_state, state, where)
    return state


def check_checkpoint_params(checkpoint: Any, params: Any) -> None:
    """The checkpoint's parameter trees have exactly the names, shapes and dtypes of the
    model's ``params``."""
    _check_arrays(checkpoint.arrays.get("params"), params, checkpoint.path, "params.safetensors")
    if "stage_start_params" in checkpoint.arrays:
        _check_arrays(checkpoint.arrays["stage_start_params"], params, checkpoint.path, "stage_start_params.safetensors")


def _check_position(state: RunState, step: int, cfg: Any, where: Path) -> None:
    """Step, stage index and stage step agree with each other and with the config's stages."""
    if state.version != step:
        raise refuse(where, "state.json", "version", f"{state.version}, but the manifest's step is {step}")
    if state.trainer.step != state.version:
        raise refuse(where, "state.json", "trainer.step", f"{state.trainer.step}, but version is {state.version}")
    stages = cfg.stage_configs()
    if state.stage_index >= len(stages):
        raise refuse(where, "state.json", "stage_index", f"{state.stage_index}, but the config has {len(stages)} "
                     "stage(s)")
    before = sum(stage.total_steps for stage, _ in stages[: state.stage_index])
    if before + state.stage_step != state.version:
        raise refuse(where, "state.json", "stage_step",
                     f"stage {state.stage_index} step {state.stage_step} is run step {before + state.stage_step} "
                     f"(the stages before it have {before} steps), but version is {state.version}")
    stage = stages[state.stage_index][0]
    if cfg.stages and state.stage_step > stage.total_steps:
        raise refuse(where, "state.json", "stage_step", f"{state.stage_step}, but stage {state.stage_index} "
                     f"({stage.name}) has {stage.total_steps} steps")


def _check_rollout(rollout_state: Mapping[str, Any], state: RunState, where: Path) -> None:
    """rollout.json parses, agrees with state.json, and every queued group has its arrays in rollout.npz."""
    from asyncrl.rollout.trajectory import ARRAY_FIELDS

    meta: RolloutMeta = parse(RolloutMeta, rollout_state["meta"], where, "rollout.json")
    if meta.ledger.version != state.version:
        raise refuse(where, "rollout.json", "ledger.version", f"{meta.ledger.version}, but state.json's version is "
                     f"{state.version}")
    queued = {str(entry[0]) for entry in meta.ledger.entries if entry[2] == "queued"}
    if queued != set(meta.groups):
        raise refuse(where, "rollout.json", "groups", f"the ledger's queued tickets {sorted(queued, key=int)} and "
                     f"the stored groups {sorted(meta.groups, key=int)} differ")
    arrays = rollout_state["arrays"]
    expected: set[str] = set()
    for ticket, group in meta.groups.items():
        for i, traj in enumerate(group.trajectories):
            names = [*ARRAY_FIELDS, *(["advantages"] if traj.advantages else [])]
            lengths = set()
            for name in names:
                key = f"g{ticket}_t{i}_{name}"
                expected.add(key)
                if key not in arrays:
                    raise refuse(where, "rollout.npz", key, "missing (rollout.json lists it)")
                array = np.asarray(arrays[key])
                if array.ndim != 1 or (name in ARRAY_FIELDS and array.dtype != ARRAY_FIELDS[name]):
                    raise refuse(where, "rollout.npz", key, f"{array.dtype}{list(array.shape)}, expected a "
                                 f"[T] {ARRAY_FIELDS.get(name, 'float32')} array")
                lengths.add(array.shape[0])
            if len(lengths) != 1:
                raise refuse(where, "rollout.npz", f"g{ticket}_t{i}_*", f"arrays of different lengths {sorted(lengths)}")
    unexpected = sorted(set(arrays) - expected)
    if unexpected:
        raise refuse(where, "rollout.npz", unexpected[0], "not part of any group in rollout.json")


def _check_arrays(saved: Any, model_params: Any, where: Path, filename: str) -> None:
    """A saved parameter tree has exactly the model's names, shapes and dtypes."""
    from asyncrl.checkpoint import flatten_tree

    if saved is None:
        raise refuse(where, filename, "(file)", "missing")
    got = flatten_tree(saved, where=filename)
    want = {key: (tuple(np.shape(leaf)), np.dtype(leaf.dtype)) for key, leaf in _flat_model(model_params).items()}
    for key in sorted(set(want) - set(got)):
        raise refuse(where, filename, key, "missing (the model has it)")
    for key in sorted(set(got) - set(want)):
        raise refuse(where, filename, key, "not a parameter of this model")
    for key, (shape, dtype) in sorted(want.items()):
        array = got[key]
        if tuple(array.shape) != shape or array.dtype != dtype:
            raise refuse(where, filename, key, f"{array.dtype}{list(array.shape)}, the model has {dtype}{list(shape)}")


def _flat_model(params: Any) -> dict[str, Any]:
    """The model's leaves by saved key, without copying them to the host."""
    from asyncrl.checkpoint import _join_key, _leaves_with_path  # the same walk and key spelling as a save

    return {_join_key(path, "params"): leaf for path, leaf in _leaves_with_path(params, ())}
