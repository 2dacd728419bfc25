"""Checkpoint store: exact round trips (bf16, ints, optax/NNX trees, executor state), keep-last-N,
incomplete and corrupt directories skipped with the reason logged, no unpickling on the load
path, resume compatibility of configs, and the ``--resume`` flag."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import re
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import yaml

from asyncrl import pytree
from asyncrl.checkpoint import load as checkpoint_load
from asyncrl.checkpoint import store as ck
from asyncrl.checkpoint.layout import checkpoint_due
from asyncrl.checkpoint.load import latest_checkpoint, load_checkpoint, resume_checkpoint
from asyncrl.checkpoint.schema import check_resume_compatible, saved_config
from asyncrl.config import Config, dump_config, load_config
from asyncrl.errors import CheckpointError, ConfigError

BF16 = ml_dtypes.bfloat16
CONFIG_YAML = dump_config(Config())


def numpy_tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 3.1415926, -65504.0], np.float32)
    return {
        "embed": np.concatenate([rng.standard_normal(24).astype(np.float32), special]).astype(BF16).reshape(4, 8),
        "layers": [
            {"w": rng.standard_normal((3, 5)).astype(np.float32), "steps": np.arange(7, dtype=np.int64) - 3},
            {"w": rng.standard_normal((5, 3)).astype(np.float32)[:, ::2], "mask": rng.random(6) > 0.5},  # strided view
        ],
        "count": np.int32(17),
        "scalar0d": np.array(-5, np.int32),
        "small": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "half": rng.standard_normal(4).astype(np.float16),
    }


def assert_same_bits(a, b, where=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
    assert a.tobytes() == np.ascontiguousarray(b).tobytes(), where  # bitwise: NaN, -0.0 and bf16 included


def save(out, step, arrays=None, state=None, **kw):
    arrays = numpy_tree(step) if arrays is None else arrays
    return ck.save_checkpoint(out, step, arrays={"params": arrays}, state=state or {"version": step},
                              config_yaml=kw.pop("config_yaml", CONFIG_YAML), **kw)


def steps_on_disk(out) -> list[int]:
    return [s for s, _ in ck._step_dirs(ck.checkpoints_root(out))]


# --------------------------------------------------------------------------- round trips


def test_numpy_tree_round_trips_bitwise_as_flat_arrays_and_into_a_template(tmp_path):
    tree = numpy_tree()
    path = save(tmp_path, 12, tree, state={"version": 12, "trainer": {"skipped": 0}, "stage": 0, "data": [1, 2]})
    assert path == tmp_path / "checkpoints" / "step_00000012"
    assert sorted(p.name for p in path.iterdir()) == ["MANIFEST.json", "arrays", "config.yaml", "hashes", "state.json"]

    loaded = load_checkpoint(path)
    assert loaded.step == 12 and loaded.state == {"version": 12, "trainer": {"skipped": 0}, "stage": 0, "data": [1, 2]}
    assert loaded.config_yaml == CONFIG_YAML and loaded.config() == Config() and loaded.rollout_state is None
    flat = loaded.arrays["params"]  # plain arrays, keyed by path
    assert set(flat) == {"embed", "layers/0/w", "layers/0/steps", "layers/1/w", "layers/1/mask", "count", "scalar0d",
                         "small", "half"}
    assert_same_bits(flat["embed"], tree["embed"], "embed")
    assert_same_bits(flat["layers/1/w"], tree["layers"][1]["w"], "strided view")
    assert_same_bits(flat["layers/0/steps"], tree["layers"][0]["steps"])
    assert_same_bits(flat["scalar0d"], tree["scalar0d"])

    exact = loaded.tree("params", tree)
    assert isinstance(exact["layers"], list) and isinstance(exact["count"], np.int32)
    for (key, a), (_, b) in zip(sorted(pytree.flatten(exact).items()), sorted(pytree.flatten(tree).items())):
        assert_same_bits(a, b, key)


def test_arrays_are_written_uncompressed_so_a_save_holds_no_second_copy(tmp_path):
    """asyncrl.checkpoint.arrays.HANDLER_OPTIONS: no zstd (compressed chunks are a second copy
    of the state in host memory until written): 4 MiB of zeros take at least 4 MiB on disk, and
    a checkpoint written with compression (as before) still reads back."""
    import asyncrl.checkpoint.arrays as checkpoint_arrays

    zeros = {"w": np.zeros((1024, 1024), np.float32)}
    path = save(tmp_path / "plain", 1, zeros)
    written = sum(f.stat().st_size for f in (path / "arrays").rglob("*") if f.is_file())
    assert written >= zeros["w"].nbytes, written
    original = dict(checkpoint_arrays.HANDLER_OPTIONS)
    try:
        checkpoint_arrays.HANDLER_OPTIONS["use_compression"] = True
        compressed = save(tmp_path / "zstd", 1, zeros)
    finally:
        checkpoint_arrays.HANDLER_OPTIONS.clear()
        checkpoint_arrays.HANDLER_OPTIONS.update(original)
    assert sum(f.stat().st_size for f in (compressed / "arrays").rglob("*") if f.is_file()) < written // 4
    assert_same_bits(load_checkpoint(compressed).tree("params", zeros)["w"], zeros["w"], "w")


def test_jax_optax_and_nnx_trees_round_trip_into_their_templates(tmp_path):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    # built directly (an nnx.Linear would spend seconds compiling its random init)
    nnx_state = nnx.State({"kernel": nnx.Param(jnp.full((3, 4), 0.3)), "bias": nnx.Param(jnp.zeros(4))})
    params = {
        "embed": (jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7).astype(jnp.bfloat16),
        "layers": [{"w": jnp.full((2, 2), 0.1), "b": jnp.zeros(2)}, {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}],
        "linear": nnx_state,
        "lr_scale": 0.5,
    }
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = tx.init({"embed": params["embed"], "w": params["layers"][0]["w"]})
    # distinct non-zero values in every leaf (put on device, nothing to compile)
    leaves, treedef = jax.tree.flatten(opt_state)
    opt_state = jax.tree.unflatten(treedef, [jnp.asarray(np.full(x.shape, 0.1 * (i + 1), x.dtype)) for i, x in enumerate(leaves)])
    path = ck.save_checkpoint(tmp_path, 3, arrays={"params": params, "opt_state": opt_state}, state={"version": 3},
                              config_yaml=CONFIG_YAML, keep=2)
    loaded = load_checkpoint(path)
    for name, original in (("params", params), ("opt_state", opt_state)):
        restored = loaded.tree(name, original)
        assert jax.tree.structure(restored) == jax.tree.structure(original), name
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(original)):
            assert type(a) is type(b)
            if isinstance(b, jax.Array):
                assert a.sharding == b.sharding
            assert_same_bits(a, b, name)
    assert isinstance(loaded.tree("params", params)["linear"], nnx.State)
    # abstract templates work too (no concrete arrays needed to restore)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), opt_state)
    restored = loaded.tree("opt_state", abstract)
    assert jax.tree.structure(restored) == jax.tree.structure(opt_state)
    # keys follow jax's paths: chain index / namedtuple field / dict key
    assert_same_bits(loaded.arrays["opt_state"]["1/0/mu/embed"], opt_state[1][0].mu["embed"])


def test_template_mismatches_are_all_reported(tmp_path):
    path = save(tmp_path, 1, {"a": np.zeros(3, np.float32), "b": np.zeros(2, np.int32), "extra": np.zeros(1)})
    template = {"a": np.zeros(4, np.float32), "b": np.zeros(2, np.int64), "c": np.zeros(1)}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path).tree("params", template)
    message = str(err.value)
    for fragment in (f"checkpoint {path}: arrays/params: ", "field 'a': shape (3,), the template has (4,)",
                     "field 'b': dtype int32", "field 'c': missing", "field 'extra': not in the template"):
        assert fragment in message
    with pytest.raises(CheckpointError, match="holds no tree 'opt' \\(it holds \\['params'\\]\\)"):
        load_checkpoint(path).tree("opt", {})


def test_one_flattener_fills_templates_and_copies_to_the_host():
    """asyncrl.pytree, the one walk every array tree takes: a flat mapping fills its template
    whatever the source spelled (int keys, namedtuples), jax arrays come back on the
    template's device, and every mismatch is named by key before anything is placed."""
    import collections

    import jax
    import jax.numpy as jnp

    State = collections.namedtuple("State", "count mu")
    template = (State(jnp.zeros((), jnp.int32), {"layers": {0: jnp.zeros(3), 1: jnp.zeros(3)}}), [np.zeros(2, BF16)])
    source = {"0/count": np.array(7, np.int32), "0/mu/layers/0": np.arange(3, dtype=np.float32),
              "0/mu/layers/1": np.ones(3, np.float32), "1/0": np.full(2, 0.5, BF16)}
    filled = pytree.fill(template, source)
    assert jax.tree.structure(filled) == jax.tree.structure(template) and isinstance(filled[0], State)
    assert isinstance(filled[0].mu["layers"][1], jax.Array) and filled[0].mu["layers"][1].sharding == template[0].mu["layers"][1].sharding
    assert pytree.flatten(filled).keys() == source.keys()
    for key, array in pytree.flatten(filled).items():
        assert_same_bits(array, source[key], key)
    host = pytree.tree_to_host(filled)
    assert isinstance(host[0], State) and isinstance(host[0].mu["layers"][0], np.ndarray)
    with pytest.raises(pytree.TreeError) as err:
        pytree.fill(template, {**source, "0/mu/layers/1": np.ones(4, np.float32), "2": np.zeros(1)}, where="opt_state")
    assert str(err.value) == ("opt_state: field '0/mu/layers/1': shape (4,), the template has (3,); "
                              "field '2': not in the template")


