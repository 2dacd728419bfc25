"""``asyncrl plan``: what a config needs on each device, before the hardware is rented.

The command (:func:`run_plan`) prints the per-device table of :func:`~asyncrl.plan.formulas.plan_config`
(the analytic model: :mod:`asyncrl.plan.formulas` says what is counted), and, when a
``--device-memory`` is given and the total does not fit, :func:`suggest` tries the changes a user
would make (more micro-batches, remat, a larger fsdp axis, fewer slots, a shorter kv_capacity,
LoRA) one at a time and then together, each with its new total.

``--xla`` adds XLA's figures for the real jitted programs compiled on this machine
(:mod:`asyncrl.plan.compiled`). The formulas' public names stay importable from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from asyncrl.config import Config, load_config
from asyncrl.errors import ConfigError
from asyncrl.plan.compiled import CompiledMemory, can_compile_here, compiled_decode_chunk, compiled_train_step
from asyncrl.plan.formulas import (
    AUTO_SLOTS_HEADROOM,
    GIB,
    Layout,
    MemoryPlan,
    choose_tensor_parallel,
    minimum_slots,
    pages_for_budget,
    plan_config,
    plan_layout,
    planned_slots,
    read_decoder_config,
    slots_for_budget,
    stage_decoder_config,
    with_pages,
    with_slots,
    with_tensor_parallel,
)


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A change that lowers the per-device total, as ``--set`` overrides, with its new total."""

    overrides: tuple[str, ...]
    total_bytes: int
    fits: bool



# --------------------------------------------------------------------------- suggestions


def _candidates(cfg: Config, layout: Layout) -> list[list[str]]:
    """Single changes that lower memory, in the order a user would try them."""
    rows = cfg.rollout.batch_size * cfg.rollout.group_size
    out: list[list[str]] = []
    if cfg.optim.by_tokens:  # fewer rows per micro-batch: smaller token budgets, down to one row
        tokens = cfg.optim.micro_batch_tokens
        while tokens is not None and tokens // 2 >= cfg.longest_row:
            tokens = tokens // 2 // cfg.longest_row * cfg.longest_row
            out.append([f"optim.micro_batch_tokens={tokens}"])
    else:
        micro = cfg.optim.micro_batch_count
        per_update = rows // max(cfg.algo.mini_batches, 1)
        for factor in (2, 4, 8, 16, 32):
            if per_update % (micro * factor) == 0 and per_update // (micro * factor) >= layout.row_shards:
                out.append([f"optim.micro_batches={micro * factor}"])
    if not cfg.model.remat:
        out.append(["model.remat=true"])
    elif cfg.model.remat_policy == "save_dots":
        out.append(["model.remat_policy=full"])
    trainer_devices = layout.mesh[0] * layout.mesh[1] * layout.mesh[2]
    fsdp = layout.mesh[1] * 2
    while fsdp * layout.mesh[2] <= trainer_devices:
        if trainer_devices % (fsdp * layout.mesh[2]) == 0:
            out.append([f"mesh.fsdp={fsdp}"] + (["mesh.data=null"] if cfg.mesh.data is not None else []))
        fsdp *= 2
    slots = planned_slots(cfg) // 2 if cfg.engine.slots != "auto" else 0  # auto sizes itself
    while slots >= cfg.rollout.group_size:
        out.append([f"engine.slots={slots}"])
        slots //= 2
    needed = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if cfg.engine.kv_capacity > needed:
        out.append([f"engine.kv_capacity={needed}", f"engine.prefill_buckets=[{max(min(cfg.engine.prefill_buckets), min(needed, cfg.data.max_prompt_tokens))}]"])
    if cfg.model.lora is None:
        out.append([_lora_suggestion(cfg)])
    return out


def _lora_suggestion(cfg: Config) -> str:
    """LoRA rank 16; on a mixture-of-experts model on attention only (what
    :func:`asyncrl.model.lora.check_moe_targets` accepts)."""
    from asyncrl.model.lora import ATTENTION_MODULES

    if not getattr(read_decoder_config(str(cfg.model.path)), "num_experts", 0):
        return "model.lora={rank: 16, alpha: 32}"
    return f"model.lora={{rank: 16, alpha: 32, target_modules: [{', '.join(ATTENTION_MODULES)}]}}"


