"""The choices a run makes from its devices' memory at start: ``engine.tensor_parallel: auto``
(:func:`resolve_auto_tensor_parallel`), ``engine.slots: auto`` and ``engine.kv_pages: auto`` (the
decode batch and each replica's KV page pool, in the memory the trainer leaves:
:func:`resolve_auto_slots`), the slot count rounded to the engine's replicas
(:func:`round_slots_to_replicas`), ``model.remat_policy: auto`` (:func:`resolve_auto_remat`), and
the trainer's ``optim.micro_batches: auto`` (:func:`resolve_auto_micro_batches`: a token budget per
micro-batch from the memory the engine leaves).

The figures come from ``asyncrl plan``'s accounting (:func:`~asyncrl.plan.formulas.size_engine`), so
a run sized here and the plan printed for it agree:

* ``engine.slots: auto``: the most slots whose plan fits the budget with the pool at the pages
  they hold at the plan's mean length (prompt + half the new tokens), at least
  :func:`~asyncrl.plan.formulas.minimum_slots` (a group's samples decode together; a beam needs
  its width), at most ``rollout.max_concurrent x rollout.group_size`` (more slots than samples in
  flight never fill), a multiple of 8 from 8 up (tile-friendly batch rows on accelerators), of the
  engine replicas;
* ``engine.kv_pages: auto``: then the most pages per replica that fit, at most every slot at its
  longest context (longer sequences than the mean are held by preempting the latest admitted).

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
from asyncrl.plan.formulas import AUTO_SLOTS_HEADROOM as HEADROOM
from asyncrl.plan.formulas import (
    GIB,
    choose_tensor_parallel,
    engine_page_size,
    mean_tokens,
    pages_for_budget,
    plan_layout,
    read_decoder_config,
    slots_for_budget,
    tensor_parallel_degrees,
    with_pages,
    with_slots,
    with_tensor_parallel,
)

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
    """``cfg`` with ``engine.slots: auto`` and ``engine.kv_pages: auto`` replaced by what this
    process's devices hold (:func:`~asyncrl.plan.formulas.size_engine` on the first local device's
    :func:`device_budget`), each logged in one line; ``cfg`` itself when both are numbers."""
    if cfg.engine.slots != "auto" and cfg.engine.kv_pages != "auto":
        return cfg
    import jax

    budget, source = device_budget(jax.local_devices()[0])
    devices, processes, backend = jax.device_count(), jax.process_count(), jax.default_backend()
    if cfg.engine.slots == "auto":
        slots = slots_for_budget(cfg, budget, devices, processes, model_cfg, backend)
        log.info("engine.slots: auto -> %d slots of %d tokens (the plan within %.2f GiB per device: %s)", slots,
                 cfg.engine.kv_capacity, budget / GIB, source)
        cfg = with_slots(cfg, slots)
    if cfg.engine.kv_pages == "auto":
        pages = pages_for_budget(cfg, budget, devices, processes, model_cfg, backend)
        cfg = with_pages(cfg, pages)
        page_size = engine_page_size(cfg, backend)
        log.info("engine.kv_pages: auto -> %d pages of %d tokens per replica (%d sequences at kv_capacity %d, %d at the "
                 "mean length %d; the plan within %.2f GiB per device)", pages, page_size,
                 pages * page_size // cfg.engine.kv_capacity, cfg.engine.kv_capacity, pages * page_size // mean_tokens(cfg),
                 mean_tokens(cfg), budget / GIB)
    return cfg


def resolve_auto_remat(cfg: Config) -> Config:
    """``cfg`` with ``model.remat_policy: auto`` (with ``model.remat``) chosen for this process's
    devices (:func:`~asyncrl.plan.auto.choose_remat_for_run` on the first local device's
    :func:`device_bytes_limit`), logged in one line; ``cfg`` itself otherwise. Runs before the
    model is loaded (the policy is part of the model): the plan reads ``model.path``'s
    ``config.json``, fetched first where it is a hub id."""
    if not (cfg.model.remat and cfg.model.remat_policy == "auto"):
        return cfg
    import jax

    from asyncrl.plan.auto import choose_remat_for_run

    backend = jax.default_backend()
    model_cfg = None
    if backend != "cpu":  # the CPU takes full without a plan: nothing to read
        from asyncrl.model.loading import resolve_model_dir
        from asyncrl.plan.formulas import read_decoder_config

        model_cfg = read_decoder_config(str(resolve_model_dir(cfg.model.path)))
    chosen, line = choose_remat_for_run(cfg, device_bytes_limit(jax.local_devices()[0]), backend, jax.device_count(),
                                        jax.process_count(), model_cfg)
    if line is not None:
        log.info("%s", line)
    return chosen


def resolve_auto_tensor_parallel(cfg: Config, model_cfg: Any = None) -> Config:
    """``cfg`` with ``engine.tensor_parallel: auto`` replaced by the degree (of those
    :func:`~asyncrl.plan.formulas.tensor_parallel_degrees` allows: dividing the model's KV heads and
    the engine's devices) that decodes the most sequences together within this process's
    :func:`device_budget` (:func:`~asyncrl.plan.formulas.choose_tensor_parallel`), logged in one
    line; refused (a ConfigError naming the field) when none fits, as a number that does not fit is
    (naming the degrees that do). ``cfg`` itself with ``engine.remote`` (servers place themselves)."""
    if cfg.engine.remote is not None:
        return cfg
    import jax

    from asyncrl.errors import ConfigError
    from asyncrl.model.loading import resolve_model_dir

    if model_cfg is None:
        model_cfg = read_decoder_config(str(resolve_model_dir(cfg.model.path)))
    devices, processes = jax.device_count(), jax.process_count()
    degrees = tensor_parallel_degrees(cfg, model_cfg, devices, processes)
    if degrees == [1] and cfg.engine.tensor_parallel == "auto":
        log.info("engine.tensor_parallel: auto -> 1 (one engine device)")
        return with_tensor_parallel(cfg, 1)
    budget, source = device_budget(jax.local_devices()[0])
    chosen, totals, sequences = choose_tensor_parallel(cfg, budget, devices, processes, model_cfg, jax.default_backend())
    fitting = [d for d in degrees if totals[d] <= budget]
    fits = ", ".join(map(str, fitting)) if fitting else "none (use more devices or less memory: asyncrl plan)"
    given = cfg.engine.tensor_parallel
    if given != "auto":
        if given in totals and totals[given] > budget:
            raise ConfigError([f"engine.tensor_parallel = {given}: the plan needs {totals[given] / GIB:.2f} GiB per device, "
                               f"over the {budget / GIB:.2f} GiB budget ({source}); degrees that fit: {fits}"])
        return cfg
    if not fitting:
        least = min(totals.values())
        raise ConfigError([f"engine.tensor_parallel: auto: no degree fits: the least engine needs {least / GIB:.2f} GiB per "
                           f"device at best (degrees {', '.join(f'{d}: {t / GIB:.2f}' for d, t in totals.items())} GiB), over "
                           f"the {budget / GIB:.2f} GiB budget ({source}); use more devices, a smaller engine.kv_capacity or "
                           "less trainer memory (asyncrl plan --device-memory lists changes)"])
    replicas = plan_layout(with_tensor_parallel(cfg, chosen), devices, processes).engine_replicas
    log.info("engine.tensor_parallel: auto -> %d (%d replica(s); %d sequences decoded together at the mean length, the "
             "most of the degrees that fit %.2f GiB per device (%s): %s)", chosen, replicas, sequences[chosen], budget / GIB,
             source, ", ".join(f"{d}: {n}" for d, n in sequences.items()))
    return with_tensor_parallel(cfg, chosen)


def round_slots_to_replicas(cfg: Config, replicas: int) -> Config:
    """``cfg`` with ``engine.slots`` rounded up to a multiple of the engine's ``replicas``
    (:func:`~asyncrl.cluster.placement.slots_for_replicas`; each replica decodes an equal share),
    said in one line when it changes, then checked against what must decode together (a group's
    samples, a beam): a :class:`~asyncrl.errors.ConfigError` at start, never a refused request later."""
    from asyncrl.cluster.placement import slots_for_replicas
    from asyncrl.errors import ConfigError

    slots = cfg.engine.slots
    if not isinstance(slots, int):
        return cfg
    rounded = slots_for_replicas(slots, replicas)
    if rounded != slots:
        log.info("engine.slots: %d -> %d (rounded up to a multiple of the engine's %d replicas: each decodes an equal "
                 "share)", slots, rounded, replicas)
        cfg = with_slots(cfg, rounded)
    together = {"rollout.group_size": cfg.rollout.group_size}
    if cfg.eval.decoding.strategy == "beam":
        together["eval.decoding.beam_width"] = cfg.eval.decoding.beam_width
    too_many = [f"{name} ({value})" for name, value in together.items() if value > rounded]
    if too_many:
        raise ConfigError([f"engine.slots: {rounded} on the engine's {replicas} replicas is fewer than {too_many[0]}, "
                           "whose samples decode together; raise engine.slots"])
    return cfg



def resolve_auto_micro_batches(cfg: Config, model_cfg: Any, sft: bool = False) -> Config:
    """``cfg`` (a stage's flat config) with ``optim.micro_batches: auto``'s token budget per
    micro-batch and device chosen for this process's devices (:func:`device_budget` of the first
    local one; :func:`~asyncrl.plan.formulas.choose_micro_batch_tokens`), logged in one line;
    ``cfg`` itself when the micro-batches are not ``auto`` or already chosen. The run calls it before
    it builds the stage's trainer; the engine's ``auto`` slots are planned with the trainer at one row."""
    if cfg.optim.micro_batches != "auto" or cfg.optim.micro_batch_tokens is not None:
        return cfg
    import jax

    from asyncrl.plan.formulas import choose_micro_batch_tokens, with_micro_batch_tokens

    budget, source = device_budget(jax.local_devices()[0])
    tokens, planned, fits = choose_micro_batch_tokens(cfg, budget, jax.device_count(), jax.process_count(), model_cfg,
                                                      jax.default_backend(), sft)
    verdict = "within" if fits else "does NOT fit even at one row:"
    log.info("optim.micro_batches: auto -> optim.micro_batch_tokens=%d (%d row(s) of %d tokens per device and micro-batch; "
             "the plan %.2f GiB per device, %s %.2f GiB: %s)", tokens, tokens // cfg.longest_row, cfg.longest_row,
             planned / GIB, verdict, budget / GIB, source)
    return with_micro_batch_tokens(cfg, tokens)
