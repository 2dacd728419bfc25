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

import json
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asyncrl import pytree
from asyncrl.config import Config, load_config
from asyncrl.errors import CheckpointError, ConfigError, TrajectorySchemaError

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
    """Array trees, one Orbax item ``arrays/<tree>/`` each."""
    rollout: bool
    """Whether ``rollout.json`` / ``rollout.npz`` are part of it."""
    processes: int = Field(ge=1)
    """How many processes wrote the arrays (each hashed the files it wrote); any number may restore them."""
    files: dict[str, ManifestFile]
    """Every file of the checkpoint (path relative to the step directory) with its size and hash."""


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

    format: Literal[1] = 1
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
    process_count: int = Field(default=1, ge=1)
    """JAX processes of the run that wrote it (a resume may have another count: the arrays are resharded; absent in older checkpoints: 1)."""
    trackers: Optional[dict[str, str]] = None
    """``{tracker: run id}`` of the run's W&B/MLflow runs, which ``--resume`` continues (absent without them)."""


# --------------------------------------------------------------------------- rollout.json


class SampleShareSnapshot(_Strict):
    """A ledger's share of the sample ids (``asyncrl.rollout.ledger.SampleShare``)."""

    base: int = Field(ge=0)
    round_size: int = Field(ge=1)
    offset: int = Field(ge=0)
    count: int = Field(ge=1)


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
    share: Optional[SampleShareSnapshot] = None
    """Which sample ids the ledger draws (its process's share; absent: all of them, from 0)."""
    fresh: list[int] = []
    """Ids never drawn that a redistribution handed this ledger, drawn first."""


class RolloutMeta(_Strict):
    """``rollout.json``: the executor's ledger and queued groups, each as
    :meth:`TrajectoryGroup.pack <asyncrl.rollout.trajectory.TrajectoryGroup.pack>` made it
    (their arrays are in ``rollout.npz``, named ``g<ticket>_t<i>_<field>``)."""

    format: Literal[1]
    ledger: LedgerSnapshot
    groups: dict[str, dict[str, Any]]
    """``{ticket: packed group}``; each is checked by ``TrajectoryGroup.unpack`` (its own schema)."""


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
    check_stage_lengths(saved_config(checkpoint.config_yaml, where=str(where / "config.yaml")), cfg,
                        state.stage_index, state.stage_step)
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
        if not checkpoint.rollout_states:
            raise refuse(where, "MANIFEST.json", "rollout", f"stage {state.stage_index} ({stage.name}) is an RL "
                         "stage, but the checkpoint has no rollout state")
        from asyncrl.checkpoint.files import rollout_files

        for (prefix, _), rollout_state in zip(rollout_files(len(checkpoint.rollout_states)), checkpoint.rollout_states):
            _check_rollout(rollout_state, state, where, prefix)
    return state


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


def _check_rollout(rollout_state: Mapping[str, Any], state: RunState, where: Path, prefix: str = "rollout") -> None:
    """rollout.json (``<prefix>.json``) parses and agrees with state.json; every queued group unpacks
    from its arrays in rollout.npz by the trajectory schema's rules, and no array is left over."""
    json_name, npz_name = f"{prefix}.json", f"{prefix}.npz"
    meta: RolloutMeta = parse(RolloutMeta, rollout_state["meta"], where, json_name)
    if meta.ledger.version != state.version:
        raise refuse(where, json_name, "ledger.version", f"{meta.ledger.version}, but state.json's version is "
                     f"{state.version}")
    queued = {str(entry[0]) for entry in meta.ledger.entries if entry[2] == "queued"}
    if queued != set(meta.groups):
        raise refuse(where, json_name, "groups", f"the ledger's queued tickets {sorted(queued, key=int)} and "
                     f"the stored groups {sorted(meta.groups, key=int)} differ")
    from asyncrl.rollout.trajectory import TrajectoryGroup  # here: importing this module loads no rollout code

    arrays = rollout_state["arrays"]
    for key in sorted(arrays):
        owner = re.match(r"g(\d+)_", key)
        if owner is None or owner.group(1) not in meta.groups:
            raise refuse(where, npz_name, key, f"not part of any group in {json_name} (arrays are named g<ticket>_<field>)")
    for ticket in meta.groups:
        group = f"g{ticket}_"
        mine = {key[len(group):]: array for key, array in arrays.items() if key.startswith(group)}
        try:
            TrajectoryGroup.unpack(meta.groups[ticket], mine, where=f"group {ticket}")
        except TrajectorySchemaError as err:
            if err.rule == "type":  # the group's JSON
                raise refuse(where, json_name, f"groups.{ticket}", str(err)) from None
            field = f"{group}{err.field}" if err.rule == "packed_arrays" else f"groups.{ticket}"
            raise refuse(where, npz_name, field, str(err)) from None