def suggest(cfg_path: Optional[str], overrides: Sequence[str], device_memory: int, devices: int, processes: int,
            model_cfg: Any = None, data: Optional[dict] = None, backend: Optional[str] = None) -> list[Suggestion]:
    """Changes that bring the per-device total under ``device_memory`` bytes: each single change
    that fits (the smallest of a kind: fewest micro-batches, most slots, ...), else the changes
    applied cumulatively in order until the total fits. Each is valid config (checked by
    :func:`~asyncrl.config.load_config`)."""
    base = load_config(cfg_path, overrides, data=data)
    layout = plan_layout(base, devices, processes)

    def total(extra: Sequence[str]) -> Optional[int]:
        try:
            cfg = load_config(cfg_path, [*overrides, *extra], data=data)
            return plan_config(cfg, devices, processes, model_cfg, backend).total_bytes
        except ConfigError:
            return None

    singles: list[Suggestion] = []
    kinds_done: set[str] = set()
    for change in _candidates(base, layout):
        kind = change[0].split("=")[0]
        if kind in kinds_done:
            continue
        new = total(change)
        if new is not None and new <= device_memory:
            singles.append(Suggestion(tuple(change), new, True))
            kinds_done.add(kind)
    if singles:
        return sorted(singles, key=lambda s: s.total_bytes)
    combined: list[str] = []
    best: Optional[Suggestion] = None
    for change in _candidates(base, layout):
        kind = change[0].split("=")[0]
        trial = [c for c in combined if c.split("=")[0] != kind] + change
        new = total(trial)
        if new is None or (best is not None and new >= best.total_bytes):
            continue
        combined, best = trial, Suggestion(tuple(trial), new, new <= device_memory)
        if best.fits:
            break
    if best is not None and best.fits:  # drop the changes the others made unnecessary, last tried first
        for change in reversed(_candidates(base, layout)):
            kept = [c for c in combined if c not in change]
            if len(kept) < len(combined):
                new = total(kept)
                if new is not None and new <= device_memory:
                    combined, best = kept, Suggestion(tuple(kept), new, True)
    return [best] if best is not None else []


# --------------------------------------------------------------------------- output


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def xla_device_total(plan: MemoryPlan, xla: dict[str, CompiledMemory]) -> Optional[int]:
    """XLA's device total from the compiled train step (``trainer``) and decode chunk (``engine``):
    each side's arguments (its resident state) and the larger of their transients (peak minus
    arguments), colocated; the larger side's peak, split. None without both programs."""
    trainer, engine = xla.get("trainer"), xla.get("engine")
    if trainer is None or engine is None:
        return None
    if not plan.layout.colocated:
        return max(trainer.peak, engine.peak)
    # One device serving the trainer's own arrays: both programs' arguments hold them once.
    shared = (sum(line.bytes for line in plan.lines if line.part == "trainer" and line.resident and line.name == "parameters")
              if plan.layout.shares_trainer_arrays and not plan.resident_bytes("engine") - _kv_bytes(plan) else 0)
    transient = max(trainer.peak - trainer.arguments, engine.peak - engine.arguments)
    return trainer.arguments + engine.arguments - shared + transient


def _kv_bytes(plan: MemoryPlan) -> int:
    return sum(line.bytes for line in plan.lines if line.part == "engine" and line.name == "KV cache")


def device_total_json(plan: MemoryPlan, device_memory: Optional[int], xla: Optional[dict[str, CompiledMemory]] = None,
                      gb_per_s: Optional[float] = None) -> dict[str, Any]:
    """The ``"program": "device_total"`` object of ``--json``: the plan's device total (and XLA's,
    where both programs were compiled), with the verdict against ``device_memory``."""
    compiled = xla_device_total(plan, xla or {})
    figure = compiled if compiled is not None else plan.total_bytes
    out: dict[str, Any] = {
        "program": "device_total", "stage": plan.stage, "plan_bytes": plan.total_bytes,
        "plan_trainer_resident_bytes": plan.resident_bytes("trainer"), "plan_engine_resident_bytes": plan.resident_bytes("engine"),
        "plan_trainer_temporary_bytes": plan.temporary_bytes("trainer"), "plan_engine_temporary_bytes": plan.temporary_bytes("engine"),
        "plan_publish_bytes": plan.publish_bytes, "colocated": plan.layout.colocated,
        "device_memory_bytes": device_memory, "fits": None if device_memory is None else figure <= device_memory,
    }
    if compiled is not None:
        out["xla_peak_bytes"] = compiled
    seconds = plan.publish_seconds(gb_per_s)
    if seconds is not None:
        out["plan_publish_s"] = round(seconds, 4)
    return out


