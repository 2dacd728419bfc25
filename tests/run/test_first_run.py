"""First-run correctness: custom workflows in eval and SFT, the config's rewards in
custom workflows, reward failures, multi-turn lengths, run directories, log messages, and
docs/workflows.md's examples, all on fakes (no model); the CLI scenarios are in test_cli_first_run.py."""

from __future__ import annotations

import json
import logging
import re
import sys
import types

import numpy as np
import pytest

from asyncrl.engine.fake import FakeEngine
from asyncrl.errors import ConfigError, RolloutError
from asyncrl.rollout.executor import WorkflowExecutor
from asyncrl.rollout.rewards import (
    RewardFailuresExceeded,
    RewardFunction,
    RewardScorer,
    build_reward_functions,
    check_reward_signatures,
)
from asyncrl.rollout.workflow import RolloutWorkflow, SingleTurnWorkflow, WorkflowInitError, build_workflow
from asyncrl.run.evaluate import EVAL_SAMPLE_ID_BASE, evaluate_workflow
from tests.helpers import REPO_ROOT
from tests.rollout_fakes import TokenWorkflow, char_tokenizer, make_cfg

DOCS = REPO_ROOT / "docs" / "workflows.md"
SAMPLES = [{"prompt": "12", "answer": "12"}, {"prompt": "34", "answer": "34"}, {"prompt": "56", "answer": "65"}]


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def docs_module():
    """docs/workflows.md's workflow example, importable as ``docs_workflows:CheckAgainWorkflow``."""
    (code,) = [block for block in _code_blocks("python") if "class CheckAgainWorkflow" in block]
    module = types.ModuleType("docs_workflows")
    exec(compile(code, str(DOCS), "exec"), module.__dict__)
    sys.modules["docs_workflows"] = module
    yield module
    del sys.modules["docs_workflows"]


def echo_engine(tokenizer, **kwargs):
    """Answers with the first two digits of the prompt (the sample's two-digit prompt), then EOS."""

    def respond(request, i):
        text = tokenizer.decode(list(request.prompt_ids), skip_special_tokens=True)
        digits = "".join(re.findall(r"\d", text))[:2] or "0"
        return tokenizer.encode(digits, add_special_tokens=False) + [tokenizer.eos_token_id]

    return FakeEngine(vocab_size=len(tokenizer), responder=respond, **kwargs)


def docs_cfg(data=None, **rollout):
    return make_cfg(
        rollout={"group_size": 2, "batch_size": 2, "max_new_tokens": 4, **rollout},
        data={"max_prompt_tokens": 6, **(data or {})},
        workflow="docs_workflows:CheckAgainWorkflow",
        rewards=[{"fn": "exact_match", "weight": 2.0}, {"fn": "positional_match", "weight": 0.5}],
        eval={"n_samples": 2},
    )


# ----------------------------------------------------------------------------- the docs workflow


def test_docs_workflow_trains_with_room_for_every_turn(docs_module):
    """The docs' two-turn workflow scores with the config's weighted rewards and
    trains once rollout.max_seq_len holds the whole episode."""
    tokenizer = char_tokenizer()
    cfg = docs_cfg(max_seq_len=48)
    workflow = build_workflow(cfg, tokenizer)
    with WorkflowExecutor(workflow, echo_engine(tokenizer), SAMPLES, cfg) as executor:
        got = executor.next_batch(0, timeout=30)
        groups = got.groups
    traj = groups[0].trajectories[0]
    assert set(traj.reward_components) == {"exact_match", "positional_match"}
    assert traj.reward == pytest.approx(2.0 * traj.reward_components["exact_match"] + 0.5 * traj.reward_components["positional_match"])
    assert traj.metadata["episode_metrics"] == {"turns": 2}
    assert got.metrics["rollout/workflow/reward_errors"] == 0


def test_multi_turn_too_long_stops_early_naming_max_seq_len(docs_module, caplog):
    """With the default one-turn max_seq_len every group is dropped too_long; the run
    stops after rollout.max_consecutive_drops with the reason and the setting, long before
    the batch timeout, and the first drop is logged."""
    tokenizer = char_tokenizer()
    cfg = docs_cfg(max_consecutive_drops=6)  # cap 6 + 4: one turn; the episode has 12 tokens
    workflow = build_workflow(cfg, tokenizer)
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        with WorkflowExecutor(workflow, echo_engine(tokenizer), SAMPLES, cfg) as executor:
            with pytest.raises(RolloutError, match=r"6 finished groups were all dropped as too_long.*raise rollout.max_seq_len"):
                executor.next_batch(0, timeout=60)
    assert "dropped:too_long" in caplog.text and "room for one turn only" in caplog.text


