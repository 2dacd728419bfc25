"""SFT: the loss (response tokens only, exact under micro-batching), the data pipeline
(layout, counted skips, seeded resumable order), the GSM8K config, and learning on a
synthetic task with the tiny model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.algo import aggregation_denominators
from asyncrl.config import load_config
from asyncrl.data import DataError
from asyncrl.model import forward_jit, token_logprobs_from_logits
from asyncrl.rollout.rewards import RewardFunction
from asyncrl.rollout.trajectory import TrainBatch
from asyncrl.rollout.workflow import SingleTurnWorkflow, token_ids
from asyncrl.run.sft import SFTData, eval_loss
from asyncrl.trainer import Trainer, sft_loss
from tests.helpers import SHARED_DATA
from tests.sft_helpers import greedy_exact_match
from workflows.synthetic import exact_match, synthetic_task

OVERRIDES = ["rollout.length_bucket=16", "rollout.max_new_tokens=8", "data.max_prompt_tokens=16",
             "sft.batch_size=32", "optim.lr=0.003"]


def make(tiny_loaded, *overrides: str, task: str = "copy", seed: int = 0, eval_size: int = 64, micro_batches: int = 1):
    cfg = load_config(None, [*OVERRIDES, f"run.seed={seed}", f"optim.micro_batches={micro_batches}", *overrides])
    data = synthetic_task(task, seed=seed, eval_size=eval_size)
    workflow = SingleTurnWorkflow(cfg, tiny_loaded.tokenizer, rewards=[RewardFunction(exact_match)])
    return cfg, data, workflow


def numpy_nll(tiny_loaded, params, batch: TrainBatch) -> float:
    """Independent reference: float64 log-softmax of the forward logits, next-token labels,
    mean over loss_mask tokens of real rows."""
    graphdef, _ = tiny_loaded.split()
    logits = np.asarray(forward_jit(graphdef, params, batch.input_ids, None, batch.attention_mask)[0], np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    labels = batch.input_ids[:, 1:]
    picked = np.take_along_axis(logp[:, :-1], labels[..., None], axis=-1)[..., 0]
    mask = batch.loss_mask[:, 1:] & (batch.group_index >= 0)[:, None]
    return float(-(picked * mask).sum() / mask.sum())


def test_example_layout(tiny_loaded):
    """Prompt = the workflow's chat template; loss_mask exactly on response + EOS; right
    padding to the length bucket; padding rows to the row multiple; schema-valid fields."""
    cfg, task, workflow = make(tiny_loaded)
    eos = tiny_loaded.stop_token_ids[0]
    data = SFTData.for_task(task, workflow, cfg, eos_token_id=eos, row_multiple=8, batch_size=5)
    batch = data.next_batch().batch
    assert batch.input_ids.shape[0] == 8 and batch.input_ids.shape[1] % 16 == 0
    assert list(batch.group_index) == [0, 1, 2, 3, 4, -1, -1, -1]
    assert not batch.attention_mask[5:].any() and not batch.loss_mask[5:].any()
    order = data.samples
    for row in range(5):
        sample = order.sample(row)
        prompt = token_ids(tiny_loaded.tokenizer.apply_chat_template(
            workflow.messages(sample)[0], add_generation_prompt=True, tokenize=True))
        response = tiny_loaded.tokenizer.encode(sample["response"], add_special_tokens=False)
        n = len(prompt) + len(response) + 1
        assert batch.input_ids[row, :n].tolist() == [*prompt, *response, eos]
        assert batch.attention_mask[row].tolist() == [True] * n + [False] * (batch.input_ids.shape[1] - n)
        assert np.flatnonzero(batch.loss_mask[row]).tolist() == list(range(len(prompt), n))
        assert tiny_loaded.tokenizer.decode(batch.input_ids[row, len(prompt):n - 1].tolist()) == sample["answer"]
    assert (batch.versions[batch.loss_mask] == 0).all() and (batch.versions[~batch.loss_mask] == -1).all()
    assert batch.temperature == 1.0 and not batch.behavior_logprobs.any() and not batch.rewards.any()


def test_loss_ignores_prompt_labels_and_trains_every_response_token(tiny_loaded):
    """Changing only prompt-position labels leaves the loss and its parameter gradient
    unchanged; on a response-only batch every response token gets gradient -1/N."""
    cfg, task, workflow = make(tiny_loaded)
    graphdef, params = tiny_loaded.split()
    batch = SFTData.for_task(task, workflow, cfg, eos_token_id=tiny_loaded.stop_token_ids[0], batch_size=4).next_batch().batch
    ids, attn, mask = (jnp.asarray(x) for x in (batch.input_ids, batch.attention_mask, batch.loss_mask))
    den = aggregation_denominators(mask, jnp.asarray(batch.group_index >= 0))

    @jax.jit
    def loss_and_grad(theta, labels):
        def loss(theta):
            logits, _ = forward_jit(graphdef, theta, ids, None, attn)
            logp, _ = token_logprobs_from_logits(logits[:, :-1], labels[:, 1:])
            logp = jnp.pad(logp, ((0, 0), (1, 0)))  # aligned with input_ids, as per_token_logprobs
            return sft_loss(logp, jnp.zeros_like(logp), mask, den)[0]
        return jax.value_and_grad(loss)(theta)

    rng = np.random.default_rng(0)
    other = np.where(batch.loss_mask, batch.input_ids, rng.integers(0, 28, batch.input_ids.shape)).astype(np.int32)
    assert (other != batch.input_ids).any()
    value, grad = loss_and_grad(params, ids)
    value2, grad2 = loss_and_grad(params, jnp.asarray(other))
    assert float(value) == float(value2) and np.isfinite(float(value))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad2)))

    # Response-only rows: everything after the first token is trained.
    only = np.asarray(batch.attention_mask).copy()
    only[:, 0] = False
    logp = jnp.asarray(rng.normal(-2.0, 0.5, only.shape), jnp.float32)
    den_only = aggregation_denominators(jnp.asarray(only), jnp.ones(only.shape[0], bool))
    d_logp = jax.grad(lambda lp: sft_loss(lp, jnp.zeros_like(lp), jnp.asarray(only), den_only)[0])(logp)
    assert np.allclose(np.asarray(d_logp), np.where(only, -1.0 / only.sum(), 0.0), rtol=1e-6, atol=0)


def test_step_loss_matches_numpy_and_micro_batching_is_exact(tiny_loaded):
    """The first SFT step's loss (and the eval loss before it) equal an independent numpy
    cross-entropy; one step with 2 micro-batches equals one with 1 (padding row included)."""
    # SGD: the update is lr * gradient, so equal parameters mean equal gradients (Adam's first
    # step, lr * g / (|g| + eps), would amplify float noise in near-zero gradient entries).
    cfg1, task, workflow = make(tiny_loaded, "optim.optimizer=sgd")
    cfg2, _, _ = make(tiny_loaded, "optim.optimizer=sgd", micro_batches=2)
    graphdef, params = tiny_loaded.split()
    batch = SFTData.for_task(task, workflow, cfg1, eos_token_id=tiny_loaded.stop_token_ids[0], row_multiple=2,
                             batch_size=7).next_batch().batch
    assert batch.input_ids.shape[0] == 8 and batch.group_index[-1] == -1
    reference = numpy_nll(tiny_loaded, params, batch)
    one, two = Trainer(cfg1, graphdef, params, objective="sft"), Trainer(cfg2, graphdef, params, objective="sft")
    total, tokens = one.nll(batch)
    assert tokens == int(batch.loss_mask.sum()) and total / tokens == pytest.approx(reference, rel=1e-5)
    m1, m2 = one.step(batch), two.step(batch)
    assert m1["loss/sft"] == pytest.approx(reference, rel=1e-5)
    assert m2["loss/sft"] == pytest.approx(m1["loss/sft"], rel=1e-6)
    assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-5)
    assert m1["train/trained_tokens"] == batch.loss_mask.sum() and "loss/total" not in m1
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params)))
    assert diff < 1e-7
    assert one.version == 1 and one.update_count == 1


def test_too_long_examples_are_counted_skips(tiny_loaded):
    """Examples over Config.max_seq_len are skipped and counted, never trained or raised;
    a split where nothing fits is a clear error."""
    # copy with 2-4 digits: prompt 5 + n tokens, response n + EOS -> 2n + 6 tokens; cap 12 keeps n <= 3.
    cfg, task, workflow = make(tiny_loaded, "rollout.max_seq_len=12", "data.max_prompt_tokens=8", "rollout.max_new_tokens=4")
    data = SFTData.for_task(task, workflow, cfg, eos_token_id=tiny_loaded.stop_token_ids[0], batch_size=16)
    batch = data.next_batch().batch
    drawn = [data.samples.sample(i) for i in range(data.position)]
    long = sum(len(s["answer"]) == 4 for s in drawn)
    assert long > 0 and data.skipped_too_long == long and data.position == 16 + long
    assert data.metrics()["sft/skipped_too_long"] == long
    assert batch.input_ids.shape[1] == 12 and batch.attention_mask.sum(1).max() <= 12
    evaluation = SFTData.for_task(task, workflow, cfg, split="eval", eos_token_id=tiny_loaded.stop_token_ids[0])
    batches = list(evaluation.batches_once())
    assert sum(int((b.group_index >= 0).sum()) for b in batches) == sum(len(s["answer"]) < 4 for s in task.eval)

    cfg_short, _, _ = make(tiny_loaded, "rollout.max_seq_len=9", "data.max_prompt_tokens=5", "rollout.max_new_tokens=4")
    with pytest.raises(DataError, match="longer than Config.max_seq_len"):
        _ = SFTData.for_task(synthetic_task("copy", seed=0, train_size=8, min_digits=4), workflow, cfg_short,
                             eos_token_id=tiny_loaded.stop_token_ids[0], batch_size=2).next_batch().batch


def test_order_is_seeded_and_resumable(tiny_loaded):
    """Same seed, same batches; a restored position continues with the very next batch;
    another seed draws another order. Samples without ``response`` use the task's solver."""
    cfg, task, workflow = make(tiny_loaded)
    eos = tiny_loaded.stop_token_ids[0]
    a = SFTData.for_task(task, workflow, cfg, eos_token_id=eos, batch_size=8)
    first = [a.next_batch().batch for _ in range(3)]
    b = SFTData.for_task(task, workflow, cfg, eos_token_id=eos, batch_size=8)
    b.next_batch(); b.next_batch()
    resumed = SFTData.for_task(task, workflow, cfg, eos_token_id=eos, batch_size=8)
    resumed.load_state_dict(b.state_dict())
    assert np.array_equal(resumed.next_batch().batch.input_ids, first[2].input_ids)
    again = SFTData.for_task(task, workflow, cfg, eos_token_id=eos, batch_size=8).next_batch().batch
    assert np.array_equal(again.input_ids, first[0].input_ids)
    cfg_other, _, _ = make(tiny_loaded, "run.seed=1")
    other = SFTData.for_task(task, workflow, cfg_other, eos_token_id=eos, batch_size=8).next_batch().batch
    assert not np.array_equal(other.input_ids, first[0].input_ids)

    no_response = [{k: v for k, v in s.items() if k != "response"} for s in task.train[:8]]
    solved = SFTData(no_response, workflow, cfg, eos_token_id=eos, solver=task.solver, batch_size=8).next_batch().batch
    direct = SFTData(list(task.train[:8]), workflow, cfg, eos_token_id=eos, batch_size=8).next_batch().batch
    assert np.array_equal(solved.input_ids, direct.input_ids)
    with pytest.raises(DataError, match="response_field"):
        _ = SFTData(no_response, workflow, cfg, eos_token_id=eos, batch_size=8).next_batch().batch


