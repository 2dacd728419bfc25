"""Sequence packing (rollout.pack) changes the work, not the results: segments that never see
each other, and packed steps whose losses, metrics and gradients equal the unpacked step's
(float32, 1e-5 relative) for GRPO's aggregations, GSPO, KL, truncation masking, multi-turn masks, padding rows, micro- and mini-batches, meshes, processes,
SFT, LoRA and the critic's GAE. The packer itself: tests/rollout/test_rollout_packing.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.algo import AlgoParams, aggregation_denominators, packed_denominators, policy_loss
from asyncrl.model.logprobs import per_token_logprobs
from asyncrl.model.transformer import segment_positions
from asyncrl.rollout.packing import pack_train_batch
from asyncrl.trainer import Trainer
from asyncrl.trainer.losses import batch_targets
from asyncrl.trainer.packed import packed_targets
from tests.trainer_fixtures import SGD, VOCAB_HIGH, VOCAB_LOW, mixed_length_batch, trainer_config

# --------------------------------------------------------------------------- the model


def test_segment_positions_restart_in_each_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_a_segment_never_sees_another_and_scores_like_its_own_row(tiny_one_layer):
    graphdef, params = tiny_one_layer
    batch = mixed_length_batch(rows=8, padding_rows=0, seed=3)
    fields = {name: getattr(batch, name) for name in ("input_ids", "attention_mask", "loss_mask", "rewards",
                                                       "group_index", "truncated")}
    packed = pack_train_batch(fields)
    seg = jnp.asarray(packed.segment_ids)
    ids = packed.tokens["input_ids"]
    lp_packed, ent_packed = per_token_logprobs(graphdef, params, ids, packed.tokens["attention_mask"], 0.7,
                                               segment_ids=seg)
    lp_rows, ent_rows = per_token_logprobs(graphdef, params, batch.input_ids, batch.attention_mask, 0.7)
    for r in range(8):
        where = np.argwhere(packed.token_row == r)
        p, cols = where[0, 0], where[:, 1]
        n = len(cols)
        np.testing.assert_allclose(np.asarray(lp_packed)[p, cols], np.asarray(lp_rows)[r, :n], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ent_packed)[p, cols], np.asarray(ent_rows)[r, :n], rtol=1e-5, atol=1e-6)
        assert np.asarray(lp_packed)[p, cols[0]] == 0.0  # a segment's first token has no context
    # Perturb every token of one segment: the other segments' log-probs do not move at all.
    row = next(p for p in range(packed.rows) if packed.segment_ids[p].max() >= 2)
    changed = np.array(ids)
    hit = packed.segment_ids[row] == 1
    changed[row, hit] = VOCAB_LOW + (changed[row, hit] - VOCAB_LOW + 5) % (VOCAB_HIGH - VOCAB_LOW)
    lp_changed, _ = per_token_logprobs(graphdef, params, changed, packed.tokens["attention_mask"], 0.7, segment_ids=seg)
    others = packed.segment_ids[row] >= 2
    np.testing.assert_array_equal(np.asarray(lp_changed)[row, others], np.asarray(lp_packed)[row, others])
    assert not np.allclose(np.asarray(lp_changed)[row, hit], np.asarray(lp_packed)[row, hit])


# --------------------------------------------------------------------------- losses and gradients


def _loss_and_grads(graphdef, params, batch, algo, packed: bool):
    """The loss of one mini-batch, as the step computes it, and its gradient in ``params``."""
    arrays = {name: jnp.asarray(getattr(batch, name)) for name in ("input_ids", "attention_mask", "loss_mask",
                                                                     "behavior_logprobs", "rewards", "group_index",
                                                                     "truncated")}
    seg = None
    if packed:
        p = pack_train_batch({k: np.asarray(v) for k, v in arrays.items()})
        seg = jnp.asarray(p.segment_ids)
        arrays = {**{k: jnp.asarray(v) for k, v in p.tokens.items()}, "segment_ids": seg}
        mask, advantages = packed_targets(arrays, algo, False)
        denominators = packed_denominators(mask, seg)
    else:
        mask, advantages = batch_targets(arrays, algo, False)
        denominators = aggregation_denominators(mask, arrays["group_index"] >= 0)
    behaviour = arrays["behavior_logprobs"]

    @jax.jit  # one program per call: far quicker than the same ops dispatched one by one
    def loss_and_grads(params):
        ref_params = jax.tree.map(lambda x: x * 0.9, params)
        ref, _ = per_token_logprobs(graphdef, ref_params, arrays["input_ids"], arrays["attention_mask"], 1.0,
                                    segment_ids=seg, with_entropy=False)

        def loss(theta):
            lp, ent = per_token_logprobs(graphdef, theta, arrays["input_ids"], arrays["attention_mask"], 1.0,
                                         segment_ids=seg)
            return policy_loss(lp, behaviour, behaviour, advantages, mask, denominators, algo, entropy=ent,
                               ref_logprobs=ref, segment_ids=seg)

        return jax.value_and_grad(loss, has_aux=True)(params)

    (value, diag), grads = loss_and_grads(params)
    return value, diag, grads


@pytest.mark.parametrize("algo_section", [
    {"aggregation": "token-mean", "kl_coef": 0.05, "entropy_coef": 0.01},
    # the other sections by name (one compiled step each): --runslow
    pytest.param({"aggregation": "seq-mean-token-mean"}, marks=pytest.mark.slow),
    pytest.param({"aggregation": "seq-mean-token-sum-norm", "loss_norm_tokens": 24, "estimator": "dr_grpo"}, marks=pytest.mark.slow),
    pytest.param({"ratio": "sequence", "aggregation": "seq-mean-token-mean", "estimator": "rloo"}, marks=pytest.mark.slow),
    pytest.param({"truncated": "mask", "kl_coef": 0.1, "kl_estimator": "k2"}, marks=pytest.mark.slow),
])
def test_packed_loss_and_gradients_equal_unpacked(tiny_one_layer, algo_section):
    graphdef, params = tiny_one_layer
    batch = mixed_length_batch(seed=1)
    batch.truncated[[1, 5]] = True
    # Off-policy behaviour log-probs so the ratio (and GSPO's sequence ratio) is not 1.
    batch.behavior_logprobs[:] = np.where(batch.loss_mask, batch.behavior_logprobs * 0.2, 0.0)
    algo = AlgoParams.from_config(trainer_config(algo=algo_section))
    unpacked = _loss_and_grads(graphdef, params, batch, algo, packed=False)
    packed = _loss_and_grads(graphdef, params, batch, algo, packed=True)
    np.testing.assert_allclose(packed[0], unpacked[0], rtol=1e-5)
    for key in unpacked[1]:
        np.testing.assert_allclose(packed[1][key], unpacked[1][key], rtol=1e-5, atol=1e-7, err_msg=key)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(unpacked[2]), jax.tree.leaves(packed[2])):
        scale = float(jnp.max(jnp.abs(a)))
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
    assert float(unpacked[0]) != 0.0


# --------------------------------------------------------------------------- the trainer's step


def _step_both(graphdef, params, batch, frozen=None, objective="rl", **sections):
    results = []
    for pack in (False, True):
        rollout = dict(sections.get("rollout", {}), pack=pack)
        cfg = trainer_config(**dict(sections, rollout=rollout))
        trainer = Trainer(cfg, graphdef, params, frozen=frozen, objective=objective)
        metrics = trainer.step(batch)
        results.append((metrics, jax.device_get(trainer.params)))
    return results


@pytest.mark.parametrize("sections", [
    {"algo": {"mini_batches": 2, "aggregation": "seq-mean-token-mean", "kl_coef": 0.05}, "optim": dict(SGD, micro_batches=2)},
    {"algo": {"ppo_epochs": 2, "mismatch_correction": True, "aggregation": "seq-mean-token-sum-norm"}, "optim": SGD},
])
@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_packed_trainer_step_equals_unpacked(tiny_one_layer, sections):
    """Micro- and mini-batches, epochs, pi_prox recomputed, KL: the step's metrics and the SGD-updated
    weights (the gradient, lr 0.5) match; packing used fewer rows."""
    graphdef, params = tiny_one_layer
    batch = mixed_length_batch(seed=4)
    (m_plain, p_plain), (m_packed, p_packed) = _step_both(graphdef, params, batch, **sections)
    for key, value in m_plain.items():
        if key.startswith(("perf/", "memory/")):
            continue
        np.testing.assert_allclose(m_packed[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(p_plain), jax.tree.leaves(p_packed)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6)
    assert m_packed["perf/flops_per_s"] * m_packed["perf/train_time"] < m_plain["perf/flops_per_s"] * m_plain["perf/train_time"]


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_packed_sft_and_lora_steps_equal_unpacked(tiny_one_layer):
    from flax import nnx

    from asyncrl.model.lora import LoraSpec, attach_lora

    graphdef, params = tiny_one_layer
    batch = mixed_length_batch(seed=5)
    (m_plain, p_plain), (m_packed, p_packed) = _step_both(graphdef, params, batch, objective="sft", optim=SGD)
    np.testing.assert_allclose(m_packed["loss/sft"], m_plain["loss/sft"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p_plain), jax.tree.leaves(p_packed)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6)

    cfg = trainer_config(model={"lora": {"rank": 4, "alpha": 8}})
    lora = attach_lora(nnx.merge(graphdef, params).cfg, params, LoraSpec.from_config(cfg.model.lora))
    (m_plain, p_plain), (m_packed, p_packed) = _step_both(lora.graphdef, lora.adapters, batch, frozen=lora.frozen,
                                                          model={"lora": {"rank": 4, "alpha": 8}}, optim=SGD)
    for key in ("loss/total", "train/grad_norm"):
        np.testing.assert_allclose(m_packed[key], m_plain[key], rtol=1e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(p_plain), jax.tree.leaves(p_packed)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6)


MESH_CODE = """
import numpy as np, jax
from asyncrl.trainer import Trainer
from tests.trainer_fixtures import mixed_length_batch
from tests.trainer_fixtures import SGD, tiny_model, trainer_config
assert jax.device_count() == 8
graphdef, params = tiny_model(layers=1)
batch = mixed_length_batch(rows=32, padding_rows=4, seed=6)

