"""``engine.slots: auto``: as many decode slots as the device's memory holds after the trainer.

The count comes from ``asyncrl plan``'s accounting (:func:`~asyncrl.run.plan_formulas.slots_for_budget`), so a
run sized here and the plan printed for it agree. A plan's total is affine in the slots each
engine replica holds (the KV cache and one decode step's logits per slot; every other line is
fixed), so two plans give the fixed bytes and the bytes per slot, and the count is the largest
that fits the budget, within:

* at least :func:`~asyncrl.run.plan_formulas.minimum_slots` (a group's samples decode together; a beam needs its width);
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
from typing import Any

from asyncrl.config import Config
from asyncrl.run.plan import AUTO_SLOTS_HEADROOM as HEADROOM
from asyncrl.run.plan import GIB, slots_for_budget, with_slots

log = logging.getLogger("asyncrl.run")


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

    budget, source = device_budget(jax.local_devices()[0])
    slots = slots_for_budget(cfg, budget, jax.device_count(), jax.process_count(), model_cfg, jax.default_backend())
    log.info("engine.slots: auto -> %d slots of %d tokens (the plan within %.2f GiB per device: %s)", slots,
             cfg.engine.kv_capacity, budget / GIB, source)
    return with_slots(cfg, slots)
