"""Thread counts of the rollout side: the executor's fixed worker pool (one replacement per
timed-out episode) and the reward helpers (one per calling thread, not one per call)."""

from __future__ import annotations

import threading
import time

import pytest

from asyncrl.engine import FakeEngine
from asyncrl.rollout import WorkflowExecutor
from asyncrl.rollout.rewards import RewardFunction, RewardScorer
from tests.rollout_fakes import EOS, TokenWorkflow, make_cfg

pytestmark = pytest.mark.timeout(30)

DATASET = [{"x": i} for i in range(37)]
WORKER = "asyncrl-rollout-worker-"
HELPER = "reward-helper-"


def live(prefix: str) -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()}


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def engine() -> FakeEngine:
    return FakeEngine(vocab_size=24, eos_token_id=EOS, seed=0, first_token_id=2, delay_s=0.0)


def run_steps(ex: WorkflowExecutor, eng: FakeEngine, steps: int, each_step=lambda: None) -> None:
    for v in range(ex.version, ex.version + steps):
        ex.next_batch(v, timeout=20)
        each_step()
        eng.update_weights(None, v + 1)
        ex.set_version(v + 1)


def test_executor_runs_every_episode_on_a_fixed_pool_of_workers():
    cfg = make_cfg({"max_concurrent": 4, "max_staleness": 1})
    workflow, eng = TokenWorkflow(cfg), engine()
    seen: list[set[str]] = []
    assert not live(WORKER)
    with WorkflowExecutor(workflow, eng, DATASET, cfg) as ex:
        run_steps(ex, eng, 30, lambda: seen.append(live(WORKER)))
    assert workflow.episodes >= 30 * 4
    names = set().union(*seen)
    assert len(names) == 4 and all(s == names for s in seen), seen  # the same 4 threads every step
    assert wait_until(lambda: not live(WORKER)), live(WORKER)  # stop() lets idle workers exit


def test_a_timed_out_episode_abandons_its_worker_and_starts_one_replacement():
    release = threading.Event()
    cfg = make_cfg({"max_concurrent": 4, "max_staleness": 1, "episode_timeout_s": 0.2})

    def hook(sample):
        if sample["sample_id"] == 2:
            release.wait(10)  # stuck until the test lets it go
        return None

    eng = engine()
    try:
        with WorkflowExecutor(TokenWorkflow(cfg, hook=hook), eng, DATASET, cfg) as ex:
            run_steps(ex, eng, 4)
            assert ex.counts()["failed:timeout"] == 1
            assert len(live(WORKER)) == 4 + 1  # the pool, and the abandoned worker still in its episode
            assert {w.name for w in ex.workers} < live(WORKER) and len(ex.workers) == 4  # a run waits for the pool only
            release.set()
            assert wait_until(lambda: len(live(WORKER)) == 4), live(WORKER)  # the abandoned one exits
            run_steps(ex, eng, 4)
            assert len(live(WORKER)) == 4
            assert ex.counts()["failed:timeout"] == 1
    finally:
        release.set()


def test_reward_calls_reuse_one_helper_and_a_stuck_call_scores_the_fallback():
    stuck, release = threading.Event(), threading.Event()
    ran_on: list[str] = []

    def score(prompt, completion):
        ran_on.append(threading.current_thread().name)
        if stuck.is_set():
            release.wait(10)
        return float(len(completion))

    scorer = RewardScorer([RewardFunction(score)], timeout_s=0.2, fallback=-1.0)
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            for _ in range(50):
                assert scorer.score("p", "abc", {}, 0) == (3.0, {"score": 3.0})
            assert len(set(ran_on)) == 1 and ran_on[0].startswith(HELPER)  # one helper for 50 calls
            stuck.set()
            started = time.monotonic()
            assert scorer.score("p", "abc", {}, 1) == (-1.0, {"score": -1.0})
            assert time.monotonic() - started < 1.5  # the stuck call was abandoned
            stuck.clear()
            assert scorer.score("p", "abc", {}, 2) == (3.0, {"score": 3.0})
            assert len(set(ran_on)) == 2  # one replacement helper, reused from then on
        except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(err)

    try:
        thread = threading.Thread(target=caller, name="test-reward-caller", daemon=True)
        thread.start()
        thread.join(20)
        assert not errors, errors
        assert scorer.metrics() == {"reward_errors": 0.0, "reward_timeouts": 1.0}
        assert ran_on[0] in live(HELPER)  # the abandoned helper is still inside the stuck call
    finally:
        release.set()
    # The abandoned helper exits once its call returns; the other once its caller thread ended.
    assert wait_until(lambda: not (live(HELPER) & set(ran_on))), live(HELPER)