def test_a_checkpoint_of_another_format_is_refused_not_skipped(tmp_path):
    """Format 1 keyed the optimizer state by dotted paths: resuming over it must stop with the
    reason, not start fresh over the run (which is what skipping an incomplete one does)."""
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    manifest = json.loads((newest / "MANIFEST.json").read_text())
    manifest["format"] = 1
    (newest / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="step_00000002: MANIFEST.json: field format: 1, this asyncrl reads format 3"):
        latest_checkpoint(tmp_path)
    cfg = load_config(data={"run": {"output_dir": str(tmp_path)}, "checkpoint": {"resume": "auto"}})
    with pytest.raises(CheckpointError, match="another run.output_dir"):
        resume_checkpoint(cfg)


def test_values_that_cannot_be_stored_are_refused_before_anything_is_written(tmp_path):
    cases = [
        ({"params": {"w": np.zeros(2), "name": "adam"}}, {}, r"cannot store a str at 'name'"),
        ({"params": {"w": np.array([object()])}}, {}, "object arrays cannot be stored without pickle"),
        ({"params": {"a/b": np.zeros(1)}}, {}, "key 'a/b'"),
        ({"params": {1: np.zeros(1), "1": np.zeros(1)}}, {}, "two leaves have the key '1'"),
        ({"../evil": {"w": np.zeros(1)}}, {}, "not a plain file name"),
        ({"params": {"w": np.zeros(1)}}, {"loss": float("nan")}, "not JSON-serialisable"),
        ({"params": {"w": np.zeros(1)}}, {"when": object()}, "not JSON-serialisable"),
    ]
    for arrays, state, match in cases:
        with pytest.raises(CheckpointError, match=match):
            ck.save_checkpoint(tmp_path, 1, arrays=arrays, state=state, config_yaml=CONFIG_YAML)
    bad_rollout = [
        ({"meta": {"x": float("inf")}, "arrays": {}}, "rollout_state\\['meta'\\] is not JSON-serialisable"),
        ({"meta": {}, "arrays": {"a": np.array([None])}}, "is an object array"),
        ({"groups": {}}, "must be WorkflowExecutor.state_dict"),
    ]
    for rollout_state, match in bad_rollout:
        with pytest.raises(CheckpointError, match=match):
            ck.save_checkpoint(tmp_path, 1, arrays={}, state={}, config_yaml=CONFIG_YAML, rollout_state=rollout_state)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.timeout(60)
