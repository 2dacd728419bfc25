"""Resharding on resume: a checkpoint written by N processes on one mesh is read by M processes
or onto another mesh shape with the same bits (params and an AdamW state sharded like the
trainer's: fsdp over the first axis), each process reading only its own shards; and no pickled
object appears anywhere in what Orbax writes.

Each writer and reader is a subprocess with forced CPU devices (two processes on loopback with
gloo stand in for two hosts)."""

from __future__ import annotations

import json
import pickletools
import textwrap
from pathlib import Path

import pytest

from tests.helpers import run_jax_processes

# argv: MODE(save|check) OUT FSDP; env: JAX_NUM_PROCESSES / JAX_PROCESS_ID / JAX_COORDINATOR_ADDRESS for 2 processes.
CHILD = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    mode, out, fsdp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from asyncrl.config import load_config
    from asyncrl.cluster.distributed import initialize_distributed
    initialize_distributed(load_config(data={}).mesh)
    import jax, jax.numpy as jnp, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from asyncrl.checkpoint import store as ck
    from asyncrl.checkpoint.load import latest_checkpoint, load_checkpoint
    from asyncrl import pytree

    devices = np.array(jax.devices()[:fsdp])
    mesh = jax.sharding.Mesh(devices, ("fsdp",))
    def place(array, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
    rng = np.random.default_rng(0)
    host = {"embed": rng.standard_normal((16, 8)).astype(np.float32),
            "layers": [{"w": rng.standard_normal((8, 8)).astype(np.float32)},
                       {"w": rng.standard_normal((8, 8)).astype(jnp.bfloat16)}],
            "norm": rng.standard_normal(8).astype(np.float32)}
    spec = lambda a: P("fsdp") if a.ndim == 2 else P()
    params = jax.tree.map(lambda a: place(a, spec(a)), host)
    tx = optax.adamw(1e-3)
    opt_state = jax.tree.map(lambda a: place(np.asarray(a), spec(a)) if a.ndim == 2 else place(np.asarray(a), P()),
                             jax.tree.map(np.asarray, tx.init(host)))
    # distinct non-zero moments
    opt_state = jax.tree.map(lambda a: a + 0.5 if a.ndim == 2 else a, opt_state)
    if mode == "save":
        ck.save_checkpoint(out, 3, arrays={"params": params, "opt_state": opt_state}, state={"version": 3},
                           config_yaml="{}\\n")
    else:
        loaded = load_checkpoint(latest_checkpoint(out))
        got = {name: loaded.tree(name, template) for name, template in (("params", params), ("opt_state", opt_state))}
        for name, template in (("params", params), ("opt_state", opt_state)):
            for (key, a), (_, b) in zip(sorted(pytree.keyed_leaves(got[name]).items()),
                                        sorted(pytree.keyed_leaves(template).items())):
                assert a.sharding == b.sharding, (key, a.sharding, b.sharding)
                for sa, sb in zip(a.addressable_shards, b.addressable_shards):  # only this process's shards
                    assert np.asarray(sa.data).tobytes() == np.asarray(sb.data).tobytes(), key
        print("EQUAL", json.dumps({"processes": loaded.processes, "process": jax.process_index()}), flush=True)
    """
)


def _run(mode: str, out: Path, processes: int, devices: int, fsdp: int) -> list[str]:
    """The child as ``processes`` JAX processes of ``devices`` CPU devices each; their outputs."""
    codes, logs = run_jax_processes(out / f"logs-{mode}-{processes}", lambda pid: ["-c", CHILD, mode, str(out), str(fsdp)],
                                    processes, timeout=300, devices=devices)
    assert codes == [0] * processes, logs
    return logs


def _equal(outputs: list[str]) -> list[dict]:
    return [json.loads(line.split("EQUAL ", 1)[1]) for out in outputs for line in out.splitlines() if "EQUAL " in line]


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
@pytest.mark.timeout(600)
def test_two_processes_to_one_and_one_to_two_restore_the_same_bits(tmp_path):
    """2 processes x 2 devices (fsdp 4 across both) -> 1 process with fsdp 2; and 1 process
    (fsdp 2) -> 2 processes x 2 devices (fsdp 4): params and AdamW moments equal bitwise, on the
    reader's shardings."""
    two = tmp_path / "two"
    _run("save", two, processes=2, devices=2, fsdp=4)
    hashes = sorted(p.name for p in (two / "checkpoints" / "step_00000003" / "hashes").iterdir())
    assert hashes == ["process_0.json", "process_1.json"]  # each process hashed the files it wrote
    assert _equal(_run("check", two, processes=1, devices=2, fsdp=2)) == [{"processes": 2, "process": 0}]

    one = tmp_path / "one"
    _run("save", one, processes=1, devices=2, fsdp=2)
    assert _equal(_run("check", one, processes=2, devices=2, fsdp=4)) == [
        {"processes": 1, "process": 0}, {"processes": 1, "process": 1}]


@pytest.mark.timeout(300)
def test_fsdp_2_to_4_on_eight_devices(tmp_path):
    _run("save", tmp_path, processes=1, devices=8, fsdp=2)
    assert _equal(_run("check", tmp_path, processes=1, devices=8, fsdp=4)) == [{"processes": 1, "process": 0}]


def _pickle_opcodes(data: bytes) -> bool:
    """Whether ``data`` is a pickle stream (protocol 2+ starts with PROTO; any stream ends with STOP)."""
    if not data.startswith(b"\x80") or not data.rstrip().endswith(b"."):
        return False
    try:
        for _ in pickletools.genops(data):
            pass
    except Exception:
        return False
    return True


def test_no_file_of_a_checkpoint_is_a_pickle(tmp_path):
    """Every file Orbax and asyncrl write into a checkpoint (trees of numpy and jax arrays,
    scalars, an optax state) is JSON, OCDBT/zarr chunks or npz without object arrays: none
    parses as a pickle stream, and npz members load with allow_pickle=False."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    from asyncrl.checkpoint import store as ck

    params = {"w": jnp.ones((4, 4)), "b": np.arange(3, dtype=np.int64), "s": np.float32(2.0)}
    path = ck.save_checkpoint(tmp_path, 1, arrays={"params": params, "opt_state": optax.adamw(1e-3).init(params)},
                              state={"version": 1}, config_yaml="{}\n",
                              rollout_state={"meta": {"format": 1}, "arrays": {"g0_t0_x": np.arange(4)}})
    files = [f for f in path.rglob("*") if f.is_file()]
    assert any("ocdbt" in str(f) for f in files) and (path / "rollout.npz") in files
    for file in files:
        data = file.read_bytes()
        assert not _pickle_opcodes(data), file
        assert b"cnumpy" not in data and b"c__builtin__" not in data and b"\x80\x04\x95" not in data, file
    with np.load(path / "rollout.npz", allow_pickle=False) as npz:
        assert [npz[name].dtype for name in npz.files] == [np.dtype(np.int64)]
    # and the manifest lists every file but itself and the per-process hash lists
    listed = set(json.loads((path / "MANIFEST.json").read_text())["files"])
    on_disk = {f.relative_to(path).as_posix() for f in files}
    assert on_disk - listed == {"MANIFEST.json", "hashes/process_0.json"}
