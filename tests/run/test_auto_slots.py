"""``engine.slots: auto`` and ``engine.kv_pages: auto``: the most slots whose ``asyncrl plan`` fits a
budget (the pool at the pages they hold at the plan's mean length), within the run's bounds, then
the most pages per replica in what they leave; the plan shows both; a run's engine gets them from
the memory it finds."""

from __future__ import annotations

import logging

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.errors import ConfigError
from asyncrl.plan.formulas import AUTO_SLOTS_HEADROOM as HEADROOM
from asyncrl.plan.formulas import (
    GIB,
    mean_tokens,
    minimum_slots,
    pages_for_budget,
    plan_config,
    slots_for_budget,
    with_mean_pages,
    with_pages,
    with_slots,
)
from asyncrl.run.auto_slots import resolve_auto_slots
from tests.helpers import REPO_ROOT

RECIPE = REPO_ROOT / "configs" / "gsm8k_grpo_qwen2.5_0.5b.yaml"
QWEN = REPO_ROOT / "configs" / "models" / "qwen2.5-0.5b"


def recipe(*overrides: str):
    return load_config(str(RECIPE), [f"model.path={QWEN}", "engine.slots=auto", *overrides])


def total(cfg, slots: int) -> int:
    return plan_config(with_mean_pages(cfg, slots, backend="gpu"), backend="gpu").total_bytes