@pytest.mark.slow  # every config validates and loads in tests/run/test_configs_from_a_clone.py
def test_gsm8k_sft_config_runs_two_steps_on_tiny(tiny_loaded):
    """configs/gsm8k_sft.yaml validates, and two SFT steps run with the tiny model: its
    character vocabulary maps characters it cannot spell to <unk>; over-long examples are
    counted skips."""
    path = SHARED_DATA / "gsm8k" / "train.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    cfg = load_config("configs/gsm8k_sft.yaml", ["model.path=tiny", f"data.dataset.kwargs.path={path}",
                                                 "sft.batch_size=8", "model.compute_dtype=float32"])
    (stage, cfg), = cfg.stage_configs()  # one SFT stage, what `asyncrl train` runs
    assert stage.type == "sft" and cfg.data.dataset.target == "gsm8k" and cfg.max_seq_len == 512
    from asyncrl.run.build import build_task_and_workflow

    cfg, task, workflow = build_task_and_workflow(cfg, tiny_loaded.tokenizer)
    graphdef, params = tiny_loaded.split()
    trainer = Trainer(cfg, graphdef, params, objective="sft")
    data = SFTData.for_task(task, workflow, cfg, eos_token_id=tiny_loaded.stop_token_ids[0], row_multiple=trainer.row_multiple)
    for _ in range(2):
        batch = data.next_batch().batch
        assert (batch.input_ids[batch.attention_mask] == tiny_loaded.tokenizer.unk_token_id).any()
        metrics = trainer.step(batch)
        assert np.isfinite(metrics["loss/sft"]) and metrics["train/skipped_updates"] == 0
    assert trainer.version == 2 and data.position >= 16
    assert data.metrics()["sft/skipped_too_long"] == data.position - 16


