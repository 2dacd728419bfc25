"""Rollout workflows: what one episode does, from a dataset sample to a TrajectoryGroup.

Users subclass :class:`RolloutWorkflow` and implement ``run_episode(engine, sample)``;
the executor runs it in a rollout thread. :class:`SingleTurnWorkflow` (alias
``single_turn``) is the RLVR case: chat-template the prompt, sample ``group_size``
completions in one engine call, score each with the configured reward functions.

Reward functions have the signature ``fn(prompt: str, completion: str, **sample_fields) -> float``.
They are weighted and summed; each raw score is kept in ``reward_components``. A function
that raises, returns a non-finite value or runs past ``rollout.reward_timeout_s`` scores
``rollout.reward_fallback`` instead; this is counted, and logged (with the sample) the first
time for each function.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence

from asyncrl.config import Config
from asyncrl.engine.protocol import GenerationRequest, InferenceEngine
from asyncrl.errors import ConfigError
from asyncrl.registry import register, resolve
from asyncrl.rollout.trajectory import TrajectoryBuilder, TrajectoryGroup

log = logging.getLogger(__name__)


class SkipSample(Exception):
    """Raised by a workflow for a sample it will not run (e.g. ``prompt_too_long``).

    The executor counts it as ``dropped:<reason>``; it is not a failure.
    """

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class RolloutWorkflow:
    """Base class of workflows. Subclasses implement :meth:`run_episode`.

    ``run_episode`` runs in a rollout thread, many at once, so it must not mutate shared
    state without a lock. ``sample`` is the dataset sample (a mapping) with its
    ``sample_id`` added; pass ``sample_id`` (and a ``turn`` number per engine call) into every
    :class:`~asyncrl.engine.protocol.GenerationRequest` so a re-issued episode draws the same
    tokens. Return a group of exactly ``rollout.group_size`` trajectories, or None when there
    is nothing to train (counted ``returned_none``). Raise :class:`SkipSample` to skip a sample.
    """

    @property
    def name(self) -> str:
        return type(self).__name__

    def run_episode(self, engine: InferenceEngine, sample: Mapping[str, Any]) -> Optional[TrajectoryGroup]:
        raise NotImplementedError(f"{type(self).__name__} must implement run_episode(engine, sample)")

    def metrics(self) -> dict[str, float]:
        """Counters reported with the executor's metrics (override to add your own)."""
        return {}


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
        fn = resolve("reward", spec.fn, where=f"rewards.{i}.fn")
        if not callable(fn):
            raise ConfigError(f"rewards.{i}.fn: {spec.fn!r} is not callable")
        name = spec.name or (spec.fn if isinstance(spec.fn, str) and ":" not in spec.fn else _fn_name(fn))
        out.append(RewardFunction(fn, spec.weight, name))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"rewards: two reward functions share a name ({', '.join(names)}); set rewards.N.name")
    return out


class RewardScorer:
    """Weighted sum of reward functions with per-call timeouts and a fallback score."""

    def __init__(self, functions: Sequence[RewardFunction], *, timeout_s: float, fallback: float):
        self.functions = list(functions)
        self.timeout_s = timeout_s
        self.fallback = fallback
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self.errors = 0
        self.timeouts = 0

    def score(self, prompt: str, completion: str, sample_fields: Mapping[str, Any], sample_id: Any) -> tuple[float, dict[str, float]]:
        """``(weighted total, {name: raw score})``."""
        total, components = 0.0, {}
        for rf in self.functions:
            value = self._call(rf, prompt, completion, sample_fields, sample_id)
            components[rf.name] = value
            total += rf.weight * value
        return total, components

    def _call(self, rf: RewardFunction, prompt: str, completion: str, fields: Mapping[str, Any], sample_id: Any) -> float:
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = rf.fn(prompt, completion, **fields)
            except BaseException:  # noqa: BLE001 - becomes the fallback score, logged
                box["error"] = traceback.format_exc()
            finally:
                done.set()

        # A daemon thread per call: a stuck reward function is abandoned, never waited on.
        threading.Thread(target=run, name=f"reward-{rf.name}", daemon=True).start()
        if not done.wait(self.timeout_s):
            return self._fallback(rf, sample_id, "timeout", f"ran past rollout.reward_timeout_s = {self.timeout_s} s")
        if "error" in box:
            return self._fallback(rf, sample_id, "error", box["error"])
        try:
            value = float(box["value"])
        except (TypeError, ValueError):
            return self._fallback(rf, sample_id, "error", f"returned {box['value']!r}, not a number")
        if not math.isfinite(value):
            return self._fallback(rf, sample_id, "error", f"returned {value}")
        return value

    def _fallback(self, rf: RewardFunction, sample_id: Any, kind: str, detail: str) -> float:
        with self._lock:
            if kind == "timeout":
                self.timeouts += 1
            else:
                self.errors += 1
            first = rf.name not in self._logged
            self._logged.add(rf.name)
        message = "reward function '%s' %s on sample %s; scoring %s (rollout.reward_fallback). Later ones are only counted.\n%s"
        (log.warning if first else log.debug)(message, rf.name, "timed out" if kind == "timeout" else "failed", sample_id, self.fallback, detail)
        return self.fallback

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {"reward_errors": float(self.errors), "reward_timeouts": float(self.timeouts)}


