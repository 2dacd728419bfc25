"""Reward functions and how rollouts call them: weighted sums, per-call timeouts on helper
threads, fallbacks and failure counts.

Reward functions have the signature ``fn(prompt: str, completion: str, **sample_fields) -> float``.
They are weighted and summed; each raw score is kept in ``reward_components``. A function
that raises, returns a non-finite value or runs past ``rollout.reward_timeout_s`` scores
``rollout.reward_fallback`` instead; this is counted, and logged (with the sample) the first
time for each function. ``rollout.max_consecutive_reward_failures`` such calls in a row of
one function stop training with the cause (:class:`RewardFailuresExceeded`); signatures are
checked against the dataset's fields at start-up (:func:`check_reward_signatures`).

Reward calls run on a helper daemon thread so that a stuck function can be abandoned: each
calling thread (a rollout worker, an eval thread) has one long-lived helper that runs its calls
one at a time, reused across calls and scorers, and exits soon after its caller thread ends. A
call past the timeout abandons its helper (it exits once the function returns) and the
caller's next call starts one replacement, so the thread count stays constant.

A workflow scores with :meth:`~asyncrl.rollout.workflow.RolloutWorkflow.score`, which holds
one :class:`RewardScorer` built from the config's rewards (:func:`build_reward_functions`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import itertools
import logging
import math
import queue
import threading
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence

from asyncrl.config import Config
from asyncrl.errors import ConfigError, RolloutError
from asyncrl.registry import resolve

log = logging.getLogger(__name__)


class RewardFailuresExceeded(RolloutError):
    """One reward function failed ``rollout.max_consecutive_reward_failures`` calls in a row: training stops."""


def reward_fields(sample: Mapping[str, Any], prompt_field: str = "prompt") -> dict[str, Any]:
    """The keyword arguments reward functions get: every sample field but the prompt and completion."""
    return {k: v for k, v in sample.items() if k not in (prompt_field, "messages", "prompt", "completion")}


# --------------------------------------------------------------------------- rewards


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A reward function, its weight, and the name of its raw score in ``reward_components``."""

    fn: Callable[..., float]
    weight: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", _fn_name(self.fn))


def _fn_name(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__name__", type(inner).__name__)


def build_reward_functions(cfg: Config) -> list[RewardFunction]:
    """The ``rewards`` of the config, resolved through the registry."""
    out = []
    for i, spec in enumerate(cfg.rewards):
        fn = resolve("reward", spec.component(), where=f"rewards.{i}.fn")
        if not callable(fn):
            raise ConfigError(f"rewards.{i}.fn: {spec.fn!r} is not callable")
        name = spec.name or (spec.fn if isinstance(spec.fn, str) and ":" not in spec.fn else _fn_name(fn))
        out.append(RewardFunction(fn, spec.weight, name))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"rewards: two reward functions share a name ({', '.join(names)}); set rewards.N.name")
    return out


def check_reward_signatures(functions: Sequence[RewardFunction], sample: Mapping[str, Any], prompt_field: str = "prompt") -> None:
    """Start-up check that every reward function accepts the documented call
    ``fn(prompt, completion, **fields)`` with the fields of ``sample`` (a dataset sample, with
    ``sample_id`` as the executor adds it). ``functions[i]`` is ``rewards.i`` of the config.
    A function that could never be called raises a :class:`ConfigError` naming ``rewards.N.fn``."""
    fields = reward_fields({**sample, "sample_id": 0}, prompt_field)
    problems = []
    for index, rf in enumerate(functions):
        try:
            signature = inspect.signature(rf.fn)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: its first call will tell
        try:
            signature.bind("prompt", "completion", **fields)
        except TypeError as err:
            problems.append(
                f"rewards.{index}.fn: {rf.name}{signature} cannot be called as fn(prompt, completion, **fields) with "
                f"this dataset's fields ({', '.join(sorted(fields)) or 'none'}): {err}; take (prompt, completion, "
                "**fields) and read the fields you need by name"
            )
    if problems:
        raise ConfigError(problems)


_HELPER_POLL_S = 0.5
"""How often an idle reward helper checks that its caller thread is still alive."""
_helper_ids = itertools.count(1)
_helper_of_thread = threading.local()


@dataclasses.dataclass
class _RewardCall:
    """One reward-function call handed to a helper; ``done`` is set once it returned or raised."""

    fn: Callable[[], Any]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    value: Any = None
    error: Optional[str] = None


