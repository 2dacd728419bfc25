"""A cheaper publish to servers: ``asyncrl serve`` re-reads only the tensors whose published
sha256 changed, and a LoRA run publishes only its adapters (PEFT, SGLang's ``/load_lora_adapter``)
after one full base publish. Against ``asyncrl serve``'s app on a thread (a real socket)."""

from __future__ import annotations

import json

import httpx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from asyncrl.config import RemoteEngineConfig
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.engine.publish import ADAPTERS_DIR, TENSOR_HASHES
from asyncrl.engine.remote import RemoteEngine, adapter_name
from asyncrl.model.hf import SAFETENSORS_INDEX
from asyncrl.model.lora import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, LoraSpec, attach_lora, merge_lora
from tests.remote_helpers import API_KEY, QUICKSTART, check_tagged_logprobs, inprocess_servers, record_remote_generations

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SPEC = LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model():
    from asyncrl.config import load_config
    from asyncrl.model import load_model

    cfg = load_config(QUICKSTART, ["engine.prefill_buckets=[32]"])
    return cfg, load_model(cfg.model)


@pytest.fixture(scope="module")
def served(tmp_path_factory, model):
    cfg, loaded = model
    tmp = tmp_path_factory.mktemp("lora")
    with inprocess_servers(tmp, 1, loaded, cfg) as started:
        yield tmp, started[0]


def engine_for(tmp, server, loaded, dtype: str, run: str, version: int) -> RemoteEngine:
    graphdef, _ = loaded.split()
    settings = RemoteEngineConfig.model_validate({"urls": [server.url], "health_check_every_s": 0, "dtype": dtype,
                                                  "publish_adapters": True})
    return RemoteEngine(settings, graphdef=graphdef, stop_token_ids=loaded.stop_token_ids,
                        weights_dir=tmp / "weights" / run, version=version, api_key=API_KEY)


def server_info(server) -> dict:
    return httpx.get(f"{server.url}/get_server_info", headers=AUTH).json()