def test_executor_state_round_trips_and_restores_a_fresh_executor(tmp_path):
    from asyncrl.engine import FakeEngine
    from asyncrl.rollout import WorkflowExecutor
    from tests.rollout_fakes import EOS, TokenWorkflow, make_cfg

    cfg = make_cfg({"max_staleness": 2, "batch_size": 3, "max_concurrent": 4})
    dataset = [{"x": i} for i in range(37)]

    def engine(version=0):
        return FakeEngine(vocab_size=24, eos_token_id=EOS, seed=0, first_token_id=2, delay_s=(0.0, 0.003), version=version)

    eng = engine()
    with WorkflowExecutor(TokenWorkflow(cfg), eng, dataset, cfg) as ex:
        for v in range(2):
            ex.next_batch(v, timeout=20)
            eng.update_weights(None, v + 1)
            ex.set_version(v + 1)
        deadline = time.monotonic() + 10
        while ex.counts()["queued"] == 0:
            assert time.monotonic() < deadline, "no group was queued"
            time.sleep(0.01)
        state = ex.state_dict()
    assert state["meta"]["groups"] and state["arrays"]

    path = ck.save_checkpoint(tmp_path, 2, arrays={}, state={"version": 2}, config_yaml=dump_config(cfg), rollout_state=state)
    assert {"rollout.json", "rollout.npz"} <= {p.name for p in path.iterdir()}
    loaded = load_checkpoint(path)
    assert json.loads(json.dumps(loaded.rollout_state["meta"])) == json.loads(json.dumps(state["meta"]))
    assert set(loaded.rollout_state["arrays"]) == set(state["arrays"])
    for name, array in state["arrays"].items():
        assert_same_bits(loaded.rollout_state["arrays"][name], array, name)

    fresh = WorkflowExecutor(TokenWorkflow(cfg), engine(version=2), dataset, cfg)
    fresh.load_state_dict(loaded.rollout_state)
    before, after = ex.counts(), fresh.counts()
    assert after["reissued"] == before["in_flight"]
    assert {k: v for k, v in after.items() if k not in ("reissued", "in_flight")} == \
        {k: v for k, v in before.items() if k not in ("reissued", "in_flight")}


