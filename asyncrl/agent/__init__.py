"""Agents written with the OpenAI SDK, trained token-exact (docs/agents.md).

:class:`AgentWorkflow` runs ``run(client, sample)`` with an ``openai`` client answered by the
engine; every completion is recorded as the ids the engine sampled, with per-token versions,
and assembled into trajectories. The same API is served over HTTP by ``asyncrl serve`` and,
per running episode, by the episode gateway. Imports no jax, and the ``openai`` SDK only when a
client is built (``AgentAsyncOpenAI``/``AgentOpenAI`` load it on first access).
"""

from typing import Any

from asyncrl.agent.api import ApiError, Limits, OpenAIEndpoint
from asyncrl.agent.recording import CompletionRecord, EpisodeRecorder, assemble_trajectories
from asyncrl.agent.tools import detect_tool_format, parse_tool_calls
from asyncrl.agent.workflow import AgentRunError, AgentWorkflow

__all__ = [
    "AgentWorkflow", "AgentRunError", "AgentAsyncOpenAI", "AgentOpenAI", "OpenAIEndpoint", "Limits", "ApiError",
    "EpisodeRecorder", "CompletionRecord", "assemble_trajectories", "parse_tool_calls", "detect_tool_format",
]


def __getattr__(name: str) -> Any:
    if name in ("AgentAsyncOpenAI", "AgentOpenAI"):
        from asyncrl.agent import client

        return getattr(client, name)
    raise AttributeError(f"module 'asyncrl.agent' has no attribute {name!r}")