def format_plan(plan: MemoryPlan, device_memory: Optional[int] = None, model_name: str = "",
                xla: Optional[dict[str, CompiledMemory]] = None) -> str:
    """The table ``asyncrl plan`` prints: GiB per device (MiB when the total is under 1 GiB);
    ``xla``: the compiled programs' figures (``trainer``, ``engine``) shown beside the totals."""
    lay = plan.layout
    unit, scale = ("GiB", GIB) if max(plan.total_bytes, device_memory or 0) >= GIB else ("MiB", 2**20)
    fmt = lambda n: f"{n / scale:.2f}"  # noqa: E731
    head = (f"asyncrl plan: {model_name} ({plan.params / 1e6:.1f}M parameters), stage {plan.stage!r}, {lay.devices} "
            f"device(s) in {lay.processes} process(es); trainer mesh (data, fsdp, tensor) = {lay.mesh}, engine on "
            f"{lay.engine_devices} device(s)" + (" shared with the trainer" if lay.colocated else " of its own")
            + ("" if lay.shares_trainer_arrays else f" ({lay.engine_replicas} replica(s) x tensor_parallel "
                                                     f"{lay.tensor_parallel})"))
    width = max(len(line.name) for line in plan.lines) + 2
    col = f"{unit}/device"
    rows = [head, "", f"{'part':<8} {'item':<{width}} {col:>10}  note"]
    for line in plan.lines:
        kind = "resident" if line.resident else f"in {line.program}"
        rows.append(f"{line.part:<8} {line.name:<{width}} {fmt(line.bytes):>10}  [{kind}] {line.note}")
    rows.append("")
    for part in ("trainer", "engine"):
        compiled = (xla or {}).get(part)
        note = (f"resident {fmt(plan.resident_bytes(part))} + temporaries {fmt(plan.temporary_bytes(part))}"
                + (f"; XLA, compiled here: {fmt(compiled.peak)} (arguments + outputs - donated + temporaries)" if compiled else ""))
        rows.append(f"{part:<8} {'total':<{width}} {fmt(plan.part_bytes(part)):>10}  {note}")
    where = ("both sides' resident state + the larger temporaries (one device holds both)" if lay.colocated
             else "the larger of the trainer's and the engine's devices")
    compiled_total = xla_device_total(plan, xla or {})
    if compiled_total is not None:
        where += f"; XLA: {fmt(compiled_total)}"
    rows.append(f"{'device':<8} {'total':<{width}} {fmt(plan.total_bytes):>10}  {where}")
    if plan.publish_bytes:
        rows.append(f"{'':<8} {'publish':<{width}} {fmt(plan.publish_bytes):>10}  received per engine device at each publish "
                    "(device to device; asyncrl plan --target gives the seconds at the target's interconnect)")
    if device_memory is not None:
        figure = compiled_total if compiled_total is not None else plan.total_bytes
        verdict = "fits" if figure <= device_memory else "does NOT fit"
        rows.append(f"{'':<8} {'device memory':<{width}} {fmt(device_memory):>10}  {verdict}")
    return "\n".join(row.rstrip() for row in rows) + "\n"


def format_suggestions(suggestions: Sequence[Suggestion], device_memory: int) -> str:
    """The changes :func:`suggest` found, each as ``--set`` arguments with its new total."""
    unit, scale = ("GiB", GIB) if device_memory >= GIB else ("MiB", 2**20)
    if not suggestions:
        return (f"no change tried here brings it under {device_memory / scale:.2f} {unit} per device; "
                "use more devices (mesh.fsdp) or larger ones\n")
    lines = ["to fit, any one of:" if len(suggestions) > 1 else
             "to fit:" if suggestions[0].fits else "closest found (still too large):"]
    for s in suggestions:
        sets = " ".join(f"--set {o}" if " " not in o else f"--set '{o}'" for o in s.overrides)
        lines.append(f"  {sets:<60} -> {s.total_bytes / scale:.2f} {unit}/device")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the command


