"""The training loop end to end on the tiny model: sinks, provenance, export, eval, crashes.

The slow test runs the full quickstart for three seeds (the README's promise); the fast
ones run a few steps of it.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from asyncrl.config import load_config
from asyncrl.metrics import read_tensorboard_scalars
from asyncrl.rollout.workflow import RolloutWorkflow
from tests.helpers import REPO_ROOT, subprocess_env

QUICKSTART = REPO_ROOT / "configs" / "quickstart.yaml"
FAST = [
    "run.total_steps=3",
    "eval.every_steps=3",
    "eval.max_prompts=8",
    "logging.dump_every_steps=1",
]


def quick_config(out_dir, *extra: str):
    return load_config(QUICKSTART, [f"run.output_dir={out_dir}", *FAST, *extra])


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    from asyncrl.train import train

    out = tmp_path_factory.mktemp("quick")
    cfg = quick_config(out)
    console = io.StringIO()
    result = train(cfg, argv=["test"], console=console)
    return cfg, result, out, console.getvalue()


def test_summary_line_and_completion(quick_run):
    cfg, result, out, console = quick_run
    assert result.steps == 3 and result.output_dir == out
    lines = console.strip().splitlines()
    assert lines[-1] == "training completed"
    assert lines[-2].startswith("asyncrl: 3 steps, eval/reward=") and str(out) in lines[-2]


def test_metrics_jsonl_and_tensorboard_names(quick_run):
    _, _, out, _ = quick_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]  # step 0: eval before training
    last = rows[-1]
    expected = {
        "reward/mean", "reward/positional_match", "eval/reward", "eval/accuracy",
        "rollout/lag_max", "rollout/lag_mean", "rollout/lag_p90", "rollout/dropped_stale", "rollout/queue_depth",
        "rollout/zero_variance_share", "loss/total", "loss/pg", "perf/step_time", "perf/trained_tokens_per_s",
        "perf/gen_tokens_per_s", "engine/decode_tokens_per_s", "engine/version",
    }
    assert expected <= set(last), sorted(expected - set(last))
    assert last["engine/version"] == 3
    assert all(0 <= row["rollout/lag_max"] <= 1 for row in rows[1:])  # quickstart: max_staleness 1
    scalars = read_tensorboard_scalars(out / "tensorboard")
    assert expected <= set(scalars), sorted(expected - set(scalars))
    assert [step for step, _ in scalars["reward/mean"]] == [1, 2, 3]
    assert not any(":" in name for name in scalars)


def test_provenance_and_trajectory_dump(quick_run):
    cfg, _, out, _ = quick_run
    assert load_config(out / "config.yaml") == cfg
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["command"] == ["test"]
    assert provenance["packages"]["jax"] and provenance["devices"][0]["platform"] == "cpu"
    assert "git_sha" in provenance
    dumps = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert {d["step"] for d in dumps} == {1, 2, 3}
    first = dumps[0]
    assert first["prompt"] and "positional_match" in first["reward_components"]
    assert all(0 <= v <= 3 for v in first["versions"])


def test_export_loads_in_transformers_with_the_trained_logits(quick_run):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from asyncrl.model import forward, load_model

    _, result, out, _ = quick_run
    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(out / "hf", torch_dtype=torch.float32).eval()
    ids = np.array([[3, 5, 7, 9, 11, 4, 6]], dtype=np.int32)
    with torch.no_grad():
        hf_logits = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    graphdef, _ = load_model("tiny").split()
    ours, _ = forward(graphdef, result.final_params, ids)
    assert np.max(np.abs(np.asarray(ours) - hf_logits)) < 1e-4


def test_eval_on_the_export_reproduces_the_final_eval(quick_run, capsys):
    from asyncrl.evaluate import evaluate_model

    cfg, result, out, _ = quick_run
    again = evaluate_model(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(out / "hf")})}))
    for name in ("eval/reward", "eval/accuracy", "eval/n_prompts"):
        assert again.metrics[name] == result.final_eval[name], name
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1])["eval/reward"] == result.final_eval["eval/reward"]


def test_synchronous_run_trains_only_current_tokens(tmp_path):
    from asyncrl.train import train

    cfg = quick_config(tmp_path, "rollout.max_staleness=0", "eval.every_steps=0", "logging.dump_every_steps=0")
    train(cfg, console=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert all(row["rollout/lag_max"] == 0 for row in rows)


def test_output_dir_of_an_earlier_run_is_refused(quick_run):
    from asyncrl.train import RunDirError, train

    cfg, _, out, _ = quick_run
    with pytest.raises(RunDirError, match="already holds a run"):
        train(cfg)


CRASH_SCRIPT = """
import sys
from asyncrl.cli import main
where = sys.argv[1]
if where == "engine":
    from asyncrl.engine import jax_engine
    def broken(self, *a, **k):
        raise RuntimeError("injected engine failure")
    jax_engine.JaxEngine._decode = broken
elif where == "trainer":
    from asyncrl.trainer import trainer
    def broken(self, batch):
        raise RuntimeError("injected trainer failure")
    trainer.Trainer.step = broken
sys.exit(main(["train", sys.argv[2], *sys.argv[3:]]))
"""


@pytest.mark.parametrize("where", ["engine", "trainer", "workflow"])
def test_a_crash_anywhere_ends_the_run_with_its_traceback(where, tmp_path):
    extra = [f"--set=run.output_dir={tmp_path}", "--set=eval.every_steps=0", "--set=run.total_steps=2"]
    if where == "workflow":
        extra += ["--set=workflow=tests.test_train_loop:FailingWorkflow", "--set=rollout.max_consecutive_failures=3"]
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, where, str(QUICKSTART), *extra],
        capture_output=True, text=True, timeout=110, env=subprocess_env(), cwd=REPO_ROOT,
    )
    assert proc.returncode != 0
    expected = {"engine": "injected engine failure", "trainer": "injected trainer failure", "workflow": "injected episode failure"}
    assert expected[where] in proc.stderr
    assert "Traceback" in proc.stderr
    assert "training completed" not in proc.stdout


class FailingWorkflow(RolloutWorkflow):
    """A workflow whose every episode raises (for the crash test)."""

    def __init__(self, cfg, tokenizer):
        pass

    def run_episode(self, engine, sample):
        raise RuntimeError("injected episode failure")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quickstart_learns(seed, tmp_path):
    """The README's promise: eval reward +0.3 and training reward +0.3 within 300 s."""
    import time

    from asyncrl.train import train

    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}", f"run.seed={seed}"])
    start = time.monotonic()
    result = train(cfg, console=io.StringIO())
    wall = time.monotonic() - start
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/reward"] for row in rows if "eval/reward" in row]
    rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
    tail = rewards[-max(1, len(rewards) // 10) :]
    print(json.dumps({"seed": seed, "wall_s": wall, "eval_first": evals[0], "eval_last": evals[-1],
                      "reward_first5": float(np.mean(rewards[:5])), "reward_last10pct": float(np.mean(tail))}))
    assert evals[-1] - evals[0] >= 0.3
    assert np.mean(tail) - np.mean(rewards[:5]) >= 0.3
    assert wall < 300
    assert result.steps == cfg.run.total_steps