# --------------------------------------------------------------------------- single turn


def _token_ids(encoded: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)`` returns a list, or a BatchEncoding (transformers 5)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    ids = list(encoded)
    if ids and isinstance(ids[0], (list, tuple)):
        ids = list(ids[0])
    return [int(t) for t in ids]


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
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.prompt_field = prompt_field
        self.system_prompt = system_prompt
        self.stop_token_ids = None if stop_token_ids is None else tuple(stop_token_ids)
        functions = build_reward_functions(cfg) if rewards is None else list(rewards)
        if not functions:
            raise ConfigError("rewards: SingleTurnWorkflow needs at least one reward function (rewards: [{fn: ...}])")
        self.scorer = RewardScorer(functions, timeout_s=cfg.rollout.reward_timeout_s, fallback=cfg.rollout.reward_fallback)

    def messages(self, sample: Mapping[str, Any]) -> tuple[list[dict[str, str]], str]:
        """Chat messages of the sample and the prompt text given to reward functions."""
        if "messages" in sample:
            messages = list(sample["messages"])
            prompt = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
        else:
            if self.prompt_field not in sample:
                raise KeyError(f"sample has no field '{self.prompt_field}' (SingleTurnWorkflow prompt_field); fields: {sorted(sample)}")
            prompt = str(sample[self.prompt_field])
            messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages, prompt

    def run_episode(self, engine: InferenceEngine, sample: Mapping[str, Any]) -> Optional[TrajectoryGroup]:
        rollout = self.cfg.rollout
        messages, prompt = self.messages(sample)
        prompt_ids = _token_ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
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
        )
        responses = engine.generate(request)
        fields = {k: v for k, v in sample.items() if k not in (self.prompt_field, "messages", "prompt", "completion")}
        trajectories = []
        for i, response in enumerate(responses):
            completion = self.tokenizer.decode(list(response.output_ids), skip_special_tokens=True)
            reward, components = self.scorer.score(prompt, completion, fields, sample_id)
            builder = TrajectoryBuilder().add_tokens(prompt_ids).add_generation(response)
            trajectories.append(
                builder.build(
                    temperature=rollout.temperature,
                    reward=reward,
                    reward_components=components,
                    metadata={"sample_id": sample_id, "index_in_group": i, "completion": completion},
                )
            )
        return TrajectoryGroup(trajectories=trajectories, metadata={"sample_id": sample_id, "prompt": prompt})

    def metrics(self) -> dict[str, float]:
        return self.scorer.metrics()


def build_workflow(cfg: Config, tokenizer: Any) -> RolloutWorkflow:
    """The workflow of ``cfg.workflow``, built as ``Workflow(cfg, tokenizer, **kwargs)``."""
    factory = resolve("workflow", cfg.workflow, where="workflow")
    workflow = factory(cfg, tokenizer)
    if not isinstance(workflow, RolloutWorkflow):
        raise ConfigError(f"workflow: {cfg.workflow!r} built a {type(workflow).__name__}, not a RolloutWorkflow subclass")
    return workflow
