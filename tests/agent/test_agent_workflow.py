"""AgentWorkflow: OpenAI-SDK agents run as episodes under the executor (concurrent episodes and
runs isolated, groups with split runs, staleness accounting), synchronous agents, the
episode-scoped HTTP endpoint used by a framework-style client, and an engine crash reaching
the executor."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

from asyncrl.agent import AgentRunError, AgentWorkflow
from asyncrl.config import load_config
from asyncrl.errors import EngineCrashed
from asyncrl.rollout import WorkflowExecutor
from asyncrl.rollout.trajectory import check_group
from tests.agent_fakes import qwen_char_tokenizer, text_engine

TOK = qwen_char_tokenizer()
DATA = [{"prompt": f"say {k}", "answer": str(k)} for k in range(12)]


def cfg_for(group_size=2, prefill_buckets=(64, 128, 256), **rollout):
    return load_config(data={
        "rollout": {"batch_size": 4, "group_size": group_size, "max_new_tokens": 16, "length_bucket": 16,
                    "max_staleness": 1, "max_concurrent": 4, "max_seq_len": 256, **rollout},
        "data": {"max_prompt_tokens": 64},
        "engine": {"kv_capacity": 256, "prefill_buckets": list(prefill_buckets)},
    })


def echo(request, i) -> str:
    """The number after the last 'say ' of the prompt, then the run (key index) and turn."""
    text = TOK.decode(list(request.prompt_ids))
    number = text.rsplit("say ", 1)[1].split("<", 1)[0]
    return f"{number} r{request.index_in_group // 128} t{request.turn}"


class Echo(AgentWorkflow):
    """Two turns; reward 1 when the model repeated the sample's number."""

    async def run(self, client, sample):
        messages = [{"role": "user", "content": sample["prompt"]}]
        first = await client.chat.completions.create(model="any", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": sample["prompt"]}]
        await asyncio.sleep(0.01)  # let other runs interleave
        second = await client.chat.completions.create(model="any", messages=messages)
        return float(second.choices[0].message.content.split()[0] == sample["answer"])


def test_concurrent_episodes_and_runs_stay_isolated_under_the_executor():
    cfg = cfg_for()
    engine = text_engine(TOK, echo, delay_s=(0.01, 0.05), version=0)
    workflow = Echo(cfg, TOK)
    with WorkflowExecutor(workflow, engine, DATA, cfg) as executor:
        got = executor.next_batch(0, timeout=60)
    assert len(got.groups) == 4
    for group in got.groups:
        sample_id = group.metadata["sample_id"]
        assert group.metadata["runs"] == [0, 1] and len(group.trajectories) == 2
        for run, traj in enumerate(group.trajectories):
            text = TOK.decode(traj.input_ids.tolist())
            # Both turns of this run, and nothing of another sample or run.
            answer = DATA[sample_id]["answer"]
            assert text.endswith(f"say {answer}<|im_end|>\n<|im_start|>assistant\n{answer} r{run} t1<|im_end|>")
            assert text.count(f"{answer} r{run} t0") == 1 and f" r{1 - run} " not in text and text.count("say ") == 2
            assert traj.reward == 1.0 and traj.metadata["run"] == run
            assert traj.metadata["episode_metrics"]["completions"] == 2.0
    metrics = workflow.metrics()
    assert metrics["agent_splits"] == 0 and metrics["agent_completions"] == 2 * metrics["agent_trajectories"]
    assert got.metrics["rollout/workflow/agent_splits"] == 0


class Editing(AgentWorkflow):
    """Run 0 keeps its history; run 1 rewrites it, so its second call starts a new trajectory."""

    def run(self, client, sample):  # a synchronous agent: openai.OpenAI, on a thread
        assert isinstance(client, openai.OpenAI)
        messages = [{"role": "user", "content": sample["prompt"]}]
        first = client.chat.completions.create(model="any", messages=messages)
        reply = first.choices[0].message.model_dump(exclude_none=True)
        if client.recorder.run_index == 1:
            reply["content"] = "edited"
        messages += [reply, {"role": "user", "content": sample["prompt"]}]
        client.chat.completions.create(model="any", messages=messages)
        return 1.0 if client.recorder.run_index == 0 else 0.0


def test_a_split_run_gives_the_group_more_trajectories_named_by_runs():
    cfg = cfg_for()
    workflow = Editing(cfg, TOK)
    group = workflow.run_episode(text_engine(TOK, echo), {**DATA[3], "sample_id": 3})
    assert group.metadata["runs"] == [0, 1, 1] and [t.reward for t in group.trajectories] == [1.0, 0.0, 0.0]
    check_group(group, group_size=2, workflow="Editing", sample_id=3, expected_temperature=1.0)
    assert workflow.metrics()["agent_splits"] == 1
    with pytest.raises(Exception, match="group_size"):
        check_group(group.model_copy(update={"metadata": {"runs": [0, 0, 0]}}), group_size=2, workflow="E", sample_id=3)


class OverHttp(AgentWorkflow):
    """What an agent framework does: build its own client from a base_url and an API key."""

    async def run(self, client, sample):
        base_url = str(client.base_url)
        assert base_url.startswith("http://127.0.0.1:") and "/episodes/" in base_url
        framework = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        answer = await framework.chat.completions.create(model="any", messages=[{"role": "user", "content": sample["prompt"]}])
        bearer = openai.AsyncOpenAI(base_url=base_url.split("/episodes/")[0] + "/v1", api_key=client.api_key, max_retries=0)
        await bearer.chat.completions.create(model="any", messages=[{"role": "user", "content": sample["prompt"]}])
        return float(answer.choices[0].message.content.split()[0] == sample["answer"])


def test_the_episode_scoped_http_endpoint_records_each_run_apart():
    cfg = cfg_for()
    workflow = OverHttp(cfg, TOK, http=True)
    groups = [workflow.run_episode(text_engine(TOK, echo), {**DATA[k], "sample_id": k}) for k in (1, 2)]
    for k, group in zip((1, 2), groups):
        assert [t.reward for t in group.trajectories] == [1.0] * 4  # two separate calls per run
        assert all(TOK.decode(t.input_ids.tolist()).startswith(f"<|im_start|>user\nsay {k}") for t in group.trajectories)
    stale = openai.OpenAI(base_url=workflow.gateway().url + "/episodes/gone/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        stale.models.list()
    workflow.gateway().close()


class Silent(AgentWorkflow):
    async def run(self, client, sample):
        return 1.0


def test_a_run_that_never_calls_the_model_is_an_error_naming_it():
    with pytest.raises(AgentRunError, match="run 0 of sample 4 made no chat completion"):
        Silent(cfg_for(), TOK).run_episode(text_engine(TOK, echo), {**DATA[4], "sample_id": 4})


def test_an_engine_crash_inside_an_agent_reaches_the_executor_as_engine_crashed():
    cfg = cfg_for()
    engine = text_engine(TOK, echo, crash_after_calls=3)
    with pytest.raises(EngineCrashed):
        Echo(cfg, TOK).run_episode(engine, {**DATA[0], "sample_id": 0})
    with WorkflowExecutor(Echo(cfg, TOK), text_engine(TOK, echo, crash_after_calls=3), DATA, cfg) as executor:
        with pytest.raises(EngineCrashed):
            executor.next_batch(0, timeout=60)



def test_a_reissued_episode_draws_the_same_tokens():
    """What a resume relies on: run r's call t is keyed (sample_id, r * KEY_STRIDE + i, t), never by timing."""
    from asyncrl.engine import FakeEngine

    def sampled(delay):
        engine = FakeEngine(vocab_size=len(TOK), eos_token_id=2, first_token_id=3, eos_prob=0.3, delay_s=delay, seed=5)
        return Echo(cfg_for(group_size=3), TOK).run_episode(engine, {**DATA[6], "prompt": "say 6", "sample_id": 6})

    first, again = sampled(0.0), sampled((0.0, 0.03))
    assert len(first.trajectories) == len(again.trajectories)
    for a, b in zip(first.trajectories, again.trajectories):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.behavior_logprobs, b.behavior_logprobs)
    assert len({tuple(t.input_ids) for t in first.trajectories}) == len(first.trajectories)  # runs differ


def test_a_call_whose_context_passes_the_largest_prefill_bucket_is_served():
    """The engine prefills a context of any length in chunks of its largest bucket, so the agent's
    endpoint bounds a call only by the context's total (``max_seq_len``, ``engine.kv_capacity``)."""
    engine = text_engine(TOK, echo, version=0)
    group = Echo(cfg_for(prefill_buckets=(16,)), TOK).run_episode(engine, {**DATA[3], "sample_id": 3})
    for traj in group.trajectories:
        assert traj.prompt_length > 17 and traj.reward == 1.0 and traj.metadata["episode_metrics"]["completions"] == 2.0


def test_the_calculator_agents_demonstrations_are_its_own_turns():
    """``calculator_agent_demos``: per problem, the first turn's response is a calculator call on the
    question's expression that the agent's parser reads back, the second's the tool's result; both
    render with the agent's prompt (tools included), so SFT teaches exactly what the agent does."""
    from asyncrl.agent.tools import parse_tool_calls
    from asyncrl.registry import resolve
    from workflows.calculator_agent import CALCULATOR, run_calculator

    task = resolve("dataset", "calculator_agent_demos")(train_size=3, eval_size=2, min_digits=1, max_digits=2)
    assert len(task.train) == 6 and all("messages" not in s for s in task.eval)
    tokenizer = qwen_char_tokenizer()
    for first, second in zip(task.train[::2], task.train[1::2]):
        expression = first["prompt"].partition(":")[2]
        parsed = parse_tool_calls(first["response"], "qwen")
        assert parsed is not None and parsed.calls == [("calculator", {"expression": expression})]
        call, result = second["messages"][1]["tool_calls"][0], second["messages"][2]["content"]
        assert result == run_calculator(call["function"]["arguments"]) == second["response"] == first["answer"]
        rendered = tokenizer.apply_chat_template(second["messages"], tools=[CALCULATOR], tokenize=False)
        turn_one = tokenizer.apply_chat_template(second["messages"][:1], tools=[CALCULATOR], tokenize=False,
                                                 add_generation_prompt=True)
        assert rendered.startswith(turn_one + first["response"])  # the call as the template writes it