def test_auto_slots_is_the_most_that_fit_a_planned_budget():
    cfg = recipe()
    budget = 18 * GIB
    slots = slots_for_budget(cfg, budget, backend="gpu")
    assert slots % 8 == 0 and minimum_slots(cfg) <= slots < cfg.rollout.max_concurrent * cfg.rollout.group_size
    assert total(cfg, slots) <= budget < total(cfg, slots + 8)
    # then the pool: the most pages per replica in what those slots leave, at most every slot's longest context
    sized = with_slots(cfg, slots)
    pages = pages_for_budget(sized, budget, backend="gpu")
    pool = lambda pages: plan_config(with_pages(sized, pages), backend="gpu").total_bytes  # noqa: E731
    assert slots * -(-mean_tokens(cfg) // 16) <= pages < slots * 1024 // 16  # mean 640 of kv_capacity 1024
    assert pool(pages) <= budget < pool(pages + 1)
    assert pages_for_budget(sized, 1000 * GIB, backend="gpu") == slots * 1024 // 16
    with pytest.raises(ConfigError, match="engine.kv_pages: auto: one sequence's longest context"):
        pages_for_budget(sized, 10 * GIB, backend="gpu")


def test_auto_slots_bounds_and_a_budget_too_small():
    cfg = recipe()
    assert slots_for_budget(cfg, 10_000 * GIB, backend="gpu") == cfg.rollout.max_concurrent * cfg.rollout.group_size
    with pytest.raises(ConfigError, match="engine.slots: auto"):
        slots_for_budget(cfg, 8 * GIB, backend="gpu")  # the trainer alone is larger
    assert load_config(data={"engine": {"slots": "auto"}, "rollout": {"group_size": 64}}).engine.slots == "auto"


def test_auto_slots_of_a_staged_config_measures_only_valid_slot_counts():
    """Each stage of a staged config is validated again when planned (engine.slots at least
    rollout.group_size): the line through the plan is measured at counts the run accepts."""
    cfg = load_config(str(REPO_ROOT / "configs" / "quickstart.yaml"), ["engine.slots=auto"])
    assert cfg.stages and cfg.rollout.group_size == 8
    slots = slots_for_budget(cfg, 10_000 * GIB)
    assert slots == cfg.rollout.max_concurrent * cfg.rollout.group_size


def test_plan_sizes_auto_slots_for_the_device_memory(capsys):
    argv = ["plan", str(RECIPE), "--set", f"model.path={QWEN}", "--set", "engine.slots=auto", "--backend", "gpu"]
    assert main([*argv, "--device-memory", "24"]) == 0
    expected = slots_for_budget(recipe(), int(HEADROOM * 24 * GIB), backend="gpu")
    captured = capsys.readouterr()
    assert f"engine.slots: auto -> {expected} slots" in captured.err
    assert "engine.kv_pages: auto -> " in captured.err and "pages of 16 tokens per replica" in captured.out
    assert main(argv) == 0
    assert "planned at its minimum, 8 slots" in capsys.readouterr().err


def test_a_run_engine_gets_auto_slots_from_memory(tiny_split, caplog):
    from asyncrl.run.build import build_local_engine

    _, graphdef, params = tiny_split
    cfg = load_config(data={"model": {"path": "tiny"}, "engine": {"slots": "auto", "kv_capacity": 64,
                                                                  "prefill_buckets": [16]},
                            "data": {"max_prompt_tokens": 16}, "rollout": {"max_new_tokens": 16, "group_size": 2,
                                                                          "max_concurrent": 3}})
    assert resolve_auto_slots(with_slots(cfg, 5), None).engine.slots == 5  # a number stays
    with caplog.at_level(logging.INFO, logger="asyncrl.run"):
        engine = build_local_engine(cfg, graphdef, params, ())
    try:
        # the CPU reports no device memory: the host's; tiny fits, so the bound max_concurrent x group_size
        assert engine.slots == 6
    finally:
        engine.shutdown()
    assert "engine.slots: auto -> 6 slots of 64 tokens" in caplog.text
    # the pool: at most every slot's longest context (the host's memory holds far more)
    assert engine.kv_pages == 6 * 64 // 16 and "engine.kv_pages: auto -> 24 pages of 16 tokens per replica" in caplog.text


def test_auto_tensor_parallel_takes_the_degree_that_decodes_the_most_sequences():
    """Qwen3-1.7B's recipe over 8 devices (fsdp 8; the engine's degrees 1, 2, 4, 8): with 8 GiB per
    device degree 2 fits but its pools hold 108 sequences at the mean length, degree 4 holds all 128
    slots (so does 8: the smaller degree, fewer collectives); with 10 GiB every degree holds them
    (1); with 5 GiB none fits (the largest is returned for the caller to refuse)."""
    from asyncrl.plan.formulas import choose_tensor_parallel

    cfg = load_config(str(REPO_ROOT / "configs" / "gsm8k_grpo.yaml"),
                      [f"model.path={REPO_ROOT / 'configs' / 'models' / 'qwen3-1.7b'}", "mesh.fsdp=8"])
    degree, totals, sequences = choose_tensor_parallel(cfg, 8 * GIB, 8, 1, backend="cpu")
    assert degree == 4 and sequences == {2: 108, 4: 128, 8: 128}
    assert min(d for d in totals if totals[d] <= 8 * GIB) == 2  # the smallest that fits is not the choice
    assert choose_tensor_parallel(cfg, 10 * GIB, 8, 1, backend="cpu")[0] == 1
    assert choose_tensor_parallel(cfg, 5 * GIB, 8, 1, backend="cpu")[::2] == (8, {})


def test_slots_are_rounded_up_to_the_replicas_so_a_group_still_fits(caplog):
    """``engine.slots: 10`` with ``rollout.group_size: 10`` on 8 engine replicas becomes 16 slots (a
    multiple of 8 that still holds the group), said in one line; a count the replicas divide stays."""
    from asyncrl.cluster.placement import slots_for_replicas
    from asyncrl.run.auto_slots import round_slots_to_replicas

    assert [slots_for_replicas(s, 8) for s in (1, 8, 9, 10, 16, 17)] == [8, 8, 16, 16, 16, 24]
    cfg = load_config(REPO_ROOT / "configs" / "quickstart.yaml", ["engine.slots=10", "rollout.group_size=10"])
    with caplog.at_level(logging.INFO, logger="asyncrl.run"):
        rounded = round_slots_to_replicas(cfg, 8)
    assert rounded.engine.slots == 16 and rounded.rollout.group_size == 10
    assert "engine.slots: 10 -> 16 (rounded up to a multiple of the engine's 8 replicas" in caplog.text
    assert round_slots_to_replicas(cfg, 2) is cfg
    beam = load_config(REPO_ROOT / "configs" / "recommend.yaml", ["engine.slots=64"])
    assert round_slots_to_replicas(beam, 8).engine.slots == 64
    with pytest.raises(ConfigError, match=r"fewer than rollout.group_size \(20\)"):
        round_slots_to_replicas(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"group_size": 20})}), 8)
