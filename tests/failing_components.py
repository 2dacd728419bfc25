"""User components that fail in each way a run can fail, for the exit-status tests
(tests/run/test_error_exits.py): resolved by import path from runs of ``asyncrl train`` started
in the repository root (``tests.failing_components:Name``)."""

from __future__ import annotations

import os
import signal

from asyncrl import GenerationRequest, RolloutWorkflow, SingleTurnWorkflow


class RaisingWorkflow(RolloutWorkflow):
    """Every episode raises, in training and in eval."""

    def run_episode(self, engine, sample):
        raise RuntimeError(f"this workflow fails on purpose (sample {sample.get('sample_id')})")


class LongPromptWorkflow(RolloutWorkflow):
    """Asks the engine for a context longer than the longest one a sequence may reach
    (``engine.kv_capacity``): an engine request error."""

    def run_episode(self, engine, sample):
        engine.generate(GenerationRequest(prompt_ids=[1] * (self.cfg.engine.kv_capacity + 8),
                                          temperature=self.cfg.rollout.temperature, max_new_tokens=2,
                                          sample_id=sample["sample_id"]))
        raise AssertionError("the engine accepted a context longer than engine.kv_capacity")


class InterruptingWorkflow(SingleTurnWorkflow):
    """The single-turn workflow, whose first episode sends SIGINT to the run's own process (Ctrl-C
    while the first step waits for its batch and compiles)."""

    sent = False

    def run_episode(self, engine, sample):
        if not InterruptingWorkflow.sent:
            InterruptingWorkflow.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return super().run_episode(engine, sample)


def raising_reward(prompt: str, completion: str, **fields: object) -> float:
    raise ValueError("this reward fails on purpose")
