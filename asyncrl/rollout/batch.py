"""prepare_batch: ordered groups in, one validated, padded TrainBatch out. Pure. And what a
batch source hands the loop per step (:class:`PreparedBatch`, :class:`BatchSource`).

``prepare_batch(groups, version, cfg)`` walks ``groups`` in the order given (ticket order or
completion order: the caller decides) and keeps the first ``B = rollout.batch_size`` groups
that survive the consumption filters, dropping (with a reason, counted as ``dropped:<reason>``):

* ``aborted``: a trajectory with ``stop_reason == "aborted"``;
* ``stale``: a trained token older than ``version − rollout.max_staleness`` (the guarantee
  of docs/design.md "Staleness control", in every batch order);
* ``prompt_too_long``: a prompt longer than ``data.max_prompt_tokens``;
* ``too_long``: a trajectory longer than the batch length cap (``Config.max_seq_len``);
* ``zero_variance``: all rewards equal, only with ``rollout.filter_zero_variance``, and at most
  ``rollout.max_filtered_per_step`` per step; past that budget such groups are trained on.

The walk stops at the B-th kept group, so the groups it examined are exactly the first
``B + len(dropped)``. A temperature other than ``rollout.temperature`` is rejected
(:class:`~asyncrl.errors.TrajectorySchemaError`): one batch, one temperature.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np

from asyncrl.config import Config
from asyncrl.errors import RolloutError, TrajectorySchemaError
from asyncrl.rollout.trajectory import RULES, TrainBatch, TrajectoryGroup, check_batch, violation_message

log = logging.getLogger(__name__)


class BatchAbandoned(RolloutError):
    """``next_batch`` stopped waiting because its ``abandon_if`` said so; nothing was consumed."""


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """One trainer step's input, as a :class:`BatchSource` made it."""

    batch: TrainBatch
    """The padded batch, ``[rows, L]`` arrays (rows: the groups' trajectories, then padding)."""
    groups: tuple[TrajectoryGroup, ...] = ()
    """The groups in the batch, in ``group_index`` order (RL; empty for SFT)."""
    sample_ids: tuple[int, ...] = ()
    """The sample id of each group (RL) or example (SFT), in batch order."""
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """The source's metrics as of this batch (``rollout/*`` or ``sft/*``), final names."""


class BatchSource(Protocol):
    """What a stage of the loop (:func:`asyncrl.run.loop.run_stage`) trains on: the RL stage's
    :class:`~asyncrl.rollout.executor.WorkflowExecutor`, the SFT stage's :class:`~asyncrl.run.sft.SFTData`."""

    def next_batch(self, version: int, timeout: Optional[float] = None, *,
                   abandon_if: Optional[Callable[[], bool]] = None) -> PreparedBatch:
        """The batch of the trainer step starting from ``version``; may wait up to ``timeout`` s,
        polling ``abandon_if`` (True: give up with :class:`BatchAbandoned`, nothing consumed)."""
        ...

    def set_version(self, version: int) -> None:
        """The engine now serves ``version`` (called after each publish)."""
        ...

    def state_dict(self) -> Any:
        """What a checkpoint keeps so that a resumed run continues with the very next batch."""
        ...

    def checkpoint_state(self) -> Any:
        """:meth:`state_dict` as of the last :meth:`set_version`: what the loop checkpoints after
        a step (consistent with the engine counters it read before that publish)."""
        ...

    def close(self) -> None:
        """Stop background work; returns promptly."""
        ...


def group_name(group: TrajectoryGroup) -> str:
    sample_id = group.metadata.get("sample_id")
    if sample_id is None and group.trajectories:
        sample_id = group.trajectories[0].metadata.get("sample_id")
    return f"sample {sample_id}" if sample_id is not None else "sample ?"