def test_eval_runs_the_workflows_own_episodes(docs_module):
    """Eval runs the custom two-turn workflow greedily with the eval settings, scores
    its episodes with its rewards, and reports components, episode metrics and task metrics."""
    tokenizer = char_tokenizer()
    cfg = docs_cfg(max_seq_len=48).model_copy()
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"max_new_tokens": 3})})
    workflow = build_workflow(cfg, tokenizer)
    engine = echo_engine(tokenizer)
    seen = []
    submit = engine.submit

    def record(request):
        seen.append(request)
        return submit(request)

    engine.submit = record
    lengths = {"answer_length": lambda prompt, completion, **fields: float(len(completion))}
    result = evaluate_workflow(engine, workflow, SAMPLES, cfg, eval_metrics=lengths)
    m = result.metrics
    # "12" and "34" are echoed right (exact 1, positional 1); "56" -> "65" is wrong (0 and 0).
    assert m["eval/reward"] == pytest.approx((2.5 + 2.5 + 0.0) / 3)
    assert m["eval/reward/exact_match"] == pytest.approx(2 / 3) and m["eval/reward/positional_match"] == pytest.approx(2 / 3)
    assert m["eval/accuracy"] == pytest.approx(2 / 3) and m["eval/episode/turns"] == 2.0
    assert m["eval/answer_length"] > 0 and m["eval/n_prompts"] == 3 and m["eval/version"] == 0
    assert "eval/pass@1" in m and "eval/pass@2" in m
    greedy = [r for r in seen if r.greedy]
    assert greedy and all(r.n == 1 and r.max_new_tokens == 3 for r in greedy)
    assert {r.turn for r in greedy} == {0, 1}  # the whole episode, both turns
    assert {r.sample_id for r in greedy} == {EVAL_SAMPLE_ID_BASE + i for i in range(3)}
    # one greedy computation per prompt and turn, although the workflow asks once per group member
    assert len(greedy) == 3 * 2
    assert all(not r.greedy and r.temperature == cfg.rollout.temperature for r in seen if r not in greedy)


