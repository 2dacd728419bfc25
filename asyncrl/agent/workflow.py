"""AgentWorkflow: train an agent written against the OpenAI SDK, token-exact.

The user writes ``run(client, sample)``; each episode runs it ``rollout.group_size`` times
(concurrently, on one event loop in the episode's rollout thread), each run with its own
client, so runs and episodes never mix. Every completion a run makes is recorded token-exact and
assembled into trajectories by :mod:`asyncrl.agent.recording`::

    class Solve(AgentWorkflow):
        async def run(self, client, sample):
            answer = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": sample["prompt"]}])
            return float(answer.choices[0].message.content.strip() == sample["answer"])

``client`` is an ``openai.AsyncOpenAI`` (an ``openai.OpenAI`` when ``run`` is a plain ``def``:
such runs go on threads) with ``set_reward(completion_id, reward)`` added. ``run`` returns the
run's reward (given to its last completion), or None when it set rewards per completion;
completions without one get the next one's times ``turn_discount``.

With ``http: true`` the client talks to the episode gateway over real HTTP
(:mod:`asyncrl.agent.gateway`): ``client.base_url`` and ``client.api_key`` are an
episode-scoped endpoint, to hand to agent frameworks that only take a ``base_url``.

A run whose first call does not fit (``context_length_exceeded``) and lets the error out skips
the sample (``dropped:prompt_too_long``). Everything else is a workflow's: staleness, the queue's accounting, eval (the eval engine
rewrites the requests), checkpoints (an episode re-issued after a resume draws the same tokens:
run ``r``'s call ``t`` is keyed ``(sample_id, r * KEY_STRIDE + i, t)``).

The group holds every run's trajectories (more than ``group_size`` when a run's conversation
split); ``metadata["runs"]`` names the run of each, and a group's advantages are taken over
all of them. Counters: ``agent_completions``, ``agent_trajectories``, ``agent_splits``,
``agent_tool_calls``, ``agent_malformed_tool_calls``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from typing import Any, Mapping, Optional

from asyncrl.agent.api import Limits, OpenAIEndpoint
from asyncrl.agent.recording import EpisodeRecorder, assemble_trajectories
from asyncrl.agent.tools import TOOL_FORMATS
from asyncrl.config import Config
from asyncrl.engine.protocol import InferenceEngine
from asyncrl.errors import ConfigError, RolloutError
from asyncrl.rollout.trajectory import TrajectoryGroup
from asyncrl.rollout.workflow import RolloutWorkflow, SkipSample


def _on_daemon_thread(fn: Any, *args: Any) -> "asyncio.Future[Any]":
    """``fn(*args)`` on a daemon thread of its own (a synchronous agent run), as a future of the loop."""
    loop = asyncio.get_running_loop()
    future: "asyncio.Future[Any]" = loop.create_future()

    def settle(value: Any, error: Optional[BaseException]) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def target() -> None:
        value, error = None, None
        try:
            value = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the episode through the future
            error = err
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:
            pass  # the episode's loop is gone (it failed or timed out): nobody waits for this run

    threading.Thread(target=target, name="agent-run", daemon=True).start()
    return future


class AgentRunError(RolloutError):
    """A run of an agent made no completion through its client: there is nothing to train."""


class AgentWorkflow(RolloutWorkflow):
    """Base class of OpenAI-SDK agents; subclasses implement :meth:`run`.

    Args:
        cfg: the run config (``rollout.group_size``, ``temperature``, ``max_new_tokens``; ``max_seq_len``).
        tokenizer: the policy's tokenizer (its chat template renders the messages and tools).
        turn_discount: reward of a completion without its own = the next one's times this.
        http: give each run a client over real HTTP to an episode-scoped endpoint (``client.base_url``).
        tool_format: how tool calls are parsed: ``auto`` (from the chat template), ``qwen``,
            ``llama3_json`` or ``none``.
        model_name: the model name ``/v1/models`` lists (any name is accepted in requests).
    """

    def __init__(self, cfg: Config, tokenizer: Any, *, turn_discount: float = 1.0, http: bool = False,
                 tool_format: str = "auto", model_name: str = "policy"):
        super().__init__(cfg, tokenizer)
        if not 0.0 <= turn_discount <= 1.0:
            raise ConfigError(f"workflow.kwargs.turn_discount: must be in [0, 1] (given {turn_discount})")
        if tool_format not in TOOL_FORMATS:
            raise ConfigError(f"workflow.kwargs.tool_format: {tool_format!r} is not one of {', '.join(TOOL_FORMATS)}")
        self.turn_discount = turn_discount
        self.http = http
        rollout = cfg.rollout
        # The engine prefills a context of any length in chunks: only the context's total bounds a call.
        context, context_field = cfg.context_limit
        limits = Limits(max_new_tokens=rollout.max_new_tokens, max_total_tokens=context, total_field=context_field,
                        required_temperature=rollout.temperature)
        self.endpoint = OpenAIEndpoint(tokenizer, model_name, limits=limits, tool_format=tool_format,
                                       template_kwargs=cfg.data.chat_template_kwargs)
        self._totals = {"completions": 0, "trajectories": 0, "splits": 0, "tool_calls": 0, "malformed_tool_calls": 0}
        self._totals_lock = threading.Lock()
        self._gateway: Any = None

    # ------------------------------------------------------------------ what users write

    async def run(self, client: Any, sample: Mapping[str, Any]) -> Optional[float]:
        """One run of the agent on ``sample``: the run's reward, or None (rewards set per completion)."""
        raise NotImplementedError(f"{type(self).__name__} must implement run(self, client, sample)")

    # ------------------------------------------------------------------ the episode

    def run_episode(self, engine: InferenceEngine, sample: Mapping[str, Any]) -> Optional[TrajectoryGroup]:
        sample_id = int(sample["sample_id"])
        recorders = [EpisodeRecorder(run_index=r, sample_id=sample_id) for r in range(self.cfg.rollout.group_size)]
        try:
            finals = asyncio.run(self._run_all(engine, recorders, sample))
        except BaseException as err:
            failure = next((r.failure for r in recorders if r.failure is not None), None)
            if failure is not None and failure is not err:
                raise failure from err  # the engine's own error (EngineCrashed stops training), not the SDK's wrapper
            raise
        trajectories, runs, splits = [], [], 0
        for recorder, final in zip(recorders, finals):
            if not recorder.records:
                raise AgentRunError(f"{self.name}: run {recorder.run_index} of sample {sample_id} made no chat completion "
                                    "through its client, so there is nothing to train; call client.chat.completions.create")
            assembled = assemble_trajectories(
                recorder.records, temperature=self.cfg.rollout.temperature, final_reward=final,
                turn_discount=self.turn_discount, metadata={"sample_id": sample_id, "run": recorder.run_index},
            )
            for traj in assembled.trajectories:
                traj.metadata["episode_metrics"].update(tool_calls=float(recorder.tool_calls),
                                                         malformed_tool_calls=float(recorder.malformed_tool_calls))
            trajectories += assembled.trajectories
            runs += [recorder.run_index] * len(assembled.trajectories)
            splits += assembled.splits
        with self._totals_lock:
            totals = self._totals
            totals["completions"] += sum(len(r.records) for r in recorders)
            totals["trajectories"] += len(trajectories)
            totals["splits"] += splits
            totals["tool_calls"] += sum(r.tool_calls for r in recorders)
            totals["malformed_tool_calls"] += sum(r.malformed_tool_calls for r in recorders)
        metadata: dict[str, Any] = {"sample_id": sample_id, "runs": runs}
        try:
            metadata["prompt"] = self.messages(sample)[1]
        except KeyError:
            pass  # a sample without a prompt field: eval decodes the prompt instead
        return TrajectoryGroup(trajectories=trajectories, metadata=metadata)

    async def _run_all(self, engine: InferenceEngine, recorders: list[EpisodeRecorder], sample: Mapping[str, Any]) -> list[Optional[float]]:
        is_async = inspect.iscoroutinefunction(self.run)
        tokens, clients = [], []
        try:
            runs = []
            for recorder in recorders:
                client, token = self._client(engine, recorder, is_async)
                tokens.append(token)
                clients.append(client)
                if is_async:
                    runs.append(self._checked(self.run(client, dict(sample)), recorder))
                else:
                    runs.append(self._checked(_on_daemon_thread(self.run, client, dict(sample)), recorder))
            return list(await asyncio.gather(*runs))
        finally:
            for client in clients:  # its connections (to the gateway, with http: true) end with the run
                with contextlib.suppress(Exception):
                    await client.close() if is_async else client.close()
            if self._gateway is not None:
                for token in tokens:
                    if token is not None:
                        self._gateway.close_episode(token)

    async def _checked(self, result: Any, recorder: EpisodeRecorder) -> Optional[float]:
        import openai  # here, not at import: `workflows` registers agents without loading the SDK

        try:
            value = await result
        except openai.BadRequestError as err:
            if err.code == "context_length_exceeded" and not recorder.records:
                raise SkipSample("prompt_too_long", f"run {recorder.run_index}: {err.message}") from None
            raise
        if value is None:
            return None
        try:
            return float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{self.name}.run returned {value!r} (run {recorder.run_index}): return a float reward or None") from None

    def _client(self, engine: InferenceEngine, recorder: EpisodeRecorder, is_async: bool) -> tuple[Any, Optional[str]]:
        from asyncrl.agent.client import AgentAsyncOpenAI, AgentOpenAI

        if not self.http:
            cls = AgentAsyncOpenAI if is_async else AgentOpenAI
            return cls(engine, self.endpoint, recorder), None
        gateway = self.gateway()
        token, base_url = gateway.open_episode(engine, self.endpoint, recorder)
        cls = AgentAsyncOpenAI if is_async else AgentOpenAI
        return cls(engine, self.endpoint, recorder, base_url=base_url, api_key=token, over_http=True), token

    def gateway(self) -> Any:
        """The episode gateway of this workflow (started on first use; ``http: true``)."""
        from asyncrl.agent.gateway import EpisodeGateway

        with self._totals_lock:
            if self._gateway is None:
                self._gateway = EpisodeGateway()
            return self._gateway

    def metrics(self) -> dict[str, float]:
        with self._totals_lock:
            own = {f"agent_{name}": float(value) for name, value in self._totals.items()}
        return {**super().metrics(), **own}
