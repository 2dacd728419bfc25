"""The reward_model reward: the batched scoring queue, what is scored (the policy's own tokens,
or the conversation re-rendered for another tokenizer), start-up errors, and a run that trains
with it."""

from __future__ import annotations

import functools
import threading
import time

import numpy as np
import pytest

import asyncrl.model.reward_model as rm_module
from asyncrl.config import load_config
from asyncrl.engine.fake import FakeEngine
from asyncrl.errors import ConfigError, RolloutError
from asyncrl.model.reward_model import load_reward_model, pad_id_array, reward_scores_jit
from asyncrl.rollout.reward_model import close_reward_models, prepare_reward_functions
from asyncrl.rollout.reward_scoring import RewardModelClosed, RewardModelScorer
from asyncrl.rollout.rewards import build_reward_functions
from asyncrl.rollout.workflow import SingleTurnWorkflow
from tests.rollout_fakes import char_tokenizer, make_cfg

torch = pytest.importorskip("torch")


def write_reward_model(out_dir, tokenizer, *, seed: int = 0, family_class: str = "LlamaForSequenceClassification"):
    """A random Llama-family reward model over ``tokenizer``'s vocabulary, saved with it."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(  # type: ignore[call-arg]
        vocab_size=len(tokenizer.get_vocab()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = getattr(transformers, family_class)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def same_tokenizer_rm(tmp_path_factory):
    return write_reward_model(tmp_path_factory.mktemp("rm_same"), char_tokenizer())


@pytest.fixture(autouse=True)
def _close_scorers():
    yield
    close_reward_models()


def direct_scores(path, sequences):
    rm = load_reward_model(path, with_tokenizer=False)
    out = []
    for ids in sequences:
        arr = np.asarray([ids], np.int32)
        out.append(float(reward_scores_jit(rm.graphdef, rm.params, rm.score_weight, arr, np.ones_like(arr, bool),
                                           pad_id_array(rm.pad_id))[0]))
    return np.array(out)


def sequences(count: int, vocab: int, seed: int = 0):
    """``count`` random sequences of a few lengths on both sides of the 16-token bucket: the
    unbatched reference (:func:`direct_scores`) compiles once per distinct length."""
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, vocab, int(rng.choice([1, 7, 16, 17, 39])))) for _ in range(count)]


# --------------------------------------------------------------------------- the scoring queue


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_scorer_batches_concurrent_callers_and_matches_unbatched_scores(same_tokenizer_rm):
    model = load_reward_model(same_tokenizer_rm, with_tokenizer=False)
    scorer = RewardModelScorer(model, batch_size=8, length_buckets=(16, 64))
    try:
        seqs = sequences(24, model.config.vocab_size)
        results: dict[int, float] = {}

        def caller(start: int) -> None:
            for i in range(start, len(seqs), 4):
                results[i] = scorer.submit(seqs[i]).result(timeout=120)

        threads = [threading.Thread(target=caller, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        batch_scores = scorer.score(seqs, timeout_s=120)  # submitted together: they share batches
        expected = direct_scores(same_tokenizer_rm, seqs)
        np.testing.assert_allclose([results[i] for i in range(len(seqs))], expected, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(batch_scores, expected, atol=1e-5, rtol=1e-5)
        metrics = scorer.metrics()
        assert metrics["reward_model/scored"] == 48 and metrics["reward_model/batches"] < 48
    finally:
        scorer.close()


def test_packed_scoring_matches_unpacked_scores(same_tokenizer_rm):
    """rollout.pack's scorer: sequences packed several to a row score as each does alone, trailing
    pad ids included (the score is at each segment's last non-pad token)."""
    model = load_reward_model(same_tokenizer_rm, with_tokenizer=False)
    scorer = RewardModelScorer(model, batch_size=8, length_buckets=(16, 64), pack=True)
    try:
        seqs = sequences(16, model.config.vocab_size, seed=1)
        seqs[3] = seqs[3] + [model.pad_id, model.pad_id]  # scored before its trailing pads
        np.testing.assert_allclose(scorer.score(seqs, timeout_s=120), direct_scores(same_tokenizer_rm, seqs),
                                   atol=1e-5, rtol=1e-5)
    finally:
        scorer.close()


def test_bad_sequences_fail_their_own_request(same_tokenizer_rm):
    model = load_reward_model(same_tokenizer_rm, with_tokenizer=False)
    scorer = RewardModelScorer(model, batch_size=4, length_buckets=(16,), name="rewards.0")
    try:
        with pytest.raises(RolloutError, match="17 tokens is longer than the largest length bucket"):
            scorer.submit([1] * 17).result(timeout=60)
        with pytest.raises(RolloutError, match="outside the reward model's vocabulary"):
            scorer.submit([1, model.config.vocab_size]).result(timeout=60)
        with pytest.raises(RolloutError, match="empty"):
            scorer.submit([]).result(timeout=60)
        assert np.isfinite(scorer.submit([1, 2, 3]).result(timeout=60))
    finally:
        scorer.close()


def test_device_failure_reaches_every_caller_of_the_batch_and_scoring_goes_on(same_tokenizer_rm, monkeypatch):
    model = load_reward_model(same_tokenizer_rm, with_tokenizer=False)
    scorer = RewardModelScorer(model, batch_size=4, length_buckets=(16,))
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("device lost")

        monkeypatch.setattr(rm_module, "reward_scores_jit", broken)
        with pytest.raises(RolloutError, match="RuntimeError: device lost"):
            scorer.submit([1, 2]).result(timeout=60)
        monkeypatch.undo()
        assert np.isfinite(scorer.submit([1, 2]).result(timeout=60))
    finally:
        scorer.close()


def test_close_fails_waiting_requests_at_once_and_later_submits(same_tokenizer_rm, monkeypatch):
    model = load_reward_model(same_tokenizer_rm, with_tokenizer=False)
    scorer = RewardModelScorer(model, batch_size=1, length_buckets=(16,))
    entered, release = threading.Event(), threading.Event()
    original = rm_module.reward_scores_jit

    def gated(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return original(*args, **kwargs)

    monkeypatch.setattr(rm_module, "reward_scores_jit", gated)
    running = scorer.submit([1, 2])
    assert entered.wait(60)
    waiting = scorer.submit([3, 4])
    started = time.monotonic()
    closer = threading.Thread(target=scorer.close, daemon=True)
    closer.start()
    with pytest.raises(RewardModelClosed):
        waiting.result(timeout=30)
    assert time.monotonic() - started < 10
    release.set()
    assert np.isfinite(running.result(timeout=60))  # the batch on the device finishes
    closer.join(timeout=30)
    with pytest.raises(RewardModelClosed):
        scorer.submit([1])


# --------------------------------------------------------------------------- the reward


def length_bonus(prompt, completion, **fields):
    return float(len(completion))


def rm_config(path, **kwargs):
    return make_cfg(rollout={"group_size": 4, "max_new_tokens": 6}, rewards=[
        {"fn": "reward_model", "kwargs": {"path": str(path), "batch_size": 8, **kwargs}, "weight": 0.5},
        {"fn": "tests.rollout.test_rollout_reward_model:length_bonus", "weight": 2.0},
    ])


def run_group(cfg, tokenizer, sample):
    functions = build_reward_functions(cfg)
    prepare_reward_functions(functions, cfg, tokenizer, sample)
    workflow = SingleTurnWorkflow(cfg, tokenizer)
    engine = FakeEngine(vocab_size=len(tokenizer.get_vocab()), eos_token_id=1, first_token_id=5)
    return workflow, workflow.run_episode(engine, {**sample, "sample_id": 3})


def test_same_tokenizer_scores_the_policys_own_tokens_combined_by_weight(same_tokenizer_rm):
    tokenizer = char_tokenizer()
    cfg = rm_config(same_tokenizer_rm)
    workflow, group = run_group(cfg, tokenizer, {"prompt": "abc"})
    seqs = [list(t.input_ids) for t in group.trajectories]  # prompt (chat template included) + completion
    expected = direct_scores(same_tokenizer_rm, seqs)
    for traj, score in zip(group.trajectories, expected):
        assert traj.reward_components["reward_model"] == pytest.approx(score, abs=1e-5)
        completion = traj.metadata["completion"]
        assert traj.reward == pytest.approx(0.5 * score + 2.0 * len(completion), abs=1e-5)
    assert workflow.metrics()["reward_errors"] == 0


def test_a_remote_engine_config_needs_nothing_of_the_engine(same_tokenizer_rm):
    """With engine.remote set (no server here: the reward never calls the engine), the reward
    model is placed on this process's devices and scores the rollouts' tokens."""
    import jax

    cfg = make_cfg(rollout={"group_size": 2, "max_new_tokens": 4}, engine={"remote": {"urls": ["http://127.0.0.1:9"]}},
                   rewards=[{"fn": "reward_model", "kwargs": {"path": str(same_tokenizer_rm)}}])
    tokenizer = char_tokenizer()
    _, group = run_group(cfg, tokenizer, {"prompt": "xy"})
    from asyncrl.rollout.reward_model import prepare_reward_model

    assert prepare_reward_model(cfg=cfg, tokenizer=tokenizer, path=str(same_tokenizer_rm)).scorer.devices == tuple(jax.devices())
    expected = direct_scores(same_tokenizer_rm, [list(t.input_ids) for t in group.trajectories])
    np.testing.assert_allclose([t.reward for t in group.trajectories], expected, atol=1e-5)


@pytest.mark.slow  # a second tokenizer; the policy's own tokens are scored in the default selection
def test_another_tokenizer_rescores_the_re_rendered_conversation(tmp_path):
    own = char_tokenizer(chars="abcdefghijklmnopqrstuvwxyz0123456789 +-=?.:!", system=True)  # another vocabulary
    path = write_reward_model(tmp_path, own, seed=3)
    policy = char_tokenizer()
    cfg = rm_config(path)
    _, group = run_group(cfg, policy, {"prompt": "abc"})
    rendered = [
        own.apply_chat_template([{"role": "user", "content": "abc"}, {"role": "assistant", "content": t.metadata["completion"]}],
                                tokenize=True, add_generation_prompt=False)
        for t in group.trajectories
    ]
    from asyncrl.rollout.workflow import token_ids

    expected = direct_scores(path, [token_ids(r) for r in rendered])
    got = [t.reward_components["reward_model"] for t in group.trajectories]
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_another_tokenizer_without_a_chat_template_is_a_start_up_error(tmp_path):
    own = char_tokenizer(system=True)
    own.chat_template = None
    path = write_reward_model(tmp_path, own)
    cfg = rm_config(path)
    with pytest.raises(ConfigError) as err:
        prepare_reward_functions(build_reward_functions(cfg), cfg, char_tokenizer(), {"prompt": "a"})
    message = str(err.value)
    assert "\n" not in message and message.startswith("rewards.0.kwargs.path:") and "no chat template" in message
    # kwargs.chat_template fixes it
    cfg = rm_config(path, chat_template=char_tokenizer(system=True).chat_template)
    prepare_reward_functions(build_reward_functions(cfg), cfg, char_tokenizer(), {"prompt": "a"})


def test_a_causal_lm_directory_is_a_one_line_error_naming_the_reward(tmp_path):
    from tests.model_helpers import save_hf_model

    save_hf_model("llama", tmp_path)
    cfg = rm_config(tmp_path)
    with pytest.raises(ConfigError) as err:
        prepare_reward_functions(build_reward_functions(cfg), cfg, char_tokenizer(), {"prompt": "a"})
    assert "\n" not in str(err.value) and str(err.value).startswith("rewards.0.kwargs.path:")
    assert "LlamaForCausalLM" in str(err.value)


def test_reward_kwargs_in_config_and_their_errors(same_tokenizer_rm):
    cfg = load_config(data={"rewards": [{"fn": "reward_model", "kwargs": {"path": "x"}}]})
    fn = build_reward_functions(cfg)[0]
    assert fn.name == "reward_model" and isinstance(fn.fn, functools.partial) and fn.fn.keywords == {"path": "x"}
    with pytest.raises(ConfigError, match="rewards.0"):
        load_config(data={"rewards": [{"fn": {"target": "reward_model", "kwargs": {"path": "x"}}, "kwargs": {"path": "y"}}]})
    cfg = make_cfg(rewards=[{"fn": "reward_model"}])
    with pytest.raises(ConfigError, match=r"rewards.0.kwargs.path: reward_model needs"):
        prepare_reward_functions(build_reward_functions(cfg), cfg, char_tokenizer(), {"prompt": "a"})
    cfg = rm_config(same_tokenizer_rm)
    with pytest.raises(ConfigError, match=r"rewards.0: the dataset's field\(s\) \['devices'\]"):
        prepare_reward_functions(build_reward_functions(cfg), cfg, char_tokenizer(), {"prompt": "a", "devices": 1})


# --------------------------------------------------------------------------- a run


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_a_run_with_a_reward_model_reward_trains(tmp_path):
    import json

    from asyncrl.config.tree import read_yaml
    from asyncrl.model.tiny import build_tiny_tokenizer
    from asyncrl.run.loop import train
    from tests.helpers import REPO_ROOT

    path = write_reward_model(tmp_path / "rm", build_tiny_tokenizer(), seed=5)  # the policy's tokenizer
    raw = read_yaml(REPO_ROOT / "configs" / "quickstart.yaml")
    raw["run"]["output_dir"] = str(tmp_path / "run")
    raw["stages"] = [{"name": "rl", "type": "rl", "total_steps": 2}]
    raw["eval"] = {"every_steps": 0}
    raw["checkpoint"] = {"every_steps": 0}
    raw["logging"] = {"dump_every_steps": 1}
    raw["rollout"].update(batch_size=4, group_size=4, max_concurrent=8)
    raw["rewards"] = [{"fn": "reward_model", "kwargs": {"path": str(path), "batch_size": 16}, "weight": 0.5},
                      {"fn": "positional_match", "weight": 1.0}]
    result = train(load_config(data=raw), argv=["test"])
    assert result.steps == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/reward_model" in row and np.isfinite(row["reward/reward_model"]) for row in rows if "reward/positional_match" in row)
    scored = [row["reward_model/scored"] for row in rows if "reward_model/scored" in row]
    # Counted since the start, rollouts that ran ahead included: at least the 4 x 4 trained per step.
    assert len(scored) == 2 and 16 <= scored[0] <= scored[1] and scored[1] >= 32
    records = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert records
    for record in records:
        parts = record["reward_components"]
        assert record["reward"] == pytest.approx(0.5 * parts["reward_model"] + parts["positional_match"], abs=1e-5)


@pytest.mark.slow  # an 8-device subprocess; the default placement is exercised by the run test
def test_placement_on_the_engines_devices_or_its_own_range(same_tokenizer_rm):
    """On 4 devices: by default the reward model sits on the engine's devices (placement.engine),
    or on kwargs.devices; a batch is split over them and scores the same as on one device."""
    from tests.helpers import run_python, subprocess_env

    code = f"""
        import jax, numpy as np
        from asyncrl.config import load_config
        from asyncrl.rollout.reward_model import prepare_reward_model
        from asyncrl.model.reward_model import load_reward_model
        from asyncrl.rollout.reward_scoring import RewardModelScorer
        from tests.rollout_fakes import char_tokenizer
        cfg = load_config(data={{"placement": {{"trainer": "0:2", "engine": "2:4"}}}})
        tok = char_tokenizer()
        default = prepare_reward_model(cfg=cfg, tokenizer=tok, path={str(same_tokenizer_rm)!r}, batch_size=8)
        own = prepare_reward_model(cfg=cfg, tokenizer=tok, path={str(same_tokenizer_rm)!r}, devices="1:2", batch_size=8)
        devices = jax.devices()
        assert default.scorer.devices == tuple(devices[2:4]), default.scorer.devices
        assert own.scorer.devices == (devices[1],), own.scorer.devices
        leaf = jax.tree_util.tree_leaves(default.scorer._params)[0]
        assert leaf.sharding.device_set == set(devices[2:4]), leaf.sharding
        seqs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
        one = RewardModelScorer(load_reward_model({str(same_tokenizer_rm)!r}, with_tokenizer=False), batch_size=8)
        np.testing.assert_allclose(default.scorer.score(seqs, 60), one.score(seqs, 60), atol=1e-5)
        np.testing.assert_allclose(own.scorer.score(seqs, 60), one.score(seqs, 60), atol=1e-5)
        print("ok")
    """
    proc = run_python(code, timeout=300, env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"))
    assert proc.stdout.strip().endswith("ok")


def test_after_the_run_closes_a_late_episode_cannot_load_the_reward_model_again(same_tokenizer_rm):
    """A rollout thread still finishing after Run.close gets RewardModelClosed, not a fresh
    scorer thread that would outlive the run; the next explicit prepare reopens it."""
    from asyncrl.rollout.reward_model import prepare_reward_model, reward_model

    prepare_reward_model(path=str(same_tokenizer_rm))
    before = {t.ident for t in threading.enumerate()}
    close_reward_models()
    with pytest.raises(RewardModelClosed, match="closed when its run ended"):
        reward_model("abc", "d", path=str(same_tokenizer_rm))
    assert not [t for t in threading.enumerate() if t.ident not in before]
    prepare_reward_model(path=str(same_tokenizer_rm))
    assert reward_model("abc", "d", path=str(same_tokenizer_rm)) == pytest.approx(
        direct_scores(same_tokenizer_rm, [_rendered(same_tokenizer_rm, "abc", "d")])[0], abs=1e-5)


def _rendered(path, prompt, completion):
    from asyncrl.rollout.reward_model import prepare_reward_model

    return prepare_reward_model(path=str(path)).render([{"role": "user", "content": prompt}], completion)