def drop_reason(group: TrajectoryGroup, version: int, cfg: Config) -> Optional[str]:
    """Why ``group`` may not be trained at ``version`` (zero variance aside), or None."""
    if group.aborted:
        return "aborted"
    if group.min_version < version - cfg.rollout.max_staleness:
        return "stale"
    if any(t.prompt_length > cfg.data.max_prompt_tokens for t in group.trajectories):
        return "prompt_too_long"
    if any(t.num_tokens > cfg.max_seq_len for t in group.trajectories):
        return "too_long"
    return None


def select_groups(
    groups: Sequence[TrajectoryGroup], version: int, cfg: Config, *, filter_budget: Optional[int] = None,
    batch_size: Optional[int] = None,
) -> tuple[list[int], list[tuple[int, str]]]:
    """The walk of :func:`prepare_batch`: ``(kept indices, [(dropped index, reason)])``.

    Stops once ``batch_size`` (default ``B``) groups are kept (fewer when ``groups`` runs out).
    ``filter_budget``: how many zero-variance drops are still allowed this step (default
    ``rollout.max_filtered_per_step``).
    """
    rollout = cfg.rollout
    size = rollout.batch_size if batch_size is None else batch_size
    budget = rollout.resolved_max_filtered_per_step if filter_budget is None else filter_budget
    kept: list[int] = []
    dropped: list[tuple[int, str]] = []
    filtered = 0
    for index, group in enumerate(groups):
        if len(kept) == size:
            break
        reason = drop_reason(group, version, cfg)
        if reason is None and rollout.filter_zero_variance and group.zero_variance:
            if filtered < budget:
                reason = "zero_variance"
                filtered += 1
            elif filtered == budget:
                log.info("zero-variance filter: budget of %d drops this step is spent; training on zero-variance groups", budget)
                filtered += 1  # log once
        if reason is None:
            kept.append(index)
        else:
            dropped.append((index, reason))
    return kept, dropped


def prepare_batch(
    groups: Sequence[TrajectoryGroup],
    version: int,
    cfg: Config,
    *,
    row_multiple: int = 1,
    filter_budget: Optional[int] = None,
    batch_size: Optional[int] = None,
) -> tuple[TrainBatch, list[tuple[TrajectoryGroup, str]]]:
    """Build the TrainBatch for the trainer step starting from ``version``.

    Args:
        groups: candidate groups in batch order; at least ``B`` must survive the filters.
        version: the version the batch is trained at (the served version ``v``).
        cfg: the run config.
        row_multiple: rows are padded up to a multiple of this (the trainer's data x fsdp
            shards x micro-batches x mini-batches).
        filter_budget: zero-variance drops still allowed this step (default: the configured budget).
        batch_size: groups to keep (default ``rollout.batch_size``; a process's share of it in a
            multi-process run).

    Returns ``(batch, dropped)`` with ``dropped`` the ``(group, reason)`` pairs in walk order.
    Raises ``ValueError`` when fewer than ``B`` groups survive, and
    :class:`~asyncrl.errors.TrajectorySchemaError` on a temperature mismatch or a broken rule.
    """
    size = cfg.rollout.batch_size if batch_size is None else batch_size
    kept, dropped_idx = select_groups(groups, version, cfg, filter_budget=filter_budget, batch_size=size)
    if len(kept) < size:
        raise ValueError(
            f"prepare_batch: only {len(kept)} of rollout.batch_size = {size} groups survive the filters "
            f"({len(groups)} given, {len(dropped_idx)} dropped)"
        )
    chosen = [groups[i] for i in kept]
    dropped = [(groups[i], reason) for i, reason in dropped_idx]
    return build_train_batch(chosen, cfg, row_multiple=row_multiple), dropped


