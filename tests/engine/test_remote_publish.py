"""Publishing weights for inference servers (asyncrl/engine/publish.py): a sharded HF safetensors
directory in the servers' dtype, each process writing the tensors it owns, complete or absent."""

from __future__ import annotations

import hashlib
import json

import httpx
import ml_dtypes
import numpy as np
import pytest

from asyncrl.engine import sglang_protocol as sp
from asyncrl.engine.publish import TENSOR_HASHES, PublishError, WeightsWriter, assign_owners, shard_file_name
from asyncrl.model.hf import SAFETENSORS_INDEX, hf_tensors_from_params, read_safetensors
from tests.helpers import run_jax_processes
from tests.remote_helpers import API_KEY, QUICKSTART, inprocess_servers


@pytest.fixture(scope="module")
def tiny():
    from asyncrl.model import load_model

    return load_model("tiny", with_tokenizer=False)


def bf16_reference(loaded, scale=1.0) -> dict:
    """The model's HF tensors times ``scale``, rounded to bfloat16 as a publish must write them."""
    _, params = loaded.split()
    return {k: (np.asarray(v, np.float32) * np.float32(scale)).astype(ml_dtypes.bfloat16)
            for k, v in hf_tensors_from_params(loaded.config, params).items()}


def test_owners_balance_the_bytes_and_agree_everywhere():
    sizes = [("a", 100), ("b", 60), ("c", 50), ("d", 10), ("e", 10)]
    owners = assign_owners(sizes, 2)
    assert owners == assign_owners(list(reversed(sizes)), 2)  # the order given does not matter
    load = [sum(s for n, s in sizes if owners[n] == p) for p in range(2)]
    assert sorted(load) == [110, 120]
    assert set(assign_owners(sizes, 8).values()) == set(range(5))  # more processes than tensors: some write none


def test_one_process_writes_bf16_shards_with_an_index_and_prunes_old_versions(tmp_path, tiny):
    from asyncrl.model import load_model

    _, params = tiny.split()
    writer = WeightsWriter(tiny.config, tmp_path, keep=2)
    for version in (1, 2, 3):
        path = writer.write(params, version)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]  # no partial directory left
    index = json.loads((path / SAFETENSORS_INDEX).read_text())
    assert set(index["weight_map"].values()) == {shard_file_name(0, 1)}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = read_safetensors(path)
    reference = bf16_reference(tiny)
    assert set(tensors) == set(reference) == set(index["weight_map"])
    for name, value in reference.items():
        assert tensors[name].dtype == ml_dtypes.bfloat16 and np.array_equal(tensors[name], value), name
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in reference.values()) == writer.last_bytes
    load_model(str(path), with_tokenizer=False)  # the HF loader reads the sharded index


def test_a_failed_write_leaves_no_version_and_names_the_file(tmp_path, tiny):
    _, params = tiny.split()
    writer = WeightsWriter(tiny.config, tmp_path, keep=2)
    writer.write(params, 1)
    (tmp_path / ".v2.partial").write_text("not a directory")  # the write of v2 cannot make its directory
    with pytest.raises(PublishError, match=r"publish v2: process 0 could not write .*\.v2\.partial/model-00001-of-00001"):
        writer.write(params, 2)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v1"]


def test_float32_publishes_the_trainer_values_exactly(tmp_path, tiny):
    _, params = tiny.split()
    path = WeightsWriter(tiny.config, tmp_path, dtype="float32").write(params, 1)
    tensors = read_safetensors(path)
    for name, value in hf_tensors_from_params(tiny.config, params).items():
        assert tensors[name].dtype == np.float32 and np.array_equal(tensors[name], np.asarray(value)), name


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
@pytest.mark.timeout(400)
def test_two_processes_each_write_their_own_tensors_and_a_server_loads_them(tmp_path, tiny):
    """2 processes x 2 CPU devices, params fsdp-sharded over all 4: one shard file per process
    holding exactly the tensors it owns, equal to the weights in bf16; ``asyncrl serve`` loads it."""
    weights = tmp_path / "weights"
    codes, logs = run_jax_processes(
        tmp_path, lambda pid: ["-m", "tests.publish_worker", str(weights / "run"), str(tmp_path / f"p{pid}.json")],
        2, devices=2, timeout=300)
    assert codes == [0, 0], logs
    reports = [json.loads((tmp_path / f"p{pid}.json").read_text()) for pid in range(2)]
    path = weights / "run" / "v1"
    assert all(r["path"] == str(path) for r in reports)
    assert all(r["engine_copy_equal"] for r in reports)  # every host's engine copy, made across hosts, is exact
    index = json.loads((path / SAFETENSORS_INDEX).read_text())
    files = [shard_file_name(p, 2) for p in range(2)]
    assert sorted(f.name for f in path.glob("*.safetensors")) == files
    reference = bf16_reference(tiny, 1.5)
    for pid, file in enumerate(files):
        owned = read_safetensors_file(path / file)
        assert set(owned) == {n for n, f in index["weight_map"].items() if f == file}
        assert reports[pid]["bytes"] == sum(v.nbytes for v in owned.values()) > 0
        for name, value in owned.items():
            assert np.array_equal(value, reference[name]), name
            # each owner hashed what it wrote; process 0 merged both processes' hashes into the index
            assert index["metadata"][TENSOR_HASHES][name] == hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
    assert not list(path.glob(".hashes-*"))  # the sidecars are gone
    total = sum(r["bytes"] for r in reports)
    assert max(r["bytes"] for r in reports) < 0.75 * total  # each process wrote its share, not everything

    from asyncrl.config import load_config

    cfg = load_config(QUICKSTART, ["engine.prefill_buckets=[32]"])
    with inprocess_servers(tmp_path, 1, tiny, cfg) as (server,):
        body = sp.UpdateWeightFromDiskReqInput(model_path=str(path), weight_version="1").model_dump()
        answer = httpx.post(f"{server.url}/update_weights_from_disk", json=body, timeout=120,
                            headers={"Authorization": f"Bearer {API_KEY}"})
        assert answer.status_code == 200 and answer.json()["success"], answer.text
        served = hf_tensors_from_params(tiny.config, server.state.engine.served_params)  # what it installed
        info = httpx.get(f"{server.url}/get_model_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert info["weight_version"] == "1"
    for name, value in reference.items():
        assert np.array_equal(np.asarray(served[name]), value.astype(np.float32)), name


def read_safetensors_file(path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path))


