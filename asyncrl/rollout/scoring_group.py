"""The tokens a workflow scored, handed to token-aware reward functions (``reward_model``).

Reward functions are called as ``fn(prompt, completion, **fields)`` with text. A workflow
that knows the token ids its policy saw scores completion ``i`` of a group inside
``with group.scoring(i):``; a reward that wants them reads :func:`current_scoring` (the
reward call runs on a helper thread with the caller's context, see
:class:`~asyncrl.rollout.rewards.RewardScorer`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence


class ScoringGroup:
    """The tokens of a group of completions, handed by a workflow to token-aware rewards.

    The workflow scores completion ``i`` inside ``with group.scoring(i):``; the
    ``reward_model`` reward reads the policy's ``prompt_ids`` + ``completion_ids[i]`` from it
    (no re-rendering with the same tokenizer), and ``messages`` + ``completions[i]`` to
    re-render for another. On its first call it submits the whole group, so the group's
    completions share device batches.
    """

    def __init__(self, messages: Sequence[Mapping[str, Any]], prompt_ids: Sequence[int],
                 completion_ids: Sequence[Sequence[int]], completions: Sequence[str]):
        if len(completion_ids) != len(completions):
            raise ValueError(f"ScoringGroup: {len(completion_ids)} completion id lists but {len(completions)} completions")
        self.messages = [dict(m) for m in messages]
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.completion_ids = [[int(t) for t in ids] for ids in completion_ids]
        self.completions = list(completions)
        self._futures: dict[Any, list[Future]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def scoring(self, index: int) -> Iterator[None]:
        """Completion ``index`` of this group is being scored (reward calls inside see it)."""
        token = _CURRENT.set((self, index))
        try:
            yield
        finally:
            _CURRENT.reset(token)

    def futures(self, key: Any, submit_all: Callable[[], list[Future]]) -> list[Future]:
        """The futures of every completion for one reward model (``submit_all()`` on first use)."""
        with self._lock:
            if key not in self._futures:
                self._futures[key] = submit_all()
            return self._futures[key]


_CURRENT: contextvars.ContextVar[Optional[tuple[ScoringGroup, int]]] = contextvars.ContextVar("scoring_group", default=None)


def current_scoring() -> Optional[tuple[ScoringGroup, int]]:
    """``(group, index)`` of the completion being scored, or None outside ``group.scoring(i)``."""
    return _CURRENT.get()
