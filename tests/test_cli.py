"""The asyncrl command line: help, version, config errors, --print-config, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from asyncrl import __version__
from asyncrl.cli import main
from asyncrl.config import load_config
from tests.helpers import REPO_ROOT, run_python, subprocess_env

QUICKSTART = str(REPO_ROOT / "configs" / "quickstart.yaml")


def test_help_lists_commands(capsys):
    try:
        main(["--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "version" in out


def test_train_help_shows_set_and_print_config(capsys):
    try:
        main(["train", "--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    assert "--set PATH=VALUE" in out and "--print-config" in out


def test_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"asyncrl {__version__}"
    with pytest.raises(SystemExit) as done:  # argparse's --version prints and exits 0
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"asyncrl {__version__}"


def test_config_error_exits_2_without_traceback(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  batch_sise: 4\n  temperature: -1\n")
    assert main(["train", str(path), "--set", "model.pth=x"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{path}: rollout.batch_sise: unknown key; did you mean 'rollout.batch_size'?" in err
    assert f"{path}: rollout.temperature: Input should be greater than 0 (given -1)" in err
    assert "--set model.pth: 'model.pth' does not exist; did you mean 'model.path'?" in err


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: no such config file" in capsys.readouterr().err


def test_print_config_round_trip(tmp_path, capsys):
    assert main(["train", QUICKSTART, "--print-config", "--set", "run.name=no", "--set", "rollout.temperature=1e-5"]) == 0
    printed = capsys.readouterr().out
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    expected = load_config(QUICKSTART, ["run.name=no", "rollout.temperature=1e-5"])
    assert load_config(path) == expected
    assert yaml.safe_load(printed)["run"]["name"] == "no"


def test_console_script_and_lazy_imports():
    # The installed entry point, in a fresh interpreter: config handling must not pull
    # in jax, flax or transformers.
    code = f"""
        import sys
        from asyncrl.cli import main
        assert main(["train", {QUICKSTART!r}, "--print-config"]) == 0
        assert main(["train", {QUICKSTART!r}, "--set", "rollout.batch_size=0"]) == 2
        import asyncrl
        asyncrl.load_config, asyncrl.Config
        heavy = sorted(m for m in ("jax", "flax", "optax", "transformers", "torch") if m in sys.modules)
        assert not heavy, heavy
    """
    run_python(code)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "train", QUICKSTART, "--set", "rollout.batch_order=fifo"],
        capture_output=True, text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=60,
    )
    assert proc.returncode == 2
    assert "rollout.batch_order: Input should be 'admission' or 'completion'" in proc.stderr
