"""PPO with a critic (GAE) learns the quickstart task to the bar GRPO's quickstart test sets
(tests/test_train_loop.py::test_quickstart_learns: held-out eval reward +0.3)."""

from __future__ import annotations

import io
import json

import pytest

from asyncrl.config import load_config
from tests.helpers import REPO_ROOT

QUICKSTART = REPO_ROOT / "configs" / "quickstart.yaml"
PPO_CRITIC = ["algo.estimator=gae", "critic={optim: {lr: 0.001, warmup_steps: 10}}"]
"""The quickstart (SFT warm start, then asynchronous RL) with GRPO's advantages replaced by GAE."""


@pytest.mark.slow
def test_quickstart_with_critic_learns(tmp_path):
    from asyncrl.run.loop import train

    cfg = load_config(QUICKSTART, [*PPO_CRITIC, f"run.output_dir={tmp_path}"])
    train(cfg, console=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/reward"] for row in rows if "eval/reward" in row]
    explained = [row["train/explained_variance"] for row in rows if "train/explained_variance" in row]
    print(json.dumps({"eval_first": evals[0], "eval_last": evals[-1], "evals": evals,
                      "explained_variance_last10": explained[-10:]}))
    assert evals[-1] - evals[0] >= 0.3  # GRPO's bar
    # And the RL stage itself improves on the SFT warm start (seed 0 measured: 0.479 -> 0.865).
    sft_end = [row["eval/reward"] for row in rows if "eval/reward" in row and row["step"] == cfg.stages[0].total_steps]
    assert evals[-1] - sft_end[0] >= 0.2
    assert (tmp_path / "hf_critic" / "config.json").is_file()
