"""Where the trainer and the in-process engine run (docs/scaling.md "Placement").

:func:`resolve_placement` turns the ``placement`` section, ``mesh`` and
``engine.tensor_parallel`` into a :class:`Placement` once ``jax.devices()`` is known (at
start, before anything is built), with one error line naming the field for each thing that
cannot work: overlapping ranges, ranges past the device count, a trainer mesh that does not
fit its devices, an engine device count the tensor-parallel degree does not divide, hosts
with unequal device counts in a multi-process run. :func:`~asyncrl.model.sharding.check_tensor_parallel` adds the
model's part (whole KV heads per device) once the model config is known.

The trainer mesh is ``build_mesh(cfg.mesh, devices=placement.trainer_devices)``; the engine's
own mesh is :func:`engine_mesh` (axes ``data``, ``fsdp``, ``tensor`` of shape
``(replicas, 1, tensor_parallel)``: the trainer's axis names, so the model's partition rules
apply unchanged and the slots split over ``data`` like the trainer's batch rows). Every placement
of more than one device gives the engine that mesh, on the trainer's devices (colocated, the
default) or on its own; only a single device serves the trainer's arrays as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from asyncrl.config.sections import parse_device_range
from asyncrl.errors import ConfigError, TrainerError

__all__ = ["Placement", "device_range", "engine_mesh", "resolve_placement", "slots_for_replicas"]


@dataclass(frozen=True)
class Placement:
    """The devices of the trainer and of the in-process engine (each in (process, id) order)."""

    trainer_devices: tuple[Any, ...]
    """The trainer mesh's devices: ``build_mesh(cfg.mesh, devices=trainer_devices)`` (one process:
    exactly ``data x fsdp x tensor`` of them)."""
    engine_devices: tuple[Any, ...]
    """This process's engine's devices (``replicas x tensor_parallel`` of them; every process of a
    multi-process run has an engine of its own on as many)."""
    tensor_parallel: int
    """``engine.tensor_parallel``: devices one engine replica splits the model over."""
    colocated: bool
    """Every engine device is also a trainer device (they share them; no speed-up from asynchrony)."""
    shares_trainer_arrays: bool
    """One device for both, in one process: the engine serves the trainer's own arrays (no mesh
    of its own; a publish copies nothing but the compute-dtype cast). With more devices the engine
    always has its own mesh (:func:`engine_mesh`), colocated or not."""

    @property
    def engine_replicas(self) -> int:
        """Engine replicas (each decodes its own share of the slots)."""
        return len(self.engine_devices) // self.tensor_parallel


def resolve_placement(cfg: Any, devices: Optional[Sequence[Any]] = None, process_count: Optional[int] = None,
                      process_index: Optional[int] = None) -> Placement:
    """The :class:`Placement` of ``cfg`` on ``devices`` (default ``jax.devices()``) for process
    ``process_index`` (default ``jax.process_index()``; with ``devices`` given, 0).

    One process: ranges over ``devices``. Several: each range over every process's own devices
    (the same on every host), the trainer's over all hosts, the engine this process's part of its
    range (one engine per process). Raises :class:`~asyncrl.errors.ConfigError` with one line
    naming the field at fault. ``process_count`` defaults to ``jax.process_count()``.
    """
    import jax

    from asyncrl.cluster.mesh import mesh_shape

    given = devices is not None
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))
    processes = jax.process_count() if process_count is None else process_count
    index = process_index if process_index is not None else 0 if given else jax.process_index()
    placement = cfg.placement
    hosts = _host_devices(devices, processes)
    holder = "each process has (jax.local_devices())" if processes > 1 else "jax.devices() has"
    trainer = [d for local in hosts for d in _device_range(placement.trainer, local, "placement.trainer", holder)]
    try:
        shape = mesh_shape(cfg.mesh, len(trainer))
    except TrainerError as err:
        where = f"placement.trainer = {placement.trainer!r} ({len(trainer)} devices)" if placement.trainer else "placement.trainer"
        raise ConfigError(f"{where}: {err}") from None
    size = math.prod(shape)
    if (placement.trainer is not None or processes > 1) and size != len(trainer):
        where = (f"placement.trainer = {placement.trainer!r} has {len(trainer)} devices" if placement.trainer else
                 f"the {processes} processes have {len(trainer)} devices")
        raise ConfigError(
            f"{where} but mesh.data x mesh.fsdp x mesh.tensor = {' x '.join(map(str, shape))} uses {size}; make the mesh "
            "fill its devices (mesh.data: null does)"
        )
    trainer = trainer[:size]
    engine = _engine_devices(placement, hosts[index], [d for d in trainer if d.process_index == index], holder)
    # auto is chosen from the devices' memory (the degree that decodes the most sequences together:
    # the run and asyncrl plan resolve it first, asyncrl.run.auto_slots); without a memory budget, 1.
    tp = 1 if cfg.engine.tensor_parallel == "auto" else cfg.engine.tensor_parallel
    if len(engine) % tp:
        where = f"placement.engine = {placement.engine!r}" if placement.engine else "placement.engine (colocated)"
        per = " of each process" if processes > 1 else ""
        raise ConfigError(
            f"engine.tensor_parallel = {tp} does not divide the {len(engine)} devices{per} of {where}; give the engine a "
            "multiple of engine.tensor_parallel devices"
        )
    colocated = set(engine) <= set(trainer)
    shares = processes == 1 and len(engine) == 1 and tuple(engine) == tuple(trainer)
    return Placement(tuple(trainer), tuple(engine), tp, colocated, shares)


def _host_devices(devices: Sequence[Any], processes: int) -> list[list[Any]]:
    """``devices`` per process (in (process, id) order); one process: all of them. Every process
    of a multi-process run must have as many devices as the others (one range fits them all)."""
    if processes == 1:
        return [list(devices)]
    hosts: list[list[Any]] = [[] for _ in range(processes)]
    for device in devices:
        hosts[device.process_index].append(device)
    counts = {len(h) for h in hosts}
    if len(counts) != 1 or 0 in counts:
        seen = ", ".join(f"process {p}: {len(h)}" for p, h in enumerate(hosts))
        raise ConfigError(f"placement: every process needs the same number of devices ({seen}); give each host as many "
                          "(XLA_FLAGS / CUDA_VISIBLE_DEVICES)")
    return hosts


def device_range(text: Optional[str], field: str, devices: Optional[Sequence[Any]] = None) -> list[Any]:
    """The devices a ``"start:stop"`` range (:class:`~asyncrl.config.sections.PlacementConfig`'s
    syntax) selects from ``devices`` (default ``jax.devices()`` in (process, id) order); null
    selects all. A bad range is a ConfigError naming ``field``."""
    import jax

    if text is not None:
        try:
            parse_device_range(text)
        except ValueError as err:
            raise ConfigError(f"{field}: {err}") from None
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))
    return _device_range(text, devices, field)


def _device_range(text: Optional[str], devices: Sequence[Any], field: str, holder: str = "jax.devices() has") -> list[Any]:
    """The devices ``text`` (``"start:stop"``) selects; null selects all. ``holder``: what ``devices``
    are, for the error (``jax.devices() has``, or each process's own)."""
    count = len(devices)
    if text is None:
        return list(devices)
    start, stop, fractional = parse_device_range(text)
    if fractional:
        lo, hi = start * count, stop * count
        if not (lo.is_integer() and hi.is_integer()):
            raise ConfigError(
                f"{field} = {text!r}: on {count} devices the bounds fall at {lo:g}:{hi:g}, not on whole devices; "
                f"give fractions that are multiples of 1/{count}, or device indices"
            )
        start, stop = lo, hi
    if stop > count:
        raise ConfigError(
            f"{field} = {text!r} needs devices up to index {int(stop) - 1}, but {holder} {count} "
            f"(indices 0..{count - 1}); shrink the range or run on more devices"
        )
    return list(devices[int(start):int(stop)])


def _engine_devices(placement: Any, local: Sequence[Any], trainer: list[Any], holder: str) -> list[Any]:
    """This process's engine devices: its range of ``local`` (this process's devices; one
    process: all), or by default its share of the trainer's (``trainer``: the trainer's devices
    of this process); the range must not partly overlap the trainer's."""
    if placement.engine is None:
        return list(trainer)
    engine = _device_range(placement.engine, local, "placement.engine", holder)
    shared = set(engine) & set(trainer)
    if shared and not set(engine) <= set(trainer):
        raise ConfigError(
            f"placement.engine = {placement.engine!r} overlaps placement.trainer = {placement.trainer or 'all devices'!r} "
            f"in {len(shared)} of its {len(engine)} devices; use disjoint ranges (e.g. trainer '0:4', engine '4:8') "
            "or an engine range inside the trainer's (shared devices)"
        )
    return engine


def slots_for_replicas(slots: int, replicas: int) -> int:
    """``slots`` rounded up to a multiple of ``replicas`` (each engine replica decodes an equal share):
    never fewer slots than configured, so a group that fits the configured slots fits the engine."""
    return max(-(-slots // replicas), 1) * replicas


def engine_mesh(placement: Placement) -> Any:
    """The engine's own mesh: axes ``("data", "fsdp", "tensor")`` of shape ``(replicas, 1,
    tensor_parallel)`` over ``placement.engine_devices`` (a replica's tensor-parallel
    devices are neighbours in device order)."""
    import numpy as np
    from jax.sharding import Mesh

    from asyncrl.model.sharding import MESH_AXES

    shape = (placement.engine_replicas, 1, placement.tensor_parallel)
    return Mesh(np.array(placement.engine_devices, dtype=object).reshape(shape), MESH_AXES)
