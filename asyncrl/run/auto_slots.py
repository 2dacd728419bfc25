"""``engine.slots: auto``: as many decode slots as the device's memory holds after the trainer.

The count comes from ``asyncrl plan``'s accounting (:func:`~asyncrl.run.plan.plan_config`), so a
run sized here and the plan printed for it agree. A plan's total is affine in the slots each
engine replica holds (the KV cache and one decode step's logits per slot; every other line is
fixed), so two plans give the fixed bytes and the bytes per slot, and the count is the largest
that fits the budget, within:

* at least :func:`minimum_slots` (a group's samples decode together; a beam needs its width);
* at most ``rollout.max_concurrent x rollout.group_size`` (more slots than samples in flight
  never fill);
* a multiple of 8 from 8 up (tile-friendly batch rows on accelerators), of the engine replicas.

The budget is the device's memory as JAX's allocator reports it (``memory_stats()['bytes_limit']``:
what XLA may allocate, after ``XLA_PYTHON_CLIENT_MEM_FRACTION``) or, on a CPU, which reports none,
the host's physical memory; times :data:`HEADROOM` (the plan is an analytic model: XLA's
temporaries and fragmentation are not in it). ``kv_capacity`` is kept as configured: it is the
longest request the run serves (several turns of an agent, eval's lengths), not a memory choice.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from asyncrl.config import Config
from asyncrl.errors import ConfigError

log = logging.getLogger("asyncrl.run")

HEADROOM = 0.9
"""Share of the device's memory the plan may fill."""
ROUND_TO = 8


def minimum_slots(cfg: Config) -> int:
    """The fewest slots the run can work with: a group (``rollout.group_size``), and eval's beam width."""
    beam = cfg.eval.decoding.beam_width if cfg.eval.decoding.strategy == "beam" else 1
    return max(cfg.rollout.group_size, beam)


def with_slots(cfg: Config, slots: int) -> Config:
    """``cfg`` with ``engine.slots = slots`` (stages inherit the top-level engine section)."""
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"slots": slots})})


def slots_for_budget(cfg: Config, budget: int, devices: int = 1, processes: int = 1, model_cfg: Any = None,
                     backend: Optional[str] = None) -> int:
    """The most slots (see the module docstring) whose plan of ``cfg`` fits ``budget`` bytes per
    device; a ConfigError naming ``engine.slots`` when even :func:`minimum_slots` does not."""
    from asyncrl.run.plan import GIB, plan_config, plan_layout

    replicas = max(plan_layout(cfg, devices, processes).engine_replicas, 1)
    total = lambda per_replica: plan_config(with_slots(cfg, per_replica * replicas), devices, processes, model_cfg,
                                            backend).total_bytes
    one, two = total(1), total(2)
    per_slot, fixed = two - one, 2 * one - two
    least = minimum_slots(cfg)
    most = max(cfg.rollout.max_concurrent * cfg.rollout.group_size, least)
    fitting = (budget - fixed) // per_slot * replicas if per_slot > 0 else most
    slots = min(fitting, most)
    if slots >= ROUND_TO * replicas:
        slots -= slots % (ROUND_TO * replicas)
    if slots < least:
        need = fixed + -(-least // replicas) * per_slot
        raise ConfigError([f"engine.slots: auto: the {least} slots the run needs (rollout.group_size, eval's beam width) "
                           f"take {need / GIB:.2f} GiB per device with the trainer, over the {budget / GIB:.2f} GiB "
                           "budget; lower engine.kv_capacity or the trainer's memory (asyncrl plan --device-memory "
                           "lists changes), or give a number"])
    return int(slots)


def device_budget(device: Any) -> tuple[int, str]:
    """``(bytes, where from)``: :data:`HEADROOM` of what JAX may allocate on ``device``, or of the
    host's physical memory where the backend reports none (the CPU)."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # backends without the call raise: the host's memory then
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(HEADROOM * stats["bytes_limit"]), f"{HEADROOM:.0%} of the device's bytes_limit"
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(HEADROOM * physical), f"{HEADROOM:.0%} of the host's physical memory"


def resolve_auto_slots(cfg: Config, model_cfg: Any) -> Config:
    """``cfg`` with ``engine.slots: auto`` replaced by the count this process's devices hold
    (:func:`slots_for_budget` on the first local device's :func:`device_budget`), logged;
    ``cfg`` itself when the slots are a number."""
    if cfg.engine.slots != "auto":
        return cfg
    import jax

    from asyncrl.run.plan import GIB

    budget, source = device_budget(jax.local_devices()[0])
    slots = slots_for_budget(cfg, budget, jax.device_count(), jax.process_count(), model_cfg, jax.default_backend())
    log.info("engine.slots: auto -> %d slots of %d tokens (the plan within %.2f GiB per device: %s)", slots,
             cfg.engine.kv_capacity, budget / GIB, source)
    return with_slots(cfg, slots)
