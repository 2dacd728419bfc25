"""Every config in configs/ runs from a copy of the repository with nothing beside it.

The repository's files (what a clone of this working tree holds: tracked and untracked files git
does not ignore) are copied into an empty folder, and each config's documented CPU command (its
header's ``# On a CPU ...:`` paragraph, tests/helpers.py ``documented_cpu_commands``) runs there,
shortened to two steps per stage and two eval prompts, as a user without network would run it:
datasets by name from ``$ASYNCRL_DATA_DIR`` (the suite's local copy), the hub offline, no
tokenizer corpus, nothing on the path but the copy. A config without a CPU command fails.

The default selection checks that every config has one, and that there it validates, its datasets
load and its model builds (no training: nothing compiles); the slow test runs every config.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO_ROOT, SHARED_DATA, documented_cpu_commands, subprocess_env

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def copy_of_the_repository(into: Path) -> Path:
    """The working tree's files a clone would hold, copied to ``into/asyncrl``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    root = into / "asyncrl"
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not there
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    return root


def user_env(clone: Path) -> dict[str, str]:
    """A user's environment in the copy: it alone on the path, GSM8K from the local copy, the hub offline."""
    env = subprocess_env(PYTHONPATH=str(clone), ASYNCRL_DATA_DIR=str(SHARED_DATA), HF_HUB_OFFLINE="1",
                         HF_DATASETS_OFFLINE="1")
    for name in ("ASYNCRL_TINY_QWEN3_CORPUS", "ASYNCRL_SHARED_DATA"):
        env.pop(name, None)
    return env


def shortened(config: Path, argv: list[str], steps: int = 2) -> list[str]:
    """``argv`` (an ``asyncrl train`` command) with ``steps`` steps per stage and two eval prompts."""
    if argv[:2] != ["asyncrl", "train"]:
        return argv
    stages = yaml.safe_load(config.read_text()).get("stages") or []
    extra = [f"stages.{i}.total_steps={steps}" for i in range(len(stages))] or [f"run.total_steps={steps}"]
    return [*argv, *(arg for item in [*extra, "eval.max_prompts=2"] for arg in ("--set", item))]


def run(argv: list[str], clone: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    program = {"asyncrl": [sys.executable, "-m", "asyncrl"], "python": [sys.executable]}[argv[0]]
    return subprocess.run([*program, *argv[1:]], cwd=clone, env=user_env(clone), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    if not (SHARED_DATA / "gsm8k" / "train.jsonl").exists():
        pytest.skip(f"{SHARED_DATA / 'gsm8k'} (the local copy of GSM8K) not present")
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return copy_of_the_repository(tmp_path_factory.mktemp("empty"))


CHECK_IN_THE_COPY = """
import sys
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.model import load_model
from asyncrl.registry import resolve

assert __import__("asyncrl").__file__.startswith(sys.argv[1]), "not the copy's asyncrl"
models, datasets = {}, {}
for argv in COMMANDS:
    assert main(argv[1:] + ["--print-config"]) == 0, argv
    cfg = load_config(argv[2], [a for a in argv[3:] if a != "--set"])
    for _, scfg in cfg.stage_configs():
        key = (repr(scfg.data.dataset), scfg.run.seed)
        if key not in datasets:
            datasets[key] = resolve("dataset", scfg.data.dataset, where="data.dataset")(seed=scfg.run.seed)
        assert len(datasets[key].train) and len(datasets[key].eval), argv
    if cfg.model.path not in models:
        models[cfg.model.path] = load_model(cfg.model)
print(sorted(models))
"""


def test_every_config_documents_a_cpu_command_whose_data_and_model_load_in_a_copy(clone):
    """Every config has a CPU command; in the copy it validates, its datasets load (GSM8K by name
    from the local copy) and its model loads (tiny-qwen3 with its shipped tokenizer), with nothing
    beside the copy."""
    missing = [c.name for c in CONFIGS if f"configs/{c.name}" not in (documented_cpu_commands(c) or [[]])[-1]]
    assert not missing, f"configs without a '# On a CPU ...:' command that runs them: {missing}"
    commands = [shortened(c, documented_cpu_commands(c)[-1]) for c in CONFIGS]
    proc = subprocess.run([sys.executable, "-c", f"COMMANDS = {commands!r}\n{CHECK_IN_THE_COPY}", str(clone)],
                          cwd=clone, env=user_env(clone), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tiny-qwen3" in proc.stdout.splitlines()[-1]
    assert sorted(p.name for p in clone.parent.iterdir()) == ["asyncrl"]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_runs_its_cpu_command_in_a_copy(clone, config):
    commands = documented_cpu_commands(config)
    assert commands, f"{config.name}: no '# On a CPU ...:' command"
    for argv in commands:
        proc = run(shortened(config, argv), clone)
        assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stderr[-3000:]}"
    assert "training completed" in proc.stdout
    assert sorted(p.name for p in clone.parent.iterdir()) == ["asyncrl"]
