"""WorkflowExecutor with FakeEngine: staleness bounds under random thread timing, accounting,
failures, timeouts, engine crashes, checkpoint round trip, and a user multi-turn workflow.

Thread timing comes from seeded FakeEngine delays (0-5 ms) and seeded episode failures;
hypothesis does not drive threads.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import numpy as np
import pytest

from asyncrl.checkpoint.files import load_rollout_state, save_rollout_state
from asyncrl.engine import FakeEngine, GenerationRequest
from asyncrl.errors import EngineCrashed, RolloutError
from asyncrl.rollout import SkipSample, TrajectoryBuilder, TrajectoryGroup, WorkflowExecutor
from asyncrl.rollout.workflow import RolloutWorkflow
from tests.rollout_fakes import EOS, TokenWorkflow, make_cfg

DATASET = [{"x": i} for i in range(37)]
FAST_SEEDS = [0, 1]
SLOW_SEEDS = list(range(2, 10))


def engine(seed=0, **kw):
    kw.setdefault("delay_s", (0.0, 0.005))
    return FakeEngine(vocab_size=24, eos_token_id=EOS, seed=seed, first_token_id=2, **kw)


def train(executor, eng, steps, start=0, check=None, timeout=20.0):
    """The trainer's side of the loop: next batch, (train), publish to the engine, then set_version.
    ``check(got, v)`` sees each :class:`PreparedBatch`."""
    seen = []
    for v in range(start, start + steps):
        got = executor.next_batch(v, timeout=timeout)
        if check is not None:
            check(got, v)
        seen.extend(got.sample_ids)
        eng.update_weights(None, v + 1)
        executor.set_version(v + 1)
    return seen


def assert_accounting(executor, trained_ids):
    counts = executor.counts()
    assert sum(counts.values()) == executor.ledger.next_sample_id
    assert counts["trained"] == len(trained_ids) == len(set(trained_ids))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("eta", [0, 1, 4])
@pytest.mark.parametrize("seed", FAST_SEEDS + [pytest.param(s, marks=pytest.mark.slow) for s in SLOW_SEEDS])
def test_ticket_order_bounds_lag_under_random_timing(seed, eta):
    cfg = make_cfg({"max_staleness": eta, "batch_size": 4, "group_size": 2, "max_concurrent": 8})
    eng = engine(seed)
    lags, last = [], []

    def check(got, v):
        batch = got.batch
        last[:] = [got]
        lag = v - batch.versions[batch.loss_mask]
        assert lag.min() >= 0 and lag.max() <= eta, f"lag {lag.max()} > η = {eta} at v = {v}"
        if eta == 0:
            assert (batch.versions[batch.loss_mask] == v).all()
        lags.append(lag.max())

    with WorkflowExecutor(TokenWorkflow(cfg, fail_rate=0.2, seed=seed), eng, DATASET, cfg) as ex:
        trained = train(ex, eng, 200, check=check)
        counts = ex.counts()
        assert_accounting(ex, trained)
        assert counts["trained"] == 200 * 4 and counts["dropped:stale"] == 0
        assert counts["failed:exception"] > 0
        assert last[0].metrics["rollout/lag_max"] <= eta
    if eta > 0:
        assert max(lags) > 0  # asynchrony actually happened


@pytest.mark.timeout(60)
def test_completion_order_drops_stale_groups_and_counts_them():
    cfg = make_cfg({"max_staleness": 1, "batch_size": 4, "max_concurrent": 8, "batch_order": "completion"})
    eng = engine(3, delay_s=lambda r: 0.06 if r.sample_id % 9 == 0 else 0.001)
    stale_seen, last = 0, []

    def check(got, v):
        nonlocal stale_seen
        last[:] = [got]
        assert (v - got.batch.versions[got.batch.loss_mask]).max() <= 1
        stale_seen += got.metrics.get("rollout/step_dropped/stale", 0)

    with WorkflowExecutor(TokenWorkflow(cfg), eng, DATASET, cfg) as ex:
        trained = train(ex, eng, 60, check=check)
        counts = ex.counts()
    assert_accounting(ex, trained)
    assert counts["dropped:stale"] > 0 and counts["dropped:stale"] == stale_seen
    assert last[0].metrics["rollout/dropped_stale"] == counts["dropped:stale"]


@pytest.mark.timeout(30)
def test_episode_timeout_abandons_the_thread_and_refills_the_slot():
    release = threading.Event()
    cfg = make_cfg({"episode_timeout_s": 0.2, "max_staleness": 1})

    def hook(sample):
        if sample["sample_id"] == 2:
            release.wait(10)  # stuck
        return None

    eng = engine(delay_s=0.0)
    try:
        with WorkflowExecutor(TokenWorkflow(cfg, hook=hook), eng, DATASET, cfg) as ex:
            trained = train(ex, eng, 4)
            counts = ex.counts()
        assert counts["failed:timeout"] == 1 and 2 not in trained
        assert_accounting(ex, trained)
    finally:
        release.set()


@pytest.mark.timeout(30)
def test_consecutive_failures_stop_with_the_root_cause():
    cfg = make_cfg({"max_consecutive_failures": 5})
    with WorkflowExecutor(TokenWorkflow(cfg, fail_rate=1.0), engine(delay_s=0.0), DATASET, cfg) as ex:
        with pytest.raises(RolloutError, match=r"(?s)5 episodes failed in a row.*failed:exception.*RuntimeError: scripted episode failure"):
            ex.next_batch(0, timeout=10)


@pytest.mark.timeout(30)
def test_engine_crash_stops_training_at_once_with_its_traceback():
    cfg = make_cfg({"max_staleness": 1})
    eng = engine(crash_after_calls=6, delay_s=0.001)
    with WorkflowExecutor(TokenWorkflow(cfg), eng, DATASET, cfg) as ex:
        start = time.monotonic()
        with pytest.raises(EngineCrashed, match="(?s)engine traceback.*scripted crash of the engine thread"):
            train(ex, eng, 50, timeout=20)
        assert time.monotonic() - start < 5
        assert ex.counts()["failed:engine_crash"] >= 1
        with pytest.raises(EngineCrashed):  # stays stopped
            ex.next_batch(ex.version, timeout=1)


@pytest.mark.timeout(30)
def test_none_skip_and_schema_failures_are_counted(caplog):
    cfg = make_cfg({"max_staleness": 1})

    def hook(sample):
        sid = sample["sample_id"]
        if sid % 6 == 1:
            raise SkipSample("prompt_too_long")
        if sid % 6 == 2:
            return "none"
        if sid % 6 == 3:
            bad = [TrajectoryBuilder().add_tokens([2, 3]).build(temperature=1.0, reward=0.0) for _ in range(2)]
            return TrajectoryGroup(trajectories=bad)  # nothing trained
        return None

    class Workflow(TokenWorkflow):
        def run_episode(self, eng, sample):
            out = super().run_episode(eng, sample)
            return None if out == "none" else out

    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        with WorkflowExecutor(Workflow(cfg, hook=hook), engine(delay_s=0.0), DATASET, cfg) as ex:
            trained = train(ex, ex.engine, 5)
            counts = ex.counts()
    assert counts["dropped:prompt_too_long"] > 0 and counts["returned_none"] > 0
    assert counts["failed:schema:no_trained_token"] > 0
    assert_accounting(ex, trained)
    messages = [r.getMessage() for r in caplog.records if "schema" in r.getMessage()]
    # Which bad sample (3, 9, 15, ...) is logged first depends on thread scheduling.
    first = re.search(r"workflow 'Workflow', sample (\d+), trajectory 0: field 'loss_mask' breaks schema rule 'no_trained_token'",
                      messages[0] if messages else "")
    assert first and int(first.group(1)) % 6 == 3, messages


@pytest.mark.timeout(40)
def test_state_dict_round_trip_reissues_in_flight_samples_first(tmp_path):
    cfg = make_cfg({"max_staleness": 2, "batch_size": 3, "max_concurrent": 4})
    hold = threading.Event()
    blocking = {"on": False}
    started = []

    def hook(sample):
        started.append(sample["sample_id"])
        if blocking["on"]:
            hold.wait(10)
        return None

    eng = engine(delay_s=(0.0, 0.003))
    ex = WorkflowExecutor(TokenWorkflow(cfg, hook=hook), eng, DATASET, cfg).start()
    try:
        trained = train(ex, eng, 3)
        blocking["on"] = True
        deadline = time.monotonic() + 5
        while ex.ledger.can_admit() or ex.counts()["in_flight"] == 0:  # let admission fill up
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.05)
        state = ex.state_dict()
        t0 = time.monotonic()
        ex.close(timeout=2)
        assert time.monotonic() - t0 < 2.5  # bounded although episodes are stuck
    finally:
        hold.set()
    before = ex.counts()
    in_flight_ids = sorted(ex.ledger.sample_id(t) for t in ex.ledger.in_flight_tickets())
    assert before["in_flight"] == len(in_flight_ids) > 0 and before["queued"] > 0

    save_rollout_state(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout.json", "rollout.npz"]
    loaded = load_rollout_state(tmp_path)  # np.load(allow_pickle=False)

    started.clear()
    eng2 = engine(delay_s=(0.0, 0.003), version=3)  # the engine resumes at the checkpoint's version
    ex2 = WorkflowExecutor(TokenWorkflow(cfg, hook=hook), eng2, DATASET, cfg)
    ex2.load_state_dict(loaded)
    after = ex2.counts()
    assert after["reissued"] == before["in_flight"] and after["in_flight"] == 0
    assert {k: v for k, v in after.items() if k not in ("reissued", "in_flight")} == \
        {k: v for k, v in before.items() if k not in ("reissued", "in_flight")}
    # queued groups come back array for array
    for ticket, group in ex._ready.items():
        if ex.ledger.state_of(ticket) == "queued":
            for a, b in zip(group.trajectories, ex2._ready[ticket].trajectories):
                np.testing.assert_array_equal(a.input_ids, b.input_ids)
                np.testing.assert_array_equal(a.behavior_logprobs, b.behavior_logprobs)
                assert a.reward == b.reward and a.metadata == b.metadata
    blocking["on"] = False
    with ex2:
        trained += train(ex2, eng2, 4, start=3)
    assert sorted(started[: len(in_flight_ids)]) == in_flight_ids  # re-issued first
    assert set(in_flight_ids) <= set(trained)
    assert_accounting(ex2, trained)
    assert ex2.counts()["reissued"] == 0 and ex2.ledger.reissued_total == len(in_flight_ids)


class TwoTurnWorkflow(RolloutWorkflow):
    """A user workflow: answer, get a (fake) tool result, answer again. Two engine calls per
    trajectory; the tool tokens of turn 2 are in the sequence but not trained."""

    TOOL = [20, 21, 22]

    def __init__(self, cfg):
        self.cfg = cfg

    def run_episode(self, engine, sample):
        r = self.cfg.rollout
        prompt = [2, 3 + sample["sample_id"] % 10, 4]
        trajs = []
        for i in range(r.group_size):
            builder = TrajectoryBuilder().add_tokens(prompt)
            first = engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=4, temperature=r.temperature,
                                                      sample_id=sample["sample_id"], index_in_group=i, turn=0))[0]
            builder.add_generation(first).add_tokens(self.TOOL)
            second = engine.generate(GenerationRequest(prompt_ids=builder.input_ids.tolist(), max_new_tokens=4,
                                                       temperature=r.temperature, sample_id=sample["sample_id"],
                                                       index_in_group=i, turn=1))[0]
            builder.add_generation(second)
            trajs.append(builder.build(temperature=r.temperature, reward=float(len(second.output_ids)),
                                       metadata={"turns": 2, "first_len": len(first.output_ids)}))
        return TrajectoryGroup(trajectories=trajs, metadata={"sample_id": sample["sample_id"]})


@pytest.mark.timeout(30)
def test_user_multi_turn_workflow_runs_through_the_executor():
    cfg = make_cfg({"max_staleness": 1, "group_size": 2, "length_bucket": 4})
    eng = engine(delay_s=(0.0, 0.002), eos_prob=0.3)
    batches = []
    with WorkflowExecutor(TwoTurnWorkflow(cfg), eng, DATASET, cfg) as ex:
        train(ex, eng, 3, check=lambda got, v: batches.append(got))
    batch = batches[-1].batch
    assert [g.metadata["sample_id"] for g in batches[-1].groups] == list(batches[-1].sample_ids)
    for row in range(batch.input_ids.shape[0]):
        ids = batch.input_ids[row][batch.attention_mask[row]]
        mask = batch.loss_mask[row][batch.attention_mask[row]]
        versions = batch.versions[row][batch.attention_mask[row]]
        starts = [k for k in range(len(ids) - 2) if ids[k:k + 3].tolist() == TwoTurnWorkflow.TOOL]
        assert starts, "tool tokens missing"
        k = starts[-1]
        assert not mask[:3].any() and not mask[k:k + 3].any()  # prompt and tool tokens masked
        assert (versions[k:k + 3] == -1).all()
        assert mask[3:k].all() and mask[k + 3:].all()  # both generations trained
    assert ex.counts()["trained"] == 3 * cfg.rollout.batch_size


@pytest.mark.timeout(30)
def test_publish_order_and_resume_version_are_enforced():
    cfg = make_cfg()
    eng = engine(delay_s=0.0)
    ex = WorkflowExecutor(TokenWorkflow(cfg), eng, DATASET, cfg)
    with pytest.raises(RolloutError, match=r"set_version\(1\) while the engine serves version 0: call engine.update_weights"):
        ex.set_version(1)
    with pytest.raises(RolloutError, match="executor is at version 0"):
        ex.next_batch(1, timeout=1)
    state = ex.state_dict()
    with pytest.raises(RolloutError, match="rollout state is at version 0 but the engine serves 2"):
        WorkflowExecutor(TokenWorkflow(cfg), engine(version=2), DATASET, cfg).load_state_dict(state)


@pytest.mark.timeout(30)
def test_an_engine_crash_wrapped_by_the_workflow_still_stops_training():
    cfg = make_cfg()

    class Wrapping(TokenWorkflow):
        def run_episode(self, eng, sample):
            try:
                return super().run_episode(eng, sample)
            except Exception as err:
                raise ValueError("tool call failed") from err

    with WorkflowExecutor(Wrapping(cfg), engine(crash_after_calls=0, delay_s=0.0), DATASET, cfg) as ex:
        with pytest.raises(EngineCrashed, match="scripted crash"):
            ex.next_batch(0, timeout=10)


@pytest.mark.timeout(30)
def test_samples_are_drawn_through_the_sample_order():
    from asyncrl.data import SampleOrder

    cfg = make_cfg({"batch_size": 4})
    order = SampleOrder(DATASET, seed=5)
    drawn = {}

    def hook(sample):
        drawn[sample["sample_id"]] = sample["x"]
        return None

    eng = engine(delay_s=0.0)
    with WorkflowExecutor(TokenWorkflow(cfg, hook=hook), eng, order, cfg) as ex:
        train(ex, eng, 12)
    assert len(drawn) > len(DATASET)  # more than one epoch
    assert all(x == order.sample(sid)["x"] for sid, x in drawn.items())


@pytest.mark.timeout(30)
def test_zero_variance_budget_holds_per_step_in_the_executor():
    cfg = make_cfg({"batch_size": 4, "group_size": 2, "filter_zero_variance": True, "max_filtered_per_step": 1})
    eng = engine(delay_s=(0.0, 0.002))
    per_step, shares = [], []

    def check(got, v):
        per_step.append(got.metrics.get("rollout/step_dropped/zero_variance", 0))
        shares.append(got.metrics["rollout/zero_variance_share"])

    with WorkflowExecutor(TokenWorkflow(cfg), eng, DATASET, cfg) as ex:
        trained = train(ex, eng, 20, check=check)
    assert max(per_step) == 1 and sum(per_step) == ex.counts()["dropped:zero_variance"]
    assert max(shares) > 0  # budget spent: zero-variance groups were trained on
    assert_accounting(ex, trained)


@pytest.mark.timeout(30)
def test_next_batch_abandoned_while_waiting_consumes_nothing():
    """A shutdown request ends the wait for rollouts (within a second), nothing consumed; the
    state saved then re-issues the stuck samples."""
    from asyncrl.rollout.executor import BatchAbandoned

    release = threading.Event()
    cfg = make_cfg({"max_staleness": 0, "batch_size": 4, "group_size": 2})
    # Samples 4.. block until released: step 2's batch never completes.
    workflow = TokenWorkflow(cfg, hook=lambda sample: release.wait(20) and None if sample["sample_id"] >= 4 else None)
    eng = engine()
    requested = threading.Event()
    with WorkflowExecutor(workflow, eng, DATASET, cfg) as ex:
        train(ex, eng, 1)
        threading.Timer(0.2, requested.set).start()
        started = time.monotonic()
        with pytest.raises(BatchAbandoned, match="nothing consumed"):
            ex.next_batch(1, timeout=20, abandon_if=requested.is_set)
        assert time.monotonic() - started < 2.5
        counts = ex.counts()
        assert counts["trained"] == 4 and counts["in_flight"] == 4
        state = ex.state_dict()
    release.set()
    ledger = state["meta"]["ledger"]
    assert ledger["consumed"] == 4 and sorted(e[1] for e in ledger["entries"] if e[2] == "in_flight") == [4, 5, 6, 7]