def run(mesh, micro, pack):
    cfg = trainer_config(optim=dict(SGD, micro_batches=micro), algo={"mini_batches": 2, "aggregation": "seq-mean-token-mean"},
                         mesh=dict(zip(("data", "fsdp", "tensor"), mesh)), rollout={"pack": pack})
    trainer = Trainer(cfg, graphdef, params)
    metrics = trainer.step(batch)
    return jax.tree.map(np.asarray, trainer.params), metrics

single, m1 = run((1, 1, 1), 1, False)
for mesh, micro in [((4, 2, 1), 2), ((1, 4, 2), 1)]:
    out, m = run(mesh, micro, True)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(out)))
    assert diff < 2e-6, (mesh, diff)
    assert abs(m["loss/total"] - m1["loss/total"]) < 1e-5 * abs(m1["loss/total"]), (mesh, m["loss/total"], m1["loss/total"])
    print(mesh, "max param diff", diff)
"""


@pytest.mark.slow  # an 8-device subprocess; the packed step is checked on one device in the default selection
def test_packed_steps_on_a_mesh_equal_the_single_device_unpacked_step():
    """data x fsdp with 2 micro-batches and fsdp x tensor, 2 mini-batches: each device's packed rows
    (a mini-batch's rows from every shard, device order) give the single-device unpacked update."""
    from tests.helpers import run_python, subprocess_env

    proc = run_python(MESH_CODE, env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    assert proc.stdout.count("max param diff") == 2


@pytest.mark.slow  # two JAX processes with gloo (tests/trainer/test_trainer_mesh.py), each packing its own rows
@pytest.mark.timeout(300)
def test_two_processes_packed_compute_the_single_process_step(tmp_path):
    from tests.trainer.test_trainer_mesh import test_two_processes_compute_the_single_process_step

    test_two_processes_compute_the_single_process_step(tmp_path, extra_args=("pack",))


# --------------------------------------------------------------------------- the critic


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_packed_gae_step_equals_unpacked(tiny_one_layer):
    """algo.estimator gae: the critic's values, per-segment GAE (each segment its own episode, the
    reward on its last trained token, multi-turn gaps skipped), whitening, the value loss and both
    updates over 2 mini-batches x 2 micro-batches x 2 epochs, with the reward's KL penalty."""
    graphdef, params = tiny_one_layer
    batch = mixed_length_batch(seed=7)
    sections = {"algo": {"estimator": "gae", "gamma": 0.9, "lam": 0.8, "mini_batches": 2, "ppo_epochs": 2,
                         "reward_kl_coef": 0.05, "truncated": "penalty", "overlong_buffer": 16},
                "critic": {"optim": dict(SGD, lr=0.1), "value_clip": 0.5}, "optim": dict(SGD, micro_batches=2)}
    batch.truncated[[2, 9]] = True
    results = []
    for pack in (False, True):
        trainer = Trainer(trainer_config(**sections, rollout={"pack": pack}), graphdef, params)
        trainer.step(batch)  # a second step: the critic's values are no longer the zero head's
        metrics = trainer.step(batch)
        results.append((metrics, jax.device_get(trainer.params), jax.device_get(trainer.critic_params)))
    (m_plain, p_plain, c_plain), (m_packed, p_packed, c_packed) = results
    for key, value in m_plain.items():
        if not key.startswith(("perf/", "memory/")):
            np.testing.assert_allclose(m_packed[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert m_plain["train/value_mean"] != 0.0
    for a, b in zip(jax.tree.leaves((p_plain, c_plain)), jax.tree.leaves((p_packed, c_packed))):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6)
