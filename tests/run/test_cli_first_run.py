"""The command line's first-run paths on the `tiny` model: `asyncrl eval`, modules next to the
config, a user package named `workflows`, and re-running after a failed start-up."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import yaml

from asyncrl.cli import main
from tests.helpers import subprocess_env

# A small RL run of the quickstart's task: one step, no SFT stage.
BASE = {
    "model": {"path": "tiny"},
    "data": {"dataset": {"target": "copy", "kwargs": {"train_size": 64, "eval_size": 4, "min_digits": 3, "max_digits": 3}},
             "max_prompt_tokens": 16},
    "rollout": {"batch_size": 2, "group_size": 2, "max_staleness": 0, "max_new_tokens": 4, "length_bucket": 32},
    "engine": {"slots": 8, "kv_capacity": 32, "prefill_buckets": [16], "decode_chunk": 4},
    "eval": {"every_steps": 0, "max_prompts": 2},
    "checkpoint": {"every_steps": 0},
    "run": {"total_steps": 1},
}

USER_REWARDS = '''
def good(prompt, completion, answer="", **fields):
    """Share of the answer's characters the completion has in place."""
    return sum(a == c for a, c in zip(answer, completion.strip())) / max(len(answer), 1)


def bad(prompt, completion):
    return 1.0
'''


def write_project(tmp_path, **changes):
    """A user's project directory: a config, a rewards module next to it, and their own
    top-level package called `workflows` (which must not hide asyncrl's built-in tasks)."""
    (tmp_path / "myrewards.py").write_text(USER_REWARDS)
    (tmp_path / "workflows").mkdir(exist_ok=True)
    (tmp_path / "workflows" / "__init__.py").write_text('"""The user\'s own workflows package."""\nMINE = True\n')
    cfg = {**BASE, "run": {**BASE["run"], "output_dir": str(tmp_path / "run")}, **changes}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_eval_command_with_user_modules_and_a_user_workflows_package(tmp_path):
    """Through the CLI as the console script starts it (sys.path[0] is the
    script's directory, not the working directory): `asyncrl eval` runs, imports
    myrewards from the working directory, and resolves the built-in `copy` task although the
    user's own `workflows` package comes first on the path."""
    config = write_project(tmp_path, rewards=[{"fn": "myrewards:good"}])
    launcher = tmp_path / "bin" / "asyncrl"
    launcher.parent.mkdir()
    launcher.write_text("import sys\nfrom asyncrl.cli import main\nsys.exit(main())\n")
    proc = subprocess.run(
        [sys.executable, str(launcher), "eval", str(config), "--set", "eval.max_new_tokens=2"],
        capture_output=True, text=True, timeout=110, cwd=tmp_path, env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "eval/reward/good" in proc.stdout and '"model": "tiny"' in proc.stdout
    assert "eval/n_prompts  2.0000" in proc.stdout or "eval/n_prompts" in proc.stdout


def test_import_errors_name_the_field_and_the_cause(tmp_path, monkeypatch, capsys):
    """A module that is not there, and one whose own import fails, are config errors
    naming rewards.N.fn and the underlying `No module named ...` (no traceback)."""
    (tmp_path / "needs_dep.py").write_text("import not_installed_anywhere\n\ndef fn(prompt, completion, **f):\n    return 0.0\n")
    config = write_project(tmp_path, rewards=[{"fn": "myrewards:good"}, {"fn": "needs_dep:fn"}, {"fn": "nowhere:fn"}])
    monkeypatch.chdir(tmp_path)
    # As under the console script: the working directory is not on the path until the CLI puts it there.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for index, expected in ((1, "No module named 'not_installed_anywhere'"), (2, "No module named 'nowhere'")):
        rewards = [{"fn": "myrewards:good"}, {"fn": ["", "needs_dep:fn", "nowhere:fn"][index]}]
        assert main(["eval", str(config), "--set", f"rewards={yaml.safe_dump(rewards, default_flow_style=True).strip()}"]) == 2
        err = capsys.readouterr().err
        assert "rewards.1.fn:" in err and expected in err and "Traceback" not in err, err
    assert "current directory" in err and str(tmp_path) in err
    # The command itself runs.
    assert main(["eval", str(config), "--set", "rewards=[{fn: 'myrewards:good'}]", "--set", "eval.max_new_tokens=2"]) == 0
    assert '"model": "tiny", "eval/reward": ' in capsys.readouterr().out
    sys.modules.pop("myrewards", None)


def test_builtin_tasks_resolve_beside_a_user_workflows_package(tmp_path):
    """The mechanism (the CLI scenario is the slow test above): with the user's own
    `workflows` package first on sys.path, the built-in tasks and rewards still resolve."""
    write_project(tmp_path)
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, ".")
        import workflows
        assert workflows.MINE
        from asyncrl.registry import resolve
        task = resolve("dataset", "copy")(seed=0, train_size=4, eval_size=1)
        assert task.train[0]["prompt"].startswith("C:")
        assert resolve("reward", "positional_match")("p", "12", answer="12") == 1.0
        assert resolve("dataset", "gsm8k")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_rerun_after_a_failed_start_and_a_bad_reward_signature(tmp_path, monkeypatch, capsys):
    """A reward function with the wrong signature is a config error at start-up
    naming rewards.0.fn; the corrected command then runs in the same run directory (the failed
    start left no completed step), and the summary reports reward errors and timeouts."""
    config = write_project(tmp_path, rewards=[{"fn": "myrewards:bad"}])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "rewards.0.fn: bad(prompt, completion) cannot be called as fn(prompt, completion, **fields)" in err, err
    assert main(["train", str(config), "--set", "rewards.0.fn=myrewards:good"]) == 0
    out = capsys.readouterr().out
    assert "asyncrl: 1 steps, no eval, reward errors 0 timeouts 0" in out and "training completed" in out, out
    assert (tmp_path / "run" / "hf" / "config.json").exists()
    # A run that completed a step does count: the same command is refused.
    assert main(["train", str(config), "--set", "rewards.0.fn=myrewards:good"]) == 1
    assert "already holds a run" in capsys.readouterr().err
    sys.modules.pop("myrewards", None)