# --------------------------------------------------------------------------- keep-last-N and replacement


def test_keep_last_n_deletes_older_checkpoints_only_after_the_new_one_is_in_place(tmp_path):
    seen_at_rename = []

    def hook(stage):
        if stage == "renamed":
            seen_at_rename.append(steps_on_disk(tmp_path))

    ck._stage_hook = hook
    try:
        for step in range(1, 6):
            save(tmp_path, step, keep=2)
    finally:
        ck._stage_hook = None
    assert steps_on_disk(tmp_path) == [4, 5]
    assert seen_at_rename == [[1], [1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]  # the old ones still there at rename
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004", "step_00000005"]

    for step in (6, 7):
        save(tmp_path, step)  # keep=None keeps everything
    assert steps_on_disk(tmp_path) == [4, 5, 6, 7]
    # incomplete directories do not count towards keep, and older ones go too
    (tmp_path / "checkpoints" / "step_00000007" / "MANIFEST.json").unlink()
    save(tmp_path, 8, keep=2)
    assert steps_on_disk(tmp_path) == [6, 7, 8]  # 6 and 8 are the two kept; broken 7 is newer than 6
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000008"


def test_saving_a_step_again_replaces_a_broken_directory_and_stale_temp_dirs_are_removed(tmp_path):
    save(tmp_path, 1)
    broken = save(tmp_path, 2)
    array_file(broken).write_bytes(b"garbage")
    stale = tmp_path / "checkpoints" / ".tmp-step_00000003-999-deadbeef"
    stale.mkdir()
    (stale / "params.safetensors").write_bytes(b"half")
    trash = tmp_path / "checkpoints" / ".trash-step_00000000-deadbeef"
    trash.mkdir()
    assert latest_checkpoint(tmp_path).name == "step_00000001"

    save(tmp_path, 2, numpy_tree(22))
    assert latest_checkpoint(tmp_path).name == "step_00000002"
    assert_same_bits(load_checkpoint(broken).arrays["params"]["embed"], numpy_tree(22)["embed"])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]


