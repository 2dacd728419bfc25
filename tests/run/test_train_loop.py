"""The training loop end to end on the tiny model: sinks, provenance, export, eval, crashes.

The slow test runs the full quickstart for three seeds (the README's promise); the fast
ones run a few steps of it.
"""

from __future__ import annotations

import io
import json
import threading

import numpy as np
import pytest

from asyncrl.config import load_config
from tests.helpers import REPO_ROOT, read_tensorboard_scalars

QUICKSTART = REPO_ROOT / "configs" / "quickstart.yaml"
# 2 SFT steps, then 3 RL steps: versions 1-2 are SFT, 3-5 RL.
FAST = [
    "stages.0.total_steps=2",
    "stages.1.total_steps=3",
    "eval.every_steps=3",
    "eval.max_prompts=8",
    "logging.dump_every_steps=1",
    "checkpoint.every_steps=0",
]


def quick_config(out_dir, *extra: str):
    return load_config(QUICKSTART, [f"run.output_dir={out_dir}", *FAST, *extra])


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    from asyncrl.run.loop import train

    out = tmp_path_factory.mktemp("quick")
    cfg = quick_config(out)
    console = io.StringIO()
    result = train(cfg, argv=["test"], console=console)
    return cfg, result, out, console.getvalue()


def test_summary_line_and_completion(quick_run):
    cfg, result, out, console = quick_run
    assert result.steps == 5 and result.output_dir == out
    lines = console.strip().splitlines()
    assert lines[-1] == "training completed"
    assert lines[-2].startswith("asyncrl: 5 steps, eval/reward=") and str(out) in lines[-2]
    assert ", first step after " in lines[-2] and "train compile " in lines[-2]
    assert any(line.startswith("[sft] step 2/5") for line in lines)
    assert any(line.startswith("[rl] step 5/5") for line in lines)


def test_metrics_jsonl_and_tensorboard_names(quick_run):
    _, _, out, _ = quick_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # step 0: eval before training; every row tagged with its stage
    assert [(row["step"], row["stage"]) for row in rows] == [(0, "sft"), (1, "sft"), (2, "sft"), (3, "rl"), (4, "rl"), (5, "rl")]
    # the start-up split, once, in the first step's row (asyncrl/run/startup.py)
    startup = {"perf/startup_load_s", "perf/startup_engine_s", "perf/startup_first_batch_wait_s",
               "perf/startup_engine_compile_s", "perf/startup_train_compile_s", "perf/time_to_first_step_s"}
    assert startup <= set(rows[1]) and not any(startup & set(row) for row in rows[2:]), sorted(startup - set(rows[1]))
    assert 0 < rows[1]["perf/startup_load_s"] < rows[1]["perf/time_to_first_step_s"]
    sft_names = {"loss/sft", "sft/samples_drawn", "perf/step_time", "perf/trained_tokens_per_s", "eval/reward", "eval/loss",
                 "perf/train_tokens_per_train_s", "perf/train_time", "perf/eval_time"}
    assert sft_names <= set(rows[2]), sorted(sft_names - set(rows[2]))
    last = rows[-1]
    rl_names = {
        "reward/mean", "reward/positional_match", "eval/reward", "eval/accuracy",
        "rollout/lag_max", "rollout/lag_mean", "rollout/lag_p90", "rollout/dropped_stale", "rollout/queue_depth",
        "rollout/zero_variance_share", "loss/total", "loss/pg", "perf/step_time", "perf/trained_tokens_per_s",
        "perf/gen_tokens_per_s", "engine/decode_tokens_per_s", "engine/version", "perf/eval_time",
    }
    assert rl_names <= set(last), sorted(rl_names - set(last))
    assert last["engine/version"] == 5
    assert all(0 <= row["rollout/lag_max"] <= 1 for row in rows[3:])  # quickstart: max_staleness 1
    # one TensorBoard run per stage, so the stages' curves never collide
    sft_scalars = read_tensorboard_scalars(out / "tensorboard" / "sft")
    rl_scalars = read_tensorboard_scalars(out / "tensorboard" / "rl")
    assert sft_names <= set(sft_scalars) and rl_names <= set(rl_scalars), sorted(rl_names - set(rl_scalars))
    assert [step for step, _ in rl_scalars["reward/mean"]] == [3, 4, 5]
    assert [step for step, _ in sft_scalars["loss/sft"]] == [1, 2]
    assert not any(":" in name for name in rl_scalars)


