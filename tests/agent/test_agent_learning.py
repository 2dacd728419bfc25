"""The OpenAI-SDK calculator agent (workflows/calculator_agent.py) on the synthetic `add` task with
tiny-qwen3: configs/calculator_agent.yaml, with the held-out greedy eval (which runs the agent
itself through the eval engine) before training and every 20 steps of each stage."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import REPO_ROOT


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_calculator_agent_calls_its_tool_on_tiny_qwen3(tmp_path):
    """configs/calculator_agent.yaml as it is: after the warm start on demonstrations the agent calls
    the calculator in every greedy eval episode and in training episodes, GRPO trains on its
    recorded completions (one trajectory per run, no splits), and the greedy eval reward ends above
    the untrained model's."""
    from asyncrl.config import load_config
    from asyncrl.run.loop import train

    cfg = load_config(REPO_ROOT / "configs" / "calculator_agent.yaml", [f"run.output_dir={tmp_path / 'run'}"])
    result = train(cfg)
    total = sum(stage.total_steps for stage in cfg.stages)
    assert result.steps == total
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [(row["step"], row["eval/reward"], row["eval/episode/tool_calls"]) for row in rows if "eval/reward" in row]
    rl = [row for row in rows if row.get("stage") == "rl" and "reward/mean" in row]
    assert len(rl) == cfg.stages[1].total_steps and all(np.isfinite(row["loss/total"]) for row in rl)
    assert rl[-1]["rollout/workflow/agent_splits"] == 0 and rl[-1]["rollout/workflow/agent_tool_calls"] > 0
    assert np.mean([row["episode/tool_calls"] for row in rl]) > 0.1, [row["episode/tool_calls"] for row in rl]
    assert evals[0][0] == 0 and evals[0][2] == 0.0 and evals[-1][0] == total, evals
    assert evals[-1][2] >= 0.9, f"the agent does not call its tool in eval: {evals}"
    assert evals[-1][1] > evals[0][1], f"the agent's greedy eval reward did not rise: {evals}"
