"""The calculator tool workflow (``workflows/multi_turn.py``): the safe arithmetic parser, a
scripted episode with FakeEngine (masks, versions, reward, episode metrics), re-issue of
in-flight multi-turn episodes after a checkpoint, and RL steps with the tiny model."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from asyncrl.checkpoint.files import load_rollout_state, save_rollout_state
from asyncrl.config import load_config
from asyncrl.engine import FakeEngine
from asyncrl.rollout import WorkflowExecutor
from asyncrl.rollout.workflow import build_workflow
from tests.rollout_fakes import MULTI_TURN_ON_TINY, char_tokenizer
from workflows.calculator import MAX_LENGTH, CalcError, calculate
from workflows.multi_turn import CalculatorWorkflow

# --------------------------------------------------------------------------- the parser


@pytest.mark.parametrize(
    "expression,value",
    [("12*7", "84"), ("12 * 7 + 3", "87"), ("-3**2", "-9"), ("2**-1", "0.5"), ("2^10", "1024"), ("1,250 + 3", "1253"),
     ("7/2", "3.5"), ("1/3", "0.333333"), ("10 // 3", "3"), ("7 % 3", "1"), ("0.2 x 50", "10"), ("$5 * 3", "15"),
     ("(3 + 4) * (2 - 5)", "-21"), (".5 + .25", "0.75"), ("48/2", "24"), ("100 - 50 - 30 - 15", "5"), ("- -4", "4")],
)
def test_calculator_evaluates_arithmetic_exactly(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression,reason",
    [("__import__('os').system('ls')", "character '_' at position 0 is not allowed"),
     ("exec('1')", "character 'e' at position 0 is not allowed"),
     ("().__class__", "character '.' at position 2 is not allowed"),
     ("9**9**9", "exponent 387420489 exceeds 64"),
     ("2**1000", "exponent 1000 exceeds 64"),
     ("10**16", "a value exceeds 1e+15"), ("10**40", "the power exceeds 1e+15"),
     ("99999999 * 99999999", "exceeds 1e+15"),
     ("2**0.5", "only integer exponents"),
     ("(" * 30 + "1" + ")" * 30, "nesting deeper than 20"),
     ("-" * 30 + "1", "nesting deeper than 20"),
     ("1+" * 150 + "1", f"expression too long (301 > {MAX_LENGTH} characters)"),
     ("1/0", "division by zero"), ("5 % 0", "division by zero"), ("0**-1", "division by zero"),
     ("", "empty expression"), ("3 +", "ends too early"), ("(3 + 4", "ends too early"), ("3 + 4)", "unexpected ')'"),
     ("1.2.3", "malformed number"), ("3 4", "unexpected '4'")],
)
def test_calculator_refuses_with_a_reason(expression, reason):
    with pytest.raises(CalcError) as info:
        calculate(expression)
    assert reason in info.value.reason


# --------------------------------------------------------------------------- scripted episodes

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?.:#<>()'_,\n"
TOK = char_tokenizer(CHARS, system=True)  # spells the tool tags: <s>=4 is the system role
EOS = 1


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def cfg_for(group_size=2, max_new_tokens=64, prefill_buckets=None, **rollout):
    raw = {
        "data": {"max_prompt_tokens": 48},
        "rollout": {"batch_size": 2, "group_size": group_size, "max_new_tokens": max_new_tokens, "length_bucket": 16,
                    "max_staleness": 1, "max_concurrent": 4, **rollout},
        "engine": {"kv_capacity": 48 + max_new_tokens, "prefill_buckets": prefill_buckets or [32, 64, 32 + max_new_tokens]},
        "rewards": [{"fn": "gsm8k_correct"}, {"fn": "gsm8k_format", "weight": 0.1}],
        "workflow": {"target": "multi_turn", "kwargs": {"system_prompt": None, "max_turns": 3}},
    }
    return load_config(data=raw)


def scripted(turns: dict[int, str]):
    """A FakeEngine responder: the text of each turn (the same for every trajectory); an answer ends in EOS."""
    return lambda request, i: ids(turns[request.turn]) + ([EOS] if "####" in turns[request.turn] else [])


def run(turns: dict[int, str], answer: str = "84", **cfg_kwargs):
    cfg = cfg_for(**cfg_kwargs)
    workflow = build_workflow(cfg, TOK)
    assert isinstance(workflow, CalculatorWorkflow)
    engine = FakeEngine(vocab_size=len(TOK), eos_token_id=EOS, version=3, responder=scripted(turns))
    sample = {"prompt": "what is 12*7?", "answer": answer, "sample_id": 5}
    return workflow, workflow.run_episode(engine, sample)


def test_scripted_call_result_answer_gives_masks_versions_and_reward():
    workflow, group = run({0: "so <calc>12*7</calc> and", 1: " the answer\n#### 84"})
    prompt = TOK.apply_chat_template([{"role": "user", "content": "what is 12*7?"}], add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    call, result, answer = ids("so <calc>12*7</calc>"), ids("<result>84</result>"), ids(" the answer\n#### 84") + [EOS]
    for traj in group.trajectories:
        np.testing.assert_array_equal(traj.input_ids, prompt + call + result + answer)  # the call stops at </calc>
        parts = [(len(prompt), False, -1), (len(call), True, 3), (len(result), False, -1), (len(answer), True, 3)]
        np.testing.assert_array_equal(traj.loss_mask, np.concatenate([np.full(n, m) for n, m, _ in parts]))
        np.testing.assert_array_equal(traj.versions, np.concatenate([np.full(n, v) for n, _, v in parts]))
        assert (traj.behavior_logprobs[~traj.loss_mask] == 0).all() and (traj.behavior_logprobs[traj.loss_mask] < 0).all()
        assert traj.reward == pytest.approx(1.1) and traj.reward_components == {"gsm8k_correct": 1.0, "gsm8k_format": 1.0}
        assert traj.metadata["episode_metrics"] == {"turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0, "truncated": 0.0}
        assert traj.metadata["completion"] == "so <calc>12*7</calc> the answer\n#### 84"  # the model's text only
        assert traj.stop_reason == "eos"
    assert workflow.metrics()["tool_calls"] == 2 and workflow.metrics()["tool_errors"] == 0


def test_a_refused_expression_is_answered_with_its_reason_and_counted():
    workflow, group = run({0: "<calc>__import__('os')</calc>", 1: "\n#### 84"}, max_new_tokens=160)
    traj = group.trajectories[0]
    text = TOK.decode(traj.input_ids[~traj.loss_mask].tolist(), skip_special_tokens=True)
    assert "<result>error: character '_' at position 0 is not allowed" in text
    assert traj.metadata["episode_metrics"]["tool_errors"] == 1.0 and traj.reward == pytest.approx(1.1)


def test_the_turn_limit_ends_an_episode_that_keeps_calling():
    workflow, group = run({0: "<calc>1+1</calc>", 1: "<calc>2+2</calc>", 2: "<calc>3+3</calc>"}, max_new_tokens=128)
    traj = group.trajectories[0]
    assert traj.metadata["episode_metrics"] == {"turns": 3.0, "tool_calls": 3.0, "tool_errors": 0.0, "truncated": 1.0}
    assert TOK.decode(traj.input_ids.tolist(), skip_special_tokens=True).endswith("<calc>3+3</calc>")  # unanswered
    assert traj.reward == 0.0


def test_the_length_budget_bounds_every_trajectory():
    workflow, group = run({0: "<calc>1+1</calc>", 1: "x" * 80}, max_new_tokens=40)
    traj = group.trajectories[0]
    assert traj.num_tokens - traj.prompt_length <= 40 and traj.stop_reason == "length"


def test_a_turn_whose_context_passes_the_largest_prefill_bucket_is_taken():
    """The engine prefills a context of any length in chunks, so only the length budget ends an episode."""
    workflow, group = run({0: "so <calc>12*7</calc> and", 1: " the answer\n#### 84"}, prefill_buckets=[16])
    traj = group.trajectories[0]
    assert traj.prompt_length + len(ids("so <calc>12*7</calc><result>84</result>")) > 17  # the second turn's context
    assert traj.metadata["episode_metrics"] == {"turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0, "truncated": 0.0}
    assert traj.reward == pytest.approx(1.1)


# --------------------------------------------------------------------------- resume


def random_calls(request, i):
    """Per (sample, trajectory, turn): a call, a refused call or an answer, as a model might."""
    rng = np.random.default_rng([request.sample_id, request.index_in_group + i, request.turn])
    a, b = rng.integers(1, 50, size=2)
    choice = rng.integers(0, 3) if request.turn < 2 else 2
    text = [f"<calc>{a}*{b}</calc>", f"<calc>{a}**{b}**{b}</calc>", f"#### {a * b}"][choice]
    return ids(text) + ([EOS] if choice == 2 else [])


@pytest.mark.timeout(60)
def test_in_flight_multi_turn_episodes_are_reissued_identically_after_a_checkpoint(tmp_path):
    cfg = cfg_for(group_size=2, max_staleness=2, max_concurrent=3, batch_size=2)
    dataset = [{"prompt": f"q{i}", "answer": "1"} for i in range(40)]
    block = threading.Event()
    release = threading.Event()
    parked: list[int] = []

    def delay(request):  # park episodes on their second turn: in flight, mid-episode
        if block.is_set() and request.turn >= 1:
            parked.append(request.sample_id)
            release.wait(10)
        return 0.0

    def make_engine(version):
        return FakeEngine(vocab_size=len(TOK), eos_token_id=EOS, version=version, responder=random_calls, delay_s=delay)

    def train(ex, eng, start, steps, groups):
        for v in range(start, start + steps):
            groups.extend(ex.next_batch(v, timeout=20).groups)
            eng.update_weights(None, v + 1)
            ex.set_version(v + 1)

    eng = make_engine(0)
    groups: list = []
    ex = WorkflowExecutor(build_workflow(cfg, TOK), eng, dataset, cfg).start()
    try:
        train(ex, eng, 0, 2, groups)
        block.set()
        deadline = time.monotonic() + 10
        while not parked:  # at least one episode is waiting inside its second turn
            assert time.monotonic() < deadline, ex.counts()
            time.sleep(0.01)
        state = ex.state_dict()
        parked_then = list(parked)
        ex.close(timeout=2)
    finally:
        release.set()
    in_flight = sorted(ex.ledger.sample_id(t) for t in ex.ledger.in_flight_tickets())
    assert parked_then and set(parked_then) <= set(in_flight)
    save_rollout_state(state, tmp_path)

    block.clear()
    eng2 = make_engine(2)
    ex2 = WorkflowExecutor(build_workflow(cfg, TOK), eng2, dataset, cfg)
    ex2.load_state_dict(load_rollout_state(tmp_path))
    assert ex2.counts()["reissued"] == len(in_flight)
    resumed: list = []
    with ex2:
        train(ex2, eng2, 2, 4, resumed)
    by_id = {g.metadata["sample_id"]: g for g in resumed}
    assert set(in_flight) <= set(by_id)
    # A re-issued episode is the episode it would have been: same turns, tokens, masks, reward.
    reference = build_workflow(cfg, TOK)
    multi_turn = 0
    for sample_id in in_flight:
        sample = {**dataset[sample_id % len(dataset)], "sample_id": sample_id}
        expected = reference.run_episode(make_engine(0), sample)
        for got, want in zip(by_id[sample_id].trajectories, expected.trajectories):
            np.testing.assert_array_equal(got.input_ids, want.input_ids)
            np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
            np.testing.assert_array_equal(got.behavior_logprobs, want.behavior_logprobs)
            assert got.reward == want.reward and got.metadata["episode_metrics"] == want.metadata["episode_metrics"]
            assert (got.versions[got.loss_mask] >= 2).all()  # generated after the resume
            multi_turn += got.metadata["episode_metrics"]["turns"] > 1
    assert multi_turn > 0
    assert ex2.ledger.reissued_total == len(in_flight) and ex2.counts()["reissued"] == 0


# --------------------------------------------------------------------------- RL with the tiny model


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rl_steps_with_the_tiny_model(tmp_path):
    """A few GRPO steps of the multi-turn workflow on `tiny` (the add task), tool tags spelled in
    the tiny character vocabulary: trajectories with tool results train, and the workflow's
    counters reach metrics.jsonl."""
    import json

    from asyncrl.run.loop import train

    cfg = load_config(data={
        "run": {"output_dir": str(tmp_path / "run"), "total_steps": 3},
        "model": {"path": "tiny"},
        **MULTI_TURN_ON_TINY,
        "engine": {"slots": 16, "kv_capacity": 32, "prefill_buckets": [16, 31], "decode_chunk": 8},
        "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 0}, "logging": {"dump_every_steps": 0},
    })
    result = train(cfg)
    assert result.steps == 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(np.isfinite(r["loss/total"]) for r in rows)
    assert rows[-1]["rollout/workflow/episodes"] >= 3 * 2 * 4
    assert rows[-1]["rollout/count/trained"] == 6
    assert rows[-1]["rollout/workflow/tool_calls"] > 0  # the random policy writes "C...=" often enough


# --------------------------------------------------------------------------- the docs' example


def test_the_docs_tool_example_is_the_runnable_file_and_runs(capsys):
    """`python docs/examples/tool_workflow.py`, run in-process (runpy) to spare an interpreter start."""
    import runpy

    from tests.helpers import REPO_ROOT

    path = REPO_ROOT / "docs" / "examples" / "tool_workflow.py"
    doc = (REPO_ROOT / "docs" / "workflows.md").read_text()
    assert "python docs/examples/tool_workflow.py" in doc
    runpy.run_path(str(path), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "reward 1.0  trained tokens 9 of 23"
    # the tool's answer "=46\n" is in the sequence, untrained, version -1
    tool = [line for line in lines if "trained=False" in line][-4:]
    assert [line.split()[0] for line in tool] == ["'='", "'4'", "'6'", "'\\n'"] and all("version=-1" in t for t in tool)
