"""A resume reads the trainer's optimizer state onto a described template (shapes, dtypes and
shardings only): the process never holds a freshly initialised optimizer state beside the
restored one. And the restore's reader places each shard on its device as a buffer the device
owns, with the template's shardings."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from asyncrl.checkpoint import store as ck
from asyncrl.checkpoint.load import load_checkpoint
from asyncrl.config import Config, dump_config
from asyncrl.errors import TrainerError
from asyncrl.trainer import Trainer
from tests.trainer_fixtures import make_batch, trainer_config


def test_a_resumed_trainer_reads_its_optimizer_state_onto_a_described_template(tiny_one_layer, tmp_path, monkeypatch):
    import asyncrl.trainer.trainer as trainer_module
    from asyncrl.run.loop import _load_trainer_state

    graphdef, params = tiny_one_layer
    cfg = trainer_config()
    saved = Trainer(cfg, graphdef, params)
    saved.step(make_batch(seed=6))
    path = ck.save_checkpoint(tmp_path, 1, arrays={"params": saved.params, "opt_state": saved.opt_state},
                              state={"trainer": saved.counters()}, config_yaml=dump_config(Config()), keep=1)

    def no_init(*args, **kwargs):
        raise AssertionError("a resumed trainer initialised an optimizer state it is about to replace")

    monkeypatch.setattr(trainer_module, "init_opt_state", no_init)
    resumed = Trainer(cfg, graphdef, params, state_from_checkpoint=True)
    described = jax.tree.leaves(resumed.opt_state)
    assert described and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in described)  # nothing allocated
    live = jax.tree.leaves(saved.opt_state)
    assert jax.tree.structure(resumed.opt_state) == jax.tree.structure(saved.opt_state)
    assert [(d.shape, d.dtype) for d in described] == [(x.shape, x.dtype) for x in live]
    assert all(d.sharding.is_equivalent_to(x.sharding, x.ndim) for d, x in zip(described, live))
    with pytest.raises(TrainerError, match="load_state_dict"):
        resumed.step(make_batch(seed=7))

    _load_trainer_state(resumed, load_checkpoint(path))
    restored = jax.tree.leaves(resumed.opt_state)
    assert all(isinstance(leaf, jax.Array) for leaf in restored)
    for got, want in zip(restored, live):
        assert got.sharding.is_equivalent_to(want.sharding, want.ndim)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (resumed.version, resumed.update_count) == (saved.version, saved.update_count)
    for got, want in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(saved.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_restored_shards_are_buffers_of_their_own_on_the_templates_shardings(tmp_path, monkeypatch):
    """Each shard is copied onto its device (an alias of the host read buffer could not be donated
    by the next train step), one read per distinct shard, on the template's sharding."""
    import asyncrl.checkpoint.arrays as checkpoint_arrays

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    value = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), sharding)
    path = ck.save_checkpoint(tmp_path, 1, arrays={"params": {"w": value, "host": np.arange(3)}}, state={},
                              config_yaml=dump_config(Config()), keep=1)
    puts = []
    device_put = jax.device_put

    def recording_put(x, *args, **kwargs):
        puts.append((type(x), kwargs.get("may_alias")))
        return device_put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", recording_put)
    template = {"w": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=sharding), "host": np.zeros(3, np.int64)}
    out = checkpoint_arrays.restore(path / "arrays", "params", template)
    assert puts == [(np.ndarray, False)]  # one shard, copied from its host buffer; the numpy leaf stays on the host
    assert out["w"].sharding == sharding and isinstance(out["host"], np.ndarray)
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(value))
    np.testing.assert_array_equal(out["host"], np.arange(3))


def test_asking_whether_a_checkpoint_holds_a_tree_reads_nothing(tmp_path):
    """``name in checkpoint.arrays`` (which :meth:`Checkpoint.tree` asks first) once read the whole
    tree to the host and kept it: a restore held the whole tree beside this process's shards."""
    path = ck.save_checkpoint(tmp_path, 1, arrays={"params": {"w": np.ones((4, 4), np.float32)}}, state={},
                              config_yaml=dump_config(Config()), keep=1)
    loaded = load_checkpoint(path)
    assert "params" in loaded.arrays and "opt_state" not in loaded.arrays
    loaded.tree("params", {"w": np.zeros((4, 4), np.float32)})
    assert loaded.arrays._read == {}  # nothing read to the host, nothing kept
    assert loaded.arrays["params"]["w"].sum() == 16  # indexing still reads the tree whole


def test_the_shard_reader_and_orbaxs_reader_agree_bit_for_bit(tmp_path):
    """The tensorstore reader reads Orbax's files as Orbax does (Orbax's reader stays for any
    layout other than its OCDBT trees), bfloat16 and integer leaves included."""
    import asyncrl.checkpoint.arrays as checkpoint_arrays

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", None))
    rng = np.random.default_rng(0)
    tree = {"w": jax.device_put(rng.normal(size=(6, 5)).astype(jnp_bfloat16()), sharding),
            "count": jax.device_put(np.int32(7), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())),
            "host": rng.normal(size=(3,)).astype(np.float32)}
    path = ck.save_checkpoint(tmp_path, 1, arrays={"params": tree}, state={}, config_yaml=dump_config(Config()), keep=1)
    template = {"w": jax.ShapeDtypeStruct((6, 5), tree["w"].dtype, sharding=sharding), "count": tree["count"],
                "host": np.zeros(3, np.float32)}
    assert checkpoint_arrays._layout(path / "arrays" / "params") is not None  # read by the shard reader
    mine = checkpoint_arrays.restore(path / "arrays", "params", template)
    orbax = checkpoint_arrays._restore_with_orbax(path / "arrays", "params", template)
    for key in tree:
        a, b = np.asarray(mine[key]), np.asarray(orbax[key])
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes() == np.asarray(tree[key]).tobytes(), key


def jnp_bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16