def run_plan(config: str, overrides: Sequence[str] = (), devices: int = 1, processes: int = 1,
             device_memory_gb: Optional[float] = None, backend: Optional[str] = None, xla: bool = False,
             as_json: bool = False, programs: Sequence[str] = ()) -> int:
    """``asyncrl plan``: print the table (and, when it does not fit ``device_memory_gb``, the
    suggestions), or with ``as_json`` the ``device_total`` object; 0 when it fits or no device memory
    is given, 1 when it does not. ``programs``: with ``xla``, compile only these (``train_step``,
    ``decode_chunk``)."""
    import json
    import sys

    if device_memory_gb is not None and not device_memory_gb > 0:
        raise ConfigError(f"--device-memory {device_memory_gb}: give the memory of one device in GB (GiB), > 0")
    cfg = load_config(config, overrides)
    device_memory = None if device_memory_gb is None else int(device_memory_gb * GIB)
    cfg = plan_auto_choices(cfg, device_memory, devices, processes, backend)
    plan = plan_config(cfg, devices, processes, backend=backend)
    compiled: dict[str, CompiledMemory] = {}
    if xla:
        stage, stage_cfg = next((s, c) for s, c in cfg.stage_configs() if s.name == plan.stage)
        why = can_compile_here(stage_cfg, plan.layout)
        if why is not None:
            print(f"asyncrl plan: --xla: not compiled here ({why}); figures are analytic", file=sys.stderr)
        else:
            decoder = stage_decoder_config(stage_cfg, backend=backend)
            sft = stage.type == "sft"
            if not programs or "train_step" in programs:
                compiled["trainer"] = compiled_train_step(stage_cfg, decoder, plan.layout, sft)
            if not sft and stage_cfg.engine.remote is None and (not programs or "decode_chunk" in programs):
                compiled["engine"] = compiled_decode_chunk(stage_cfg, decoder, plan.layout)
    if as_json:
        print(json.dumps(device_total_json(plan, device_memory, compiled)))
    else:
        sys.stdout.write(format_plan(plan, device_memory, cfg.model.path, compiled))
    figure = xla_device_total(plan, compiled) or plan.total_bytes
    if device_memory is None or figure <= device_memory:
        return 0
    if not as_json:
        sys.stdout.write(format_suggestions(suggest(config, overrides, device_memory, devices, processes, backend=backend),
                                            device_memory))
    return 1


def plan_auto_choices(cfg: Config, device_memory: Optional[int], devices: int, processes: int,
                      backend: Optional[str], micro_batches: bool = True) -> Config:
    """``cfg`` with ``engine.tensor_parallel: auto`` and ``engine.slots: auto`` chosen for
    ``device_memory`` bytes per device as a run chooses them at start, then (``micro_batches``)
    ``optim.micro_batches: auto`` as the run's trainer chooses it (stderr says what)."""
    if cfg.engine.tensor_parallel == "auto" and cfg.engine.remote is None:
        cfg = _plan_auto_tensor_parallel(cfg, device_memory, devices, processes, backend)
    if cfg.engine.slots == "auto":
        cfg = _plan_auto_slots(cfg, device_memory, devices, processes, backend)
    if cfg.engine.kv_pages == "auto" and device_memory is not None and cfg.engine.remote is None:
        import sys

        try:
            pages = pages_for_budget(cfg, int(AUTO_SLOTS_HEADROOM * device_memory), devices, processes, backend=backend)
        except ConfigError as err:  # the plan below says what does not fit, with the changes that do
            print(f"asyncrl plan: {err.problems[0]}", file=sys.stderr)
        else:
            print(f"asyncrl plan: engine.kv_pages: auto -> {pages} pages per replica ({AUTO_SLOTS_HEADROOM:.0%} of "
                  "--device-memory)", file=sys.stderr)
            cfg = with_pages(cfg, pages)
    if micro_batches:
        cfg = plan_auto_micro_batches(cfg, device_memory, devices, processes, backend)
    return cfg


