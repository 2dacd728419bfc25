"""``model.remat_policy: auto`` / ``model.logprob_chunk_size: auto``: what a run takes, and what
``asyncrl plan --target`` chooses (the cheapest setting whose XLA peak fits; explicit values win)."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.errors import ConfigError
from asyncrl.model.loading import runtime_options
from asyncrl.plan.auto import auto_candidates, choose_auto


def test_auto_is_the_memory_safe_default_in_a_run_and_explicit_values_stay():
    section = load_config(data={}).model
    assert (section.remat_policy, section.logprob_chunk_size) == ("auto", "auto")
    runtime = runtime_options(section, "cpu")
    assert (runtime["remat_policy"], runtime["logprob_chunk_size"]) == ("full", None)
    given = load_config(data={}, overrides=["model.remat_policy=save_dots", "model.logprob_chunk_size=64"]).model
    assert (runtime_options(given, "gpu")["remat_policy"], runtime_options(given, "gpu")["logprob_chunk_size"]) == ("save_dots", 64)
    assert runtime_options(load_config(data={}, overrides=["model.logprob_chunk_size=null"]).model)["logprob_chunk_size"] is None
    with pytest.raises(ConfigError, match="logprob_chunk_size"):
        load_config(data={}, overrides=["model.logprob_chunk_size=0"])


def test_candidates_cheapest_first_and_only_for_fields_left_auto():
    remat = load_config(data={"model": {"remat": True}})
    assert auto_candidates(remat, 128) == [
        ("model.remat_policy=save_dots", "model.logprob_chunk_size=128"), ("model.remat_policy=save_dots", "model.logprob_chunk_size=64"),
        ("model.remat_policy=save_dots", "model.logprob_chunk_size=32"), ("model.remat_policy=full", "model.logprob_chunk_size=128"),
        ("model.remat_policy=full", "model.logprob_chunk_size=64"), ("model.remat_policy=full", "model.logprob_chunk_size=32")]
    assert auto_candidates(load_config(data={}), 64) == [("model.logprob_chunk_size=64",), ("model.logprob_chunk_size=32",)]  # no remat: no policy
    explicit = load_config(data={"model": {"remat": True, "remat_policy": "full", "logprob_chunk_size": 16}})
    assert auto_candidates(explicit, 512) == [()]


def test_choose_compiles_only_where_the_formulas_cannot_tell():
    candidates = [("a",), ("b",), ("c",), ("d",)]
    estimates = {"a": 200, "b": 105, "c": 95, "d": 50}
    peaks = {"b": 101, "c": 99, "d": 60}
    compiled = []

    def measure(c):
        compiled.append(c[0])
        return peaks[c[0]]

    choice = choose_auto(candidates, 100, lambda c: estimates[c[0]], measure)
    assert choice.overrides == ("c",) and choice.fits and choice.peak_bytes == 99
    assert compiled == ["b", "c"]  # "a" is over the budget by more than the formulas' tolerance
    assert [c for c, _ in choice.tried] == [("b",), ("c",)] and "compiled: b: " in choice.describe(100)
    compiled.clear()
    clear = choose_auto(candidates, 250, lambda c: estimates[c[0]], measure)
    assert clear.overrides == ("a",) and clear.peak_bytes is None and compiled == []  # under it by more: no compile
    nothing = choose_auto(candidates, 10, lambda c: estimates[c[0]], measure)
    assert nothing.overrides == ("d",) and not nothing.fits  # none fits: the least-memory one, measured
    assert choose_auto([()], 10, lambda c: 0, measure).overrides == ()


def test_plan_target_states_the_choice_and_explicit_values_win():
    """On the cpu target (this process's CPU; its memory is the host's) the cheapest candidate is
    clear from the formulas: no compile. An explicit value is kept as given."""
    from asyncrl.plan.auto import resolve_for_target
    from asyncrl.plan.targets import get_target

    small = ["stages=[]", "rollout.batch_size=2", "engine.slots=16", "model.remat=true"]
    cfg = load_config("configs/quickstart.yaml", small)
    chosen, line = resolve_for_target("configs/quickstart.yaml", small, cfg, get_target("cpu"), 1, 1)
    assert (chosen.model.remat_policy, chosen.model.logprob_chunk_size) == ("save_dots", 32)  # the window whole
    assert line.startswith("auto -> --set model.remat_policy=save_dots --set model.logprob_chunk_size=32 (the plan's total")
    pinned = [*small, "model.remat_policy=full", "model.logprob_chunk_size=8"]
    kept, line = resolve_for_target("configs/quickstart.yaml", pinned, load_config("configs/quickstart.yaml", pinned),
                                    get_target("cpu"), 1, 1)
    assert line is None and (kept.model.remat_policy, kept.model.logprob_chunk_size) == ("full", 8)


def test_a_run_chooses_save_dots_only_where_the_formulas_clear_it_and_full_on_a_cpu():
    """The run's choice from its device's bytes (no device here: the bytes are given; no compile)."""
    from asyncrl.plan.auto import PLAN_TOLERANCE, apply_sets, choose_remat_for_run
    from asyncrl.plan.formulas import plan_config

    cfg = load_config(data={"model": {"remat": True}, "engine": {"slots": 16}})
    total = {policy: plan_config(apply_sets(cfg, [f"model.remat_policy={policy}"]), backend="gpu").total_bytes
             for policy in ("save_dots", "full")}
    assert total["save_dots"] > total["full"]
    roomy = int(total["save_dots"] * (1 + PLAN_TOLERANCE)) + 1
    chosen, line = choose_remat_for_run(cfg, roomy, "gpu")
    assert chosen.model.remat_policy == "save_dots" and line.startswith("model.remat_policy: auto -> save_dots")
    tight = int(total["save_dots"] * (1 + PLAN_TOLERANCE)) - 1  # save_dots would fit, but not by the formulas' margin
    assert choose_remat_for_run(cfg, tight, "gpu")[0].model.remat_policy == "full"
    assert choose_remat_for_run(cfg, roomy, "cpu")[0].model.remat_policy == "full"  # the CPU: full, as before
    assert choose_remat_for_run(cfg, None, "tpu")[0].model.remat_policy == "full"  # no limit reported
    assert chosen.model.logprob_chunk_size == "auto"  # the run's chunk stays its own (RUN_AUTO)
    pinned = apply_sets(cfg, ["model.remat_policy=full"])
    assert choose_remat_for_run(pinned, roomy, "gpu") == (pinned, None)  # an explicit policy wins
    auto_slots = load_config(data={"model": {"remat": True}, "engine": {"slots": "auto"}})  # sized under full first
    chosen, line = choose_remat_for_run(auto_slots, roomy * 4, "gpu")
    assert chosen.engine.slots == "auto" and "engine.slots: auto planned at" in line


def test_micro_batches_auto_takes_the_largest_budget_that_fits_beside_the_engine():
    """``optim.micro_batches: auto``: whole rows of the length cap (at most 32,768 tokens), the most that
    fit the budget with the engine's slots sized first; unchosen, the plan counts one row."""
    from asyncrl.plan.formulas import (
        MICRO_BATCH_TOKENS_CAP,
        choose_micro_batch_tokens,
        micro_batch_budgets,
        plan_config,
        with_micro_batch_tokens,
    )

    cfg = load_config(data={"rollout": {"batch_size": 8, "group_size": 4, "max_new_tokens": 64, "length_bucket": 64},
                            "data": {"max_prompt_tokens": 64}, "optim": {"micro_batches": "auto"}, "engine": {"slots": 16}})
    assert cfg.longest_row == 128 and cfg.packs  # a token budget packs
    assert micro_batch_budgets(cfg, row_shards=2) == [k * 128 for k in range(16, 0, -1)]  # 32 rows per mini-batch, 2 shards
    long = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_seq_len": 20000})})
    assert micro_batch_budgets(long, 1) == [long.longest_row]  # over the cap: one row
    assert micro_batch_budgets(cfg, 1)[0] <= MICRO_BATCH_TOKENS_CAP
    total = {k: plan_config(with_micro_batch_tokens(cfg, 128 * k), backend="gpu").total_bytes for k in (1, 5, 6, 32)}
    assert plan_config(cfg, backend="gpu").total_bytes == total[1]  # auto, unchosen: one row
    assert total[1] < total[5] < total[6] < total[32]
    tokens, planned, fits = choose_micro_batch_tokens(cfg, total[5] + 1, backend="gpu")
    assert (tokens, planned, fits) == (5 * 128, total[5], True)
    assert choose_micro_batch_tokens(cfg, total[32], backend="gpu")[0] == 32 * 128
    assert choose_micro_batch_tokens(cfg, total[1] - 1, backend="gpu") == (128, total[1], False)
