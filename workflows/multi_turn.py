"""Multi-turn tool use: the model may call a calculator while it solves a problem.

Tag format (the defaults; each is a keyword argument of :class:`CalculatorWorkflow`)::

    model:  ... so the total is <calc>12*7 + 3</calc>
    tool:   <result>87</result>                       (appended, not trained)
    model:  ... 87 apples.
            #### 87<|im_end|>

An episode runs turns: generate until ``</calc>`` (a stop sequence), EOS or the length
budget. When the turn ended on ``</calc>``, the text after the turn's last ``<calc>`` is
evaluated by :func:`workflows.calculator.calculate` (no ``eval``; length, nesting and
magnitude limits) and ``<result>VALUE</result>`` (or ``<result>error: REASON</result>``)
is appended as non-trained tokens (``loss_mask`` false, version -1), then the model
continues. The episode ends at EOS, at a turn that calls no tool, at ``max_turns`` engine
calls, or when the next turn would not fit the length budget.

* Trained tokens are exactly the ids the engine sampled: each turn's output is appended as
  it came back (``TrajectoryBuilder.add_generation``); only tool results are tokenised.
* The budget: everything after the prompt (model and tool tokens) stays within
  ``rollout.max_new_tokens``, and the whole trajectory within ``Config.context_limit``
  (``max_seq_len``, and the in-process engine's ``kv_capacity``; it prefills a long context in chunks).
* Rewards: the configured reward functions score the model's own text (every turn,
  without the tool results), so a tool result is never mistaken for the model's answer.
* Per-episode metrics in ``metadata["episode_metrics"]``: ``turns``, ``tool_calls``,
  ``tool_errors``, ``truncated`` (1.0 when the budget or turn limit ended it mid-call).
* Randomness: turn ``t`` of trajectory ``i`` is requested with ``(sample_id, i, t)``, so an
  episode re-issued after a resume samples the same tokens.

Usable with GSM8K: ``workflow: multi_turn`` with the ``gsm8k`` dataset and its rewards.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from asyncrl.engine.protocol import GenerationRequest, GenerationResponse, InferenceEngine
from asyncrl.errors import ConfigError
from asyncrl.registry import register
from asyncrl.rollout.rewards import RewardFunction
from asyncrl.rollout.trajectory import TrajectoryBuilder, TrajectoryGroup
from asyncrl.rollout.workflow import SingleTurnWorkflow, SkipSample

from .calculator import CalcError, calculate

TOOL_INSTRUCTIONS = (
    "You can use a calculator: write <calc>EXPRESSION</calc> with numbers, + - * / // % ** and "
    "parentheses, and its value comes back as <result>VALUE</result>. When you are done, give the "
    "final answer after '####'."
)


@register("workflow", "multi_turn")
class CalculatorWorkflow(SingleTurnWorkflow):
    """Tool use with a calculator; ``group_size`` independent multi-turn trajectories per prompt.

    Args (beyond :class:`~asyncrl.rollout.workflow.SingleTurnWorkflow`'s):
        max_turns: most engine calls per trajectory.
        call_open, call_close: the tags around a calculator call (``call_close`` stops a turn).
        result_template: the tool's answer, with ``{result}``.
        error_template: the tool's answer to a refused expression, with ``{reason}``.
        system_prompt: the instructions (default :data:`TOOL_INSTRUCTIONS`; null for none).
    """

    def __init__(
        self,
        cfg: Any,
        tokenizer: Any,
        rewards: Optional[Sequence[RewardFunction]] = None,
        *,
        max_turns: int = 4,
        call_open: str = "<calc>",
        call_close: str = "</calc>",
        result_template: str = "<result>{result}</result>",
        error_template: str = "<result>error: {reason}</result>",
        system_prompt: Optional[str] = TOOL_INSTRUCTIONS,
        prompt_field: str = "prompt",
        stop_token_ids: Optional[Sequence[int]] = None,
    ):
        super().__init__(cfg, tokenizer, rewards, prompt_field=prompt_field, system_prompt=system_prompt,
                         stop_token_ids=stop_token_ids)
        if max_turns < 1:
            raise ConfigError(f"workflow.kwargs.max_turns: must be >= 1 (given {max_turns})")
        if not call_open or not call_close:
            raise ConfigError("workflow.kwargs.call_open / call_close: the tool-call tags must not be empty")
        self.max_turns = max_turns
        self.call_open, self.call_close = call_open, call_close
        self.result_template, self.error_template = result_template, error_template
        self.close_ids = self._encode(call_close)
        if not self.close_ids:
            raise ConfigError(f"workflow.kwargs.call_close: {call_close!r} encodes to no tokens")
        self._lock = threading.Lock()
        self._totals = {"tool_calls": 0, "tool_errors": 0, "episodes": 0}

    # ------------------------------------------------------------------ pieces

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)

    def tool_reply(self, turn_text: str) -> tuple[str, bool]:
        """The tool's answer to a turn that ended on ``call_close``, and whether it is an error."""
        body = turn_text[: turn_text.rfind(self.call_close)]
        start = body.rfind(self.call_open)
        if start < 0:
            return self.error_template.format(reason=f"no {self.call_open} before {self.call_close}"), True
        try:
            return self.result_template.format(result=calculate(body[start + len(self.call_open) :])), False
        except CalcError as err:
            return self.error_template.format(reason=err.reason), True

    def budget(self, prompt_len: int) -> int:
        """The most tokens a trajectory may hold: its prompt plus ``rollout.max_new_tokens``, within
        :attr:`~asyncrl.config.Config.context_limit` (the engine prefills any context below it in chunks)."""
        return min(prompt_len + self.cfg.rollout.max_new_tokens, self.cfg.context_limit[0])

    # ------------------------------------------------------------------ one trajectory

    def run_trajectory(self, engine: InferenceEngine, prompt_ids: list[int], sample_id: int, index: int) -> tuple[TrajectoryBuilder, dict]:
        """Turns of trajectory ``index``: returns the builder and its episode metrics (and texts)."""
        builder = TrajectoryBuilder().add_tokens(prompt_ids)
        total = self.budget(len(prompt_ids))
        texts: list[str] = []
        stats: dict[str, Any] = {"turns": 0.0, "tool_calls": 0.0, "tool_errors": 0.0, "truncated": 0.0}
        for turn in range(self.max_turns):
            context = builder.input_ids.tolist()
            room = total - len(context)
            if room < 1:
                stats["truncated"] = 1.0
                break
            response = self._generate(engine, context, room, sample_id, index, turn)
            builder.add_generation(response)
            stats["turns"] += 1
            texts.append(self._decode(response.output_ids))
            if not self._ends_in_call(response):
                break
            reply, error = self.tool_reply(texts[-1])
            stats["tool_calls"] += 1
            stats["tool_errors"] += float(error)
            reply_ids = self._encode(reply)
            if turn + 1 == self.max_turns or len(builder) + len(reply_ids) >= total:
                stats["truncated"] = 1.0  # the call goes unanswered: no room or no turn left
                break
            builder.add_tokens(reply_ids)  # tool output: loss_mask false, version -1
        stats["completion"] = "".join(texts)
        return builder, stats

    def _generate(self, engine: InferenceEngine, context: list[int], room: int, sample_id: int, index: int, turn: int) -> GenerationResponse:
        rollout = self.cfg.rollout
        request = GenerationRequest(
            prompt_ids=context, n=1, temperature=rollout.temperature, max_new_tokens=min(room, rollout.max_new_tokens),
            stop_token_ids=self.stop_token_ids, stop_sequences=(tuple(self.close_ids),),
            sample_id=sample_id, index_in_group=index, turn=turn,
        )
        (response,) = engine.generate(request)
        return response

    def _ends_in_call(self, response: GenerationResponse) -> bool:
        """A turn calls the tool when it stopped on the ``call_close`` sequence (or its text
        ends with it, however the model spelled it in tokens)."""
        if response.stop_reason == "stop":
            return True
        if response.stop_reason == "length":
            return self._decode(response.output_ids).rstrip().endswith(self.call_close)
        return False

    # ------------------------------------------------------------------ the episode

    def run_episode(self, engine: InferenceEngine, sample: Mapping[str, Any]) -> Optional[TrajectoryGroup]:
        rollout = self.cfg.rollout
        messages, prompt = self.messages(sample)
        prompt_ids = self.prompt_ids(messages)
        if len(prompt_ids) > self.cfg.data.max_prompt_tokens:
            raise SkipSample("prompt_too_long", f"{len(prompt_ids)} tokens > data.max_prompt_tokens = {self.cfg.data.max_prompt_tokens}")
        sample_id = sample["sample_id"]
        trajectories = []
        for index in range(rollout.group_size):
            builder, stats = self.run_trajectory(engine, prompt_ids, sample_id, index)
            completion = stats.pop("completion")
            reward, components = self.score(prompt, completion, sample)  # the config's rewards: on the model's text
            self._count(stats)
            trajectories.append(builder.build(
                temperature=rollout.temperature, reward=reward, reward_components=components,
                metadata={"sample_id": sample_id, "index_in_group": index, "completion": completion,
                          "episode_metrics": stats},
            ))
        return TrajectoryGroup(trajectories=trajectories, metadata={"sample_id": sample_id, "prompt": prompt})

    def _count(self, stats: Mapping[str, float]) -> None:
        with self._lock:
            self._totals["episodes"] += 1
            self._totals["tool_calls"] += int(stats["tool_calls"])
            self._totals["tool_errors"] += int(stats["tool_errors"])

    def metrics(self) -> dict[str, float]:
        with self._lock:
            totals = {name: float(value) for name, value in self._totals.items()}
        return {**super().metrics(), **totals}