def test_sft_encodes_with_a_custom_workflow(docs_module):
    """An SFT stage formats prompts with any RolloutWorkflow (tokenizer and messages
    come from the base class)."""
    from asyncrl.run.sft import encode_example

    tokenizer = char_tokenizer()
    workflow = build_workflow(docs_cfg(), tokenizer)
    ids, mask = encode_example({"prompt": "12", "response": "12"}, workflow, eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(ids[mask].tolist()) == "12<eos>"


def test_workflow_without_base_init_gets_cfg_and_tokenizer_from_the_builder():
    """A subclass that skips super().__init__ still gets cfg and tokenizer from the
    builder (so SFT and eval work), and a clear message (not a bare AttributeError) when
    built by hand and used."""
    from asyncrl.run.sft import encode_example

    class NoInit(RolloutWorkflow):
        def __init__(self, cfg, tokenizer):
            self.my_cfg = cfg

    module = types.ModuleType("noinit_workflows")
    module.NoInit = NoInit
    sys.modules["noinit_workflows"] = module
    tokenizer = char_tokenizer()
    try:
        cfg = make_cfg(workflow="noinit_workflows:NoInit")
        workflow = build_workflow(cfg, tokenizer)
    finally:
        del sys.modules["noinit_workflows"]
    assert workflow.tokenizer is tokenizer and workflow.cfg is cfg
    ids, mask = encode_example({"prompt": "12", "response": "3"}, workflow, eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(ids[mask].tolist()) == "3<eos>"
    with pytest.raises(WorkflowInitError, match="has no 'tokenizer' because its __init__ does not call super"):
        _ = NoInit(cfg, None).tokenizer


def test_score_uses_the_configs_weights_and_fallback():
    """RolloutWorkflow.score applies the config's rewards (weights, fallback, counting)."""

    def broken(prompt, completion, **fields):
        raise ValueError("no")

    module = types.ModuleType("score_rewards")
    module.broken = broken
    sys.modules["score_rewards"] = module
    try:
        cfg = make_cfg(rollout={"reward_fallback": -2.0},
                       rewards=[{"fn": "exact_match", "weight": 3.0}, {"fn": "score_rewards:broken", "weight": 0.5}])
        workflow = TokenWorkflow(cfg)
        reward, components = workflow.score("p", " 7 ", {"answer": "7", "sample_id": 3})
    finally:
        del sys.modules["score_rewards"]
    assert components == {"exact_match": 1.0, "broken": -2.0}
    assert reward == pytest.approx(3.0 * 1.0 + 0.5 * -2.0)
    assert workflow.metrics() == {"reward_errors": 1.0, "reward_timeouts": 0.0}


# ----------------------------------------------------------------------------- reward failures


def test_reward_signature_is_checked_against_the_dataset_fields():
    def two_args(prompt, completion):
        return 1.0

    def takes_answer(prompt, completion, answer):
        return 1.0

    functions = [RewardFunction(lambda prompt, completion, **f: 1.0, name="ok"), RewardFunction(two_args)]
    with pytest.raises(ConfigError, match=r"rewards\.1\.fn: two_args\(prompt, completion\) cannot be called as "
                                          r"fn\(prompt, completion, \*\*fields\).*answer, sample_id"):
        check_reward_signatures(functions, {"prompt": "1", "answer": "1"})
    with pytest.raises(ConfigError, match=r"rewards\.0\.fn: takes_answer.*unexpected keyword argument 'sample_id'"):
        check_reward_signatures([RewardFunction(takes_answer)], {"prompt": "1", "answer": "1"})


def test_consecutive_reward_failures_stop_training_with_the_cause():
    """A reward function failing on every call stops the run (it used to train on -1.0 silently)."""

    def explode(prompt, completion, **fields):
        raise KeyError("gold")

    tokenizer = char_tokenizer()
    cfg = make_cfg(rollout={"max_consecutive_reward_failures": 5, "max_new_tokens": 4})
    scorer = RewardScorer.from_config([RewardFunction(explode)], cfg)
    assert scorer.max_consecutive_failures == 5
    workflow = SingleTurnWorkflow(cfg, tokenizer, rewards=[RewardFunction(explode)])
    with WorkflowExecutor(workflow, echo_engine(tokenizer), SAMPLES, cfg) as executor:
        with pytest.raises(RewardFailuresExceeded, match=r"(?s)'explode' failed on \d+ calls in a row \(rollout.max_consecutive_reward_failures = 5\).*KeyError: 'gold'"):
            executor.next_batch(0, timeout=60)


def test_build_reward_functions_then_check_names_the_config_field():
    cfg = make_cfg(rewards=[{"fn": "exact_match"}, {"fn": "tests.run.test_first_run:_no_kwargs_reward"}])
    with pytest.raises(ConfigError, match=r"rewards\.1\.fn: _no_kwargs_reward"):
        check_reward_signatures(build_reward_functions(cfg), {"prompt": "1", "answer": "1"})


def _no_kwargs_reward(prompt, completion):
    return 0.0


# ----------------------------------------------------------------------------- run directories


def test_run_dir_without_a_completed_step_is_no_run(tmp_path):
    from asyncrl.run.rundir import RunDirError, prepare_output_dir

    cfg = make_cfg(run={"output_dir": str(tmp_path)})
    (tmp_path / "metrics.jsonl").write_text("")  # a start-up failure left this
    prepare_output_dir(cfg, None)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/reward": 0.1}) + "\n{\"step\": 3")
    prepare_output_dir(cfg, None)  # step 0 (eval before training) and a torn line: still no run
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss/total": 0.1}) + "\n")
    with pytest.raises(RunDirError, match="already holds a run"):
        prepare_output_dir(cfg, None)


# ----------------------------------------------------------------------------- smaller matters


def test_failed_episodes_log_the_first_few_then_a_summary(caplog, monkeypatch):
    import asyncrl.rollout.executor as executor_module

    monkeypatch.setattr(executor_module, "FAILURE_SUMMARY_EVERY_S", 0.0)
    cfg = make_cfg(rollout={"max_consecutive_failures": 8})
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        with WorkflowExecutor(TokenWorkflow(cfg, fail_rate=1.0), FakeEngine(), SAMPLES, cfg) as executor:
            with pytest.raises(RolloutError, match="8 episodes failed in a row"):
                executor.next_batch(0, timeout=60)
    full = [r for r in caplog.records if "episode failed (failed:exception)" in r.getMessage()]
    assert len(full) == 3 and "summarised periodically" in full[-1].getMessage()
    assert any("more episodes failed" in r.getMessage() and "failed:exception" in r.getMessage() for r in caplog.records)


def test_trained_tokens_per_s_has_one_producer():
    """The trainer names its metrics itself (its compute time and tokens over it are not the
    loop's whole-step figures), and the loop's merge refuses a name with two producers."""
    from asyncrl.run.metrics import merge_producers
    from asyncrl.trainer.trainer import step_metric_name

    assert [step_metric_name(k) for k in ("loss", "pg_loss", "sft_loss", "logprob_gap", "grad_norm")] == [
        "loss/total", "loss/pg", "loss/sft", "engine/logprob_gap", "train/grad_norm"]
    merged = merge_producers(trainer={"perf/train_tokens_per_train_s": 5.0, "perf/train_time": 1.0},
                             loop={"perf/trained_tokens_per_s": 4.0, "perf/step_time": 1.25})
    assert merged == {"perf/train_tokens_per_train_s": 5.0, "perf/train_time": 1.0,
                      "perf/trained_tokens_per_s": 4.0, "perf/step_time": 1.25}
    with pytest.raises(ValueError, match="'perf/trained_tokens_per_s' is produced by both trainer and loop"):
        merge_producers(trainer={"perf/trained_tokens_per_s": 5.0}, loop={"perf/trained_tokens_per_s": 4.0})


def test_workflows_doc_metric_names_are_the_logged_ones():
    text = DOCS.read_text()
    for name in ("rollout/count/failed/exception", "rollout/count/failed/timeout", "rollout/count/dropped/too_long"):
        assert name in text
    assert "first 3 failures of each kind are logged" in text


def test_readme_lists_the_tiny_vocabulary():
    from asyncrl.model.tiny import TINY_ALPHABET, TINY_SPECIAL_TOKENS

    readme = (REPO_ROOT / "README.md").read_text()
    listed = readme[readme.index("a character\nvocabulary:"): readme.index("learns to copy")]
    assert "`0123456789`" in listed and f"the {len(TINY_ALPHABET)} characters" in listed
    for char in TINY_ALPHABET.replace(" ", "").replace("\n", "").lstrip("0123456789"):
        assert f"`{char}`" in listed, char
    assert "space" in listed and "newline" in listed
    assert all(f"`{token}`" in listed for token in TINY_SPECIAL_TOKENS)


def test_docs_yaml_and_loop_examples_run(docs_module):
    """docs/workflows.md: every YAML block is a valid config, and the trainer-side loop runs."""
    import yaml

    from asyncrl.config import load_config

    for block in _code_blocks("yaml"):
        raw = yaml.safe_load(block)
        raw["rewards"] = [{**r, "fn": "exact_match" if "mypkg" in str(r["fn"]) else r["fn"]} for r in raw.get("rewards", [])]
        load_config(data=raw)
    (loop,) = [block for block in _code_blocks("python") if "executor.next_batch(v" in block]
    tokenizer = char_tokenizer()
    cfg = docs_cfg(max_seq_len=48)
    namespace = {
        "WorkflowExecutor": WorkflowExecutor, "workflow": build_workflow(cfg, tokenizer), "engine": echo_engine(tokenizer),
        "dataset": SAMPLES, "cfg": cfg, "start": 0, "total_steps": 2, "params": np.zeros(1),
        "train_step": lambda params, batch: params + batch.loss_mask.sum(),
    }
    exec(compile(loop, str(DOCS), "exec"), namespace)
    assert namespace["engine"].version == 2 and namespace["params"][0] > 0


@pytest.mark.slow  # a second family's loading path
def test_qwen2_sliding_window_covering_no_layer_loads_as_full_attention(tmp_path):
    """use_sliding_window with max_window_layers = every layer is full attention in
    transformers; it loads and matches transformers' logits past the window length."""
    pytest.importorskip("torch")
    from asyncrl.model import forward_jit, load_model
    from tests.model_helpers import hf_logits, save_hf_model

    overrides = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}
    torch_model = save_hf_model("qwen2", tmp_path / "m", config_overrides=overrides)
    loaded = load_model(str(tmp_path / "m"))
    ids = np.arange(3, 15, dtype=np.int32)[None, :]  # 12 tokens, 3x the window
    ours = np.asarray(forward_jit(*loaded.split(), ids)[0])
    np.testing.assert_allclose(ours, hf_logits(torch_model, ids), rtol=2e-4, atol=2e-4)


def test_export_has_the_default_permissions(tmp_path):
    import os
    import stat

    from asyncrl.model import export_hf, load_model

    loaded = load_model("tiny")
    out = export_hf(loaded, loaded.tokenizer, tmp_path / "hf")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