# --------------------------------------------------------------------------- incomplete and corrupt directories


def array_file(path: Path) -> Path:
    """The largest chunk file Orbax wrote for the ``params`` tree of checkpoint ``path``."""
    return max((f for f in (path / "arrays" / "params").rglob("*") if f.is_file() and "/d/" in str(f)),
               key=lambda f: f.stat().st_size)


def _truncate(path: Path) -> None:
    f = array_file(path)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    f = array_file(path)
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))


def _drop_manifest(path: Path) -> None:
    (path / "MANIFEST.json").unlink()


def _garble_manifest(path: Path) -> None:
    (path / "MANIFEST.json").write_text('{"format": 1, "step": 3, "fil')


def _drop_state(path: Path) -> None:
    (path / "state.json").unlink()


def _wrong_step(path: Path) -> None:
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["step"] = 2
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


def _unlisted_tree(path: Path) -> None:
    manifest = json.loads((path / "MANIFEST.json").read_text())
    del manifest["files"]["arrays/params/_METADATA"]
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


def _foreign_entry(path: Path) -> None:
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["files"]["../../outside"] = {"bytes": 1, "sha256": "0"}
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("corrupt, reason", [
    (_truncate, "arrays/params/.*/d/[0-9a-f]+ has .* bytes, the manifest says"),
    (_flip_byte, "arrays/params/.*/d/[0-9a-f]+ does not match its sha256"),
    (_drop_manifest, "no MANIFEST.json"),
    (_garble_manifest, "MANIFEST.json is unreadable"),
    (_drop_state, "state.json is missing"),
    (_wrong_step, "MANIFEST.json is of step 2, the directory of step 3"),
    (_unlisted_tree, "does not list arrays/params/_METADATA"),
    (_foreign_entry, "malformed entry '../../outside'"),
])
def test_an_incomplete_or_corrupt_checkpoint_is_skipped_for_the_previous_one(tmp_path, caplog, corrupt, reason):
    save(tmp_path, 1)
    previous = save(tmp_path, 2)
    newest = save(tmp_path, 3)
    corrupt(newest)
    partial = tmp_path / "checkpoints" / ".tmp-step_00000004-1-abcdef12"  # a write that never finished
    partial.mkdir()
    (partial / "params.safetensors").write_bytes(b"\x00" * 10)
    with caplog.at_level(logging.INFO, logger="asyncrl.checkpoint"):
        assert latest_checkpoint(tmp_path) == previous
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and "step_00000003" in skipped[0]
    assert any(re.search(reason, m) for m in skipped), skipped
    assert any("unfinished checkpoint write" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match="step_00000003"):
        load_checkpoint(newest)


def test_size_only_check_misses_a_flipped_byte_but_load_catches_it(tmp_path):
    path = save(tmp_path, 1)
    _flip_byte(path)
    assert ck.checkpoint_problems(path, checksums=False) == []
    assert latest_checkpoint(tmp_path, checksums=False) == path
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        load_checkpoint(path)
    load_checkpoint(path, verify=False)  # explicitly unverified: reads the (wrong) bytes


def test_no_checkpoints_means_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "checkpoints" / "step_00000001")


# --------------------------------------------------------------------------- nothing unpickles


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _rewrite_listed(path: Path, filename: str, data: bytes) -> None:
    (path / filename).write_bytes(data)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["files"][filename] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


