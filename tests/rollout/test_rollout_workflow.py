"""SingleTurnWorkflow with a tiny character-level HF tokenizer and FakeEngine: chat template,
one call with n = group_size, weighted rewards, fallback on errors and timeouts, prompt limits,
and building the workflow from config."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from asyncrl.engine import FakeEngine
from asyncrl.errors import ConfigError
from asyncrl.rollout import SingleTurnWorkflow, SkipSample, WorkflowExecutor, build_workflow
from asyncrl.rollout.rewards import RewardFunction
from asyncrl.rollout.trajectory import check_group
from tests.rollout_fakes import char_tokenizer, make_cfg

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def exact_match(prompt: str, completion: str, answer: str = "", **fields) -> float:
    return float(completion.strip() == answer)


def length_penalty(prompt: str, completion: str, scale: float = 0.1, **fields) -> float:
    return -scale * len(completion)


def broken(prompt, completion, **fields):
    raise ZeroDivisionError("reward bug")


def sleepy(prompt, completion, **fields):
    time.sleep(2)
    return 1.0


def scripted_engine(tokenizer, texts):
    """Sample i of every request answers texts[i] followed by EOS."""
    outputs = [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in texts]
    return FakeEngine(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                      responder=lambda request, i: outputs[request.index_in_group + i])


def test_single_turn_episode_builds_a_checked_group(tokenizer):
    cfg = make_cfg({"group_size": 3, "max_new_tokens": 8})
    rewards = [RewardFunction(exact_match, 1.0), RewardFunction(length_penalty, 0.5, "len")]
    workflow = SingleTurnWorkflow(cfg, tokenizer, rewards, prompt_field="question")
    engine = scripted_engine(tokenizer, ["4", "5", "44"])
    group = workflow.run_episode(engine, {"question": "2+2=?", "answer": "4", "sample_id": 11})
    check_group(group, group_size=3, workflow=workflow.name, sample_id=11, expected_temperature=1.0)
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "2+2=?"}], add_generation_prompt=True,
                                               tokenize=True)["input_ids"]
    first = group.trajectories[0]
    np.testing.assert_array_equal(first.input_ids, prompt_ids + tokenizer.encode("4") + [tokenizer.eos_token_id])
    assert not first.loss_mask[: len(prompt_ids)].any() and first.loss_mask[len(prompt_ids):].all()
    assert first.loss_mask[-1] and first.input_ids[-1] == tokenizer.eos_token_id  # the EOS is trained
    assert [t.reward_components for t in group.trajectories] == [
        {"exact_match": 1.0, "len": -0.1}, {"exact_match": 0.0, "len": -0.1}, {"exact_match": 0.0, "len": -0.2}]
    np.testing.assert_allclose(group.rewards, [1.0 - 0.05, -0.05, -0.1])
    assert [t.metadata["completion"] for t in group.trajectories] == ["4", "5", "44"]
    assert all(t.stop_reason == "eos" for t in group.trajectories)


def test_reward_errors_and_timeouts_give_the_fallback_counted_and_logged_once(tokenizer, caplog):
    cfg = make_cfg({"group_size": 2, "reward_timeout_s": 0.1, "reward_fallback": -3.0})
    workflow = SingleTurnWorkflow(cfg, tokenizer, [RewardFunction(broken), RewardFunction(sleepy, 2.0)])
    engine = scripted_engine(tokenizer, ["1", "2"])
    with caplog.at_level(logging.DEBUG, logger="asyncrl"):
        start = time.monotonic()
        group = workflow.run_episode(engine, {"prompt": "1+1=?", "sample_id": 4})
        assert time.monotonic() - start < 1.5  # the sleeping function was abandoned
    np.testing.assert_allclose(group.rewards, [-3.0 + 2 * -3.0] * 2)
    assert group.trajectories[0].reward_components == {"broken": -3.0, "sleepy": -3.0}
    assert workflow.metrics() == {"reward_errors": 2.0, "reward_timeouts": 2.0}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # once per function
    text = "\n".join(r.getMessage() for r in warnings)
    assert "'broken' failed on sample 4" in text and "ZeroDivisionError: reward bug" in text
    assert "'sleepy' timed out on sample 4" in text


def test_prompt_too_long_is_a_counted_skip(tokenizer):
    cfg = make_cfg({"batch_size": 2, "group_size": 2, "max_staleness": 0}, {"max_prompt_tokens": 8})
    workflow = SingleTurnWorkflow(cfg, tokenizer, [RewardFunction(exact_match)])
    with pytest.raises(SkipSample, match="prompt_too_long: 12 tokens > data.max_prompt_tokens = 8"):
        workflow.run_episode(FakeEngine(), {"prompt": "0123456789", "sample_id": 0})
    dataset = [{"prompt": "1+1=?", "answer": "2"}, {"prompt": "a very long prompt", "answer": "x"}]
    engine = scripted_engine(tokenizer, ["2", "3"])
    with WorkflowExecutor(workflow, engine, dataset, cfg) as ex:
        got = ex.next_batch(0, timeout=10)
        batch = got.batch
        counts = ex.counts()
    assert counts["dropped:prompt_too_long"] >= 1 and counts["trained"] == 2
    assert set(got.sample_ids) <= {0, 2, 4, 6}
    np.testing.assert_allclose(batch.rewards, [1, 0, 1, 0])


def test_build_workflow_from_config(tokenizer):
    cfg = make_cfg(rewards=[{"fn": "tests.rollout.test_rollout_workflow:exact_match", "weight": 2.0},
                            {"fn": {"target": "tests.rollout.test_rollout_workflow:length_penalty", "kwargs": {"scale": 1.0}},
                             "name": "length"}],
                   workflow={"target": "single_turn", "kwargs": {"prompt_field": "question"}})
    workflow = build_workflow(cfg, tokenizer)
    assert isinstance(workflow, SingleTurnWorkflow) and workflow.prompt_field == "question"
    assert [(f.name, f.weight) for f in workflow.scorer.functions] == [("exact_match", 2.0), ("length", 1.0)]
    group = workflow.run_episode(scripted_engine(tokenizer, ["7", "77", "7", "7"]), {"question": "3+4=?", "answer": "7", "sample_id": 0})
    np.testing.assert_allclose(group.rewards[:2], [2.0 - 1.0, -2.0])
    with pytest.raises(ConfigError, match="rewards: SingleTurnWorkflow needs at least one reward function"):
        build_workflow(make_cfg(), tokenizer)
    with pytest.raises(ConfigError, match="rewards.0.fn: cannot import module"):
        build_workflow(make_cfg(rewards=[{"fn": "no_such_module:f"}]), tokenizer)
    with pytest.raises(ConfigError, match="workflow.kwargs: got an unexpected keyword argument 'colour'"):
        build_workflow(make_cfg(workflow={"target": "single_turn", "kwargs": {"colour": 1}},
                                rewards=[{"fn": "tests.rollout.test_rollout_workflow:exact_match"}]), tokenizer)


def test_chat_template_kwargs_reach_every_prompt_rendering(tokenizer):
    """data.chat_template_kwargs (Qwen3's enable_thinking) is passed to the template by rollouts,
    SFT examples and the start-up length check alike, so they render the same tokens."""
    from asyncrl.data import DataError
    from asyncrl.run.build import _check_prompts_fit
    from asyncrl.run.sft import encode_example

    think = char_tokenizer()
    think.chat_template = (
        "{% for m in messages %}<u>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>"
        "{% if enable_thinking is defined and enable_thinking is false %}    {% endif %}{% endif %}"
    )
    plain, off = make_cfg(), make_cfg(data={"chat_template_kwargs": {"enable_thinking": False}})
    sample = {"prompt": "1+1=?", "answer": "2", "response": "2", "sample_id": 0}
    expected = think.apply_chat_template([{"role": "user", "content": "1+1=?"}], add_generation_prompt=True,
                                         tokenize=True, enable_thinking=False)["input_ids"]
    workflow = SingleTurnWorkflow(off, think, [RewardFunction(exact_match)])
    assert workflow.prompt_ids(workflow.messages(sample)[0]) == list(expected)
    assert len(expected) == len(SingleTurnWorkflow(plain, think, [RewardFunction(exact_match)])
                                .prompt_ids([{"role": "user", "content": "1+1=?"}])) + 4
    engine = scripted_engine(think, ["2", "2"])
    group = workflow.run_episode(engine, sample)
    assert list(group.trajectories[0].input_ids[:len(expected)]) == list(expected)
    ids, mask = encode_example(sample, workflow, think.eos_token_id)
    assert ids[:len(expected)].tolist() == list(expected) and not mask[:len(expected)].any()
    # 11 prompt tokens with the think block, 7 without: only the kwargs make it too long for 8.
    tight = make_cfg(data={"max_prompt_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}})
    with pytest.raises(DataError, match="0 of 1 train prompts"):
        _check_prompts_fit(tight, [sample], SingleTurnWorkflow(tight, think, [RewardFunction(exact_match)]), think, "")


def test_chat_template_kwargs_refuse_what_asyncrl_sets_itself():
    with pytest.raises(ConfigError, match="data.chat_template_kwargs.*add_generation_prompt.*cannot be set here"):
        make_cfg(data={"chat_template_kwargs": {"add_generation_prompt": False}})