def plan_auto_micro_batches(cfg: Config, device_memory: Optional[int], devices: int, processes: int,
                            backend: Optional[str]) -> Config:
    """``cfg`` with ``optim.micro_batches: auto`` chosen (:func:`_plan_auto_micro_batches`); ``cfg``
    itself when it is not ``auto`` or already chosen."""
    if cfg.optim.micro_batches != "auto" or cfg.optim.micro_batch_tokens is not None:
        return cfg
    return _plan_auto_micro_batches(cfg, device_memory, devices, processes, backend)


def _plan_auto_micro_batches(cfg: Config, device_memory: Optional[int], devices: int, processes: int,
                             backend: Optional[str]) -> Config:
    """``optim.micro_batches: auto`` chosen for ``device_memory`` as a run chooses it when its trainer is
    built (stderr says the budget; without a device memory the plan takes its least, one row)."""
    import sys

    from asyncrl.plan.formulas import choose_micro_batch_tokens, with_micro_batch_tokens

    if device_memory is None:
        tokens = cfg.longest_row
        print(f"asyncrl plan: optim.micro_batches: auto: planned at its least, one row of {tokens} tokens per device "
              "and micro-batch; give --device-memory to choose it as a run does", file=sys.stderr)
        return with_micro_batch_tokens(cfg, tokens)
    sizes = []
    for stage, flat in cfg.stage_configs():  # the smallest any stage chooses: one budget for the run's config
        sizes.append(choose_micro_batch_tokens(flat, int(AUTO_SLOTS_HEADROOM * device_memory), devices, processes,
                                               backend=backend, sft=stage.type == "sft")[0])
    tokens = min(sizes)
    print(f"asyncrl plan: optim.micro_batches: auto -> optim.micro_batch_tokens={tokens} ({tokens // cfg.longest_row} "
          f"row(s) of {cfg.longest_row} tokens per device and micro-batch, {AUTO_SLOTS_HEADROOM:.0%} of the device's "
          f"memory)", file=sys.stderr)
    return with_micro_batch_tokens(cfg, tokens)


def _plan_auto_tensor_parallel(cfg: Config, device_memory: Optional[int], devices: int, processes: int,
                               backend: Optional[str]) -> Config:
    """``engine.tensor_parallel: auto`` chosen as a run chooses it (stderr says the degree)."""
    import sys

    budget = None if device_memory is None else int(AUTO_SLOTS_HEADROOM * device_memory)
    degree, totals, sequences = choose_tensor_parallel(cfg, budget, devices, processes, backend=backend)
    why = ("the smallest, without a device memory to size it against" if budget is None or device_memory is None else
           f"{sequences[degree]} sequences decoded together at the mean length, the most within "
           f"{AUTO_SLOTS_HEADROOM:.0%} of the device's {device_memory / GIB:.2f} GiB" if sequences else
           f"none fits {AUTO_SLOTS_HEADROOM:.0%} of the device's {device_memory / GIB:.2f} GiB: a run refuses it")
    if len(totals) > 1 or budget is not None:
        print(f"asyncrl plan: engine.tensor_parallel: auto -> {degree} ({why}; degrees "
              f"{', '.join(f'{d}: {t / GIB:.2f} GiB' for d, t in totals.items())})", file=sys.stderr)
    return with_tensor_parallel(cfg, degree)


def _plan_auto_slots(cfg: Config, device_memory: Optional[int], devices: int, processes: int,
                     backend: Optional[str]) -> Config:
    """``engine.slots: auto`` sized for ``device_memory`` as a run would size it (stderr says the
    count); without a device memory the plan shows the fewest slots the run needs."""
    import sys

    if device_memory is None:
        slots = minimum_slots(cfg)
        print(f"asyncrl plan: engine.slots: auto: planned at its minimum, {slots} slots; give --device-memory to size it "
              "as a run does", file=sys.stderr)
    else:
        slots = slots_for_budget(cfg, int(AUTO_SLOTS_HEADROOM * device_memory), devices, processes, backend=backend)
        print(f"asyncrl plan: engine.slots: auto -> {slots} slots ({AUTO_SLOTS_HEADROOM:.0%} of --device-memory)", file=sys.stderr)
    return with_slots(cfg, slots)
