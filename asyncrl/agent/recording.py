"""What an agent's completions become: token-exact records, then trajectories.

Every completion the OpenAI-compatible API answers inside an episode is recorded as a
:class:`CompletionRecord`: the prompt ids exactly as the chat template produced them, the ids
the engine sampled (never decoded and re-encoded), their behaviour log-probs and the weights
version of every token (a completion spanning a publish carries both versions).

:func:`assemble_trajectories` turns one run's records into trajectories, by token ids only:

* a completion whose prompt ids start with an earlier completion's ``prompt + output`` ids
  (a conversation that grew by appending: tool results, the next user turn) continues that
  completion's trajectory: the new prompt tokens are masked (not trained, version -1), the new
  output trained. Each completion is continued at most once (the first that extends it);
* any other completion (the first, one whose history the agent edited, one whose template
  re-rendered earlier turns differently) starts a trajectory of its own. Those after the first
  call are counted as ``splits``; nothing is ever merged by text.

Rewards: a completion's reward is the one set for it (``client.set_reward``), else the next
completion's times ``turn_discount`` (walking back through the run's completions in the order
they were made); the last completion's default is the run's return value (0 when it returned
None). A trajectory's reward is that of its last completion.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional, Sequence

import numpy as np

from asyncrl.engine.protocol import GenerationResponse
from asyncrl.rollout.trajectory import Trajectory, TrajectoryBuilder


@dataclasses.dataclass
class CompletionRecord:
    """One sampled answer (one choice of one API call), token-exact."""

    completion_id: str
    """The ``id`` of the API answer (shared by the ``n`` choices of one call)."""
    choice: int
    """Index of this choice in the answer."""
    call: int
    """Number of the API call within its run (0, 1, ...)."""
    prompt_ids: np.ndarray
    """int32 ``[P]``: the prompt as templated and sent to the engine."""
    response: GenerationResponse
    """The engine's sample: ``output_ids``, ``logprobs``, ``versions`` ``[N]``, ``stop_reason``."""
    reward: Optional[float] = None
    """Set by ``client.set_reward``; None: derived (see the module docstring)."""

    @property
    def full_ids(self) -> np.ndarray:
        """int32 ``[P + N]``: prompt then sampled ids."""
        return np.concatenate([self.prompt_ids, np.asarray(self.response.output_ids, np.int32)])


class EpisodeRecorder:
    """The completions of one run (one of an episode's ``group_size`` agent runs); thread-safe,
    since a synchronous agent may call from several threads."""

    def __init__(self, run_index: int = 0, sample_id: int = 0):
        self.run_index = run_index
        self.sample_id = sample_id
        self.records: list[CompletionRecord] = []
        self.tool_calls = 0
        self.malformed_tool_calls = 0
        self.failure: Optional[BaseException] = None
        """The engine's error when a call failed (an engine crash reaches the executor through it)."""
        self._calls = 0
        self._lock = threading.Lock()

    def next_call(self) -> int:
        """A fresh call number (the engine's ``turn`` of the request)."""
        with self._lock:
            self._calls += 1
            return self._calls - 1

    def add(self, record: CompletionRecord) -> None:
        with self._lock:
            self.records.append(record)

    def count_tool_calls(self, parsed: int, malformed: int) -> None:
        with self._lock:
            self.tool_calls += parsed
            self.malformed_tool_calls += malformed

    def set_reward(self, completion_id: str, reward: float, choice: Optional[int] = None) -> None:
        """Reward of the completion ``completion_id`` (every choice, or only ``choice``)."""
        with self._lock:
            found = [r for r in self.records if r.completion_id == completion_id and (choice is None or r.choice == choice)]
            if not found:
                known = sorted({r.completion_id for r in self.records})
                raise KeyError(f"set_reward: no completion {completion_id!r}"
                               + (f" choice {choice}" if choice is not None else "") + f" in this run (known: {known})")
            for record in found:
                record.reward = float(reward)


def completion_rewards(records: Sequence[CompletionRecord], final: Optional[float], turn_discount: float) -> list[float]:
    """Reward of each record (module docstring): set ones kept, the others discounted back from the next."""
    rewards = [0.0] * len(records)
    following = float(final) if final is not None else 0.0
    for i in range(len(records) - 1, -1, -1):
        own = records[i].reward
        if own is not None:
            rewards[i] = own
        else:
            rewards[i] = following if i == len(records) - 1 else turn_discount * following
        following = rewards[i]
    return rewards


def _starts_with(ids: np.ndarray, prefix: np.ndarray) -> bool:
    return len(prefix) <= len(ids) and bool(np.array_equal(ids[: len(prefix)], prefix))


@dataclasses.dataclass(frozen=True)
class Assembled:
    """One run's trajectories and how they were formed."""

    trajectories: list[Trajectory]
    chains: list[list[int]]
    """Record indices of each trajectory, in order."""
    splits: int
    """Completions after the run's first call that extended no earlier one."""


def assemble_trajectories(records: Sequence[CompletionRecord], *, temperature: float, final_reward: Optional[float],
                          turn_discount: float = 1.0, metadata: Optional[dict] = None) -> Assembled:
    """One run's records (in call order) as trajectories (module docstring). ``metadata`` is put on
    each trajectory, with ``completion_ids`` and ``episode_metrics`` added."""
    rewards = completion_rewards(records, final_reward, turn_discount)
    chains: list[list[int]] = []
    tails: dict[int, int] = {}  # record index -> its chain, while no later record extends it
    splits = 0
    for i, record in enumerate(records):
        parents = [j for j in tails if _starts_with(record.prompt_ids, records[j].full_ids)]
        if parents:
            parent = max(parents, key=lambda j: len(records[j].full_ids))  # the longest (latest) history
            chain = tails.pop(parent)
            chains[chain].append(i)
        else:
            chain = len(chains)
            chains.append([i])
            splits += int(record.call > 0)
        tails[i] = chain
    trajectories = []
    for members in chains:
        builder = TrajectoryBuilder()
        covered = 0
        for k in members:
            record = records[k]
            builder.add_tokens(record.prompt_ids[covered:].tolist())
            builder.add_generation(record.response)
            covered = len(record.prompt_ids) + len(record.response.output_ids)
        last = records[members[-1]]
        info = dict(metadata or {})
        info["completion_ids"] = [f"{records[k].completion_id}:{records[k].choice}" for k in members]
        info["episode_metrics"] = {"completions": float(len(members)), "splits": float(splits)}
        trajectories.append(builder.build(temperature=temperature, reward=rewards[members[-1]], metadata=info,
                                          stop_reason=last.response.stop_reason))
    return Assembled(trajectories, chains, splits)