def rounded(tree, dtype: str):
    """``tree`` as a publish in ``dtype`` delivers it to a float32 server."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    return jax.tree.map(lambda x: np.asarray(np.asarray(x, np.float32).astype(np_dtype), np.float32), tree)


def served_params(server):
    return jax.tree.map(np.asarray, server.state.engine.served_params)


def logits(graphdef, params, ids):
    from asyncrl.model import forward

    out, _ = forward(graphdef, jax.tree.map(jnp.asarray, params), jnp.asarray(ids, jnp.int32)[None])
    return np.asarray(out, np.float32)


def trained_adapters(loaded, seed: int):
    """Adapters with a non-zero B (fresh ones leave the model unchanged, which would test nothing)."""
    _, params = loaded.split()
    lora = attach_lora(loaded.config, params, SPEC, seed=seed)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(rng.normal(0, 0.05, x.shape), x.dtype) if str(p[-1].key) == "lora_b" else x, lora.adapters)


def test_a_second_publish_reads_only_the_tensors_that_changed(served, model):
    tmp, server = served
    cfg, loaded = model
    graphdef, params = loaded.split()
    engine = engine_for(tmp, server, loaded, "bfloat16", "skip", version=int(server.state.label))
    try:
        first = jax.tree.map(lambda x: x * 1.01, params)
        engine.update_weights(first, engine.version + 1)
        index = json.loads((tmp / "weights" / "skip" / f"v{engine.version}" / SAFETENSORS_INDEX).read_text())
        names = set(index["weight_map"])
        assert set(index["metadata"][TENSOR_HASHES]) == names
        assert "lm_head.weight" not in names  # tied: the embedding is the head, published and read once
        info = server_info(server)
        assert info["serve/tensors_read"] == len(names) and info["serve/tensors_kept"] == 0  # it held no hashes yet

        second = jax.tree.map(lambda x: x, first)
        layer = second["layers"][0]["self_attn"]["q_proj"]
        layer["kernel"] = layer["kernel"] * 1.5
        second["norm"]["weight"] = second["norm"]["weight"] + 0.25
        engine.update_weights(second, engine.version + 1)
        info = server_info(server)
        assert info["serve/tensors_read"] == 2 and info["serve/tensors_kept"] == len(names) - 2
        changed = [layer["kernel"], second["norm"]["weight"]]
        assert info["serve/bytes_read"] == sum(int(np.prod(x.shape)) * 2 for x in changed)  # bfloat16
        want, got = rounded(second, "bfloat16"), served_params(server)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
        out = engine.generate(GenerationRequest(prompt_ids=[5, 6, 7], greedy=True, max_new_tokens=4, stop_token_ids=[]))
        assert out[0].versions.tolist() == [engine.version] * 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_a_lora_publish_moves_only_adapter_bytes_and_serves_the_merged_model(served, model, dtype, atol):
    tmp, server = served
    cfg, loaded = model
    graphdef, base = loaded.split()
    engine = engine_for(tmp, server, loaded, dtype, f"lora-{dtype}", version=int(server.state.label))
    root = tmp / "weights" / f"lora-{dtype}"
    ids = [5, 9, 14, 3, 22, 7]
    try:
        for k in range(2):
            adapters = trained_adapters(loaded, seed=k)
            version = engine.version + 1
            engine.update_lora(base, adapters, SPEC, version)
            adapter_dir = root / ADAPTERS_DIR / f"v{version}"
            assert {p.name for p in adapter_dir.iterdir()} == {PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE}
            peft_bytes = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters)) * (2 if dtype == "bfloat16" else 4)
            assert engine.writer.last_bytes == peft_bytes  # the last write was the adapter alone
            base_dirs = sorted(p.name for p in root.glob("v*"))
            assert base_dirs == [f"v{version - k}"], base_dirs  # the base was written once, at the first publish
            info = server_info(server)
            assert info["active_lora_adapter"] == adapter_name(version)
            assert info["serve/tensors_read"] == len(jax.tree.leaves(adapters))  # the adapter's tensors, nothing else

            merged = merge_lora(rounded(base, dtype), rounded(adapters, dtype), SPEC.scale)
            trainer_merged = merge_lora(base, adapters, SPEC.scale)
            served_logits = logits(graphdef, served_params(server), ids)
            np.testing.assert_allclose(served_logits, logits(graphdef, merged, ids), atol=1e-5)  # what a server must compute
            np.testing.assert_allclose(served_logits, logits(graphdef, trainer_merged, ids), atol=atol)  # the trainer's model

            out = engine.generate(GenerationRequest(prompt_ids=ids, n=2, max_new_tokens=6, stop_token_ids=[]))
            assert all(o.versions.tolist() == [version] * 6 for o in out)  # every token tagged with its adapter's version
    finally:
        engine.shutdown()


def engine_after_two_adapter_publishes(served, model, name: str):
    """``(server, engine)``: a bfloat16 remote engine on the served base that has published two
    trained adapters (the caller shuts the engine down)."""
    tmp, server = served
    _, loaded = model
    _, base = loaded.split()
    engine = engine_for(tmp, server, loaded, "bfloat16", name, version=int(server.state.label))
    try:
        for k in range(2):
            engine.update_lora(base, trained_adapters(loaded, seed=k), SPEC, engine.version + 1)
    except BaseException:
        engine.shutdown()
        raise
    return server, engine


def test_a_request_naming_a_replaced_adapter_comes_back_empty_and_aborted(served, model):
    server, engine = engine_after_two_adapter_publishes(served, model, "replaced")
    try:
        old = adapter_name(engine.version - 1)
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}, "lora_path": old, "return_logprob": True}
        answer = httpx.post(f"{server.url}/generate", json=body, headers=AUTH).json()
        assert answer["output_ids"] == [] and answer["meta_info"]["finish_reason"]["type"] == "abort"
        body["lora_path"] = "nope"
        refused = httpx.post(f"{server.url}/generate", json=body, headers=AUTH)
        assert refused.status_code == 400 and "'nope' is not a loaded adapter" in refused.json()["error"]["message"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("damage, needle", [
    ("shape", r"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: shape [4, 7]"),
    ("missing", r"base_model.model.model.layers.1.mlp.down_proj.lora_B.weight: missing"),
    ("module", r"base_model.model.model.layers.0.self_attn.qq_proj.lora_A.weight: model.layers.0.self_attn.qq_proj is no linear layer"),
    ("truncated", f"{PEFT_WEIGHTS_FILE}: cannot read safetensors"),
])
def test_a_wrong_adapter_is_refused_naming_the_tensor(served, model, damage, needle):
    from safetensors.numpy import load_file, save_file

    tmp, server = served
    _, loaded = model
    root = tmp / "weights" / f"bad-{damage}"
    from asyncrl.engine.publish import WeightsWriter

    writer = WeightsWriter(loaded.config, tmp / "weights" / f"bad-{damage}", dtype="float32")
    path = writer.write_adapter(trained_adapters(loaded, seed=3), SPEC, 1)
    tensors = load_file(str(path / PEFT_WEIGHTS_FILE))
    prefix = "base_model.model.model.layers."
    if damage == "shape":
        tensors[prefix + "0.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 7), np.float32)
    elif damage == "missing":
        del tensors[prefix + "1.mlp.down_proj.lora_B.weight"]
    elif damage == "module":
        tensors[prefix + "0.self_attn.qq_proj.lora_A.weight"] = tensors.pop(prefix + "0.self_attn.q_proj.lora_A.weight")
    save_file(tensors, str(path / PEFT_WEIGHTS_FILE))
    if damage == "truncated":  # a copy cut short: the file's header names more bytes than it has
        data = (path / PEFT_WEIGHTS_FILE).read_bytes()
        (path / PEFT_WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    before = server.state.engine.version
    answer = httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": f"bad-{damage}", "lora_path": str(path)},
                        headers=AUTH)
    assert answer.status_code == 400 and answer.json()["success"] is False
    assert needle in answer.json()["error_message"], answer.json()["error_message"]
    assert server.state.engine.version == before and f"bad-{damage}" not in server.state.adapters  # nothing installed
    assert root.is_dir()


@pytest.mark.slow  # ~30 s: a 3-step LoRA run on a server
def test_a_lora_run_publishes_adapters_and_tags_every_token_with_its_version(tmp_path, monkeypatch):
    """The quickstart with rank-4 adapters and ``publish_adapters``: the base is written once, each
    later publish only an adapter, and every sampled token's log-prob is that of base + the adapter
    of the version it is tagged with (1e-5), so per-token versions stay exact."""
    import io

    from safetensors.numpy import load_file

    from asyncrl.config import load_config
    from asyncrl.model import load_model
    from asyncrl.model.hf import param_layout
    from asyncrl.model.lora import adapters_from_peft
    from asyncrl.run.loop import train

    seen = record_remote_generations(monkeypatch)
    cfg0 = load_config(QUICKSTART, ["engine.prefill_buckets=[32]"])
    loaded = load_model(cfg0.model)
    out = tmp_path / "run"
    weights = tmp_path / "weights" / "run"
    with inprocess_servers(tmp_path, 1, loaded, cfg0) as started:
        remote = json.dumps({"urls": [started[0].url], "weights_dir": str(weights), "keep_weights": 1000,
                             "health_check_every_s": 0, "api_key_env": "ASYNCRL_TEST_API_KEY", "publish_adapters": True})
        cfg = load_config(QUICKSTART, [f"run.output_dir={out}", f"engine.remote={remote}", "model.lora={rank: 4, alpha: 8}",
                                       "stages.0.total_steps=1", "stages.1.total_steps=2", "eval.every_steps=0",
                                       "checkpoint.every_steps=0"])
        result = train(cfg, console=io.StringIO())
    assert result.steps == 3
    assert sorted(p.name for p in weights.glob("v*")) == ["v1"]  # the base, once
    assert sorted(p.name for p in (weights / ADAPTERS_DIR).iterdir()) == ["v1", "v2", "v3"]

    base = load_model(str(weights / "v1"), with_tokenizer=False)
    graphdef, base_params = base.split()
    layout = param_layout(base.config)
    samples = [(list(req.prompt_ids), r) for req, responses in seen if not req.greedy for r in responses]

    def model_of(version: int):
        if version == 0:
            return loaded.split()
        adapter_dir = weights / ADAPTERS_DIR / f"v{version}"
        tensors = load_file(str(adapter_dir / PEFT_WEIGHTS_FILE))
        adapters, scale = adapters_from_peft(tensors, json.loads((adapter_dir / PEFT_CONFIG_FILE).read_text()), layout, "t")
        return graphdef, merge_lora(base_params, adapters, scale)

    versions = check_tagged_logprobs(samples, model_of, cfg.rollout.temperature)
    assert versions and max(versions) >= 1


def test_a_server_rejoining_during_adapter_publishes_gets_the_base_and_the_current_adapter(served, model):
    server, engine = engine_after_two_adapter_publishes(served, model, "rejoin")
    try:
        remote = engine.servers[0]
        engine._mark_unhealthy(remote, "test: it went away")
        engine._check_one(remote)  # the health thread's rejoin: base, then the current adapter (unloaded first)
        assert remote.healthy
        assert server.state.active_adapter == adapter_name(engine.version) and server.state.label == str(engine.version)
        out = engine.generate(GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=3, stop_token_ids=[]))
        assert out[0].versions.tolist() == [engine.version] * 3
    finally:
        engine.shutdown()
