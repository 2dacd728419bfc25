"""Publishing across devices: the engine's serving copy of published params, made device to
device (:func:`serving_copy`), on one host or on every host of a multi-process run.

One rule for every placement (docs/scaling.md "Placement"): a published leaf is cast to the
compute dtype (:func:`~asyncrl.model.compute_copy.cast_for_compute`'s rule) and laid out on the
engine's sharding, a group of at most :data:`COPY_GROUP_BYTES` at a time, by one jitted program
on the source's own devices, then moved to the engine's devices when they are others:

* the engine on the trainer's devices (colocated): the program writes the engine's layout
  directly (XLA's all-gathers and slices over the shared devices); nothing is moved after;
* the engine on devices of its own (split): the program lays the group out on a view of the
  trainer's devices shaped like the engine's layout, so every shard the engine needs is held
  whole by some trainer device, and ``jax.device_put`` copies each shard device to device;
* the engine on the trainer's one device: the program casts the leaves the model computes in
  another dtype, the others are served as they are;
* host arrays, or one device's whole arrays for an engine on others: uploaded or sliced straight
  onto the engine's sharding, then cast there;
* the trainer's params spanning several processes (every host runs an engine of its own on its
  own devices): every process runs the same program, a collective over the trainer's devices
  whose output is laid out on every host at once (:func:`_host_staging`: per host, a view of its
  trainer devices shaped like its engine's layout), so each host's engine shards arrive on its
  devices by XLA's all-gathers across hosts, where the engine's layout needs them; each process
  then wraps its own shards as its engine's arrays (its engine on those devices: no copy) or
  copies them to its engine's devices. Every process must call it at the same point (the
  engines' constructors, and each publish's install).

No leaf passes through host memory, and the engine drops its previous copy before it makes the
new one (:class:`~asyncrl.engine.jax_engine.JaxEngine` installs versions that way), so a publish
holds one serving copy plus one group's staging at its peak.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

__all__ = ["COPY_GROUP_BYTES", "PublishGroup", "host_publish_groups", "publish_groups", "serving_copy"]

COPY_GROUP_BYTES = 128 << 20
"""Bytes one copy program handles: what a device holds beyond its own shards while a publish
runs (the model never is whole on every device at once)."""


@dataclasses.dataclass(frozen=True)
class PublishGroup:
    """Leaves laid out by one program of a publish (:func:`publish_groups`)."""

    indices: tuple[int, ...]
    """The leaves' positions in ``jax.tree.leaves`` order."""
    program: Any
    """The jitted cast-and-layout program (takes the leaves as a list)."""


def publish_groups(params: Any, shardings: Any, compute_dtype: Any, formats: Any = None,
                   group_bytes: int = COPY_GROUP_BYTES) -> tuple[list[Any], list[bool], list[PublishGroup]]:
    """How :func:`serving_copy` lays out ``params`` (arrays or ``jax.ShapeDtypeStruct`` with
    shardings, so the plan can compile the same programs): ``(targets, casts, groups)``, per leaf its
    target sharding (or Format) and whether it is cast; and the groups of sharded leaves, each laid
    out by one program on its source devices. Leaves already in their dtype and sharding are in no
    group and not cast; host leaves neither, nor one device's leaves for an engine on other devices
    (they are uploaded or sliced)."""
    from asyncrl.model.compute_copy import cast_flags

    leaves = jax.tree.leaves(params)
    is_target = lambda s: isinstance(s, jax.sharding.Sharding) or type(s).__name__ == "Format"  # noqa: E731
    targets = jax.tree.leaves(shardings if formats is None else formats, is_leaf=is_target)
    if len(targets) != len(leaves):
        raise ValueError(f"serving_copy: {len(leaves)} params but {len(targets)} shardings (different structures)")
    casts = cast_flags(params, compute_dtype)
    dtype = str(np.dtype(compute_dtype))
    sharded: dict[Any, list[int]] = {}  # source device assignment -> leaves laid out by one program there
    for i, (x, target) in enumerate(zip(leaves, targets)):
        source = getattr(x, "sharding", None)
        if source is None or (not casts[i] and source == _sharding(target)):
            continue
        if len(source.device_set) == 1 and _assignment(source) != _assignment(_sharding(target)):
            continue  # one device's whole array for a mesh (a multi-process publish): sliced onto it, then cast
        sharded.setdefault(_assignment(source), []).append(i)
    groups = []
    for indices in sharded.values():
        sizes = [int(np.prod(leaves[i].shape)) * np.dtype(leaves[i].dtype).itemsize for i in indices]
        for group in _byte_groups(indices, sizes, group_bytes):
            sources = tuple(leaves[i].sharding for i in group)
            staging = tuple(_staging(leaves[i].sharding, targets[i]) for i in group)
            flags = tuple(casts[i] for i in group)
            groups.append(PublishGroup(tuple(group), _layout_jit(sources, staging, flags, dtype)))
    return targets, casts, groups


