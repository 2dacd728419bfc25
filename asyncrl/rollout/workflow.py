"""Rollout workflows: what one episode does, from a dataset sample to a TrajectoryGroup.

Users subclass :class:`RolloutWorkflow` and implement ``run_episode(engine, sample)``;
the executor runs it in a rollout thread. :class:`SingleTurnWorkflow` (alias
``single_turn``) is the RLVR case: chat-template the prompt, sample ``group_size``
completions in one engine call, score each with the configured reward functions.

Reward functions, their timeouts and failure counts live in :mod:`asyncrl.rollout.rewards`;
a workflow scores with :meth:`RolloutWorkflow.score`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping, Optional, Sequence

from asyncrl.config import Config
from asyncrl.engine.protocol import GenerationRequest, InferenceEngine
from asyncrl.errors import ConfigError, RolloutError
from asyncrl.registry import register, resolve
from asyncrl.rollout.rewards import (
    RewardFunction,
    RewardScorer,
    build_reward_functions,
    reward_fields,
)
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
