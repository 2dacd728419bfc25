"""``model.remat_policy: auto`` and ``model.logprob_chunk_size: auto`` chosen for a target by
``asyncrl plan --target``: the cheapest setting whose XLA peak fits the device.

Cheapest means least recomputation: ``remat_policy: save_dots`` (the backward recomputes norms,
rope, attention and activations) before ``full`` (the whole layer), and the largest lm-head
chunk (the trained window whole, then halves of it down to :data:`SMALLEST_CHUNK` positions:
each chunk is recomputed in the backward, and smaller chunks are more loop steps). An explicit
value in the config always wins: only fields left ``auto`` are chosen (``remat_policy`` only
with ``model.remat``; without it there is no policy to pick); the choice printed here is the
``--set`` that pins it.

A run chooses its remat policy by itself (:func:`choose_remat_for_run`, called at start with the
memory its devices report: :func:`asyncrl.run.auto_slots.resolve_auto_remat`), from the formulas
alone: no compile at start. It takes ``save_dots`` only where the plan is under the device's
memory by more than :data:`PLAN_TOLERANCE`, else ``full``; on a CPU ``full``. Its lm-head chunk
stays what :data:`asyncrl.model.loading.RUN_AUTO` says (the chunk under
``model.logprob_chunk_budget_mb``).

Compiles are the cost (tens of seconds to minutes each here), so the calibrated formulas
(:mod:`asyncrl.plan.formulas`, within :data:`PLAN_TOLERANCE` of XLA on the shipped configs)
decide where they are clear (a candidate over the budget by more than the tolerance cannot fit,
one under it by more fits) and XLA's peak decides in between, at most ``max_compiles`` compiles;
when none fits, the least-memory candidate is returned as not fitting. The report that follows
compiles the chosen setting and prints its verdict.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from asyncrl.config import Config

SMALLEST_CHUNK = 32
"""The smallest lm-head chunk ``auto`` tries (positions)."""
PLAN_TOLERANCE = 0.10
"""How far the plan's formulas may be from XLA's figures (docs/benchmarks.md's calibration table):
a candidate whose formula total exceeds the budget by more is not compiled."""


@dataclasses.dataclass(frozen=True)
class MemoryChoice:
    """What ``auto`` became for a target."""

    overrides: tuple[str, ...]
    """The chosen values as ``--set`` overrides (empty: nothing was ``auto``)."""
    peak_bytes: Optional[int]
    """XLA's per-device peak with them (None: nothing compiled)."""
    fits: bool
    tried: tuple[tuple[tuple[str, ...], int], ...] = ()
    """Each candidate compiled, in order, with XLA's per-device peak."""

    def describe(self, budget: int) -> str:
        """One line for ``asyncrl plan``: the choice, how it was decided, what was compiled."""
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        sets = " ".join(f"--set {o}" for o in self.overrides)
        if self.peak_bytes is None:
            how = f"the plan's total is under the {gib(budget)} per device by more than its {PLAN_TOLERANCE:.0%} tolerance"
        else:
            how = (f"XLA peak {gib(self.peak_bytes)} of {gib(budget)} per device: "
                   + ("fits" if self.fits else "does NOT fit; the least memory tried"))
        tried = "; ".join(f"{' '.join(o.split('.', 1)[-1] for o in c)}: {gib(p)}" for c, p in self.tried)
        return f"auto -> {sets} ({how}" + (f"; compiled: {tried})" if tried else ")")


def auto_candidates(cfg: Config, window: int) -> list[tuple[str, ...]]:
    """The settings ``auto`` may take for ``cfg``, cheapest first, as ``--set`` overrides: every
    remat policy left ``auto`` (``save_dots``, ``full``) with every chunk left ``auto`` (``window``,
    then halves down to :data:`SMALLEST_CHUNK`). ``[()]`` when nothing is ``auto``."""
    model = cfg.model
    policies: list[Optional[str]] = ["save_dots", "full"] if (model.remat and model.remat_policy == "auto") else [None]
    chunks: list[Optional[int]] = [None]
    if model.logprob_chunk_size == "auto":
        chunks, size = [], window
        while size >= SMALLEST_CHUNK or not chunks:
            chunks.append(size)
            size //= 2
    out = []
    for policy in policies:
        for chunk in chunks:
            sets = ([f"model.remat_policy={policy}"] if policy else []) + ([f"model.logprob_chunk_size={chunk}"] if chunk else [])
            out.append(tuple(sets))
    return out


def choose_auto(candidates: Sequence[tuple[str, ...]], budget: int, estimate: Callable[[tuple[str, ...]], int],
                measure: Optional[Callable[[tuple[str, ...]], int]], max_compiles: int = 3) -> MemoryChoice:
    """The first of ``candidates`` (cheapest first) that fits ``budget`` bytes per device. The
    formulas (``estimate``) are within :data:`PLAN_TOLERANCE` of XLA, so a candidate over the
    budget by more is skipped uncompiled and one under it by more is taken uncompiled (its peak,
    None here, is the report's); in between XLA's peak (``measure``: bytes per device, trainer
    and engine where they share it) decides. After ``max_compiles`` compiles without a fit, the
    least-memory candidate is measured and returned as not fitting. Without ``measure`` (a run's
    start: nothing is compiled) only a candidate the formulas clear is taken, else the last (the
    least memory), its ``fits`` the formulas' verdict."""
    if not candidates or candidates[0] == ():
        return MemoryChoice((), None, True)
    tried: list[tuple[tuple[str, ...], int]] = []
    for candidate in candidates:
        planned = estimate(candidate)
        if planned * (1 + PLAN_TOLERANCE) <= budget:
            return MemoryChoice(candidate, None, True, tuple(tried))
        if measure is None:
            if candidate == candidates[-1]:
                return MemoryChoice(candidate, None, planned <= budget)
            continue
        if planned > budget * (1 + PLAN_TOLERANCE) and candidate != candidates[-1]:
            continue
        peak = measure(candidate)
        tried.append((candidate, peak))
        if peak <= budget:
            return MemoryChoice(candidate, peak, True, tuple(tried))
        if len(tried) >= max_compiles:
            break
    last = candidates[-1]
    found = next((p for c, p in tried if c == last), None)
    if found is None:
        assert measure is not None  # without it the loop returned at the last candidate
        found = measure(last)
        tried.append((last, found))
    return MemoryChoice(last, found, found <= budget, tuple(tried))


# --------------------------------------------------------------------------- for a target


def run_peak(cfg: Config, target: Any, devices: int, hosts: int) -> int:
    """XLA's per-device peak of ``cfg`` on ``target`` (run where the target's compile-only devices
    are: the ``--target`` process): over the stages (:func:`~asyncrl.plan.programs.stage_programs`),
    the train step's at its first batch shape, or where the engine shares the trainer's devices the
    device total of it and the decode chunk over the whole cache
    (:func:`~asyncrl.plan.command.xla_device_total`)."""
    from asyncrl.cluster.placement import resolve_placement
    from asyncrl.plan.command import xla_device_total
    from asyncrl.plan.compiled import compile_lowered, engine_args, lower_decode_chunk, lower_train_step, train_shape
    from asyncrl.plan.formulas import abstract_params, plan_layout, plan_stage, stage_decoder_config
    from asyncrl.plan.programs import stage_programs
    from asyncrl.plan.targets import target_devices

    found = target_devices(target, devices, hosts)
    peak = 0
    for stage in stage_programs(cfg):
        flat, sft = stage.flat, stage.sft
        layout = plan_layout(flat, devices, hosts)
        model_cfg = stage_decoder_config(flat, backend=target.platform)
        placement = resolve_placement(flat, found, hosts)
        trainer = compile_lowered(lower_train_step(flat, model_cfg, placement.trainer_devices,
                                                   train_shape(flat, sft, layout.row_shards, hosts), sft))[0]
        total = trainer.peak
        if stage.engine and layout.colocated:
            decode = compile_lowered(lower_decode_chunk(flat, engine_args(flat, model_cfg, placement, target.platform)))[0]
            plan = plan_stage(flat, model_cfg, layout, abstract_params(model_cfg), sft, stage.stage.name, target.platform)
            total = xla_device_total(plan, {"trainer": trainer, "engine": decode}) or total
        peak = max(peak, total)
    return peak


def resolve_for_target(config: Optional[str], overrides: Sequence[str], cfg: Config, target: Any, devices: int,
                       hosts: int) -> tuple[Config, Optional[str]]:
    """``cfg`` with its ``auto`` remat policy and lm-head chunk chosen for ``target``
    (:func:`choose_auto` on :func:`run_peak` against the target's memory per device), and the
    line ``asyncrl plan --target`` prints about the choice (None when nothing was ``auto``)."""
    from asyncrl.config import load_config
    from asyncrl.plan.activations import batch_shape
    from asyncrl.plan.formulas import plan_config
    from asyncrl.plan.targets import device_memory_bytes

    window = max(batch_shape(flat, stage.type == "sft")[2] for stage, flat in cfg.stage_configs())
    candidates = auto_candidates(cfg, window)
    if candidates == [()]:
        return cfg, None
    budget = device_memory_bytes(target)
    with_sets = lambda sets: load_config(config, [*overrides, *sets])  # noqa: E731
    estimate = lambda sets: plan_config(_same_slots(with_sets(sets), cfg), devices, hosts,  # noqa: E731
                                        backend=target.platform).total_bytes
    measure = lambda sets: run_peak(_same_slots(with_sets(sets), cfg), target, devices, hosts)  # noqa: E731
    choice = choose_auto(candidates, budget, estimate, measure)
    return _same_slots(with_sets(choice.overrides), cfg), choice.describe(budget)


def _same_slots(new: Config, planned: Config) -> Config:
    """``new`` with ``planned``'s engine slots and micro-batch token budget (``engine.slots: auto`` and
    ``optim.micro_batches: auto`` are chosen before the remat policy and the lm-head chunk)."""
    from asyncrl.plan.formulas import with_slots

    slots = planned.engine.slots
    new = with_slots(new, slots) if isinstance(slots, int) and new.engine.slots != slots else new
    tokens = planned.optim.micro_batch_tokens
    if tokens is not None and new.optim.micro_batch_tokens is None and new.optim.micro_batches == "auto":
        from asyncrl.plan.formulas import with_micro_batch_tokens

        new = with_micro_batch_tokens(new, tokens)
    return new


# --------------------------------------------------------------------------- in a run


def apply_sets(cfg: Config, sets: Sequence[str]) -> Config:
    """``cfg`` with ``--set`` overrides ``sets`` applied, as :func:`~asyncrl.config.load_config` applies
    them (``cfg`` written out and read back: :func:`~asyncrl.config.dump_config` round-trips)."""
    if not sets:
        return cfg
    import yaml

    from asyncrl.config import dump_config, load_config

    return load_config(data=yaml.safe_load(dump_config(cfg)), overrides=list(sets))


def choose_remat_for_run(cfg: Config, device_bytes: Optional[int], backend: str, devices: int = 1, processes: int = 1,
                         model_cfg: Any = None) -> tuple[Config, Optional[str]]:
    """``cfg`` with ``model.remat_policy: auto`` (with ``model.remat``) chosen as a run chooses it at
    start, and the line it logs (None when the policy is not ``auto`` or there is no remat).

    ``device_bytes``: the memory JAX may allocate on one of the run's devices
    (``memory_stats()['bytes_limit']``), over ``devices`` devices in ``processes`` processes,
    ``backend`` their platform. On a GPU or TPU the calibrated formulas decide without a compile
    (:func:`choose_auto` without ``measure``): ``save_dots`` when the plan's total with it is under
    ``device_bytes`` by more than :data:`PLAN_TOLERANCE`, else ``full``. The plan is taken at the
    slots the run will have: a number as given, ``engine.slots: auto`` sized first under ``full``
    (as ``asyncrl plan --target`` sizes it before its choice), and ``save_dots`` must leave
    ``auto`` its minimum too. On a CPU (or a device that reports no limit) ``full``: a CPU's
    memory is the host's, shared with everything else on it and not limited by JAX, so there
    is no budget to choose against, and its compiler keeps most activations under either
    policy (docs/performance.md "Memory before hardware")."""
    from asyncrl.errors import ConfigError
    from asyncrl.plan.formulas import AUTO_SLOTS_HEADROOM, GIB, plan_config, slots_for_budget, with_slots

    if not (cfg.model.remat and cfg.model.remat_policy == "auto"):
        return cfg, None
    full = apply_sets(cfg, ["model.remat_policy=full"])
    if backend == "cpu" or not device_bytes:
        return full, "model.remat_policy: auto -> full (the CPU: no device memory limit to choose against)"
    sized = cfg.engine.slots == "auto" and cfg.engine.remote is None
    slots_budget = int(AUTO_SLOTS_HEADROOM * device_bytes)
    planned_slots = slots_for_budget(full, slots_budget, devices, processes, model_cfg, backend) if sized else None

    def at_slots(candidate: Config) -> Config:
        return with_slots(candidate, planned_slots) if planned_slots is not None else candidate

    # The run's lm-head chunk is its own (RUN_AUTO): only the policy is a candidate here.
    window_fixed = cfg if cfg.model.logprob_chunk_size != "auto" else apply_sets(cfg, ["model.logprob_chunk_size=null"])
    candidates = auto_candidates(window_fixed, 0)
    totals = {sets: plan_config(at_slots(apply_sets(window_fixed, sets)), devices, processes, model_cfg, backend).total_bytes
              for sets in candidates}
    choice = choose_auto(candidates, device_bytes, totals.__getitem__, None)
    chosen = apply_sets(cfg, choice.overrides)
    if sized and chosen.model.remat_policy != "full":
        try:  # engine.slots: auto, sized after this under the chosen policy, must still get its minimum
            slots_for_budget(chosen, slots_budget, devices, processes, model_cfg, backend)
        except ConfigError:
            chosen = full
    policy = chosen.model.remat_policy
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    plan = totals[next(c for c in candidates if f"model.remat_policy={policy}" in c)]
    other = totals[candidates[0]]
    why = (f"the plan's {gib(plan)} per device is under the device's {gib(device_bytes)} by more than "
           f"{PLAN_TOLERANCE:.0%}" if policy == "save_dots" else
           f"save_dots would plan {gib(other)} per device, not under the device's {gib(device_bytes)} by "
           f"{PLAN_TOLERANCE:.0%}; full plans {gib(plan)}")
    return chosen, f"model.remat_policy: auto -> {policy} ({why}" + (
        f"; engine.slots: auto planned at {planned_slots}, its size under full" if planned_slots is not None else "") + ")"