def serving_copy(params: Any, shardings: Any, compute_dtype: Any, formats: Any = None,
                 group_bytes: int = COPY_GROUP_BYTES) -> Any:
    """``params`` (a pytree of arrays: the trainer's, host numpy, or one device's) as the engine
    serves them: each leaf that the model only uses in ``compute_dtype`` cast to it, every leaf
    placed on its sharding in ``shardings`` (same structure), device to device (module docstring),
    and in its memory layout in ``formats`` (``jax.experimental.layout.Format`` leaves, or None:
    row-major; :func:`~asyncrl.engine.layouts.serving_formats`). New arrays throughout, except
    leaves already in their dtype and sharding: those are served as they are, never copied."""
    leaves, treedef = jax.tree.flatten(params)
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
        return jax.tree.unflatten(treedef, _across_hosts(leaves, shardings, compute_dtype, formats, group_bytes))
    targets, casts, groups = publish_groups(params, shardings, compute_dtype, formats, group_bytes)
    dtype = str(np.dtype(compute_dtype))
    grouped = {i for group in groups for i in group.indices}
    out: list[Any] = list(leaves)
    for i, (x, target) in enumerate(zip(leaves, targets)):
        if i in grouped or (not casts[i] and _placed_as(x, target)):
            continue
        placed = jax.device_put(x, target)  # host data or one device: upload or slice onto the target, then cast there
        out[i] = _layout_jit((_sharding(target),), (target,), (True,), dtype)([placed])[0] if casts[i] else placed
    for group in groups:
        staged = group.program([leaves[i] for i in group.indices])
        for i, array in zip(group.indices, staged):
            out[i] = array if _placed_as(array, targets[i]) else jax.device_put(array, targets[i])
        del staged
    return jax.tree.unflatten(treedef, out)


def _sharding(target: Any) -> Any:
    """A target's sharding (a Format carries one)."""
    return getattr(target, "sharding", target) if not isinstance(target, jax.sharding.Sharding) else target


def _placed_as(x: Any, target: Any) -> bool:
    """Whether ``x`` is a device array already on ``target``'s sharding: it is served as it is (in
    its own memory layout: a wanted layout is worth a copy only where a copy is made anyway)."""
    return isinstance(x, jax.Array) and x.sharding == _sharding(target)


def _assignment(sharding: Any) -> tuple:
    """The devices a jitted program over ``sharding`` runs on, in its order."""
    return tuple(sharding._device_assignment)