class _RewardHelper:
    """A daemon thread that runs the reward calls of one caller thread, one at a time.

    It exits when its caller thread has ended, or after finishing a call the caller stopped
    waiting for (``abandoned``; the caller has started a replacement by then).
    """

    def __init__(self, caller: threading.Thread):
        self.caller = caller
        self.abandoned = False
        self._lock = threading.Lock()
        self._inbox: "queue.SimpleQueue[_RewardCall]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"reward-helper-{next(_helper_ids)}", daemon=True)
        self.thread.start()

    @classmethod
    def for_current_thread(cls) -> "_RewardHelper":
        """The calling thread's helper, started on first use or after the last one was abandoned."""
        helper = getattr(_helper_of_thread, "helper", None)
        if helper is None or helper.abandoned:
            helper = _helper_of_thread.helper = cls(threading.current_thread())
        return helper

    def call(self, fn: Callable[[], Any], timeout_s: float) -> Optional[_RewardCall]:
        """Run ``fn`` on this helper; the finished call, or None after ``timeout_s`` (helper abandoned)."""
        job = _RewardCall(fn)
        self._inbox.put(job)
        if not job.done.wait(timeout_s):
            with self._lock:  # decided under the lock, so a call finishing right now is not lost
                if not job.done.is_set():
                    self.abandoned = True
                    return None
        return job

    def _loop(self) -> None:
        while True:
            try:
                job = self._inbox.get(timeout=_HELPER_POLL_S)
            except queue.Empty:
                if not self.caller.is_alive():
                    return
                continue
            try:
                job.value = job.fn()
            except BaseException:  # noqa: BLE001 - becomes the fallback score, logged
                job.error = traceback.format_exc()
            with self._lock:
                job.done.set()
                if self.abandoned:
                    return


class RewardScorer:
    """Weighted sum of reward functions with per-call timeouts and a fallback score."""

    def __init__(self, functions: Sequence[RewardFunction], *, timeout_s: float, fallback: float,
                 max_consecutive_failures: Optional[int] = None):
        self.functions = list(functions)
        self.timeout_s = timeout_s
        self.fallback = fallback
        self.max_consecutive_failures = max_consecutive_failures
        """Failed calls in a row of one function that raise :class:`RewardFailuresExceeded` (None: never)."""
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._in_a_row: dict[str, int] = {}
        self.errors = 0
        self.timeouts = 0

    @classmethod
    def from_config(cls, functions: Sequence[RewardFunction], cfg: Config) -> "RewardScorer":
        """A scorer with the config's ``rollout.reward_timeout_s``, ``reward_fallback`` and
        ``max_consecutive_reward_failures``."""
        rollout = cfg.rollout
        return cls(functions, timeout_s=rollout.reward_timeout_s, fallback=rollout.reward_fallback,
                   max_consecutive_failures=rollout.max_consecutive_reward_failures)

    def score(self, prompt: str, completion: str, sample_fields: Mapping[str, Any], sample_id: Any) -> tuple[float, dict[str, float]]:
        """``(weighted total, {name: raw score})``."""
        total, components = 0.0, {}
        for rf in self.functions:
            value = self._call(rf, prompt, completion, sample_fields, sample_id)
            components[rf.name] = value
            total += rf.weight * value
        return total, components

    def _call(self, rf: RewardFunction, prompt: str, completion: str, fields: Mapping[str, Any], sample_id: Any) -> float:
        # On the caller's helper thread: a stuck reward function is abandoned, never waited on.
        # The caller's context travels with the call (the reward_model reward reads the tokens
        # the workflow scored from it, asyncrl.rollout.scoring_group).
        context = contextvars.copy_context()
        job = _RewardHelper.for_current_thread().call(lambda: context.run(rf.fn, prompt, completion, **fields), self.timeout_s)
        if job is None:
            return self._fallback(rf, sample_id, "timeout", f"ran past rollout.reward_timeout_s = {self.timeout_s} s")
        if job.error is not None:
            return self._fallback(rf, sample_id, "error", job.error)
        try:
            value = float(job.value)
        except (TypeError, ValueError):
            return self._fallback(rf, sample_id, "error", f"returned {job.value!r}, not a number")
        if not math.isfinite(value):
            return self._fallback(rf, sample_id, "error", f"returned {value}")
        with self._lock:
            self._in_a_row[rf.name] = 0
        return value

    def _fallback(self, rf: RewardFunction, sample_id: Any, kind: str, detail: str) -> float:
        with self._lock:
            if kind == "timeout":
                self.timeouts += 1
            else:
                self.errors += 1
            first = rf.name not in self._logged
            self._logged.add(rf.name)
            in_a_row = self._in_a_row[rf.name] = self._in_a_row.get(rf.name, 0) + 1
        what = "timed out" if kind == "timeout" else "failed"
        limit = self.max_consecutive_failures
        if limit is not None and in_a_row >= limit:
            raise RewardFailuresExceeded(
                f"reward function '{rf.name}' {what} on {in_a_row} calls in a row "
                f"(rollout.max_consecutive_reward_failures = {limit}); last, on sample {sample_id}:\n{detail.strip()}"
            )
        message = "reward function '%s' %s on sample %s; scoring %s (rollout.reward_fallback). Later ones are only counted.\n%s"
        (log.warning if first else log.debug)(message, rf.name, what, sample_id, self.fallback, detail)
        return self.fallback

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {"reward_errors": float(self.errors), "reward_timeouts": float(self.timeouts)}
