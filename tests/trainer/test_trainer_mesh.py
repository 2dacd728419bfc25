"""The trainer on a device mesh and across processes equals the single-device step.

Each test runs in spawned subprocesses: 8 forced CPU devices (``XLA_FLAGS`` only there),
or two JAX processes on loopback with gloo collectives.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from asyncrl.cluster.launch import free_port
from tests.helpers import REPO_ROOT, run_python, subprocess_env

MESH_CODE = """
import numpy as np, jax
from asyncrl.trainer import Trainer
from tests.trainer_fixtures import SGD, make_batch, tiny_model, trainer_config
assert jax.device_count() == 8
graphdef, params = tiny_model(layers=1)  # 4 heads / 2 KV heads: tensor=2 splits both
batch = make_batch(rows=32, padding_rows=4, seed=11)

def run(mesh, micro):
    cfg = trainer_config(optim=dict(SGD, micro_batches=micro), algo={"mini_batches": 2},
                         mesh=dict(zip(("data", "fsdp", "tensor"), mesh)))
    trainer = Trainer(cfg, graphdef, params)
    metrics = trainer.step(batch)
    return jax.tree.map(np.asarray, trainer.params), metrics, trainer

single, m1, _ = run((1, 1, 1), 1)
moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(params)))
assert moved > 1e-3, moved
for mesh, micro in [((4, 2, 1), 2), ((1, 4, 2), 1)]:
    out, m, trainer = run(mesh, micro)
    q = trainer.params["layers"][0]["self_attn"]["q_proj"]["kernel"]
    assert len(q.sharding.device_set) == 8 and not q.sharding.is_fully_replicated, q.sharding
    diff = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(out)))
    assert diff < 1e-5, (mesh, diff)
    assert abs(m["loss/total"] - m1["loss/total"]) < 1e-5, (mesh, m["loss/total"], m1["loss/total"])
    print(mesh, "max param diff", diff)
"""


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_mesh_steps_equal_single_device_step():
    """One step (2 SGD updates) on data x fsdp (with 2 micro-batches) and on fsdp x tensor
    equals the single-device step: same mini-batch split, same sums."""
    proc = run_python(MESH_CODE, env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    assert proc.stdout.count("max param diff") == 2


PROCESS_CODE = """
import sys
import numpy as np, jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
from tests.trainer_fixtures import SGD, make_batch, slice_rows, tiny_model, trainer_config
cfg = trainer_config(optim=SGD, mesh={"distributed": {"enabled": True, "coordinator_address": f"127.0.0.1:{port}",
                                                       "num_processes": 2, "process_id": pid}},
                     rollout={"pack": sys.argv[4:] == ["pack"]})  # tests/trainer/test_packing.py passes "pack"
from asyncrl.cluster.distributed import initialize_distributed
from asyncrl.trainer import Trainer
initialize_distributed(cfg.mesh)
assert jax.process_count() == 2 and jax.device_count() == 2
graphdef, params = tiny_model(layers=1)  # one layer: half the compile time
trainer = Trainer(cfg, graphdef, params)
full = make_batch(rows=16, padding_rows=0, seed=12)
# Process p feeds its own whole groups (2 groups of 4 rows each), group indices local.
mine = slice_rows(full, 8 * pid, 8 * pid + 8, group_offset=2 * pid)
metrics = trainer.step(mine)
state = trainer.state_dict()  # gathers to the host
if pid == 0:
    leaves = jax.tree.leaves(state["params"])
    np.savez(out, loss=metrics["loss/total"], *leaves)
print("done", pid)
"""



@pytest.mark.slow  # 15 s cold: two JAX processes with gloo; the 8-device mesh test stays in the default selection
@pytest.mark.timeout(150)
def test_two_processes_compute_the_single_process_step(tmp_path, extra_args=()):
    out = tmp_path / "two.npz"
    port = str(free_port())
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(PROCESS_CODE), port, str(pid), str(out), *extra_args],
                         env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for pid in range(2)
    ]
    # The single-process reference, here, while the two processes run.
    from asyncrl.trainer import Trainer
    from tests.trainer_fixtures import SGD, make_batch, tiny_model, trainer_config

    graphdef, params = tiny_model(layers=1)
    trainer = Trainer(trainer_config(optim=SGD), graphdef, params)
    metrics = trainer.step(make_batch(rows=16, padding_rows=0, seed=12))
    reference = jax.tree.leaves(jax.tree.map(np.asarray, trainer.params))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log
    two = np.load(out)
    assert abs(float(two["loss"]) - metrics["loss/total"]) < 1e-5
    diffs = [float(np.abs(two[f"arr_{i}"] - ref).max()) for i, ref in enumerate(reference)]
    assert max(diffs) < 1e-5, max(diffs)
    moved = max(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(reference, jax.tree.leaves(params)))
    assert moved > 1e-3
