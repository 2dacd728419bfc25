"""Tool calls: the model's tool-call text parsed into OpenAI ``tool_calls``.

Two formats, picked from the chat template (``detect_tool_format``) or named:

* ``qwen`` (Hermes style, the Qwen2.5/Qwen3 templates): one or more blocks
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``; the text before the first
  block is the message content.
* ``llama3_json`` (the Llama 3.1 template's JSON form): the whole output, after an optional
  ``<|python_tag|>``, is ``{"name": "f", "parameters": {...}}`` (``arguments`` is accepted too).

A malformed call (bad JSON, no name, arguments not an object, an unclosed block) is not an
error: :func:`parse_tool_calls` returns None and the caller answers the text as plain content
with ``finish_reason: stop``, so the agent sees what the model wrote.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any, Literal, Optional

ToolFormat = Literal["qwen", "llama3_json", "none"]
TOOL_FORMATS: tuple[str, ...] = ("auto", "qwen", "llama3_json", "none")

_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ParsedToolCalls:
    """What a tool-calling output said: the content before the calls and the calls."""

    content: Optional[str]
    """The text before the first call (stripped; None when empty)."""
    calls: list[tuple[str, dict[str, Any]]]
    """``(function name, arguments)`` in the order written."""

    def openai_tool_calls(self) -> list[dict[str, Any]]:
        """The calls as OpenAI ``tool_calls`` (arguments JSON-encoded, fresh ``call_`` ids)."""
        return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                for name, arguments in self.calls]


def detect_tool_format(chat_template: Optional[str]) -> ToolFormat:
    """The tool-call format a chat template teaches: ``qwen`` when it mentions ``<tool_call>``,
    ``llama3_json`` when it mentions ``<|python_tag|>`` or Llama's ``"parameters"`` form, else ``none``."""
    text = chat_template or ""
    if "<tool_call>" in text:
        return "qwen"
    if "<|python_tag|>" in text or '"parameters": ' in text:
        return "llama3_json"
    return "none"


def _call(obj: Any, arguments_keys: tuple[str, ...]) -> Optional[tuple[str, dict[str, Any]]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments JSON-encoded
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return (obj["name"], arguments) if isinstance(arguments, dict) else None


def parse_tool_calls(text: str, tool_format: ToolFormat) -> Optional[ParsedToolCalls]:
    """The tool calls in ``text`` (a decoded completion, special tokens removed), or None when it
    makes none or a malformed one."""
    if tool_format == "qwen":
        if "<tool_call>" not in text:
            return None
        first = text.index("<tool_call>")
        blocks = _QWEN_BLOCK.findall(text[first:])
        rest = _QWEN_BLOCK.sub("", text[first:]).strip()
        if not blocks or rest:  # an unclosed block, or text between/after the calls
            return None
        calls = []
        for block in blocks:
            try:
                call = _call(json.loads(block), ("arguments", "parameters"))
            except json.JSONDecodeError:
                return None
            if call is None:
                return None
            calls.append(call)
        content = text[:first].strip()
        return ParsedToolCalls(content or None, calls)
    if tool_format == "llama3_json":
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return None
        try:
            call = _call(json.loads(body), ("parameters", "arguments"))
        except json.JSONDecodeError:
            return None
        return None if call is None else ParsedToolCalls(None, [call])
    return None
