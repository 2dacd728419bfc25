"""The trainer's device mesh and JAX's multi-process runtime.

:func:`~asyncrl.cluster.distributed.initialize_distributed` (idempotent) must run before anything else touches JAX
when ``mesh.distributed.enabled``; :func:`build_mesh` then lays ``jax.devices()`` (all
processes' devices, process-major) out as a ``(data, fsdp, tensor)`` mesh. Batch rows
are split over ``data`` x ``fsdp`` (:func:`row_sharding`), so with devices in process
order every process owns a contiguous block of rows: the rows of its own groups.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncrl.errors import TrainerError

__all__ = ["build_mesh", "mesh_shape", "row_shards", "local_row_shards", "row_sharding"]

ROW_AXES = ("data", "fsdp")
"""Mesh axes batch rows are split over."""


def mesh_shape(mesh_cfg: Any, num_devices: int) -> tuple[int, int, int]:
    """``(data, fsdp, tensor)`` with ``data: null`` resolved; errors name the ``mesh.*`` keys."""
    fsdp, tensor = mesh_cfg.fsdp, mesh_cfg.tensor
    if mesh_cfg.data is None:
        if num_devices % (fsdp * tensor):
            raise TrainerError(
                f"mesh.fsdp x mesh.tensor = {fsdp} x {tensor} does not divide the {num_devices} devices; "
                "set mesh.data, mesh.fsdp and mesh.tensor so that their product divides the device count"
            )
        data = num_devices // (fsdp * tensor)
    else:
        data = mesh_cfg.data
    if data * fsdp * tensor > num_devices:
        raise TrainerError(
            f"mesh.data x mesh.fsdp x mesh.tensor = {data} x {fsdp} x {tensor} = {data * fsdp * tensor} "
            f"needs more than the {num_devices} devices jax.devices() has"
        )
    return data, fsdp, tensor


def build_mesh(mesh_cfg: Any, devices: Any = None):
    """A ``jax.sharding.Mesh`` with axes ``("data", "fsdp", "tensor")``.

    Uses the first ``data * fsdp * tensor`` devices in (process, id) order; with several
    processes the mesh must cover every device.
    """
    import jax
    from jax.sharding import Mesh

    from asyncrl.model.sharding import MESH_AXES

    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    shape = mesh_shape(mesh_cfg, len(devices))
    size = int(np.prod(shape))
    if jax.process_count() > 1 and size != len(devices):
        raise TrainerError(
            f"mesh: {shape} uses {size} of the {len(devices)} devices of {jax.process_count()} processes; "
            "a multi-process mesh must use them all"
        )
    return Mesh(np.array(devices[:size], dtype=object).reshape(shape), MESH_AXES)


def row_shards(mesh: Any) -> int:
    """How many ways batch rows are split (``data * fsdp``)."""
    return int(np.prod([mesh.shape[a] for a in ROW_AXES]))


def local_row_shards(mesh: Any) -> int:
    """Row shards whose devices belong to this process."""
    import jax

    devs = mesh.devices.reshape(row_shards(mesh), -1)  # [row shard, tensor]
    return int(sum(any(d.process_index == jax.process_index() for d in row) for row in devs))


def row_sharding(mesh: Any, ndim: int):
    """``NamedSharding`` of an array whose first dimension is batch rows (split over data x fsdp)."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(ROW_AXES, *([None] * (ndim - 1))))
