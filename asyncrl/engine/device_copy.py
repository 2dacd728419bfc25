"""Publishing across devices: the engine's serving copy of published params, made device to
device (:func:`serving_copy`), and the whole-array copies a multi-process run hands its engine
(:func:`local_copy`).

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
* host arrays, or one device's whole arrays for an engine on others (a multi-process run's
  :func:`local_copy`): uploaded or sliced straight onto the engine's sharding, then cast there.

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

__all__ = ["COPY_GROUP_BYTES", "PublishGroup", "local_copy", "publish_groups", "serving_copy"]

COPY_GROUP_BYTES = 128 << 20
"""Bytes one copy program handles: what a device holds beyond its own shards while a publish or
:func:`local_copy` runs (the model never is whole on every device at once)."""


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
        raise ValueError("JaxEngine: params span other processes' devices; every process calls "
                         "asyncrl.engine.device_copy.local_copy on them and process 0 hands its copies to the engine")
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


def local_copy(arrays: list, group_bytes: int = COPY_GROUP_BYTES) -> list:
    """Each array (on a ``NamedSharding``) as one single-device array holding all of it, on one of
    this process's devices: replicated over its own mesh by a jitted identity (an all-gather on
    device), a group of at most ``group_bytes`` at a time, then one replica of each kept (the other
    replicas are freed before the next group). With several processes every process must call it
    (collectives over the params' mesh); process 0 then hands the copies to its engine."""
    by_mesh: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        by_mesh.setdefault(x.sharding.mesh, []).append(i)
    out = list(arrays)
    for mesh, indices in by_mesh.items():
        for group in _byte_groups(indices, [arrays[i].nbytes for i in indices], group_bytes):
            replicated = _replicate_jit(mesh)([arrays[i] for i in group])
            for i, full in zip(group, replicated):
                out[i] = full.addressable_shards[0].data
            del replicated
    return out


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


_REPLICATORS: dict[Any, Any] = {}


def _replicate_jit(mesh: Any) -> Any:
    """A jitted identity whose outputs are replicated over ``mesh`` (one per mesh, so the
    program compiles once per parameter structure)."""
    if mesh not in _REPLICATORS:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        _REPLICATORS[mesh] = jax.jit(_identity, out_shardings=replicated)
    return _REPLICATORS[mesh]


def _identity(tree: Any) -> Any:
    return tree
