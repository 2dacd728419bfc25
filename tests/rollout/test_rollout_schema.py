"""Trajectory schema rules (one test per rule, message checked) and the pure prepare_batch."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.errors import TrajectorySchemaError
from asyncrl.rollout.batch import prepare_batch, select_groups
from asyncrl.rollout.trajectory import RULES, TrajectoryGroup, check_group, check_trajectory
from tests.rollout_fakes import make_cfg, make_group, make_traj

WHERE = "workflow 'W', sample 7, trajectory 1"

# rule -> overrides of make_traj that break it (and only it)
BROKEN = {
    "dtype": dict(behavior_logprobs=np.array(["a", "b", "c", "d", "e", "f", "g"])),
    "ndim": dict(input_ids=np.zeros((7, 1), np.int32)),
    "equal_length": dict(versions=np.zeros(5, np.int32)),
    "token_id": dict(input_ids=np.array([2, 3, -4, 5, 6, 7, 8], np.int32)),
    "first_token_trained": dict(loss_mask=np.ones(7, bool), versions=np.zeros(7, np.int32),
                                behavior_logprobs=np.full(7, -0.5, np.float32)),
    "no_trained_token": dict(loss_mask=np.zeros(7, bool)),
    "trained_version": dict(versions=np.array([-1, -1, -1, 0, -1, 0, 0], np.int32),
                            behavior_logprobs=np.array([0, 0, 0, -0.5, 0, -0.5, -0.5], np.float32)),
    "version_range": dict(versions=np.array([-2, -1, -1, 0, 0, 0, 0], np.int32)),
    "trained_logprob": dict(behavior_logprobs=np.array([0, 0, 0, -0.5, 0.25, -0.5, -0.5], np.float32)),
    "ungenerated_logprob": dict(behavior_logprobs=np.array([0, -1.0, 0, -0.5, -0.5, -0.5, -0.5], np.float32)),
    "stop_reason": dict(stop_reason="finished"),
    "temperature": dict(temperature=0.0),
    "reward": dict(reward=float("nan")),
    "reward_components": dict(reward_components={"acc": float("inf")}),
    "metadata": dict(metadata={"obj": object()}),
    "advantages": dict(advantages=np.zeros(3, np.float32)),
}


def test_a_valid_trajectory_passes_and_lists_are_coerced():
    traj = make_traj(loss_mask=[0, 0, 0, 1, 1, 1, 1], input_ids=list(range(2, 9)))
    assert traj.loss_mask.dtype == bool and traj.input_ids.dtype == np.int32
    check_trajectory(traj, WHERE, expected_temperature=1.0)


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_each_rule_names_workflow_sample_trajectory_field_and_rule(rule):
    traj = make_traj(**BROKEN[rule])
    with pytest.raises(TrajectorySchemaError) as info:
        check_trajectory(traj, WHERE)
    err = info.value
    assert err.rule == rule
    field = RULES[rule][0]
    assert err.field == field
    message = str(err)
    assert message.startswith(WHERE) and f"rule '{rule}'" in message and f"field '{field}'" in message


def test_a_group_packs_to_json_and_arrays_and_back_bit_for_bit():
    import json

    group = make_group(group_size=3, rewards=[0.0, 1.0, 0.5])
    group.trajectories[1].advantages = np.array([0, 0, 0, 1.5, -2.0, 0.25, 1.0], np.float32)
    meta, arrays = group.pack()
    assert set(arrays) == {f"t{i}_{name}" for i in range(3) for name in
                           ("input_ids", "loss_mask", "behavior_logprobs", "versions")} | {"t1_advantages"}
    back = TrajectoryGroup.unpack(json.loads(json.dumps(meta)), arrays, where="rollout state, group 5")
    assert back.metadata == group.metadata
    for a, b in zip(group.trajectories, back.trajectories):
        for name in ("input_ids", "loss_mask", "behavior_logprobs", "versions", "advantages"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or (x.dtype == y.dtype and x.tobytes() == y.tobytes()), name
        assert (a.reward, a.temperature, a.stop_reason, a.metadata) == (b.reward, b.temperature, b.stop_reason, b.metadata)


def _packed(**traj_overrides):
    return make_group(group_size=2, **traj_overrides).pack()


@pytest.mark.parametrize("damage, rule, fragment", [
    (lambda m, a: a.pop("t1_versions"), "packed_arrays", "array 't1_versions' is missing"),
    (lambda m, a: a.update(t2_input_ids=np.zeros(7, np.int32)), "packed_arrays", "'t2_input_ids' is not listed"),
    (lambda m, a: a.update(t0_input_ids=a["t0_input_ids"].astype(np.int64)), "dtype", "trajectory 0"),
    (lambda m, a: a["t1_loss_mask"].__setitem__(0, True), "first_token_trained", "trajectory 1"),
    (lambda m, a: m["trajectories"][0].update(bogus=1), "type", "trajectories.0.bogus"),
    (lambda m, a: m["trajectories"][1].update(stop_reason="finished"), "stop_reason", "trajectory 1"),
])
def test_unpacking_checks_the_schema_rules_and_names_the_group(damage, rule, fragment):
    """A packed group comes back only if it obeys every rule: a damaged checkpoint cannot
    smuggle a trajectory into a batch that the episode-end check would have refused."""
    meta, arrays = _packed()
    damage(meta, arrays)
    with pytest.raises(TrajectorySchemaError) as info:
        TrajectoryGroup.unpack(meta, arrays, where="rollout state, queued group 4")
    assert info.value.rule == rule
    assert str(info.value).startswith("rollout state, queued group 4") and fragment in str(info.value)


def test_an_empty_trajectory_has_no_trained_token():
    empty = make_traj(n_prompt=0, n_gen=0)
    with pytest.raises(TrajectorySchemaError, match="no_trained_token.*empty"):
        check_trajectory(empty, WHERE)


def test_generated_but_untrained_tokens_keep_their_values():
    # turn-2 prompt tokens are generated-looking but masked: real versions/logprobs are allowed
    traj = make_traj(loss_mask=np.array([0, 0, 0, 1, 0, 1, 1], bool))
    check_trajectory(traj, WHERE)


def test_temperature_mismatch_and_group_size():
    with pytest.raises(TrajectorySchemaError, match="temperature_mismatch"):
        check_trajectory(make_traj(temperature=0.7), WHERE, expected_temperature=1.0)
    group = make_group(group_size=3)
    with pytest.raises(TrajectorySchemaError, match=r"workflow 'W', sample 7: field 'trajectories' breaks schema rule 'group_size'.*got 3, expected 2"):
        check_group(group, group_size=2, workflow="W", sample_id=7)
    with pytest.raises(TrajectorySchemaError, match="sample 7, trajectory 1: field 'temperature'"):
        check_group(TrajectoryGroup(trajectories=[make_traj(), make_traj(temperature=-1.0)]), group_size=2, workflow="W", sample_id=7)


# --------------------------------------------------------------------------- prepare_batch


def test_batch_layout_padding_bucket_and_rows():
    cfg = make_cfg({"batch_size": 2, "group_size": 2, "length_bucket": 8})
    groups = [make_group(sample_id=0, n_gen=4), make_group(sample_id=1, n_gen=7, stop_reason="length")]
    batch, dropped = prepare_batch(groups, 0, cfg, row_multiple=3)
    assert dropped == []
    assert batch.input_ids.shape == (6, 16)  # 4 rows -> 6 (multiple of 3); 10 tokens -> 16
    np.testing.assert_array_equal(batch.group_index, [0, 0, 1, 1, -1, -1])
    np.testing.assert_array_equal(batch.truncated, [False, False, True, True, False, False])
    np.testing.assert_array_equal(batch.attention_mask.sum(1), [7, 7, 10, 10, 0, 0])
    assert not batch.loss_mask[4:].any() and (batch.versions[4:] == -1).all()
    assert (batch.loss_mask <= batch.attention_mask).all()
    traj = groups[1].trajectories[1]
    np.testing.assert_array_equal(batch.input_ids[3, :10], traj.input_ids)
    np.testing.assert_array_equal(batch.behavior_logprobs[3, :10], traj.behavior_logprobs)
    np.testing.assert_array_equal(batch.rewards[:4], [0, 1, 0, 1])
    assert batch.input_ids.dtype == np.int32 and batch.behavior_logprobs.dtype == np.float32
    assert batch.temperature == 1.0 and batch.advantages is None


def test_length_is_capped_by_max_seq_len():
    cfg = make_cfg({"batch_size": 1, "length_bucket": 64, "max_new_tokens": 8}, {"max_prompt_tokens": 4})
    batch, _ = prepare_batch([make_group(n_prompt=3, n_gen=8)], 0, cfg)
    assert batch.input_ids.shape[1] == 12  # the bucket would give 64; the cap is 4 + 8


def test_consumption_filters_and_walk_order():
    cfg = make_cfg({"batch_size": 2, "max_staleness": 1}, {"max_prompt_tokens": 4})
    groups = [
        make_group(sample_id=0, version=3),                       # stale at v=5 (lag 2 > 1)
        make_group(sample_id=1, version=4),                       # kept
        make_group(sample_id=2, version=5, stop_reason="aborted"),  # aborted
        make_group(sample_id=3, version=5, n_prompt=5),           # prompt too long
        make_group(sample_id=4, version=5, n_prompt=4, n_gen=9),  # 13 tokens > 4 + 8
        make_group(sample_id=5, version=5),                       # kept: walk stops here
        make_group(sample_id=6, version=0),                       # never examined
    ]
    batch, dropped = prepare_batch(groups, 5, cfg)
    assert [(g.metadata["sample_id"], r) for g, r in dropped] == [
        (0, "stale"), (2, "aborted"), (3, "prompt_too_long"), (4, "too_long")]
    assert len(set(batch.group_index[batch.group_index >= 0].tolist())) == 2
    assert (5 - batch.versions[batch.loss_mask]).max() <= 1
    with pytest.raises(ValueError, match="only 1 of rollout.batch_size = 2"):
        prepare_batch(groups[:3], 5, cfg)


def test_zero_variance_budget_then_fill():
    cfg = make_cfg({"batch_size": 2, "filter_zero_variance": True, "max_filtered_per_step": 2})
    flat = [make_group(sample_id=i, rewards=[1.0, 1.0]) for i in range(4)]
    varied = make_group(sample_id=9, rewards=[0.0, 1.0])
    batch, dropped = prepare_batch([flat[0], varied, flat[1], flat[2], flat[3]], 0, cfg)
    assert [(g.metadata["sample_id"], r) for g, r in dropped] == [(0, "zero_variance"), (1, "zero_variance")]
    np.testing.assert_array_equal(batch.rewards, [0, 1, 1, 1])  # budget spent: flat[2] trained
    kept, dropped_idx = select_groups(flat, 0, cfg, filter_budget=0)
    assert kept == [0, 1] and dropped_idx == []
    off = make_cfg({"batch_size": 2})
    assert prepare_batch(flat, 0, off)[1] == []  # filter off by default
    assert off.rollout.resolved_max_filtered_per_step == 8


def test_temperature_mismatch_is_rejected_and_advantages_all_or_none():
    cfg = make_cfg({"batch_size": 1, "temperature": 0.8})
    with pytest.raises(TrajectorySchemaError, match=r"sample 0, trajectory 0: field 'temperature' breaks schema rule 'temperature_mismatch'"):
        prepare_batch([make_group()], 0, cfg)
    cfg = make_cfg({"batch_size": 1})
    adv = np.arange(7, dtype=np.float32)
    group = TrajectoryGroup(trajectories=[make_traj(advantages=adv), make_traj(advantages=adv)])
    batch, _ = prepare_batch([group], 0, cfg)
    np.testing.assert_array_equal(batch.advantages[0, :7], adv)
    mixed = TrajectoryGroup(trajectories=[make_traj(advantages=adv), make_traj()])
    with pytest.raises(TrajectorySchemaError, match="advantages"):
        prepare_batch([mixed], 0, cfg)


def test_vectorised_batch_check_names_the_row():
    cfg = make_cfg({"batch_size": 1})
    good = make_traj()
    bad = make_traj()
    bad.behavior_logprobs[5] = 0.5  # mutated after the per-trajectory check
    with pytest.raises(TrajectorySchemaError, match=r"prepare_batch, sample 3, trajectory 1: field 'behavior_logprobs' breaks schema rule 'trained_logprob'.*batch row 1, token 5"):
        prepare_batch([TrajectoryGroup(trajectories=[good, bad], metadata={"sample_id": 3})], 0, cfg)
