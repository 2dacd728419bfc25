"""Compile the engine's decode chunk for a compile-only H100 and read its launch structure (run in a
process of its own: XLA reads ``XLA_FLAGS``, the dump folder and the command-buffer flags, once).

    JAX_PLATFORMS=cpu python -m tests.engine.h100_decode_structure LAYERS INNER

prints :class:`asyncrl.plan.thunk_sequence.DecodeStructure` as a JSON line (kernels per step, per
layer and outside the layers, steps per loop iteration, whether the body and the loop are inside
command buffers, host round trips per token) with the program's temporaries and the page pool's
bytes (``temp_bytes``, ``pool_bytes``). The model is Qwen2.5-0.5B's shape
(configs/models/qwen2.5-0.5b) with ``LAYERS`` layers, bf16 compute, 128 slots, a 1024-slot cache,
16-step chunks (the 0.5B recipe's engine) and ``INNER`` steps per loop iteration, Gumbel sampling
(the GPU's), on the ``h100`` target of ``asyncrl plan --target`` (asyncrl/plan/targets.py). Used by
test_decode_compiled_h100.py when the CUDA plugin is importable (the aot venv, tests/README.md)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys
import tempfile


def main(layers: int, inner: int) -> dict:
    dump = tempfile.mkdtemp(prefix="asyncrl-h100-")
    from asyncrl.engine.platform import xla_flags_for

    os.environ["XLA_FLAGS"] = " ".join([f"--xla_dump_to={dump}", *xla_flags_for("gpu")])
    import jax
    import numpy as np
    from flax import nnx

    from asyncrl.engine.jax_programs import decode_chunk_jit, idle_controls, init_pool
    from asyncrl.model.compute_copy import compute_copy
    from asyncrl.model.transformer import Decoder, split_params
    from asyncrl.plan.formulas import read_decoder_config
    from asyncrl.plan.targets import get_target, target_devices
    from asyncrl.plan.thunk_sequence import decode_structure

    (device,) = target_devices(get_target("h100"), 1)
    on_device = jax.sharding.SingleDeviceSharding(device)
    cfg = read_decoder_config("configs/models/qwen2.5-0.5b/config.json").replace(
        num_layers=layers, compute_dtype="bfloat16", param_dtype="float32")
    graphdef, params = split_params(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=on_device), tree)
    serving = abstract(jax.eval_shape(lambda p: compute_copy(p, cfg.compute_dtype), params))
    pages = 128 * 1024 // 16  # every slot at its longest context, in pages of 16 (the GPU's)
    pool = abstract(jax.eval_shape(lambda: init_pool(cfg, pages, 16)))
    controls = abstract(jax.tree.map(np.asarray, idle_controls(128, 8, 1024 // 16, pages)))
    key = abstract(np.zeros(2, np.uint32))
    compiled = decode_chunk_jit.lower(graphdef, serving, pool, controls, None, key, 16, False, None, sampler="gumbel",
                                      inner=inner).compile()
    memory = compiled.memory_analysis()
    assert memory is not None, "no memory analysis for the h100 target"
    (thunks,) = glob.glob(f"{dump}/*decode_chunk*thunk_sequence_after_thunk_passes.txt")
    with open(thunks) as f:
        structure = decode_structure(f.read(), layers)
    assert structure is not None, f"{thunks}: no while loop"
    pool_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(pool))
    return {**dataclasses.asdict(structure), "temp_bytes": memory.temp_size_in_bytes, "pool_bytes": pool_bytes}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
