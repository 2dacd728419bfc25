"""Rollout workflows: what one episode does, from a dataset sample to a TrajectoryGroup.

Users subclass :class:`RolloutWorkflow` and implement ``run_episode(engine, sample)``;
the executor runs it in a rollout thread. :class:`SingleTurnWorkflow` (alias
``single_turn``) is the RLVR case: chat-template the prompt, sample ``group_size``
completions in one engine call, score each with the configured reward functions.

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
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import logging
import itertools
import math
import queue
import threading
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence

from asyncrl.config import Config
from asyncrl.engine.protocol import GenerationRequest, InferenceEngine
from asyncrl.errors import ConfigError, RolloutError
from asyncrl.registry import register, resolve
from asyncrl.rollout.scoring_group import ScoringGroup
from asyncrl.rollout.trajectory import TrajectoryBuilder, TrajectoryGroup

log = logging.getLogger(__name__)


class SkipSample(Exception):
    """Raised by a workflow for a sample it will not run (e.g. ``prompt_too_long``).

    The executor counts it as ``dropped:<reason>``; it is not a failure.
    """

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class WorkflowInitError(RolloutError):
    """A workflow subclass whose ``__init__`` did not call ``RolloutWorkflow.__init__``."""


class RewardFailuresExceeded(RolloutError):
    """One reward function failed ``rollout.max_consecutive_reward_failures`` calls in a row: training stops."""


class RolloutWorkflow:
    """Base class of workflows. Subclasses implement :meth:`run_episode`.

    ``__init__(cfg, tokenizer)`` stores :attr:`cfg` and :attr:`tokenizer`; a subclass with
    its own ``__init__`` calls ``super().__init__(cfg, tokenizer)`` (SFT and eval format
    prompts with :attr:`tokenizer` and :meth:`messages`). Every workflow can score a
    completion with the config's ``rewards:`` (weights, timeouts, fallback, counting) by
    :meth:`score`.

    ``run_episode`` runs in a rollout thread, many at once, so it must not mutate shared
    state without a lock. ``sample`` is the dataset sample (a mapping) with its
    ``sample_id`` added; pass ``sample_id`` (and a ``turn`` number per engine call) into every
    :class:`~asyncrl.engine.protocol.GenerationRequest` so a re-issued episode draws the same
    tokens. Return a group of exactly ``rollout.group_size`` trajectories, or None when there
    is nothing to train (counted ``returned_none``). Raise :class:`SkipSample` to skip a sample.
    """

    prompt_field: str = "prompt"
    """The sample field :meth:`messages` reads the prompt from (unless the sample has ``messages``)."""
    system_prompt: Optional[str] = None
    """An optional system message :meth:`messages` puts before the prompt."""

    def __init__(self, cfg: Config, tokenizer: Any):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._scorer: Optional["RewardScorer"] = None
        self._scorer_lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: a subclass that skipped the base __init__.
        if name in ("cfg", "tokenizer", "_scorer", "_scorer_lock"):
            raise WorkflowInitError(
                f"workflow {type(self).__name__}: has no '{name}' because its __init__ does not call "
                "super().__init__(cfg, tokenizer) (RolloutWorkflow.__init__); add that call"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def name(self) -> str:
        return type(self).__name__

    def messages(self, sample: Mapping[str, Any]) -> tuple[list[dict[str, str]], str]:
        """Chat messages of the sample and the prompt text given to reward functions.

        The sample's ``messages`` (a list of chat messages) when present, else one user
        message with ``sample[prompt_field]``; :attr:`system_prompt` goes first when set.
        SFT and eval use this too, so they format prompts exactly as training does.
        """
        if "messages" in sample:
            messages = list(sample["messages"])
            prompt = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
        else:
            if self.prompt_field not in sample:
                raise KeyError(f"sample has no field '{self.prompt_field}' ({self.name} prompt_field); fields: {sorted(sample)}")
            prompt = str(sample[self.prompt_field])
            messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages, prompt

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of ``messages`` as the model sees them: :func:`render_prompt` with this
        workflow's tokenizer and the config's ``data.chat_template_kwargs``."""
        return render_prompt(self.tokenizer, messages, self.cfg.data.chat_template_kwargs)

    @property
    def decoding_constraint(self) -> Any:
        """The :class:`~asyncrl.engine.constraints.TokenTrie` of ``rollout.decoding.constraint`` (None
        when unset): pass it as every request's ``constraint`` and to ``add_generation`` (docs/decoding.md)."""
        path = self.cfg.rollout.decoding.constraint
        if not path:
            return None
        from asyncrl.engine.constraints import load_trie

        return load_trie(path)

    @property
    def scorer(self) -> "RewardScorer":
        """The :class:`RewardScorer` of the config's ``rewards:``, built on first use."""
        if self._scorer is None:
            with self._scorer_lock:
                if self._scorer is None:
                    functions = build_reward_functions(self.cfg)
                    if not functions:
                        raise ConfigError(f"rewards: workflow {self.name} scores with the config's rewards, but there are none (rewards: [{{fn: ...}}])")
                    self._scorer = RewardScorer.from_config(functions, self.cfg)
        return self._scorer

    def score(self, prompt: str, completion: str, sample: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        """Score ``completion`` with the config's ``rewards:``: ``(weighted total, {name: raw score})``.

        Each function is called as ``fn(prompt, completion, **fields)`` with every field of
        ``sample`` except the prompt/``messages``/``completion`` fields (``sample_id`` included).
        Failures and timeouts score ``rollout.reward_fallback`` and are counted (see the module
        docstring); ``rollout.max_consecutive_reward_failures`` failures in a row of one function
        raise :class:`RewardFailuresExceeded`, which stops training.
        """
        return self.scorer.score(prompt, completion, reward_fields(sample, self.prompt_field), sample.get("sample_id"))

    def run_episode(self, engine: InferenceEngine, sample: Mapping[str, Any]) -> Optional[TrajectoryGroup]:
        raise NotImplementedError(f"{type(self).__name__} must implement run_episode(engine, sample)")

    def metrics(self) -> dict[str, float]:
        """Counters reported with the executor's metrics (``reward_errors``, ``reward_timeouts``
        once :meth:`score` was used); override (calling super) to add your own."""
        scorer = vars(self).get("_scorer")
        return scorer.metrics() if scorer is not None else {}


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


# --------------------------------------------------------------------------- single turn


def token_ids(encoded: Any) -> list[int]:
    """Token ids as a flat ``list[int]`` from what ``apply_chat_template(tokenize=True)`` or
    ``encode`` returned: a list, a batch of one, or a BatchEncoding (transformers 5)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    ids = list(encoded)
    if ids and isinstance(ids[0], (list, tuple)):
        ids = list(ids[0])
    return [int(t) for t in ids]


def render_prompt(tokenizer: Any, messages: Sequence[Mapping[str, Any]], template_kwargs: Optional[Mapping[str, Any]] = None) -> list[int]:
    """Prompt token ids of ``messages`` through the tokenizer's chat template, with the
    generation prompt, and ``template_kwargs`` (``data.chat_template_kwargs``, e.g.
    ``{"enable_thinking": False}``) passed to the template. Every place that renders a
    prompt (rollouts, eval, SFT, the start-up length check) goes through here so they agree."""
    return token_ids(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **dict(template_kwargs or {})))


@register("workflow", "single_turn")
class SingleTurnWorkflow(RolloutWorkflow):
    """RLVR: one prompt, ``group_size`` completions in one engine call, rewards per completion.

    Args:
        cfg: the run config (``rollout.*``, ``data.max_prompt_tokens``, ``rewards``).
        tokenizer: an HF-style tokenizer (``apply_chat_template``, ``decode``).
        rewards: reward functions; default: those of ``cfg.rewards``.
        prompt_field: the sample field holding the prompt text (a ``messages`` field, a list
            of chat messages, is used instead when present).
        system_prompt: an optional system message put before the prompt.
        stop_token_ids: stop tokens of the requests; default: the engine's (the model's EOS ids).
    """

    def __init__(
        self,
        cfg: Config,
        tokenizer: Any,
        rewards: Optional[Sequence[RewardFunction]] = None,
        *,
        prompt_field: str = "prompt",
        system_prompt: Optional[str] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
    ):
        super().__init__(cfg, tokenizer)
        self.prompt_field = prompt_field
        self.system_prompt = system_prompt
        self.stop_token_ids = None if stop_token_ids is None else tuple(stop_token_ids)
        functions = build_reward_functions(cfg) if rewards is None else list(rewards)
        if not functions:
            raise ConfigError("rewards: SingleTurnWorkflow needs at least one reward function (rewards: [{fn: ...}])")
        self._scorer = RewardScorer.from_config(functions, cfg)

    def run_episode(self, engine: InferenceEngine, sample: Mapping[str, Any]) -> Optional[TrajectoryGroup]:
        rollout = self.cfg.rollout
        messages, prompt = self.messages(sample)
        prompt_ids = self.prompt_ids(messages)
        limit = self.cfg.data.max_prompt_tokens
        if len(prompt_ids) > limit:
            raise SkipSample("prompt_too_long", f"{len(prompt_ids)} tokens > data.max_prompt_tokens = {limit}")
        sample_id = sample["sample_id"]
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            n=rollout.group_size,
            temperature=rollout.temperature,
            max_new_tokens=rollout.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            sample_id=sample_id,
            constraint=self.decoding_constraint,
        )
        responses = engine.generate(request)
        completions = [self.tokenizer.decode(list(r.output_ids), skip_special_tokens=True) for r in responses]
        # Token-aware rewards (reward_model) read the policy's own ids from the group.
        group = ScoringGroup(messages, prompt_ids, [list(r.output_ids) for r in responses], completions)
        trajectories = []
        for i, (response, completion) in enumerate(zip(responses, completions)):
            with group.scoring(i):
                reward, components = self.score(prompt, completion, sample)
            builder = TrajectoryBuilder().add_tokens(prompt_ids).add_generation(response, constraint=request.constraint)
            trajectories.append(
                builder.build(
                    temperature=rollout.temperature,
                    reward=reward,
                    reward_components=components,
                    metadata={"sample_id": sample_id, "index_in_group": i, "completion": completion},
                )
            )
        return TrajectoryGroup(trajectories=trajectories, metadata={"sample_id": sample_id, "prompt": prompt})


def build_workflow(cfg: Config, tokenizer: Any) -> RolloutWorkflow:
    """The workflow of ``cfg.workflow``, built as ``Workflow(cfg, tokenizer, **kwargs)``."""
    factory = resolve("workflow", cfg.workflow, where="workflow")
    workflow = factory(cfg, tokenizer)
    if not isinstance(workflow, RolloutWorkflow):
        raise ConfigError(f"workflow: {cfg.workflow!r} built a {type(workflow).__name__}, not a RolloutWorkflow subclass")
    if "_scorer_lock" not in vars(workflow):
        # Its __init__ skipped RolloutWorkflow.__init__: provide what SFT, eval and score() use,
        # keeping anything the subclass set itself.
        state = vars(workflow)
        state.setdefault("cfg", cfg)
        state.setdefault("tokenizer", tokenizer)
        state.setdefault("_scorer", None)
        state["_scorer_lock"] = threading.Lock()
    return workflow
