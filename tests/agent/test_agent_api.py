"""The OpenAI-compatible API over an engine, driven by the real ``openai`` SDK: single and
multi-turn chats, n > 1, parameter mapping and refusals, token-exact recording (ids equal what
the engine samples for the same request), merged vs split trajectories, a completion spanning a
publish, tool calls (Qwen and Llama 3.1 forms, malformed ones)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import numpy as np
import openai
import pytest

from asyncrl.agent import AgentAsyncOpenAI, AgentOpenAI, EpisodeRecorder, Limits, OpenAIEndpoint, assemble_trajectories
from asyncrl.agent.api import KEY_STRIDE
from asyncrl.agent.tools import detect_tool_format, parse_tool_calls
from asyncrl.engine.protocol import GenerationRequest
from tests.agent_fakes import EOS_ID, qwen_char_tokenizer, text_engine

TOK = qwen_char_tokenizer()
USER = [{"role": "user", "content": "what is 2+3?"}]


def chat_ids(messages, **kwargs) -> list[int]:
    out = TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def client_for(engine, recorder=None, limits=None, sync=False):
    limits = limits or Limits(max_new_tokens=64)
    recorder = recorder or EpisodeRecorder(run_index=1, sample_id=7)
    cls = AgentOpenAI if sync else AgentAsyncOpenAI
    return cls(engine, OpenAIEndpoint(TOK, limits=limits), recorder), recorder


def test_single_turn_returns_sdk_types_and_records_the_engines_own_tokens():
    engine = text_engine(TOK, lambda r, i: "it is 5", version=2)
    client, recorder = client_for(engine)
    answer = asyncio.run(client.chat.completions.create(model="gpt-4o", messages=USER))
    assert isinstance(answer, openai.types.chat.ChatCompletion)
    assert answer.choices[0].message.content == "it is 5" and answer.choices[0].finish_reason == "stop"
    [record] = recorder.records
    np.testing.assert_array_equal(record.prompt_ids, chat_ids(USER))
    # The same request straight to the engine: the identical ids, log-probs and versions.
    direct = engine.generate(GenerationRequest(prompt_ids=chat_ids(USER), max_new_tokens=64, sample_id=7,
                                               index_in_group=KEY_STRIDE, turn=0))[0]
    np.testing.assert_array_equal(record.response.output_ids, direct.output_ids)
    np.testing.assert_array_equal(record.response.logprobs, direct.logprobs)
    np.testing.assert_array_equal(record.response.versions, np.full(len(direct.output_ids), 2))
    assert record.response.output_ids[-1] == EOS_ID  # EOS kept in the ids, dropped from the text
    assert answer.usage.prompt_tokens == len(chat_ids(USER)) and answer.usage.completion_tokens == len(direct.output_ids)


def test_n_samples_are_distinct_choices_each_recorded():
    engine = FakeRandom()
    client, recorder = client_for(engine.engine)
    answer = asyncio.run(client.chat.completions.create(model="m", messages=USER, n=3, max_tokens=6))
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [r.choice for r in recorder.records] == [0, 1, 2] and {r.completion_id for r in recorder.records} == {answer.id}
    outputs = [tuple(r.response.output_ids) for r in recorder.records]
    assert len(set(outputs)) == 3 and all(len(o) <= 6 for o in outputs)
    direct = engine.engine.generate(GenerationRequest(prompt_ids=chat_ids(USER), n=3, max_new_tokens=6, sample_id=7,
                                                      index_in_group=KEY_STRIDE))
    assert outputs == [tuple(d.output_ids) for d in direct]
    for choice, response in zip(answer.choices, direct):
        assert choice.message.content == TOK.decode(list(response.output_ids), skip_special_tokens=True)


class FakeRandom:
    """A FakeEngine sampling printable characters (ids past the specials)."""

    def __init__(self, **kwargs):
        from asyncrl.engine import FakeEngine

        self.engine = FakeEngine(vocab_size=len(TOK), eos_token_id=EOS_ID, first_token_id=3, eos_prob=0.0, **kwargs)


def test_sync_client_and_text_completions_and_models():
    engine = text_engine(TOK, lambda r, i: "ok")
    client, recorder = client_for(engine, sync=True)
    assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content == "ok"
    text = client.completions.create(model="m", prompt="2+3=")
    assert text.choices[0].text == "ok" and text.object == "text_completion"
    assert [m.id for m in client.models.list()] == ["asyncrl"]
    assert len(recorder.records) == 2 and list(recorder.records[1].prompt_ids) == TOK.encode("2+3=")
    assert [r.call for r in recorder.records] == [0, 1]


def test_logprobs_true_returns_the_recorded_behaviour_logprobs():
    client, recorder = client_for(text_engine(TOK, lambda r, i: "abc"), sync=True)
    choice = client.chat.completions.create(model="m", messages=USER, logprobs=True).choices[0]
    got = [entry.logprob for entry in choice.logprobs.content]
    np.testing.assert_allclose(got, recorder.records[0].response.logprobs, rtol=1e-6)
    assert [entry.token for entry in choice.logprobs.content][:3] == ["a", "b", "c"]


def test_sampling_parameters_map_to_the_engine_request():
    seen = []
    engine = text_engine(TOK, lambda r, i: seen.append(r) or "a, b. c")
    client, _ = client_for(engine, limits=Limits(max_new_tokens=20, max_total_tokens=200), sync=True)
    answer = client.chat.completions.create(model="m", messages=USER, temperature=0.5, top_p=0.9, max_completion_tokens=50,
                                            stop=[". "], seed=11)
    request = seen[-1]
    assert (request.temperature, request.top_p, request.max_new_tokens, request.turn) == (0.5, 0.9, 20, 11)
    assert request.stop_sequences == (tuple(TOK.encode(". ", add_special_tokens=False)),)
    assert answer.choices[0].message.content == "a, b" and answer.choices[0].finish_reason == "stop"  # cut at the stop
    client.chat.completions.create(model="m", messages=USER, temperature=0)
    assert seen[-1].greedy
    client.chat.completions.create(model="m", messages=USER, max_tokens=3)
    assert seen[-1].max_new_tokens == 3


@pytest.mark.parametrize("kwargs,param", [
    ({"stream": True}, "stream"), ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"), ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"n": 0}, "n"), ({"top_p": 0}, "top_p"),
    ({"extra_body": {"best_of": 2}}, "best_of"), ({"temperature": 0.7}, "temperature"),
])
def test_unsupported_parameters_are_a_400_naming_the_parameter(kwargs, param):
    client, recorder = client_for(text_engine(TOK, lambda r, i: "x"), limits=Limits(required_temperature=1.0), sync=True)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, **kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param and param in info.value.message
    assert recorder.records == []


def test_a_prompt_past_the_context_is_a_400_context_length_exceeded():
    limits = Limits(max_total_tokens=10, total_field="engine.kv_capacity")
    client, _ = client_for(text_engine(TOK, lambda r, i: "x"), limits=limits, sync=True)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER)
    assert info.value.code == "context_length_exceeded" and "10-token context (engine.kv_capacity)" in info.value.message


# --------------------------------------------------------------------------- trajectories


def two_turns(edit_history: bool):
    engine = text_engine(TOK, lambda r, i: ["5", "10"][r.turn], version=4)
    client, recorder = client_for(engine, sync=True)
    messages = list(USER)
    first = client.chat.completions.create(model="m", messages=messages)
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    if edit_history:
        assistant["content"] = "five"  # the agent rewrote what the model said
    messages += [assistant, {"role": "user", "content": "times 2?"}]
    client.chat.completions.create(model="m", messages=messages)
    return recorder, messages


def test_a_conversation_that_extends_becomes_one_trajectory_trained_on_completions_only():
    recorder, messages = two_turns(edit_history=False)
    out = assemble_trajectories(recorder.records, temperature=1.0, final_reward=1.0)
    assert out.splits == 0 and len(out.trajectories) == 1
    traj = out.trajectories[0]
    full = chat_ids(messages) + list(recorder.records[1].response.output_ids)
    np.testing.assert_array_equal(traj.input_ids, full)
    first, second = (r.response for r in recorder.records)
    p0, p1 = len(recorder.records[0].prompt_ids), len(recorder.records[1].prompt_ids)
    trained = np.zeros(len(full), bool)
    trained[p0:p0 + len(first.output_ids)] = True
    trained[p1:] = True
    np.testing.assert_array_equal(traj.loss_mask, trained)
    np.testing.assert_array_equal(traj.versions, np.where(trained, 4, -1))
    np.testing.assert_array_equal(traj.behavior_logprobs[trained], np.concatenate([first.logprobs, second.logprobs]))
    assert (traj.behavior_logprobs[~trained] == 0).all() and traj.reward == 1.0


def test_an_edited_history_splits_into_separate_trajectories_counted():
    recorder, _ = two_turns(edit_history=True)
    out = assemble_trajectories(recorder.records, temperature=1.0, final_reward=1.0, turn_discount=0.5)
    assert out.splits == 1 and len(out.trajectories) == 2
    for traj, record in zip(out.trajectories, recorder.records):
        np.testing.assert_array_equal(traj.input_ids, record.full_ids)  # never merged by text
        assert traj.loss_mask.sum() == len(record.response.output_ids)
    assert [t.reward for t in out.trajectories] == [0.5, 1.0]  # the earlier turn discounted
    assert out.trajectories[1].metadata["episode_metrics"]["splits"] == 1.0


def test_set_reward_per_completion_and_discount():
    engine = text_engine(TOK, lambda r, i: "x")
    client, recorder = client_for(engine, sync=True)
    ids = [client.chat.completions.create(model="m", messages=[{"role": "user", "content": str(k)}]).id for k in range(3)]
    client.set_reward(ids[1], 2.0)
    out = assemble_trajectories(recorder.records, temperature=1.0, final_reward=None, turn_discount=0.5)
    assert [t.reward for t in out.trajectories] == [1.0, 2.0, 0.0]
    with pytest.raises(KeyError, match="no completion 'nope'"):
        client.set_reward("nope", 1.0)


def test_a_completion_spanning_a_publish_keeps_exact_per_token_versions():
    from asyncrl.engine import FakeEngine

    engine = FakeEngine(vocab_size=len(TOK), eos_token_id=EOS_ID, first_token_id=3, eos_prob=0.0, chunk_size=4, delay_s=1.2)
    client, recorder = client_for(engine, sync=True)
    publisher = threading.Timer(0.5, lambda: engine.update_weights(None, 1))
    publisher.start()
    client.chat.completions.create(model="m", messages=USER, max_tokens=12)
    publisher.join(5)
    versions = recorder.records[0].response.versions
    assert versions[0] == 0 and versions[-1] == 1 and (np.diff(versions) >= 0).all()
    traj = assemble_trajectories(recorder.records, temperature=1.0, final_reward=0.0).trajectories[0]
    np.testing.assert_array_equal(traj.versions[traj.loss_mask], versions)


# --------------------------------------------------------------------------- tools

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>'


def test_tool_calls_are_parsed_and_tool_results_render_back_into_one_trajectory():
    seen = []
    engine = text_engine(TOK, lambda r, i: seen.append(TOK.decode(list(r.prompt_ids))) or [CALL, "it is 5"][r.turn])
    client, recorder = client_for(engine, sync=True, limits=Limits(max_new_tokens=200))
    first = client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": "2+3"}
    assert "# Tools" in seen[0] and '"name": "calc"' in seen[0]  # tools= went through the chat template
    messages = [*USER, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "it is 5" and second.choices[0].finish_reason == "stop"
    assert "<tool_response>\n5\n</tool_response>" in seen[1]
    out = assemble_trajectories(recorder.records, temperature=1.0, final_reward=1.0)
    assert out.splits == 0 and len(out.trajectories) == 1  # the re-rendered call is token-identical
    assert recorder.tool_calls == 1 and recorder.malformed_tool_calls == 0


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "calc", "arguments": {"expression": </tool_call>',
                                  '<tool_call>\n{"arguments": {}}\n</tool_call>', "<tool_call>\n{\"name\": \"calc\""])
def test_a_malformed_tool_call_is_plain_content_with_finish_reason_stop(text):
    client, recorder = client_for(text_engine(TOK, lambda r, i: text), sync=True, limits=Limits(max_new_tokens=200))
    choice = client.chat.completions.create(model="m", messages=USER, tools=TOOLS).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == text and not choice.message.tool_calls
    assert recorder.malformed_tool_calls == 1


def test_tool_formats():
    assert detect_tool_format(TOK.chat_template) == "qwen"
    assert detect_tool_format("{{ '<|python_tag|>' }}") == "llama3_json" and detect_tool_format("{{ m }}") == "none"
    two = parse_tool_calls("let me see\n" + CALL + "\n" + CALL.replace("2+3", "4"), "qwen")
    assert two is not None and two.content == "let me see" and [c[1]["expression"] for c in two.calls] == ["2+3", "4"]
    llama = parse_tool_calls('<|python_tag|>{"name": "calc", "parameters": {"expression": "1"}}', "llama3_json")
    assert llama is not None and llama.calls == [("calc", {"expression": "1"})]
    assert parse_tool_calls("the answer is {1}", "llama3_json") is None and parse_tool_calls(CALL + " trailing", "qwen") is None
    assert dataclasses.asdict(parse_tool_calls(CALL, "qwen"))["calls"] == [("calc", {"expression": "2+3"})]
