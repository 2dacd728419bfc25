"""``engine.slots: auto``: as many decode slots as the device's memory holds after the trainer;
and ``model.remat_policy: auto`` chosen from the same memory (:func:`resolve_auto_remat`).

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
from typing import Any, Optional

from asyncrl.config import Config
from asyncrl.run.plan import AUTO_SLOTS_HEADROOM as HEADROOM
from asyncrl.run.plan import GIB, slots_for_budget, with_slots

log = logging.getLogger("asyncrl.run")


def device_bytes_limit(device: Any) -> Optional[int]:
    """What JAX may allocate on ``device`` (``memory_stats()['bytes_limit']``), or None where the
    backend reports none (the CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without the call raise
        stats = None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def device_budget(device: Any) -> tuple[int, str]:
    """``(bytes, where from)``: :data:`HEADROOM` of what JAX may allocate on ``device``, or of the
    host's physical memory where the backend reports none (the CPU)."""
    limit = device_bytes_limit(device)
    if limit is not None:
        return int(HEADROOM * limit), f"{HEADROOM:.0%} of the device's bytes_limit"
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


def resolve_auto_remat(cfg: Config) -> Config:
    """``cfg`` with ``model.remat_policy: auto`` (with ``model.remat``) chosen for this process's
    devices (:func:`~asyncrl.run.plan_auto.choose_remat_for_run` on the first local device's
    :func:`device_bytes_limit`), logged in one line; ``cfg`` itself otherwise. Runs before the
    model is loaded (the policy is part of the model): the plan reads ``model.path``'s
    ``config.json``, fetched first where it is a hub id."""
    if not (cfg.model.remat and cfg.model.remat_policy == "auto"):
        return cfg
    import jax

    from asyncrl.run.plan_auto import choose_remat_for_run

    backend = jax.default_backend()
    model_cfg = None
    if backend != "cpu":  # the CPU takes full without a plan: nothing to read
        from asyncrl.model.loading import resolve_model_dir
        from asyncrl.run.plan_formulas import read_decoder_config

        model_cfg = read_decoder_config(str(resolve_model_dir(cfg.model.path)))
    chosen, line = choose_remat_for_run(cfg, device_bytes_limit(jax.local_devices()[0]), backend, jax.device_count(),
                                        jax.process_count(), model_cfg)
    if line is not None:
        log.info("%s", line)
    return chosen
