"""One process of a multi-process publish for tests/engine/test_remote_publish.py: ``python -m
tests.publish_worker WEIGHTS_DIR REPORT`` with the ``JAX_*`` variables set. The built-in ``tiny``
model's weights, sharded over an fsdp mesh of every process's devices, scaled by 1.5 (so they
differ from the model a server starts with), published as version 1 by
:class:`~asyncrl.engine.publish.WeightsWriter`, then laid out as each process's in-process
engine's serving copy on that process's own devices (2-way tensor parallel), a few tensors per
collective program (:func:`~asyncrl.engine.device_copy.serving_copy` across hosts); the process's
figures go to ``REPORT`` as JSON."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from asyncrl.cluster.distributed import initialize_distributed
from asyncrl.config.sections import DistributedConfig


def main(weights_dir: str, report: str) -> None:
    initialize_distributed(SimpleNamespace(distributed=DistributedConfig()))
    import jax
    import numpy as np

    from asyncrl.cluster.mesh import build_mesh
    from asyncrl.engine.device_copy import serving_copy
    from asyncrl.engine.publish import WeightsWriter
    from asyncrl.model import load_model
    from asyncrl.model.sharding import MESH_AXES, param_shardings, shard_params

    loaded = load_model("tiny", with_tokenizer=False)
    _, params = loaded.split()
    mesh = build_mesh(SimpleNamespace(data=1, fsdp=jax.device_count(), tensor=1))
    reference = params
    params = shard_params(loaded.config, jax.tree.map(lambda x: x * 1.5, params), mesh)
    assert not any(x.is_fully_addressable for x in jax.tree.leaves(params)), "the params must span processes"
    writer = WeightsWriter(loaded.config, weights_dir, keep=2, group_bytes=64 << 10)  # several gather programs
    path = writer.write(params, 1)
    # Each process's in-process engine's serving copy on its own devices (1 replica x 2-way tensor
    # parallel), made by collectives over the trainer's mesh, a few tensors per program.
    local = jax.sharding.Mesh(np.array(jax.local_devices()).reshape(1, 1, -1), MESH_AXES)
    shardings = param_shardings(loaded.config, params, local)
    copies = jax.tree.leaves(serving_copy(params, shardings, "float32", group_bytes=64 << 10))
    expected = jax.tree.leaves(jax.tree.map(lambda x: np.asarray(x) * np.float32(1.5), reference))
    copied = all(c.is_fully_addressable and c.sharding == t and np.array_equal(np.asarray(c), e)
                 for c, t, e in zip(copies, jax.tree.leaves(shardings), expected))
    with open(report, "w") as f:
        json.dump({"process": jax.process_index(), "path": str(path), "bytes": writer.last_bytes,
                   "engine_copy_equal": copied}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
