"""Compile the engine's decode chunk for a compile-only H100 and count its kernels (run in a process
of its own: XLA reads ``XLA_FLAGS``, the dump folder and the command-buffer flags, once).

    JAX_PLATFORMS=cpu python -m tests.engine.h100_decode_structure LAYERS INNER

prints a JSON line: ``kernels_per_iteration`` (the kernels of the decode loop's body, recorded as
one command buffer), ``nested_loops`` (``while`` loops inside the body: each would be a host round
trip per its own iteration), ``condition_kernels``, ``outside_kernels`` (before the loop). The model
is Qwen2.5-0.5B's shape (configs/models/qwen2.5-0.5b) with ``LAYERS`` layers, bf16 compute, 128
slots, a 1024-slot cache, 16-step chunks (the 0.5B recipe's engine) and ``INNER`` steps per loop
iteration, Gumbel sampling (the GPU's). Used by test_decode_compiled_h100.py when the CUDA plugin is
importable (the aot venv, see /work/shared/README.md)."""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile

H100 = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def count(thunks: str) -> dict:
    """Kernels of a ``*thunk_sequence_after_thunk_passes.txt`` by where they run."""
    found = {"kernels_per_iteration": 0, "condition_kernels": 0, "outside_kernels": 0, "nested_loops": 0, "loops": 0}
    section = "outside"
    for line in thunks.splitlines():
        text = line.strip()
        if text.startswith("condition:"):
            section = "condition" if section == "outside" else section
            continue
        if text.startswith("body:"):
            section = "body"
            continue
        m = re.match(r"\d+: (k\w+)", text)
        if not m or m.group(1) in ("kCommandBuffer", "kSequential", "kCopy"):
            continue
        if m.group(1) == "kWhile":
            found["nested_loops" if section == "body" else "loops"] += 1
            continue
        key = {"body": "kernels_per_iteration", "condition": "condition_kernels"}[section] if section != "outside" else "outside_kernels"
        found[key] += 1
    return found


def main(layers: int, inner: int) -> dict:
    dump = tempfile.mkdtemp(prefix="asyncrl-h100-")
    from asyncrl.engine.platform import xla_flags_for

    os.environ["XLA_FLAGS"] = " ".join([f"--xla_dump_to={dump}", *xla_flags_for("gpu")])
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import topologies

    from asyncrl.engine.jax_programs import decode_chunk_jit, idle_controls, init_slot_state
    from asyncrl.model.compute_copy import compute_copy
    from asyncrl.model.transformer import Decoder, split_params
    from asyncrl.run.plan import read_decoder_config

    device = topologies.get_topology_desc(platform="cuda", target_config=H100, topology="1x1x1").devices[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    cfg = read_decoder_config("configs/models/qwen2.5-0.5b/config.json").replace(
        num_layers=layers, compute_dtype="bfloat16", param_dtype="float32")
    graphdef, params = split_params(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=on_device), tree)
    serving = abstract(jax.eval_shape(lambda p: compute_copy(p, cfg.compute_dtype), params))
    state = abstract(jax.eval_shape(lambda: init_slot_state(cfg, 128, 1024)))
    controls = abstract(jax.tree.map(np.asarray, idle_controls(128, 8)))
    decode_chunk_jit.lower(graphdef, serving, state, controls, 16, False, None, sampler="gumbel", inner=inner).compile()
    (thunks,) = glob.glob(f"{dump}/*decode_chunk*thunk_sequence_after_thunk_passes.txt")
    with open(thunks) as f:
        return count(f.read())


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
