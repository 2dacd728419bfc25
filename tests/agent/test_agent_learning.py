"""The OpenAI-SDK calculator agent (workflows/calculator_agent.py) learns the synthetic `add` task
on tiny-qwen3: configs/calculator_agent.yaml, shortened, with the held-out greedy eval (which runs
the agent itself through the eval engine) before training, and after.

What rises: the agent's greedy eval reward, from the untrained model's (about 0: random subwords)
to well above, over an SFT warm start on the answers (with the agent's own tools prompt) followed
by GRPO on the agent's recorded completions. GRPO alone from random init does not lift tiny-qwen3's
reward within a test's budget (4096-token vocabulary, 8-token answers), hence the warm start."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import REPO_ROOT


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_calculator_agent_learns_add_on_tiny_qwen3(tmp_path, monkeypatch):
    from asyncrl.config import load_config
    from asyncrl.run.loop import train

    cfg = load_config(REPO_ROOT / "configs" / "calculator_agent.yaml", [
        f"run.output_dir={tmp_path / 'run'}", "eval.every_steps=1000", "eval.max_prompts=16",
        "stages.0.total_steps=30", "stages.1.total_steps=12",
    ])
    result = train(cfg)
    assert result.steps == 42
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [(row["step"], row["eval/reward"]) for row in rows if "eval/reward" in row]
    rl = [row for row in rows if row.get("stage") == "rl" and "reward/mean" in row]
    assert len(rl) == 12 and all(np.isfinite(row["loss/total"]) for row in rl)
    # GRPO trained on the agent's completions: 12 steps x 4 groups x 4 runs, one trajectory each (no splits)
    assert rl[-1]["rollout/workflow/agent_completions"] >= 12 * 4 * 4 and rl[-1]["rollout/workflow/agent_splits"] == 0
    first, last = evals[0], evals[-1]
    assert first[0] == 0 and last[0] == 42, evals
    assert last[1] > first[1] + 0.05, f"the agent's greedy eval reward did not rise: {evals}"
