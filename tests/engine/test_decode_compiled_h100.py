"""The decode chunk compiled for a compile-only H100, run only where the CUDA
plugin is importable (the aot venv: ``JAX_PLATFORMS=cpu ~/.cache/asyncrl-aot-cuda/bin/python -m pytest
tests/engine/test_decode_compiled_h100.py``; the CI venv skips it). Qwen2.5-0.5B's layers (3 of
them), 128 slots, a 1024-slot cache, 16-step chunks and the GPU's 8 steps per loop iteration, read
by ``asyncrl plan --target``'s own parser (asyncrl/plan/thunk_sequence.py): at most 10 kernels per
layer and at most 15 outside the layers per step, the loop's body one command buffer of 8 steps (one host
round trip per 8 tokens), and the page pool written in place (temporaries below its bytes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.engine.platform import GPU_INNER_STEPS
from asyncrl.plan.targets import plugin_installed

pytestmark = [pytest.mark.skipif(not plugin_installed("gpu"), reason="needs the CUDA plugin (compile-only H100)"),
              pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def _structure(layers: int, inner: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "tests.engine.h100_decode_structure", str(layers), str(inner)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_decode_step_kernels_and_host_round_trips_on_h100():
    inner = GPU_INNER_STEPS
    s = _structure(3, inner)
    print(f"h100 decode step: {s['kernels_per_layer']} kernels per layer + {s['kernels_outside_layers']} outside; "
          f"{s['steps_per_iteration']} steps per loop iteration, {s['host_round_trips_per_token']:g} host round trips per token")
    assert s["steps_per_iteration"] == inner >= 8 and s["body_in_command_buffer"], s  # one launch per 8 tokens
    assert s["host_round_trips_per_token"] <= 1 / 8, s
    assert s["kernels_per_layer"] <= 10, s  # (16 without the decode attention kernel)
    assert s["kernels_outside_layers"] <= 15, s
    assert s["temp_bytes"] < s["pool_bytes"], s  # the pool is written in place: no second copy among the temporaries


def test_engine_mesh_runs_the_kernel_per_device_on_gpus():
    """On an engine mesh (KV heads split over two H100s) the decode kernel, which XLA does not
    partition, runs per device in a shard_map: the kernel is in the program and nothing gathers the
    cache around it; ``model.attention: xla`` takes the einsum path (partitioned, no all-gather either)."""
    code = """
import functools, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from asyncrl.model.attention import _decode_kernel, _scatter_and_attend, attention_kernel, compiled_for
from asyncrl.plan.targets import get_target, target_devices
devices = target_devices(get_target("h100"), 2)
mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 1, 2), ("data", "fsdp", "tensor"))
spec = lambda *s: NamedSharding(mesh, P(*s))
A = lambda shape, s=(), dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=spec(*s))
heads, cache = (None, None, "tensor", None), (None, "tensor", None, None)
args = (A((16, 1, 14, 64), heads), A((16, 1, 2, 64), heads), A((16, 1, 2, 64), heads), A((16, 2, 128, 64), cache),
        A((16, 2, 128, 64), cache), A((16,), dt=jnp.int32), A((16, 1, 128), dt=jnp.bool_))
reference = functools.partial(_scatter_and_attend, scale=0.125)
for choice in ("auto", "xla"):
    def step(*a):
        with compiled_for(mesh=mesh):
            if attention_kernel(choice, jnp.bfloat16, 64, decode=True) == "pallas":
                return _decode_kernel(*a[:6], a[6], 0.125, reference)
            return reference(*a)
    text = jax.jit(step).lower(*args).compile().as_text()
    print(choice, "__gpu$xla.gpu.triton" in text, text.count("all-gather"))
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    kernel, einsum = out.stdout.strip().splitlines()[-2:]
    assert kernel.split() == ["auto", "True", "0"]  # the kernel, per device: no all-gather
    assert einsum.split() == ["xla", "False", "0"]  # no kernel, no all-gather