def test_nothing_on_the_load_path_unpickles(tmp_path, monkeypatch):
    rollout_state = {
        "meta": {"format": 1, "ledger": {"version": 1}, "groups": {}},
        "arrays": {"g0_t0_input_ids": np.arange(5, dtype=np.int32), "g0_t0_loss_mask": np.ones(5, bool)},
    }
    path = ck.save_checkpoint(tmp_path, 1, arrays={"params": numpy_tree(), "opt_state": {"mu": np.ones(3, BF16)}},
                              state={"version": 1}, config_yaml=CONFIG_YAML, rollout_state=rollout_state)

    def refuse(*args, **kwargs):
        raise AssertionError("the load path unpickled")

    class RefusingUnpickler:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the load path built a pickle.Unpickler")

    real_np_load = np.load
    np_load_calls = []

    def np_load(*args, **kwargs):
        np_load_calls.append(kwargs.get("allow_pickle"))
        if kwargs.get("allow_pickle") is not False:
            raise AssertionError("numpy.load without allow_pickle=False")
        return real_np_load(*args, **kwargs)

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", RefusingUnpickler)
    monkeypatch.setattr(np, "load", np_load)
    assert latest_checkpoint(tmp_path) == path
    loaded = load_checkpoint(path)
    assert np_load_calls == [False]
    assert_same_bits(loaded.arrays["opt_state"]["mu"], np.ones(3, BF16))
    assert loaded.rollout_state["meta"] == rollout_state["meta"]

    # a planted pickle in the executor's arrays (manifest updated to match) is refused, not run
    marker = tmp_path / "pwned"
    import io

    monkeypatch.undo()  # pickle itself is back: the refusal must come from allow_pickle=False
    buffer = io.BytesIO()
    np.savez(buffer, g0_t0_input_ids=np.array([_Payload(marker)], dtype=object))
    _rewrite_listed(path, "rollout.npz", buffer.getvalue())
    with pytest.raises(CheckpointError, match="rollout state is unreadable"):
        load_checkpoint(path)
    assert not marker.exists()


# --------------------------------------------------------------------------- configs and resume


def test_only_logging_total_steps_eval_and_checkpoint_may_change_on_resume():
    saved = Config()
    allowed = load_config(data={"logging": {"level": "DEBUG"}, "run": {"total_steps": 500},
                                "eval": {"every_steps": 3, "n_samples": 4}, "checkpoint": {"keep": 1, "resume": "auto"}})
    check_resume_compatible(saved, allowed)

    changed = load_config(data={
        "rollout": {"batch_size": 16}, "model": {"path": "other/model"}, "run": {"seed": 7, "total_steps": 9},
        "workflow": {"target": "my.pkg:Flow", "kwargs": {"turns": 2}}, "rewards": [{"fn": "exact_match"}],
        "logging": {"level": "ERROR"},
    })
    with pytest.raises(ConfigError) as err:
        check_resume_compatible(saved, changed, where="runs/x/checkpoints/step_00000004")
    problems = err.value.problems
    assert problems[0].startswith("cannot resume from runs/x/checkpoints/step_00000004")
    assert ("only logging.*, run.total_steps, run.compile_cache, run.output_dir, run.name, eval.*, checkpoint.*, "
            "mesh.distributed, stages.N.total_steps may") in problems[0]
    body = problems[1:]
    assert "rollout.batch_size: checkpoint has 8, this config has 16" in body
    assert 'model.path: checkpoint has "tiny", this config has "other/model"' in body
    assert "run.seed: checkpoint has 0, this config has 7" in body
    assert any(p.startswith('workflow: checkpoint has "single_turn", this config has {"target": "my.pkg:Flow"') for p in body)
    assert any(p.startswith("rewards: checkpoint has [], this config has [{") for p in body)
    assert len(body) == 5  # logging.level and run.total_steps are not listed

    two = load_config(data={"rewards": [{"fn": "a"}, {"fn": "b", "weight": 1.0}]})
    other = load_config(data={"rewards": [{"fn": "a"}, {"fn": "b", "weight": 0.5}]})
    with pytest.raises(ConfigError, match=r"rewards\.1\.weight: checkpoint has 1.0, this config has 0.5"):
        check_resume_compatible(two, other)


