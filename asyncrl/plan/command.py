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
    minimum_slots,
    plan_config,
    plan_layout,
    planned_slots,
    read_decoder_config,
    slots_for_budget,
    stage_decoder_config,
    with_slots,
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
    micro = cfg.optim.micro_batches
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


def format_plan(plan: MemoryPlan, device_memory: Optional[int] = None, model_name: str = "",
                xla: Optional[dict[str, CompiledMemory]] = None) -> str:
    """The table ``asyncrl plan`` prints: GiB per device (MiB when the total is under 1 GiB);
    ``xla``: the compiled programs' figures (``trainer``, ``engine``) shown beside the totals."""
    lay = plan.layout
    unit, scale = ("GiB", GIB) if max(plan.total_bytes, device_memory or 0) >= GIB else ("MiB", 2**20)
    fmt = lambda n: f"{n / scale:.2f}"  # noqa: E731
    head = (f"asyncrl plan: {model_name} ({plan.params / 1e6:.1f}M parameters), stage {plan.stage!r}, {lay.devices} "
            f"device(s) in {lay.processes} process(es); trainer mesh (data, fsdp, tensor) = {lay.mesh}, engine on "
            f"{lay.engine_devices} device(s)" + (" shared with the trainer" if lay.colocated else " of its own"))
    width = max(len(line.name) for line in plan.lines) + 2
    col = f"{unit}/device"
    rows = [head, "", f"{'part':<8} {'item':<{width}} {col:>10}  note"]
    for line in plan.lines:
        rows.append(f"{line.part:<8} {line.name:<{width}} {fmt(line.bytes):>10}  {line.note}")
    rows.append("")
    for part in ("trainer", "engine"):
        compiled = (xla or {}).get(part)
        note = f"XLA, compiled here: {fmt(compiled.peak)} (arguments + outputs - donated + temporaries)" if compiled else ""
        rows.append(f"{part:<8} {'total':<{width}} {fmt(plan.part_bytes(part)):>10}  {note}")
    where = "trainer + engine on one device" if lay.colocated else "the larger of trainer and engine devices"
    rows.append(f"{'device':<8} {'total':<{width}} {fmt(plan.total_bytes):>10}  {where}")
    if device_memory is not None:
        verdict = "fits" if plan.total_bytes <= device_memory else "does NOT fit"
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
             device_memory_gb: Optional[float] = None, backend: Optional[str] = None, xla: bool = False) -> int:
    """``asyncrl plan``: print the table (and, when it does not fit ``device_memory_gb``, the
    suggestions); 0 when it fits or no device memory is given, 1 when it does not."""
    import sys

    if device_memory_gb is not None and not device_memory_gb > 0:
        raise ConfigError(f"--device-memory {device_memory_gb}: give the memory of one device in GB (GiB), > 0")
    cfg = load_config(config, overrides)
    device_memory = None if device_memory_gb is None else int(device_memory_gb * GIB)
    if cfg.engine.slots == "auto":
        cfg = _plan_auto_slots(cfg, device_memory, devices, processes, backend)
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
            compiled["trainer"] = compiled_train_step(stage_cfg, decoder, plan.layout, sft)
            if not sft and stage_cfg.engine.remote is None:
                compiled["engine"] = compiled_decode_chunk(stage_cfg, decoder)
    sys.stdout.write(format_plan(plan, device_memory, cfg.model.path, compiled))
    if device_memory is None or plan.total_bytes <= device_memory:
        return 0
    sys.stdout.write(format_suggestions(suggest(config, overrides, device_memory, devices, processes, backend=backend),
                                        device_memory))
    return 1


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
