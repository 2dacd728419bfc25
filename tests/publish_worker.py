"""One process of a multi-process publish for tests/engine/test_remote_publish.py: ``python -m
tests.publish_worker WEIGHTS_DIR REPORT`` with the ``JAX_*`` variables set. The built-in ``tiny``
model's weights, sharded over an fsdp mesh of every process's devices, scaled by 1.5 (so they
differ from the model a server starts with), published as version 1 by
:class:`~asyncrl.engine.publish.WeightsWriter`, then copied whole onto one device of each process
a few tensors at a time (:func:`~asyncrl.engine.jax_engine.local_copy`, the in-process engine's
path); the process's figures go to ``REPORT`` as JSON."""

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
    from asyncrl.engine.device_copy import local_copy
    from asyncrl.engine.publish import WeightsWriter
    from asyncrl.model import load_model
    from asyncrl.model.sharding import shard_params

    loaded = load_model("tiny", with_tokenizer=False)
    _, params = loaded.split()
    mesh = build_mesh(SimpleNamespace(data=1, fsdp=jax.device_count(), tensor=1))
    reference = params
    params = shard_params(loaded.config, jax.tree.map(lambda x: x * 1.5, params), mesh)
    assert not any(x.is_fully_addressable for x in jax.tree.leaves(params)), "the params must span processes"
    writer = WeightsWriter(loaded.config, weights_dir, keep=2, group_bytes=64 << 10)  # several gather programs
    path = writer.write(params, 1)
    # The in-process engine's copy (asyncrl.run.multihost.Hosts.engine_copy), a few tensors per program.
    leaves = jax.tree.leaves(params)
    copies = local_copy(leaves, group_bytes=64 << 10)
    expected = jax.tree.leaves(jax.tree.map(lambda x: np.asarray(x) * np.float32(1.5), reference))
    copied = all(len(c.sharding.device_set) == 1 and np.array_equal(np.asarray(c), e) for c, e in zip(copies, expected))
    with open(report, "w") as f:
        json.dump({"process": jax.process_index(), "path": str(path), "bytes": writer.last_bytes,
                   "engine_copy_equal": copied}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
