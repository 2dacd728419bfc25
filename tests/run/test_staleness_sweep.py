"""scripts/staleness_sweep.py: the summary it prints per setting, and the documented command."""

from __future__ import annotations

import json
import sys

from tests.helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import staleness_sweep  # noqa: E402


def test_summary_of_a_metrics_file(tmp_path):
    rows = [
        {"step": 0, "stage": "sft", "engine/decode_s": 1.0, "eval/reward": 0.1},
        {"step": 1, "stage": "rl", "perf/step_time": 2.0, "perf/trained_tokens_per_s": 100.0, "rollout/lag_max": 1.0,
         "rollout/lag_mean": 0.5, "rollout/wait_s": 0.2, "rollout/dropped_stale": 0.0, "engine/decode_s": 2.0},
        {"step": 2, "stage": "rl", "perf/step_time": 1.0, "perf/trained_tokens_per_s": 400.0, "rollout/lag_max": 2.0,
         "rollout/lag_mean": 1.5, "rollout/wait_s": 0.0, "rollout/dropped_stale": 1.0, "engine/decode_s": 2.5,
         "eval/reward": 0.75},
        {"step": 3, "stage": "rl", "perf/step_time": 1.0, "perf/trained_tokens_per_s": 100.0, "rollout/lag_max": 1.0,
         "rollout/lag_mean": 1.0, "rollout/wait_s": 0.1, "rollout/dropped_stale": 1.0, "engine/decode_s": 4.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = staleness_sweep.summarise(path)
    # engine busy: step 2 (0.5 s decoding in 1 s); step 3 follows an eval, so its delta is left out
    assert summary == {
        "rl_steps": 3, "trained_tokens_per_s": 175.0, "rl_time_s": 4.0, "final_eval_reward": 0.75, "lag_max": 2.0,
        "lag_mean": 1.0, "dropped_stale": 1.0, "wait_s_mean": 0.1, "engine_busy": 0.5,
    }


def test_the_docs_table_names_the_script():
    doc = (REPO_ROOT / "docs" / "staleness.md").read_text()
    assert "```bash\npython scripts/staleness_sweep.py\n```" in doc  # run by tests/test_doc_commands.py
    results = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    table = results[results.index("`python scripts/staleness_sweep.py`"):]
    for eta in (0, 1, 2, 4):
        assert f"\n| {eta} | " in table