def batch_shape(real_rows: int, longest: int, cfg: Config, row_multiple: int, where: str) -> tuple[int, int]:
    """``(rows, L)`` of a TrainBatch (docs/design.md "TrainBatch"): rows padded up to a multiple of
    ``row_multiple``; ``L`` the longest sequence rounded up to ``rollout.length_bucket`` and
    capped by ``Config.max_seq_len``. RL and SFT batches share this rule."""
    if row_multiple < 1:
        raise ValueError(f"{where}: row_multiple must be >= 1 (given {row_multiple})")
    rows = -(-real_rows // row_multiple) * row_multiple
    bucket = cfg.rollout.length_bucket
    length = min(-(-longest // bucket) * bucket, cfg.max_seq_len)
    if longest > length:
        raise ValueError(f"{where}: a sequence of {longest} tokens exceeds the length cap {length} (Config.max_seq_len)")
    return rows, length


def build_train_batch(groups: Sequence[TrajectoryGroup], cfg: Config, *, row_multiple: int = 1) -> TrainBatch:
    """Stack, pad and check ``groups`` (already selected) into a TrainBatch."""
    if row_multiple < 1:
        raise ValueError(f"row_multiple must be >= 1 (given {row_multiple})")
    temperature = cfg.rollout.temperature
    trajectories = [(k, g, i, t) for k, g in enumerate(groups) for i, t in enumerate(g.trajectories)]
    for _, group, i, traj in trajectories:
        if traj.temperature != temperature:
            rule = "temperature_mismatch"
            raise TrajectorySchemaError(
                violation_message(f"prepare_batch, {group_name(group)}, trajectory {i}", rule,
                                  f"given {traj.temperature}, rollout.temperature is {temperature}"),
                rule=rule, field=RULES[rule][0],
            )
    real_rows = len(trajectories)
    rows, length = batch_shape(real_rows, max(t.num_tokens for *_, t in trajectories), cfg, row_multiple, "prepare_batch")

    input_ids = np.zeros((rows, length), np.int32)
    attention_mask = np.zeros((rows, length), bool)
    loss_mask = np.zeros((rows, length), bool)
    behavior_logprobs = np.zeros((rows, length), np.float32)
    versions = np.full((rows, length), -1, np.int32)
    rewards = np.zeros(rows, np.float32)
    group_index = np.full(rows, -1, np.int32)
    truncated = np.zeros(rows, bool)
    with_advantages = sum(t.advantages is not None for *_, t in trajectories)
    if with_advantages not in (0, real_rows):
        rule = "advantages"
        raise TrajectorySchemaError(
            violation_message("prepare_batch", rule, f"{with_advantages} of {real_rows} trajectories carry advantages; all or none must"),
            rule=rule, field=RULES[rule][0],
        )
    advantages = np.zeros((rows, length), np.float32) if with_advantages else None
    tries = sorted({t.constraint for *_, t in trajectories if t.constraint is not None})
    if len(tries) > 1:
        rule = "constraint_mismatch"
        raise TrajectorySchemaError(
            violation_message("prepare_batch", rule, f"the trajectories were decoded under {len(tries)} tries ({', '.join(tries)})"),
            rule=rule, field=RULES[rule][0],
        )
    constraint_nodes = np.full((rows, length), -1, np.int32) if tries else None

    names = []
    for row, (k, group, i, traj) in enumerate(trajectories):
        n = traj.num_tokens
        input_ids[row, :n] = traj.input_ids
        attention_mask[row, :n] = True
        loss_mask[row, :n] = traj.loss_mask
        behavior_logprobs[row, :n] = traj.behavior_logprobs
        versions[row, :n] = traj.versions
        rewards[row] = traj.reward
        group_index[row] = k
        truncated[row] = traj.stop_reason == "length"
        if advantages is not None:
            advantages[row, :n] = traj.advantages
        if constraint_nodes is not None and traj.constraint_nodes is not None:
            constraint_nodes[row, :n] = traj.constraint_nodes
        names.append(f"{group_name(group)}, trajectory {i}")
    batch = TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behavior_logprobs=behavior_logprobs,
        versions=versions,
        rewards=rewards,
        group_index=group_index,
        truncated=truncated,
        temperature=float(temperature),
        advantages=advantages,
        constraint=tries[0] if tries else None,
        constraint_nodes=constraint_nodes,
    )
    check_batch(batch, names)
    return batch
