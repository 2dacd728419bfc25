"""configs/long_reasoning_grpo.yaml: it validates as written with DAPO's choices, its CPU smoke
command validates, and its plan leaves at least a fifth of each device free on its targets (8 x
H100 and a TPU v6e-8 for Qwen3-1.7B, 8 x H100 for Qwen3-8B). The smoke command itself runs in
tests/test_doc_commands.py (chain ``long_reasoning``); the compiled figures are docs/scaling.md's."""

from __future__ import annotations

import re
import shlex

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from tests.helpers import REPO_ROOT

RECIPE = "configs/long_reasoning_grpo.yaml"
MODELS = REPO_ROOT / "configs" / "models"


def documented_smoke_command() -> list[str]:
    """The CPU smoke command from the recipe's header comment, as argv (after ``asyncrl``)."""
    text = (REPO_ROOT / RECIPE).read_text()
    block = re.search(r"#   asyncrl train configs/long_reasoning_grpo.yaml --set model.path=tiny-qwen3 \\\n((?:#.*\n)+?)#\n", text)
    assert block, "the smoke command is missing from the recipe's comments"
    lines = [f"train {RECIPE} --set model.path=tiny-qwen3"] + [
        line.lstrip("#").strip().rstrip("\\") for line in block.group(1).splitlines()]
    return shlex.split(" ".join(lines))


def test_recipe_validates_as_written_with_dapo_s_choices(capsys):
    cfg = load_config(REPO_ROOT / RECIPE)
    assert cfg.rollout.max_new_tokens == 16384 and cfg.longest_row == cfg.engine.kv_capacity == 16768
    assert cfg.algo.truncated == "penalty" and cfg.algo.overlong_buffer == 4096  # DAPO's soft overlong punishment
    assert cfg.algo.clip_high == 0.28 and cfg.algo.aggregation == "token-mean" and cfg.rollout.filter_zero_variance
    assert cfg.packs and cfg.optim.micro_batches == "auto" and cfg.rollout.max_staleness == 4 and cfg.algo.decoupled
    assert "/" not in cfg.model.path.split("Qwen/", 1)[-1]  # a hub id, not a path
    # Every sample in flight decodes at once, and each replica's pool holds its share of them at the
    # recipe's stated mean length (about 1,550 tokens) with room for the long tail.
    engine, replicas, mean = cfg.engine, 8, 1550
    assert engine.slots == cfg.rollout.max_concurrent * cfg.rollout.group_size and engine.slots % replicas == 0
    assert engine.kv_pages * engine.page_size // mean >= 2 * engine.slots // replicas
    argv = documented_smoke_command()
    assert main([*argv, "--print-config"]) == 0
    assert "long_reasoning_cpu_smoke" in capsys.readouterr().out


@pytest.mark.parametrize("model,backend,memory_gib", [
    ("qwen3-1.7b", "gpu", 79.11), ("qwen3-1.7b", "tpu", 32.0),
    pytest.param("qwen3-8b", "gpu", 79.11, marks=pytest.mark.slow)])  # Qwen3-8B's abstract parameters: seconds more
def test_the_plan_leaves_a_fifth_of_each_device_free(model, backend, memory_gib):
    from asyncrl.plan.command import plan_auto_choices
    from asyncrl.plan.formulas import GIB, plan_config

    # engine.tensor_parallel: auto takes 1 on each (one replica per device); pinned here to plan once per choice.
    cfg = load_config(REPO_ROOT / RECIPE, [f"model.path={MODELS / model}", "engine.tensor_parallel=1"])
    memory = int(memory_gib * GIB)
    cfg = plan_auto_choices(cfg, memory, 8, 1, backend)
    assert cfg.optim.micro_batch_tokens == cfg.longest_row  # one 16,768-token row per micro-batch and device
    assert plan_config(cfg, 8, backend=backend).total_bytes <= 0.8 * memory