def test_rl_stage_starts_from_the_sft_weights(quick_run):
    """The first RL step's behaviour tokens carry version 2: the engine served the last SFT
    weights when the RL stage began (one engine for the run, versions count every step)."""
    _, _, out, _ = quick_run
    dumps = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    first_rl = [d for d in dumps if d["step"] == 3]
    assert first_rl and all(min(d["versions"]) == 2 for d in first_rl)


def test_provenance_and_trajectory_dump(quick_run):
    cfg, _, out, _ = quick_run
    assert load_config(out / "config.yaml") == cfg
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["command"] == ["test"]
    assert provenance["packages"]["jax"] and provenance["devices"][0]["platform"] == "cpu"
    assert "git_sha" in provenance
    dumps = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert {d["step"] for d in dumps} == {3, 4, 5}
    first = dumps[0]
    assert first["prompt"] and "positional_match" in first["reward_components"]
    assert all(2 <= v <= 5 for v in first["versions"])


@pytest.mark.slow  # the export's parity with transformers stays in the default selection (tests/model/test_model.py)
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
    """README's `asyncrl eval configs/quickstart.yaml --set model.path=runs/quickstart/hf`, through
    the command line (every config's eval command imports what it needs)."""
    from asyncrl.cli import main

    cfg, result, out, _ = quick_run
    overrides = [f"run.output_dir={out}", *FAST, f"model.path={out / 'hf'}"]
    assert main(["eval", str(QUICKSTART), *[arg for o in overrides for arg in ("--set", o)]]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    again = json.loads(printed[-1])
    for name in ("eval/reward", "eval/accuracy", "eval/n_prompts"):
        assert again[name] == result.final_eval[name], name


def test_synchronous_run_trains_only_current_tokens(tmp_path):
    from asyncrl.run.loop import train

    cfg = quick_config(tmp_path, "rollout.max_staleness=0", "eval.every_steps=0", "logging.dump_every_steps=0",
                       "stages.0.total_steps=1")
    train(cfg, console=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl_rows = [row for row in rows if row["stage"] == "rl"]
    assert len(rl_rows) == 3
    assert all(row["rollout/lag_max"] == 0 and row["rollout/lag_mean"] == 0 for row in rl_rows)


def test_output_dir_of_an_earlier_run_is_refused(quick_run):
    from asyncrl.run.loop import train
    from asyncrl.run.rundir import RunDirError

    cfg, _, out, _ = quick_run
    with pytest.raises(RunDirError, match="already holds a run"):
        train(cfg)


def _crash_config(tmp_path, *extra: str):
    return quick_config(tmp_path, "eval.every_steps=0", "stages.0.total_steps=1", "stages.1.total_steps=2", *extra)


def test_engine_crash_ends_the_run_with_the_engine_traceback(tmp_path, monkeypatch):
    from asyncrl.engine import scheduler
    from asyncrl.errors import EngineCrashed
    from asyncrl.run.loop import train

    def broken(self, *args, **kwargs):
        raise RuntimeError("injected engine failure")

    monkeypatch.setattr(scheduler.Scheduler, "_decode", broken)
    before = set(threading.enumerate())
    with pytest.raises(EngineCrashed) as info:
        train(_crash_config(tmp_path), console=io.StringIO())
    assert "injected engine failure" in str(info.value) and "Traceback" in str(info.value)
    # The threads that call into the runtime ended before train() raised: an interpreter exiting
    # under one of them (the train step's compile, a rollout worker) aborts instead of exiting 1.
    runtime = ("asyncrl-rollout-worker", "asyncrl-precompile", "asyncrl-jax-engine", "asyncrl-dispatcher")
    assert not [t.name for t in set(threading.enumerate()) - before if t.is_alive() and t.name.startswith(runtime)]


def test_trainer_crash_ends_the_run(tmp_path, monkeypatch):
    from asyncrl.run.loop import train
    from asyncrl.trainer import trainer

    calls = []

    def broken(self, batch):
        calls.append(self.objective)
        raise RuntimeError("injected trainer failure")

    monkeypatch.setattr(trainer.Trainer, "step", broken)
    with pytest.raises(RuntimeError, match="injected trainer failure"):
        train(_crash_config(tmp_path), console=io.StringIO())
    assert calls == ["sft"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quickstart_learns(seed, tmp_path):
    """The README's promise: eval reward +0.3 and training reward +0.3 within 300 s."""
    import time

    from asyncrl.run.loop import train

    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}", f"run.seed={seed}"])
    start = time.monotonic()
    result = train(cfg, console=io.StringIO())
    wall = time.monotonic() - start
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/reward"] for row in rows if "eval/reward" in row]
    rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]  # the RL stage's training reward
    tail = rewards[-max(1, len(rewards) // 10) :]
    print(json.dumps({"seed": seed, "wall_s": wall, "eval_first": evals[0], "eval_last": evals[-1],
                      "reward_first5": float(np.mean(rewards[:5])), "reward_last10pct": float(np.mean(tail))}))
    assert evals[-1] - evals[0] >= 0.3
    assert np.mean(tail) - np.mean(rewards[:5]) >= 0.3
    assert wall < 300
    assert result.steps == cfg.total_steps


def test_plot_metrics_writes_the_curves(quick_run, tmp_path, capsys):
    import importlib.util

    _, _, out, _ = quick_run
    spec = importlib.util.spec_from_file_location("plot_metrics", REPO_ROOT / "scripts" / "plot_metrics.py")
    plot_metrics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_metrics)
    assert plot_metrics.main([str(out), "-o", str(tmp_path / "curves.png")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 6 and {"reward/mean", "eval/reward", "rollout/lag_max"} <= set(summary["series"])
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_command_writes_the_newest_checkpoint_or_the_hf_export(quick_run, tmp_path, capsys):
    import shutil

    from asyncrl.cli import main
    from asyncrl.model import load_model

    _, result, out, _ = quick_run

    def same_weights(directory):
        _, params = load_model(str(directory), with_tokenizer=False).split()
        import jax

        flat_a, flat_b = jax.tree.leaves(params), jax.tree.leaves(result.final_params)
        return len(flat_a) == len(flat_b) and all(np.array_equal(np.asarray(a), b) for a, b in zip(flat_a, flat_b))

    # A run with checkpoints but no hf/ (stopped before the end): the newest checkpoint,
    # here the end of the RL stage, holds the final policy.
    stopped = tmp_path / "stopped_run"
    shutil.copytree(out / "checkpoints", stopped / "checkpoints")
    assert main(["export", str(stopped), str(tmp_path / "from_checkpoint")]) == 0
    assert same_weights(tmp_path / "from_checkpoint")
    # Without checkpoints, the final hf/ export is what there is.
    bare = tmp_path / "bare_run"
    shutil.copytree(out / "hf", bare / "hf")
    assert main(["export", str(bare), str(tmp_path / "from_hf")]) == 0
    assert same_weights(tmp_path / "from_hf")
    capsys.readouterr()
    # Nothing saved, or a target in use: clear errors, status 1.
    (tmp_path / "empty_run").mkdir()
    assert main(["export", str(tmp_path / "empty_run"), str(tmp_path / "x")]) == 1
    assert "holds no saved policy" in capsys.readouterr().err
    assert main(["export", str(bare), str(tmp_path / "from_hf")]) == 1
    assert "exists and is not empty" in capsys.readouterr().err


def test_an_rl_run_compiles_its_first_step_while_the_first_rollouts_run(tmp_path, compile_cache):
    """RL from the start: the train step's compile starts before the engine's first rollouts
    (asyncrl/trainer/precompile.py); the quickstart's one length bucket makes the first batch's
    shape certain, so the prediction is a hit and the step loads the program from the cache
    (which the fixture turns on: ``-p no:cacheprovider`` turns the suite's off)."""
    from asyncrl.run.loop import train

    cfg = quick_config(tmp_path, "stages=[]", "run.total_steps=2", "eval.every_steps=0", "logging.dump_every_steps=0")
    train(cfg, console=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0]["perf/startup_precompile_hit"] == 1.0 and "perf/startup_precompile_hit" not in rows[1]


@pytest.mark.slow  # a whole run; packed steps equal unpacked ones in tests/trainer/test_packing.py
def test_a_packed_run_logs_the_unpacked_runs_losses(quick_run, tmp_path):
    """rollout.pack through the whole loop (SFT stage, RL stage, eval): every step's loss, gradient
    norm and trained tokens are the unpacked run's (rollouts are seeded, so the batches are too)."""
    from asyncrl.run.loop import train

    _, _, plain_out, _ = quick_run
    train(quick_config(tmp_path, "rollout.pack=true"), argv=["test"], console=io.StringIO())
    keys = ("loss/sft", "loss/total", "train/grad_norm", "train/trained_tokens")
    runs = [[{k: row[k] for k in keys if k in row} for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if row["step"] > 0] for out in (plain_out, tmp_path)]
    assert len(runs[1]) == 5 and all(len(row) == 3 for row in runs[1])
    for plain, packed in zip(*runs):
        assert plain.keys() == packed.keys() and plain["train/trained_tokens"] == packed["train/trained_tokens"]
        for key in plain:
            np.testing.assert_allclose(packed[key], plain[key], rtol=1e-5, err_msg=key)