def check_checkpoint_params(checkpoint: Any, params: Any) -> None:
    """The checkpoint's parameter trees have exactly the keys, shapes and dtypes of the
    model's ``params`` (checked without copying either; :meth:`Checkpoint.tree` places them)."""
    for name in ("params", "stage_start_params"):
        if name == "params" or name in checkpoint.arrays:
            saved = checkpoint.saved(name) if name in checkpoint.arrays else None  # shapes and dtypes only
            _check_arrays(saved, params, checkpoint.path, f"arrays/{name}")


def _check_arrays(saved: Optional[Mapping[str, Any]], model_params: Any, where: Path, filename: str) -> None:
    """A saved flat parameter tree has exactly the model's keys, shapes and dtypes."""
    if saved is None:
        raise refuse(where, filename, "(file)", "missing")
    problems = pytree.mismatches(model_params, saved, where=filename)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {where}: {filename}: {problems[0]}{more}")


# --------------------------------------------------------------------------- config.yaml on resume


RESUME_MUTABLE_FIELDS = ("logging", "run.total_steps", "run.compile_cache", "run.output_dir", "run.name", "eval",
                         "checkpoint", "mesh.distributed", "stages.N.total_steps")
"""Dotted config paths (a section or a field) that may differ between a checkpoint and its resume
(``N``: any stage index; a stage's length is checked against the run's position by
:func:`check_stage_lengths` once ``state.json`` is read). ``run.output_dir`` and ``run.name`` may
differ because a run directory may be moved or copied: a checkpoint stores no path of its own
(it is found in, and its files are read from, the directory the config names now)."""


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
    generic = re.sub(r"^stages\.\d+\.", "stages.N.", dotted)
    return any(generic == p or generic.startswith(p + ".") for p in RESUME_MUTABLE_FIELDS)


def check_stage_lengths(saved: Config, new: Config, stage_index: int, stage_step: int) -> None:
    """A resume may lengthen (or shorten) the stage it is in and the stages after it, never a
    finished stage, and never end the current one before the ``stage_step`` steps it has done.
    Raises :class:`ConfigError` naming ``stages.N.total_steps``."""
    if not saved.stages or not new.stages or len(saved.stages) != len(new.stages):
        return  # a different stage list is refused by check_resume_compatible
    problems = []
    for index, (before, now) in enumerate(zip(saved.stages, new.stages)):
        if before.total_steps == now.total_steps:
            continue
        if index < stage_index:
            problems.append(f"stages.{index}.total_steps: stage {index} ({now.name}) is finished at {before.total_steps} "
                            f"steps; only the current stage ({stage_index}) and later ones may change length on resume")
        elif index == stage_index and now.total_steps < stage_step:
            problems.append(f"stages.{index}.total_steps: {now.total_steps} is below the {stage_step} steps stage {index} "
                            f"({now.name}) has done; give at least {stage_step}")
    if problems:
        raise ConfigError(problems)


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
    ``run.compile_cache``, ``eval.*`` and ``checkpoint.*``: a :class:`ConfigError` lists every differing dotted
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
