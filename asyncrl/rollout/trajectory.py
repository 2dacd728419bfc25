"""Trajectory, TrajectoryGroup and TrainBatch, and the schema rules they obey (declared once).

A :class:`Trajectory` is one sampled sequence (numpy arrays ``[T]`` plus scalars); a
:class:`TrajectoryGroup` is the ``rollout.group_size`` trajectories of one prompt, kept or
dropped whole; a :class:`TrainBatch` is what ``prepare_batch`` hands the trainer
(arrays ``[rows, L]``, right-padded). See docs/design.md "Contracts".

The token-level rules live in one vectorised function, :func:`array_violations`, over
``[rows, L]`` arrays. The per-trajectory check (run in the rollout thread at episode end)
applies it to one trajectory viewed as a ``[1, T]`` batch; ``prepare_batch`` applies it
to the stacked batch. Every violation names the rule, the field, and where it happened.

A group packs itself to JSON plus named ``[T]`` arrays (:meth:`TrajectoryGroup.pack`) and
back (:meth:`TrajectoryGroup.unpack`, which runs every rule again): how queued groups are
checkpointed without pickle.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Annotated, Any, Callable, Mapping, Optional, Sequence

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from asyncrl.engine.protocol import STOP_REASONS, GenerationResponse
from asyncrl.errors import TrajectorySchemaError

# --------------------------------------------------------------------------- the schema

ARRAY_FIELDS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.bool_),
    "behavior_logprobs": np.dtype(np.float32),
    "versions": np.dtype(np.int32),
}
"""Per-token fields of a trajectory (``[T]``) and of a batch (``[rows, L]``), with their dtypes."""

RULES: dict[str, tuple[str, str]] = {
    # rule: (field, what it requires)
    "dtype": ("*", "arrays have the dtypes of ARRAY_FIELDS (int32 ids, bool mask, float32 log-probs, int32 versions)"),
    "ndim": ("*", "per-token arrays are one-dimensional [T]"),
    "equal_length": ("*", "input_ids, loss_mask, behavior_logprobs and versions have equal lengths"),
    "token_id": ("input_ids", "token ids are >= 0"),
    "first_token_trained": ("loss_mask", "loss_mask[0] is false (the first token has no log-prob)"),
    "mask_outside_tokens": ("loss_mask", "trained tokens are real tokens (loss_mask within attention_mask)"),
    "no_trained_token": ("loss_mask", "at least one token is trained"),
    "trained_version": ("versions", "trained tokens have versions >= 0"),
    "version_range": ("versions", "versions are >= -1 (-1 marks tokens the policy did not generate)"),
    "trained_logprob": ("behavior_logprobs", "trained tokens have finite log-probs <= 0"),
    "ungenerated_logprob": ("behavior_logprobs", "tokens with version -1 (not generated) have log-prob 0"),
    "stop_reason": ("stop_reason", f"stop_reason is one of {', '.join(STOP_REASONS)}"),
    "temperature": ("temperature", "temperature is finite and > 0"),
    "temperature_mismatch": ("temperature", "temperature equals rollout.temperature (one temperature per batch)"),
    "reward": ("reward", "reward is finite"),
    "reward_components": ("reward_components", "reward components are finite floats keyed by name"),
    "metadata": ("metadata", "metadata is JSON-serialisable"),
    "advantages": ("advantages", "advantages, when given, are finite float32 [T]"),
    "constraint": ("constraint_nodes", "constraint and constraint_nodes come together; the nodes are int32 [T], >= -1, "
                   "and >= 0 only on generated tokens"),
    "constraint_mismatch": ("constraint", "a batch's constrained trajectories share one trie (the trainer's rollout.decoding.constraint)"),
    "group_size": ("trajectories", "a group has exactly rollout.group_size trajectories, or, with metadata['runs'] "
                   "(the run of each trajectory: an agent run may yield several), trajectories of exactly runs 0..group_size-1"),
    "type": ("*", "fields have the types of the Trajectory model"),
    "packed_arrays": ("*", "a packed group has exactly the arrays its JSON lists, each [T]"),
}
"""Every schema rule: its field and what it requires. Failures are counted ``failed:schema:<rule>``."""


def _coerce(dtype: np.dtype) -> Callable[[Any], Any]:
    """Turn lists and compatible arrays into ``dtype``; leave anything else for the ``dtype`` rule."""

    def convert(value: Any) -> Any:
        arr = np.asarray(value)
        if arr.dtype == dtype:
            return arr
        if arr.size == 0 and arr.dtype == np.float64:  # np.asarray([])
            return arr.astype(dtype)
        kind = arr.dtype.kind
        if dtype.kind == "b" and kind in "iu" and np.isin(arr, (0, 1)).all():
            return arr.astype(dtype)
        if dtype.kind == "i" and kind in "iu" and (arr.size == 0 or (arr.min() >= np.iinfo(dtype).min and arr.max() <= np.iinfo(dtype).max)):
            return arr.astype(dtype)
        if dtype.kind == "f" and kind in "fiu":
            return arr.astype(dtype)
        return arr

    return convert


IdsArray = Annotated[np.ndarray, BeforeValidator(_coerce(ARRAY_FIELDS["input_ids"]))]
MaskArray = Annotated[np.ndarray, BeforeValidator(_coerce(ARRAY_FIELDS["loss_mask"]))]
LogprobArray = Annotated[np.ndarray, BeforeValidator(_coerce(ARRAY_FIELDS["behavior_logprobs"]))]
VersionArray = Annotated[np.ndarray, BeforeValidator(_coerce(ARRAY_FIELDS["versions"]))]
FloatArray = Annotated[np.ndarray, BeforeValidator(_coerce(np.dtype(np.float32)))]


class Trajectory(BaseModel):
    """One sampled sequence. Arrays are ``[T]`` and aligned token by token.

    Lists and compatible arrays are converted to the schema dtypes on construction;
    the rules in :data:`RULES` are checked by :func:`check_trajectory` (the executor runs
    it at episode end), not by the constructor.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    input_ids: IdsArray
    """int32 ``[T]``: prompt, then generated tokens (and in multi-turn, tool/user tokens)."""
    loss_mask: MaskArray
    """bool ``[T]``: true on generated tokens that are trained on; never derived from token ids."""
    behavior_logprobs: LogprobArray
    """float32 ``[T]``: log-prob of token t given tokens < t under the sampling policy; 0 where not generated."""
    versions: VersionArray
    """int32 ``[T]``: policy version that generated token t; -1 where not generated."""
    temperature: float
    """The sampling temperature (> 0)."""
    reward: float
    """Scalar reward of the sequence."""
    reward_components: dict[str, float] = Field(default_factory=dict)
    """Each reward function's raw score."""
    stop_reason: str
    """``eos``, ``stop``, ``length`` or ``aborted`` (an aborted trajectory drops its group)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """JSON-serialisable facts (sample id, answer, turns, ...)."""
    advantages: Optional[FloatArray] = None
    """float32 ``[T]``, optional: a workflow's own per-token advantages (else the trainer computes them)."""
    constraint: Optional[str] = None
    """The fingerprint of the :class:`~asyncrl.engine.constraints.TokenTrie` some tokens were
    decoded under (None: none); the trainer scores those tokens under the same mask (docs/decoding.md)."""
    constraint_nodes: Optional[IdsArray] = None
    """int32 ``[T]`` with ``constraint``: the trie node each token was chosen at, -1 for tokens
    not decoded under it (prompt, free turns)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_length(self) -> int:
        """Tokens before the first generated one (the first turn's prompt)."""
        generated = np.flatnonzero(self.versions >= 0)
        return int(generated[0]) if generated.size else self.num_tokens


class TrajectoryGroup(BaseModel):
    """The ``rollout.group_size`` trajectories of one prompt; kept or dropped whole.

    Version facts (oldest trained token, ...) are derived from the token versions.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory]
    """The sampled sequences, ``rollout.group_size`` of them (or more, from ``group_size`` agent
    runs, when ``metadata["runs"]`` names the run of each: see :mod:`asyncrl.agent.workflow`)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """JSON-serialisable facts about the prompt."""

    @property
    def rewards(self) -> np.ndarray:
        """float32 ``[group_size]``."""
        return np.array([t.reward for t in self.trajectories], dtype=np.float32)

    @property
    def min_version(self) -> int:
        """Version of the oldest trained token (-1 if none is trained)."""
        trained = [t.versions[t.loss_mask] for t in self.trajectories]
        trained = [v for v in trained if v.size]
        return int(min(v.min() for v in trained)) if trained else -1

    @property
    def aborted(self) -> bool:
        return any(t.stop_reason == "aborted" for t in self.trajectories)

    @property
    def zero_variance(self) -> bool:
        """All rewards equal: the group carries no group-relative signal."""
        rewards = self.rewards
        return bool(rewards.size == 0 or np.all(rewards == rewards[0]))

    def pack(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(JSON meta, arrays)``: the meta is :class:`PackedGroup`'s, the arrays
        ``t<i>_<field>`` (``[T]``, schema dtypes; ``t<i>_advantages`` only where given)."""
        arrays: dict[str, np.ndarray] = {}
        trajectories = []
        for i, traj in enumerate(self.trajectories):
            for name in ARRAY_FIELDS:
                arrays[f"t{i}_{name}"] = getattr(traj, name)
            if traj.advantages is not None:
                arrays[f"t{i}_advantages"] = traj.advantages
            if traj.constraint is not None and traj.constraint_nodes is not None:
                arrays[f"t{i}_constraint_nodes"] = traj.constraint_nodes
            trajectories.append({
                "temperature": traj.temperature, "reward": traj.reward, "reward_components": traj.reward_components,
                "stop_reason": traj.stop_reason, "metadata": traj.metadata, "advantages": traj.advantages is not None,
                "constraint": traj.constraint,
            })
        return {"metadata": self.metadata, "trajectories": trajectories}, arrays

    @classmethod
    def unpack(cls, meta: Any, arrays: Mapping[str, np.ndarray], *, where: str) -> "TrajectoryGroup":
        """The group :meth:`pack` made, checked on the way in: the meta against
        :class:`PackedGroup`, the array names against the meta, every trajectory against
        :data:`RULES` (:func:`check_trajectory`). Raises :class:`TrajectorySchemaError`
        naming ``where``, the trajectory and the array."""
        try:
            packed = PackedGroup.model_validate(meta)
        except ValidationError as err:
            first = err.errors()[0]
            detail = f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
            raise TrajectorySchemaError(violation_message(where, "type", detail), rule="type", field="*") from None
        expected = {f"t{i}_{name}" for i, traj in enumerate(packed.trajectories)
                    for name in [*ARRAY_FIELDS, *(["advantages"] if traj.advantages else []),
                                 *(["constraint_nodes"] if traj.constraint is not None else [])]}
        for key in sorted(expected ^ set(arrays)):
            detail = f"array {key!r} is {'missing' if key in expected else 'not listed in the JSON'}"
            raise TrajectorySchemaError(violation_message(where, "packed_arrays", detail), rule="packed_arrays", field=key)
        trajectories = []
        for i, traj in enumerate(packed.trajectories):
            fields: dict[str, Any] = {name: np.asarray(arrays[f"t{i}_{name}"]) for name in ARRAY_FIELDS}
            fields["advantages"] = np.asarray(arrays[f"t{i}_advantages"]) if traj.advantages else None
            fields["constraint_nodes"] = np.asarray(arrays[f"t{i}_constraint_nodes"]) if traj.constraint is not None else None
            # model_construct: no dtype coercion, so a wrong dtype is the "dtype" rule's to report
            trajectory = Trajectory.model_construct(**fields, **traj.model_dump(exclude={"advantages"}))
            check_trajectory(trajectory, f"{where}, trajectory {i}")
            trajectories.append(trajectory)
        if not _json_ok(packed.metadata):
            raise TrajectorySchemaError(violation_message(where, "metadata"), rule="metadata", field="metadata")
        return cls(trajectories=trajectories, metadata=packed.metadata)


class PackedTrajectory(BaseModel):
    """The JSON part of one packed trajectory (its arrays are named ``t<i>_<field>``)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    temperature: float
    reward: float
    reward_components: dict[str, float]
    stop_reason: str
    metadata: dict[str, Any]
    advantages: bool
    """Whether ``t<i>_advantages`` is among the arrays."""
    constraint: Optional[str] = None
    """The trie fingerprint; ``t<i>_constraint_nodes`` is among the arrays when set."""


class PackedGroup(BaseModel):
    """The JSON part of a packed :class:`TrajectoryGroup`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    metadata: dict[str, Any]
    trajectories: list[PackedTrajectory]


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """What ``prepare_batch`` hands the trainer: numpy arrays, right-padded.

    ``rows = B * group_size`` padded up to a multiple of the trainer's row multiple with
    padding rows (``group_index == -1``, all masks false). ``L`` is the longest sequence
    rounded up to ``rollout.length_bucket`` and capped by the configured maximum.
    """

    input_ids: np.ndarray
    """int32 ``[rows, L]``."""
    attention_mask: np.ndarray
    """bool ``[rows, L]``: real tokens."""
    loss_mask: np.ndarray
    """bool ``[rows, L]``: trained tokens (a subset of ``attention_mask``)."""
    behavior_logprobs: np.ndarray
    """float32 ``[rows, L]``."""
    versions: np.ndarray
    """int32 ``[rows, L]``; -1 on non-generated tokens and padding."""
    rewards: np.ndarray
    """float32 ``[rows]``."""
    group_index: np.ndarray
    """int32 ``[rows]``: group of each row (0..B-1); -1 for padding rows."""
    truncated: np.ndarray
    """bool ``[rows]``: ``stop_reason == "length"``."""
    temperature: float
    """The one sampling temperature of the batch."""
    advantages: Optional[np.ndarray] = None
    """float32 ``[rows, L]``, only when the workflow supplied its own."""
    constraint: Optional[str] = None
    """The fingerprint of the one trie the batch's constrained tokens were decoded under (None: none)."""
    constraint_nodes: Optional[np.ndarray] = None
    """int32 ``[rows, L]`` with ``constraint``: each token's trie node, -1 where unconstrained and on padding."""


# --------------------------------------------------------------------------- checks


def violation_message(where: str, rule: str, detail: str = "") -> str:
    field, requirement = RULES[rule]
    return f"{where}: field '{field}' breaks schema rule '{rule}' ({requirement}){': ' + detail if detail else ''}"


def array_violations(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    loss_mask: np.ndarray,
    behavior_logprobs: np.ndarray,
    versions: np.ndarray,
) -> list[tuple[str, int, int]]:
    """The token-level rules over ``[rows, L]`` arrays, vectorised.

    Returns ``(rule, row, position)`` of the first violation of each broken rule (position
    -1 for row-level rules). Rows whose ``attention_mask`` is all false are padding rows and
    must have no trained token.
    """
    found: list[tuple[str, int, int]] = []

    def first(rule: str, bad: np.ndarray) -> None:
        if bad.any():
            row, pos = np.unravel_index(int(np.argmax(bad)), bad.shape)
            found.append((rule, int(row), int(pos)))

    trained = loss_mask
    first("token_id", attention_mask & (input_ids < 0))
    first("first_token_trained", trained[:, :1])
    first("mask_outside_tokens", trained & ~attention_mask)
    real_rows = attention_mask.any(axis=1)
    empty = real_rows & ~trained.any(axis=1)
    if empty.any():
        found.append(("no_trained_token", int(np.argmax(empty)), -1))
    first("trained_version", trained & (versions < 0))
    first("version_range", attention_mask & (versions < -1))
    with np.errstate(invalid="ignore"):
        first("trained_logprob", trained & ~(np.isfinite(behavior_logprobs) & (behavior_logprobs <= 0)))
    first("ungenerated_logprob", attention_mask & (versions == -1) & (behavior_logprobs != 0))
    return found


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def check_trajectory(traj: Trajectory, where: str, *, expected_temperature: Optional[float] = None) -> None:
    """Every rule of :data:`RULES` on one trajectory; raises :class:`TrajectorySchemaError`.

    ``where`` names the trajectory (workflow, sample and index) for the message.
    """

    def fail(rule: str, detail: str = "") -> None:
        raise TrajectorySchemaError(violation_message(where, rule, detail), rule=rule, field=RULES[rule][0])

    arrays = {name: getattr(traj, name) for name in ARRAY_FIELDS}
    for name, arr in arrays.items():
        if arr.dtype != ARRAY_FIELDS[name]:
            fail("dtype", f"'{name}' has dtype {arr.dtype}, expected {ARRAY_FIELDS[name]}")
        if arr.ndim != 1:
            fail("ndim", f"'{name}' has shape {arr.shape}")
    lengths = {name: arr.shape[0] for name, arr in arrays.items()}
    if len(set(lengths.values())) != 1:
        fail("equal_length", ", ".join(f"{k}={v}" for k, v in lengths.items()))
    if lengths["input_ids"] == 0:
        fail("no_trained_token", "the trajectory is empty")
    row = {name: arr[None, :] for name, arr in arrays.items()}
    violations = array_violations(
        row["input_ids"], np.ones_like(row["loss_mask"]), row["loss_mask"], row["behavior_logprobs"], row["versions"]
    )
    if violations:
        rule, _, pos = violations[0]
        fail(rule, f"at token {pos}" if pos >= 0 else "")
    if traj.stop_reason not in STOP_REASONS:
        fail("stop_reason", f"given {traj.stop_reason!r}")
    if not (math.isfinite(traj.temperature) and traj.temperature > 0):
        fail("temperature", f"given {traj.temperature}")
    if expected_temperature is not None and traj.temperature != expected_temperature:
        fail("temperature_mismatch", f"given {traj.temperature}, rollout.temperature is {expected_temperature}")
    if not math.isfinite(traj.reward):
        fail("reward", f"given {traj.reward}")
    bad = [k for k, v in traj.reward_components.items() if not math.isfinite(v)]
    if bad:
        fail("reward_components", f"not finite: {', '.join(bad)}")
    if not _json_ok(traj.metadata):
        fail("metadata", "json.dumps failed")
    if traj.advantages is not None:
        adv = traj.advantages
        if adv.dtype != np.float32 or adv.shape != traj.input_ids.shape or not np.isfinite(adv).all():
            fail("advantages", f"dtype {adv.dtype}, shape {adv.shape}, expected float32 {traj.input_ids.shape}, finite")
    if (traj.constraint is None) != (traj.constraint_nodes is None):
        fail("constraint", "one of constraint and constraint_nodes is set without the other")
    if traj.constraint_nodes is not None:
        nodes = traj.constraint_nodes
        if nodes.dtype != np.int32 or nodes.shape != traj.input_ids.shape:
            fail("constraint", f"dtype {nodes.dtype}, shape {nodes.shape}, expected int32 {traj.input_ids.shape}")
        outside = (nodes < -1) | ((nodes >= 0) & (traj.versions < 0))
        if outside.any():
            fail("constraint", f"at token {int(np.argmax(outside))}")


def check_group(
    group: TrajectoryGroup,
    *,
    group_size: int,
    workflow: str,
    sample_id: Any,
    expected_temperature: Optional[float] = None,
) -> None:
    """The per-trajectory checks of one episode's group (run in the rollout thread)."""
    where = f"workflow '{workflow}', sample {sample_id}"
    runs = group.metadata.get("runs")
    if runs is None and len(group.trajectories) != group_size:
        rule = "group_size"
        raise TrajectorySchemaError(
            violation_message(where, rule, f"got {len(group.trajectories)}, expected {group_size}"), rule=rule, field=RULES[rule][0]
        )
    if runs is not None and (not isinstance(runs, list) or len(runs) != len(group.trajectories)
                             or sorted(set(runs)) != list(range(group_size))):
        rule = "group_size"
        detail = f"metadata['runs'] = {runs!r} for {len(group.trajectories)} trajectories, expected runs 0..{group_size - 1}"
        raise TrajectorySchemaError(violation_message(where, rule, detail), rule=rule, field=RULES[rule][0])
    if not _json_ok(group.metadata):
        rule = "metadata"
        raise TrajectorySchemaError(violation_message(where + " (group)", rule), rule=rule, field="metadata")
    for i, traj in enumerate(group.trajectories):
        check_trajectory(traj, f"{where}, trajectory {i}", expected_temperature=expected_temperature)


def check_batch(batch: TrainBatch, row_names: Sequence[str]) -> None:
    """The vectorised rules over a stacked batch; ``row_names[r]`` names row r for messages."""
    violations = array_violations(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.behavior_logprobs, batch.versions)
    padding = batch.group_index < 0
    if (batch.attention_mask[padding].any()) or batch.loss_mask[padding].any():
        violations.append(("mask_outside_tokens", int(np.argmax(padding)), -1))
    if violations:
        rule, row, pos = violations[0]
        name = row_names[row] if row < len(row_names) else f"padding row {row}"
        detail = f"batch row {row}" + (f", token {pos}" if pos >= 0 else "")
        raise TrajectorySchemaError(violation_message(f"prepare_batch, {name}", rule, detail), rule=rule, field=RULES[rule][0])


# --------------------------------------------------------------------------- building


class TrajectoryBuilder:
    """Assemble a trajectory turn by turn (multi-turn and tool workflows).

    ``add_tokens`` appends tokens the policy did not generate (prompt, tool output, user
    turn): untrained, version -1, log-prob 0. ``add_generation`` appends an engine response:
    trained (unless ``trained=False``; such tokens keep their real log-probs and versions).
    """

    def __init__(self) -> None:
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._logprobs: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []
        self._nodes: list[np.ndarray] = []
        self._constraint: Optional[str] = None
        self.stop_reason: str = "eos"

    @property
    def input_ids(self) -> np.ndarray:
        return np.concatenate(self._ids).astype(np.int32) if self._ids else np.zeros(0, np.int32)

    def __len__(self) -> int:
        return sum(len(x) for x in self._ids)

    def add_tokens(self, token_ids: Sequence[int]) -> "TrajectoryBuilder":
        ids = np.asarray(token_ids, dtype=np.int32)
        self._ids.append(ids)
        self._mask.append(np.zeros(len(ids), bool))
        self._logprobs.append(np.zeros(len(ids), np.float32))
        self._versions.append(np.full(len(ids), -1, np.int32))
        self._nodes.append(np.full(len(ids), -1, np.int32))
        return self

    def add_generation(self, response: GenerationResponse, *, trained: bool = True, constraint: Any = None) -> "TrajectoryBuilder":
        """``constraint``: the request's :class:`~asyncrl.engine.constraints.TokenTrie`, if any
        (its nodes travel with the trajectory so the trainer scores the tokens under its mask)."""
        n = len(response.output_ids)
        if constraint is not None:
            if self._constraint not in (None, constraint.fingerprint):
                raise ValueError("TrajectoryBuilder.add_generation: one trajectory's turns must share one constraint")
            self._constraint = constraint.fingerprint
            self._nodes.append(np.asarray(constraint.walk(response.output_ids)[:-1], np.int32))
        else:
            self._nodes.append(np.full(n, -1, np.int32))
        self._ids.append(np.asarray(response.output_ids, np.int32))
        self._mask.append(np.full(n, trained, bool))
        self._logprobs.append(np.asarray(response.logprobs, np.float32))
        self._versions.append(np.asarray(response.versions, np.int32))
        self.stop_reason = response.stop_reason
        return self

    def build(self, *, temperature: float, reward: float, reward_components: Optional[dict[str, float]] = None,
              metadata: Optional[dict[str, Any]] = None, stop_reason: Optional[str] = None) -> Trajectory:
        return Trajectory(
            input_ids=self.input_ids,
            loss_mask=np.concatenate(self._mask) if self._mask else np.zeros(0, bool),
            behavior_logprobs=np.concatenate(self._logprobs) if self._logprobs else np.zeros(0, np.float32),
            versions=np.concatenate(self._versions) if self._versions else np.zeros(0, np.int32),
            temperature=temperature,
            reward=reward,
            reward_components=dict(reward_components or {}),
            stop_reason=stop_reason or self.stop_reason,
            metadata=dict(metadata or {}),
            constraint=self._constraint,
            constraint_nodes=None if self._constraint is None else np.concatenate(self._nodes).astype(np.int32),
        )