@pytest.mark.slow  # 14 s cold; the SFT loss is checked against numpy in the default selection
def test_sft_raises_greedy_exact_match_on_copy(tiny_loaded):
    """SFT alone on the tiny model: greedy exact match on held-out copy prompts goes from
    near 0 to >= 0.5 (``scripts/sft_demo.py`` has the full curves)."""
    cfg, task, workflow = make(tiny_loaded, eval_size=64)
    graphdef, params = tiny_loaded.split()
    trainer = Trainer(cfg, graphdef, params, objective="sft")
    data = SFTData.for_task(task, workflow, cfg, eos_token_id=tiny_loaded.stop_token_ids[0], row_multiple=trainer.row_multiple)
    held_out = SFTData.for_task(task, workflow, cfg, split="eval", eos_token_id=tiny_loaded.stop_token_ids[0])

    def accuracy() -> float:
        return greedy_exact_match(graphdef, trainer.params, trainer.model_cfg, workflow, task.eval,
                                  max_new_tokens=6, stop_token_ids=tiny_loaded.stop_token_ids)

    before, loss_before = accuracy(), eval_loss(trainer, held_out)["eval/loss"]
    assert before <= 0.05
    for _ in range(200):
        trainer.step(data.next_batch().batch)
    after, loss_after = accuracy(), eval_loss(trainer, held_out)["eval/loss"]
    assert after >= 0.5, (before, after, loss_before, loss_after)
    assert loss_after < loss_before / 4
