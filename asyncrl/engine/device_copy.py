"""Publishing across devices: the engine's copy of published params, moved device to device
(:func:`move_params`), and the whole-array copies a multi-process run hands its engine
(:func:`local_copy`)."""

from __future__ import annotations

from typing import Any

import jax


def move_params(params: Any, shardings: Any) -> Any:
    """``params`` (a pytree of arrays, e.g. the trainer's, on any devices) put on ``shardings``
    (the engine's), device to device.

    ``jax.device_put`` copies a shard device to device only when the source array already
    holds a shard with the exact index range the target device needs (or lives on one
    device, which it slices there); otherwise (JAX 0.10's ``shard_sharded_device_array_slow_path``)
    it goes through ``np.asarray`` of the whole array on the host. So a leaf whose source
    shards do not cover the target's (the trainer's fsdp split vs the engine's tensor split)
    is first replicated over its own devices by a jitted identity (XLA's all-gather, on
    device), and the engine's shards are sliced from one replica on device. Host values
    (numpy) are simply ``device_put``.
    """
    leaves, treedef = jax.tree.flatten(params)
    targets = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    assert len(targets) == len(leaves), "shardings do not match the params' structure"
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
        raise ValueError("JaxEngine: params span other processes' devices; every process calls "
                         "asyncrl.engine.device_copy.local_copy on them and process 0 hands its copies to the engine")
    gather = [i for i, (x, s) in enumerate(zip(leaves, targets)) if not _copies_directly(x, s)]
    for i, whole in zip(gather, local_copy([leaves[i] for i in gather])):
        leaves[i] = whole
    moved = jax.device_put(leaves, targets)
    return jax.tree.unflatten(treedef, moved)


COPY_GROUP_BYTES = 128 << 20
"""Bytes :func:`local_copy` replicates per program: what a device holds beyond its own shards while
it runs (the model never is whole on every device at once)."""


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


def _copies_directly(x: Any, target: Any) -> bool:
    """True when ``device_put(x, target)`` needs no host round trip: ``x`` is not a device
    array (host data is uploaded anyway), lives on one device, or holds every index range
    ``target`` asks for; also when it cannot be regathered here (not a ``NamedSharding``)."""
    if not isinstance(x, jax.Array) or len(x.sharding.device_set) == 1:
        return True
    if not isinstance(x.sharding, jax.sharding.NamedSharding):
        return True

    def ranges(sharding: Any) -> set:
        return {tuple(sl.indices(n) for sl, n in zip(idx, x.shape))
                for idx in sharding.addressable_devices_indices_map(x.shape).values()}

    return ranges(target) <= ranges(x.sharding)


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