def test_resume_checkpoint_follows_checkpoint_resume_and_refuses_incompatible_configs(tmp_path, monkeypatch):
    base = {"run": {"output_dir": str(tmp_path), "total_steps": 4}, "checkpoint": {"resume": "auto"}}
    cfg = load_config(data=base)
    assert resume_checkpoint(cfg) is None  # nothing saved yet: start fresh
    ck.save_checkpoint(tmp_path, 2, arrays={"params": {"w": np.ones(2)}}, state={"version": 2}, config_yaml=dump_config(cfg))
    newest = ck.save_checkpoint(tmp_path, 4, arrays={"params": {"w": np.full(2, 4.0)}}, state={"version": 4},
                                config_yaml=dump_config(cfg))

    assert resume_checkpoint(load_config(data={**base, "checkpoint": {"resume": "never"}})) is None
    longer = load_config(data={**base, "run": {"output_dir": str(tmp_path), "total_steps": 10}})
    resumed = resume_checkpoint(longer)
    assert resumed.step == 4 and resumed.path == newest and resumed.state == {"version": 4}
    np.testing.assert_array_equal(resumed.tree("params", {"w": np.zeros(2)})["w"], [4.0, 4.0])

    calls = []
    monkeypatch.setattr(checkpoint_load, "load_checkpoint", lambda *a, **k: calls.append(a))
    incompatible = load_config(data={**base, "rollout": {"max_staleness": 3}})
    with pytest.raises(ConfigError, match="rollout.max_staleness: checkpoint has 1, this config has 3"):
        resume_checkpoint(incompatible)
    assert calls == []  # refused before any array was read

    (newest / "config.yaml").write_text("rollout: {batch_sise: 3}\n")
    monkeypatch.undo()
    # the damaged config fails its checksum: the previous checkpoint is taken instead
    assert resume_checkpoint(longer).step == 2


def test_a_checkpoint_config_this_version_cannot_read_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        saved_config(yaml.safe_dump({"rollout": {"batch_sise": 3}}), where="ck/config.yaml")
    assert "ck/config.yaml: the checkpoint's config is no longer valid:" in err.value.problems[0]
    assert any("rollout.batch_sise" in p for p in err.value.problems)
    with pytest.raises(CheckpointError, match="not valid YAML"):
        saved_config("a: [")


def test_checkpoint_due_every_n_steps_and_at_the_end():
    cfg = load_config(data={"run": {"total_steps": 10}, "checkpoint": {"every_steps": 4}})
    assert [s for s in range(1, 11) if checkpoint_due(cfg, s)] == [4, 8, 10]
    off = load_config(data={"run": {"total_steps": 10}, "checkpoint": {"every_steps": 0}})
    assert [s for s in range(1, 11) if checkpoint_due(off, s)] == [10]
    assert [s for s in range(1, 7) if checkpoint_due(off, s, total_steps=6)] == [6]


def test_checkpoint_config_defaults_and_validation():
    section = Config().checkpoint
    assert (section.every_steps, section.keep, section.resume) == (50, 3, "never")
    with pytest.raises(ConfigError, match="checkpoint.resume"):
        load_config(data={"checkpoint": {"resume": "always"}})
    with pytest.raises(ConfigError, match="checkpoint.keep"):
        load_config(data={"checkpoint": {"keep": 0}})
    assert load_config(data={"checkpoint": {"keep": None}}).checkpoint.keep is None


def test_train_resume_flag_sets_checkpoint_resume_auto(tmp_path, capsys):
    from asyncrl.cli import main

    config = tmp_path / "c.yaml"
    config.write_text("run: {total_steps: 3}\n")
    assert main(["train", str(config), "--resume", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["checkpoint"]["resume"] == "auto"
    assert main(["train", str(config), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["checkpoint"]["resume"] == "never"
    assert main(["train", str(config), "--set", "checkpoint.resume=auto", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["checkpoint"]["resume"] == "auto"


def test_checkpoint_modules_import_no_jax():
    import subprocess
    import sys

    from tests.helpers import REPO_ROOT, subprocess_env

    code = ("import sys; from asyncrl.checkpoint import save_checkpoint, load_checkpoint, latest_checkpoint; "
            "from asyncrl.run.shutdown import ShutdownGuard; "
            "print(sorted(m for m in ('jax', 'safetensors', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), cwd=REPO_ROOT,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"