@pytest.mark.slow  # a 2-process run of 2 steps beside an in-process server: about a minute on a busy 2-core machine
@pytest.mark.timeout(600)
def test_a_two_process_run_publishes_to_a_server_each_process_writing_its_share(tmp_path):
    """``asyncrl train`` as 2 processes with ``engine.remote``: every version the server loads is a
    directory with one shard file per process, and the run ends with the server at version 2."""
    import yaml

    from asyncrl.config import load_config
    from asyncrl.model import load_model

    model = "tiny:layers=1"
    loaded = load_model(model, with_tokenizer=False)
    serve_cfg = load_config(QUICKSTART, [f"model.path={model}", "engine.prefill_buckets=[32]"])
    with inprocess_servers(tmp_path, 1, loaded, serve_cfg) as (server,):
        out = tmp_path / "run"
        remote = {"urls": [server.url], "weights_dir": str(tmp_path / "weights" / "run"), "keep_weights": 10,
                  "health_check_every_s": 0, "api_key_env": "ASYNCRL_TEST_API_KEY"}
        config = {"run": {"name": "mp-remote", "seed": 3, "total_steps": 2, "output_dir": str(out)},
                  "model": {"path": model}, "data": {"dataset": "copy"}, "workflow": "single_turn",
                  "rollout": {"batch_size": 4, "group_size": 4, "max_staleness": 0, "max_new_tokens": 8},
                  "engine": {"remote": remote}, "eval": {"every_steps": 0},
                  "checkpoint": {"every_steps": 0, "keep": None}}
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(config))
        codes, logs = run_jax_processes(tmp_path, lambda pid: ["-m", "asyncrl.cli", "train", str(path)], 2,
                                        devices=1, timeout=480, ASYNCRL_TEST_API_KEY=API_KEY)
        assert codes == [0, 0], logs
        info = httpx.get(f"{server.url}/get_model_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert info["weight_version"] == "2"
    versions = sorted(p.name for p in (tmp_path / "weights" / "run").iterdir())
    assert versions == ["v0", "v1", "v2"], versions  # v0: written once at start by both processes
    for version in versions:
        files = sorted(f.name for f in (tmp_path / "weights" / "run" / version).glob("*.safetensors"))
        assert files == [shard_file_name(0, 2), shard_file_name(1, 2)], (version, files)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and all(row["perf/publish_time"] > 0 for row in rows)


def test_a_server_update_holds_one_serving_copy_at_its_peak(tmp_path, tiny):
    """``/update_weights_from_disk`` on a server holding an adapter's base too: when the engine
    installs the new weights (it drops its own copy first), the process's live device arrays hold
    one copy of the weights, not the old one beside the new."""
    import jax
    from safetensors.numpy import save_file

    from asyncrl.config import load_config
    from asyncrl.run.build import build_local_engine
    from asyncrl.serve.state import ServeState

    cfg = load_config(QUICKSTART, ["model.compute_dtype=float32"])
    graphdef, params = tiny.split()
    params = jax.tree.map(np.asarray, params)  # host values: the engine's device copy is its own
    engine = build_local_engine(cfg, graphdef, params, tiny.stop_token_ids)
    state = ServeState(engine, tiny.config, str(tiny.path), weights_root=tmp_path, api_key=None)
    state.base = engine.served_params  # as after /load_lora_adapter: the unmerged base kept beside the served one
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.served_params))
    path = tmp_path / "v1"
    path.mkdir()
    save_file({k: np.asarray(v) * 2 for k, v in hf_tensors_from_params(tiny.config, params).items()},
              str(path / "model.safetensors"))
    assert state.base_params() is engine.served_params
    live = lambda: sum(a.nbytes for a in jax.live_arrays())  # noqa: E731
    install, peaks = engine.runner.install, []

    def measured_take(new):
        install(new)
        peaks.append(live())  # the new serving copy is in place; what else is still alive

    engine.runner.install = measured_take
    before = live()
    try:
        state.load_and_install(path, "1")
    finally:
        engine.shutdown()
    assert engine.version == 1 and len(peaks) == 1
    assert peaks[0] - before < weights / 2, (peaks[0] - before, weights)  # old + new would be +weights
