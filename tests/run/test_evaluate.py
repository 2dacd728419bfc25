"""Evaluation: greedy reward/accuracy, pass@k against a brute-force count, version checks."""

from __future__ import annotations

import itertools
import math

import pytest

from asyncrl.engine.fake import FakeEngine
from asyncrl.rollout.rewards import RewardFunction
from asyncrl.rollout.workflow import SingleTurnWorkflow
from asyncrl.run.evaluate import EvalError, combine_eval_parts, evaluate_part, evaluate_workflow, pass_at_k
from tests.rollout_fakes import char_tokenizer, make_cfg
from workflows.synthetic import positional_match


def test_pass_at_k_matches_brute_force():
    for n, c, k in [(5, 2, 1), (5, 2, 3), (6, 0, 2), (4, 4, 4), (7, 3, 2)]:
        outcomes = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(outcomes, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert math.isclose(pass_at_k(n, c, k), brute)
    with pytest.raises(ValueError, match="pass@3 needs at least 3 samples"):
        pass_at_k(2, 1, 3)


def _setup(eval_section=None, **engine_kwargs):
    tokenizer = char_tokenizer()
    cfg = make_cfg(eval=eval_section or {})
    workflow = SingleTurnWorkflow(cfg, tokenizer, rewards=[RewardFunction(positional_match)])
    samples = [{"prompt": "12", "answer": "12"}, {"prompt": "34", "answer": "34"}, {"prompt": "56", "answer": "65"}]

    def respond(request, i):
        # echo the digits of the prompt, then EOS: right for copy prompts, half right for "56"->"65"
        text = tokenizer.decode(list(request.prompt_ids), skip_special_tokens=True)
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    return cfg, workflow, samples, FakeEngine(vocab_size=len(tokenizer), responder=respond, **engine_kwargs)


def test_greedy_reward_accuracy_and_pass_at_k():
    cfg, workflow, samples, engine = _setup({"n_samples": 3})
    result = evaluate_workflow(engine, workflow, samples, cfg)
    m = result.metrics
    assert m["eval/reward"] == pytest.approx((1 + 1 + 0) / 3)
    assert m["eval/accuracy"] == pytest.approx(2 / 3)
    assert m["eval/pass@1"] == pytest.approx(2 / 3) and m["eval/pass@3"] == pytest.approx(2 / 3)
    assert m["eval/n_prompts"] == 3 and m["eval/version"] == 0 and m["eval/aborted"] == 0
    assert [row["completion"] for row in result.rows] == ["12", "34", "56"]


def test_parts_of_several_processes_combine_to_the_one_process_eval():
    """Each process evaluates its block of the eval samples (their ids unchanged); process 0
    combines the JSON parts to the one-process metrics, figure for figure."""
    import json

    cfg, workflow, samples, engine = _setup({"n_samples": 3})
    whole = evaluate_workflow(engine, workflow, samples, cfg).metrics
    for processes in (2, 3, 4):  # 4: one process has no sample
        parts = [json.loads(json.dumps(evaluate_part(engine, workflow, samples, cfg, share=(p, processes))))
                 for p in range(processes)]
        assert sum(part["n"] for part in parts) == 3
        combined = combine_eval_parts(parts, workflow).metrics
        assert {k: v for k, v in combined.items() if k != "eval/time_s"} == {
            k: v for k, v in whole.items() if k != "eval/time_s"}, processes


def test_max_prompts_and_empty_split():
    cfg, workflow, samples, engine = _setup({"max_prompts": 1})
    assert evaluate_workflow(engine, workflow, samples, cfg).metrics["eval/n_prompts"] == 1
    with pytest.raises(EvalError, match="eval split is empty"):
        evaluate_workflow(engine, workflow, [], cfg)


def test_workflow_without_prompts_is_a_clear_error():
    cfg, _, samples, engine = _setup()
    with pytest.raises(EvalError, match="workflow 'object' has no run_episode"):
        evaluate_workflow(engine, object(), samples, cfg)


def test_every_sample_skipped_says_why_and_which_setting():
    tokenizer = char_tokenizer()
    cfg = make_cfg(data={"max_prompt_tokens": 4})
    workflow = SingleTurnWorkflow(cfg, tokenizer, rewards=[RewardFunction(positional_match)])
    samples = [{"prompt": "123456", "answer": "1"}, {"prompt": "1234567", "answer": "1"}]
    with pytest.raises(EvalError, match=r"skipped every one of the 2 eval samples: 2 prompt_too_long "
                                        r"\(e\.g\. prompt_too_long: 8 tokens > data\.max_prompt_tokens = 4\): "
                                        r"raise data\.max_prompt_tokens"):
        evaluate_workflow(FakeEngine(vocab_size=len(tokenizer)), workflow, samples, cfg)


def test_eval_episodes_run_on_daemon_threads_kept_from_one_eval_to_the_next():
    import threading

    from asyncrl.run import evaluate as evaluate_module

    cfg, workflow, samples, engine = _setup({"n_samples": 3})
    evaluate_workflow(engine, workflow, samples, cfg)
    threads = evaluate_module._POOL.threads
    names = {t.name for t in threading.enumerate() if t.name.startswith("asyncrl-eval-")}
    evaluate_workflow(engine, workflow, samples, cfg)
    evaluate_workflow(engine, workflow, samples, cfg)
    assert evaluate_module._POOL.threads == threads  # no new thread for the later evals
    pool = [t for t in threading.enumerate() if t.name.startswith("asyncrl-eval-")]
    assert {t.name for t in pool} == names and all(t.daemon for t in pool)


@pytest.mark.timeout(30)
def test_a_stuck_eval_episode_is_an_error_and_the_next_eval_still_runs():
    import threading

    tokenizer = char_tokenizer()
    cfg = make_cfg(rollout={"episode_timeout_s": 3.0})  # generous: the healthy episodes must finish in it under load
    release = threading.Event()

    class Stuck(SingleTurnWorkflow):
        def run_episode(self, engine, sample):
            if sample["prompt"] == "99":
                release.wait(20)  # stuck until the test ends
            return super().run_episode(engine, sample)

    workflow = Stuck(cfg, tokenizer, rewards=[RewardFunction(positional_match)])
    engine = FakeEngine(vocab_size=len(tokenizer))
    try:
        with pytest.raises(EvalError, match="ran past rollout.episode_timeout_s = 3.0 s"):
            evaluate_workflow(engine, workflow, [{"prompt": "99", "answer": "1"}], cfg)
        result = evaluate_workflow(engine, workflow, [{"prompt": "12", "answer": "1"}, {"prompt": "34", "answer": "1"}], cfg)
        assert result.metrics["eval/n_prompts"] == 2
    finally:
        release.set()
