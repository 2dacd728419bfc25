"""The calculator tool workflow as an OpenAI-SDK agent (``workflow: calculator_agent``).

The same task as ``workflows/multi_turn.py`` (a calculator the model may call while it
solves a problem, :func:`workflows.calculator.calculate` behind it), written the way agents
are written for the OpenAI API: a ``calculator`` function in ``tools=``, the model's
``tool_calls`` answered by ``role: tool`` messages, until the model answers without a call::

    answer = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    message = answer.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": run_calculator(call)})

The chat template renders the tools and tool results (tiny-qwen3's and Qwen's templates:
``<tool_call>{...}</tool_call>``, ``<tool_response>...</tool_response>``), the client
records every completion token-exact, and the turns of a run become one trajectory whenever
the re-rendered history extends the previous prompt + completion (the tool results masked).

Reward: the config's ``rewards`` (e.g. ``positional_match`` with the ``add`` dataset, or
``gsm8k_correct``) on the model's last answer, the one that called no tool. A run that never
answers (every turn a call, or the context full) scores them on empty text.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from asyncrl.agent import AgentWorkflow
from asyncrl.data import TaskData
from asyncrl.errors import ConfigError
from asyncrl.registry import register

from .calculator import CalcError, calculate
from .synthetic import synthetic_task

CALCULATOR: Any = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
"""The tool the agent offers, in OpenAI's ``tools=`` form."""


def run_calculator(arguments: str) -> str:
    """The tool's answer to a call's JSON ``arguments``: the value, or ``error: REASON``."""
    try:
        expression = json.loads(arguments).get("expression")
    except (json.JSONDecodeError, AttributeError):
        return "error: arguments must be a JSON object with an expression"
    if not isinstance(expression, str):
        return "error: expression must be a string"
    try:
        return calculate(expression)
    except CalcError as err:
        return f"error: {err.reason}"


@register("workflow", "calculator_agent")
class CalculatorAgent(AgentWorkflow):
    """An OpenAI-SDK agent with a calculator tool; scored by the config's ``rewards``.

    Args (beyond :class:`~asyncrl.agent.AgentWorkflow`'s):
        max_turns: most model calls per run.
        system_prompt: an optional system message (the tools are described by the chat template).
        prompt_field: the sample field with the question.
    """

    def __init__(self, cfg: Any, tokenizer: Any, *, max_turns: int = 4, system_prompt: Optional[str] = None,
                 prompt_field: str = "prompt", **kwargs: Any):
        super().__init__(cfg, tokenizer, **kwargs)
        if max_turns < 1:
            raise ConfigError(f"workflow.kwargs.max_turns: must be >= 1 (given {max_turns})")
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        self.prompt_field = prompt_field
        self.scorer  # noqa: B018 - a config without rewards fails at start-up, not in the first episode

    def prompt_ids(self, messages: Any) -> list[int]:
        """The first turn's prompt as the agent sends it (the tools included), so an SFT warm start
        (``type: sft`` stages) and eval format prompts exactly as the agent's requests are rendered."""
        return self.endpoint.render(list(messages), [CALCULATOR])

    async def run(self, client: Any, sample: Mapping[str, Any]) -> float:
        import openai  # here: registering this workflow does not load the SDK

        chat, prompt = self.messages(sample)
        messages: list[Any] = list(chat)
        final = ""
        for _ in range(self.max_turns):
            try:
                answer = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            except openai.BadRequestError as err:
                if err.code == "context_length_exceeded" and len(messages) > len(chat):
                    break  # no room for another turn: scored on what it said so far
                raise  # the question itself does not fit: the sample is skipped (prompt_too_long)
            message = answer.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                final = message.content or ""
                break
            for call in message.tool_calls:
                arguments = call.function.arguments if call.type == "function" else ""
                messages.append({"role": "tool", "tool_call_id": call.id, "content": run_calculator(arguments)})
        reward, _ = self.score(prompt, final, sample)
        return reward


def tool_call_text(expression: str) -> str:
    """The model's side of a calculator call as Qwen's template (and tiny-qwen3's) writes an
    assistant turn that calls it: what the agent's parser reads back as the call."""
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'


@register("dataset", "calculator_agent_demos")
def calculator_agent_demos(*, seed: int = 0, task: str = "add", **task_kwargs: Any) -> TaskData:
    """Demonstrations of the calculator agent on a synthetic arithmetic task (``add``: ``A:3+4``),
    for an SFT warm start of ``workflow: calculator_agent``: each train problem gives two examples,
    the first turn (the question, answered by a calculator call on its expression) and the second
    (the question, that call and the tool's result, answered by the result). The eval split is the
    task's own questions, on which eval runs the whole agent. ``task_kwargs``: the task's
    (``train_size``, ``eval_size``, ``min_digits``, ``max_digits``)."""
    base = synthetic_task(task, seed=seed, **task_kwargs)
    train = []
    for sample in base.train:
        expression = sample["prompt"].partition(":")[2]
        arguments = json.dumps({"expression": expression})
        call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
        question = {"role": "user", "content": sample["prompt"]}
        train.append({"prompt": sample["prompt"], "answer": sample["answer"], "response": tool_call_text(expression)})
        train.append({"messages": [question, {"role": "assistant", "content": "", "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": "call_0", "content": run_calculator(arguments)}],
                      "answer": sample["answer"], "response": sample["answer"]})
    return TaskData(train=train, eval=base.eval, reward="positional_match")