def _staging(source: Any, target: Any) -> Any:
    """Where the copy program writes a leaf on the source's devices: the target sharding itself
    when it spans the same devices in the same order; else the target's partition spec on a view
    of the source devices shaped like the target's mesh (each shard the target needs is then held
    whole by a source device), or replicated over the source when no such view exists."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if _assignment(source) == _assignment(_sharding(target)):
        return target  # (a Format: written in its layout at once)
    target = _sharding(target)
    devices = list(_assignment(source))  # the program's own order: a jit's shardings must agree on it
    if isinstance(target, NamedSharding):
        split = _spec_axes(target.spec)
        sizes = [target.mesh.shape[a] if a in split else 1 for a in target.mesh.axis_names]
        if len(devices) % math.prod(sizes) == 0:  # the target's split axes, the other devices as replicas of them
            view = Mesh(np.array(devices, dtype=object).reshape([len(devices) // math.prod(sizes), *sizes]),
                        ("replica", *target.mesh.axis_names))
            return NamedSharding(view, target.spec)
    return NamedSharding(Mesh(np.array(devices, dtype=object), ("source",)), PartitionSpec())


def _spec_axes(spec: Any) -> set:
    """The mesh axes a partition spec splits over."""
    axes: set = set()
    for entry in spec:
        if entry is None:
            continue
        axes.update(entry if isinstance(entry, tuple) else (entry,))
    return axes


_LAYOUT_PROGRAMS: dict[Any, Any] = {}


def _layout_jit(sources: tuple, staging: tuple, flags: tuple, dtype: str) -> Any:
    """A jitted program laying a group of leaves (on ``sources``) out on ``staging`` (shardings, or
    Formats with a memory layout), casting those
    ``flags`` marks to ``dtype`` first, on the source layout, so that XLA moves the narrower
    values (one program per group layout: it compiles once per parameter structure)."""
    from jax.sharding import NamedSharding, PartitionSpec

    key = (sources, staging, flags, dtype)
    if key not in _LAYOUT_PROGRAMS:
        def cast(leaves: list) -> list:
            out = []
            for x, source, flag in zip(leaves, sources, flags):
                if flag:
                    x = jax.lax.with_sharding_constraint(x.astype(dtype), source)
                if isinstance(source, NamedSharding):  # gathered whole, then sliced: XLA's own way between unlike splits
                    x = jax.lax.with_sharding_constraint(x, NamedSharding(source.mesh, PartitionSpec()))
                out.append(x)
            return out

        _LAYOUT_PROGRAMS[key] = jax.jit(cast, out_shardings=list(staging))
    return _LAYOUT_PROGRAMS[key]


def _across_hosts(leaves: list, shardings: Any, compute_dtype: Any, formats: Any, group_bytes: int) -> list:
    """:func:`serving_copy` of leaves that span several processes (the trainer's global params)
    onto this process's engine (``shardings``/``formats`` on its own devices): one collective
    program per group, the same on every process (module docstring)."""
    is_target = lambda s: isinstance(s, jax.sharding.Sharding) or type(s).__name__ == "Format"  # noqa: E731
    targets = jax.tree.leaves(shardings if formats is None else formats, is_leaf=is_target)
    if len(targets) != len(leaves):
        raise ValueError(f"serving_copy: {len(leaves)} params but {len(targets)} shardings (different structures)")
    if not all(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
        raise ValueError("serving_copy: some params span several processes and others do not; publish the trainer's "
                         "global params (every leaf on its mesh)")
    out: list[Any] = [None] * len(leaves)
    for group in host_publish_groups(leaves, targets, compute_dtype, group_bytes):
        staged = group.program([leaves[i] for i in group.indices])
        for i, array in zip(group.indices, staged):
            out[i] = _own_shards(array, _host_staging(leaves[i].sharding, _sharding(targets[i]))[1], targets[i])
        del staged
    return out


def host_publish_groups(leaves: list, targets: list, compute_dtype: Any,
                        group_bytes: int = COPY_GROUP_BYTES) -> list[PublishGroup]:
    """The collective programs of a publish to every host's engine (:func:`serving_copy` of params
    spanning processes): ``leaves`` (the trainer's global arrays, or ``jax.ShapeDtypeStruct`` with
    their shardings, so the plan compiles the same programs) in groups of at most ``group_bytes``,
    each laid out on every host at once (:func:`_host_staging` of this process's engine
    ``targets``: shardings or Formats on its devices)."""
    from asyncrl.model.compute_copy import cast_flags

    casts = cast_flags(leaves, compute_dtype)
    dtype = str(np.dtype(compute_dtype))
    by_source: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        by_source.setdefault(_assignment(x.sharding), []).append(i)
    groups = []
    for indices in by_source.values():
        sizes = [int(np.prod(leaves[i].shape)) * np.dtype(leaves[i].dtype).itemsize for i in indices]
        for group in _byte_groups(indices, sizes, group_bytes):
            staging = tuple(_host_staging(leaves[i].sharding, _sharding(targets[i]))[0] for i in group)
            program = _layout_jit(tuple(leaves[i].sharding for i in group), staging, tuple(casts[i] for i in group), dtype)
            groups.append(PublishGroup(tuple(group), program))
    return groups


def _host_staging(source: Any, target: Any) -> tuple[Any, Any]:
    """Where the collective copy writes a leaf: ``(global sharding over the source's devices,
    this process's part of it)``. Per process, its source devices (in the program's order) are
    viewed as the target's mesh with replicas in front, the target's partition spec on them, so
    each process's shards are its engine's shards; every process must have as many source
    devices and the same engine layout (the placement's rule). Where no such view exists, the
    leaf is replicated on every source device."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = list(_assignment(source))
    processes = sorted({d.process_index for d in devices})
    per_process = len(devices) // len(processes)
    contiguous = all(d.process_index == processes[i // per_process] for i, d in enumerate(devices))
    if isinstance(target, NamedSharding) and contiguous:
        split = _spec_axes(target.spec)
        sizes = [target.mesh.shape[a] if a in split else 1 for a in target.mesh.axis_names]
        if per_process % math.prod(sizes) == 0:
            shape = [per_process // math.prod(sizes), *sizes]
            names = ("replica", *target.mesh.axis_names)
            whole = Mesh(np.array(devices, dtype=object).reshape([len(processes), *shape]), ("hosts", *names))
            mine = [d for d in devices if d.process_index == jax.process_index()]
            return NamedSharding(whole, target.spec), NamedSharding(Mesh(np.array(mine, dtype=object).reshape(shape), names),
                                                                    target.spec)
    mine = [d for d in devices if d.process_index == jax.process_index()]
    return (NamedSharding(Mesh(np.array(devices, dtype=object), ("source",)), PartitionSpec()),
            NamedSharding(Mesh(np.array(mine, dtype=object), ("source",)), PartitionSpec()))


def _own_shards(array: Any, local: Any, target: Any) -> Any:
    """This process's shards of a collective copy's output as one array of its own: on its engine's
    ``target`` at once when the shards are where the target wants them (the engine on these
    devices), else on ``local`` and copied onto ``target`` device to device."""
    shards = [shard.data for shard in array.addressable_shards]
    sharding = _sharding(target)
    if sharding.devices_indices_map(array.shape) == local.devices_indices_map(array.shape) and target is sharding:
        return jax.make_array_from_single_device_arrays(array.shape, sharding, shards)
    mine = jax.make_array_from_single_device_arrays(array.shape, local, shards)
    return jax.device_put(mine, target)


def _byte_groups(items: list, sizes: list[int], budget: int) -> list[list]:
    """``items`` in order, cut into runs of at most ``budget`` bytes (an item larger than it alone)."""
    groups: list[list] = []
    size = 0
    for item, nbytes in zip(items, sizes):
        if not groups or (size + nbytes > budget and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups
