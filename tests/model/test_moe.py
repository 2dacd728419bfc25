"""Mixture-of-experts Qwen3 (``qwen3_moe``): parity with transformers' Qwen3MoeForCausalLM on a
random checkpoint it wrote itself (4 experts, top-2, one of the two layers dense through
``mlp_only_layers``), the grouped experts against the dense reference, the load-balancing loss
against a numpy formula, refusals, and the routing the engine and the trainer share.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.errors import ModelError
from asyncrl.model import export_hf, forward_jit, load_model, moe, per_token_logprobs_jit, split_params
from tests.model_helpers import hf_logits, rewrite_config
from tests.moe_helpers import TINY_MOE, save_tiny_moe

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny-moe"
    hf = save_tiny_moe(path)
    return path, hf, load_model(str(path), with_tokenizer=False)


def padded_batch(seed: int = 0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(5, TINY_MOE["vocab_size"], size=(3, 11)).astype(np.int32)
    mask = np.ones(ids.shape, bool)
    mask[1, :3] = False
    mask[2, -4:] = False
    ids[~mask] = 0
    return ids, mask


def test_config_and_layers(checkpoint):
    _, hf, lm = checkpoint
    cfg = lm.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 16)
    assert cfg.norm_topk_prob and cfg.mlp_only_layers == (1,)
    assert [cfg.is_moe_layer(i) for i in range(2)] == [True, False]
    params = lm.split()[1]
    assert params["layers"][0]["mlp"]["experts"]["gate_proj"].shape == (4, 32, 16)
    assert params["layers"][0]["mlp"]["experts"]["down_proj"].shape == (4, 16, 32)
    assert "gate_proj" in params["layers"][1]["mlp"]  # the dense layer keeps the MLP's names
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())


def test_logits_and_logprobs_match_transformers(checkpoint):
    _, hf, lm = checkpoint
    ids, mask = padded_batch()
    ref = hf_logits(hf, ids, mask)
    graphdef, params = lm.split()
    ours = np.asarray(forward_jit(graphdef, params, jnp.asarray(ids), None, jnp.asarray(mask))[0])
    assert np.abs(ours - ref)[mask].max() < 1e-4
    lp, _ = per_token_logprobs_jit(graphdef, params, jnp.asarray(ids), jnp.asarray(mask), 1.0)
    ref_lp = torch.log_softmax(torch.tensor(ref), -1).numpy()
    b, t = np.nonzero(mask[:, 1:] & mask[:, :-1])
    np.testing.assert_allclose(np.asarray(lp)[b, t + 1], ref_lp[b, t, ids[b, t + 1]], atol=1e-4)


def test_routing_matches_transformers_router(checkpoint):
    """Our float32 route() picks the experts and weights transformers' router picks."""
    _, hf, _ = checkpoint
    x = torch.randn(64, TINY_MOE["hidden_size"])
    with torch.no_grad():
        logits, weights, experts = hf.model.layers[0].mlp.gate(x)
    ours_w, ours_e = moe.route(jnp.asarray(logits.numpy()), 2, True)
    np.testing.assert_array_equal(np.asarray(ours_e), experts.numpy())
    np.testing.assert_allclose(np.asarray(ours_w), weights.numpy(), atol=1e-6)


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-5), pytest.param(jnp.bfloat16, 3e-2, marks=pytest.mark.slow)])
def test_grouped_experts_equal_the_dense_reference(dtype, atol):
    rng = np.random.default_rng(0)
    tokens, hidden, inter, experts, k = 37, 16, 8, 5, 2
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    gate, up = (jnp.asarray(rng.standard_normal((experts, hidden, inter)) * 0.3, dtype) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((experts, inter, hidden)) * 0.3, dtype)
    logits = jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)
    logits = logits.at[:, 4].add(-10.0)  # expert 4 never chosen: an empty group
    weights, chosen = moe.route(logits, k, False)
    grouped = moe.experts_grouped(x, chosen, weights, gate, up, down)
    dense = moe.experts_dense(x, chosen, weights, gate, up, down)
    assert grouped.dtype == dtype
    np.testing.assert_allclose(np.asarray(grouped, np.float32), np.asarray(dense, np.float32), atol=atol)
    if dtype == jnp.float32:  # and their gradients (the trainer differentiates the grouped form)
        loss = lambda f: lambda *w: jnp.sum(jnp.sin(f(x, chosen, weights, *w)))  # noqa: E731
        g1 = jax.grad(loss(moe.experts_grouped), argnums=(0, 1, 2))(gate, up, down)
        g2 = jax.grad(loss(moe.experts_dense), argnums=(0, 1, 2))(gate, up, down)
        for a, b in zip(g1, g2):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def numpy_load_balancing_loss(router_logits: list[np.ndarray], top_k: int, mask: np.ndarray) -> float:
    """transformers' load_balancing_loss_func written out in numpy (float64)."""
    num_experts = router_logits[0].shape[-1]
    counts = np.zeros(num_experts)
    prob_sum = np.zeros(num_experts)
    rows = 0.0
    for logits in router_logits:
        z = logits.astype(np.float64)
        probs = np.exp(z - z.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
        for token in np.nonzero(mask)[0]:
            counts[chosen[token]] += 1
            prob_sum += probs[token]
            rows += 1
    return float(num_experts * np.sum((counts / rows) * (prob_sum / rows)))


def test_load_balancing_loss_matches_numpy_and_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(1)
    layers = [rng.standard_normal((2 * 9, 6)).astype(np.float32) * 2 for _ in range(3)]
    mask = rng.random(2 * 9) > 0.3
    ours = float(moe.load_balancing_loss([jnp.asarray(x) for x in layers], 2, jnp.asarray(mask)))
    assert ours == pytest.approx(numpy_load_balancing_loss(layers, 2, mask), rel=1e-5)
    hf = load_balancing_loss_func(tuple(torch.tensor(x) for x in layers), 6, 2, torch.tensor(mask.reshape(2, 9)))
    assert ours == pytest.approx(float(hf), rel=1e-5)
    # Perfect balance gives k; every token on the same two experts gives the maximum load E / k.
    one_expert = np.tile(np.array([[9.0, 8.0, 0, 0, 0, 0]], np.float32), (18, 1))
    assert float(moe.expert_load_max([jnp.asarray(one_expert)], 2, jnp.ones(18, bool))) == pytest.approx(3.0)


def test_export_loads_in_transformers_with_equal_logits(checkpoint, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path, _, lm = checkpoint
    out = export_hf(lm.model, None, tmp_path / "export", stop_token_ids=lm.stop_token_ids)
    with safe_open(str(out / "model.safetensors"), "np") as f, safe_open(str(path / "model.safetensors"), "np") as g:
        assert sorted(f.keys()) == sorted(g.keys())  # transformers' own per-expert names
    hf = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    ids, mask = padded_batch(seed=4)
    ours = np.asarray(forward_jit(*lm.split(), jnp.asarray(ids), None, jnp.asarray(mask))[0])
    assert np.abs(ours - hf_logits(hf, ids, mask))[mask].max() < 1e-5
    assert load_model(str(out), with_tokenizer=False).config == lm.config


@pytest.mark.parametrize("change, named", [
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not supported"),
])
def test_unsupported_options_are_refused_by_name(checkpoint, tmp_path, change, named):
    import shutil

    path, _, _ = checkpoint
    copy = tmp_path / "m"
    shutil.copytree(path, copy)
    rewrite_config(copy, **change)
    with pytest.raises(ModelError, match=named):
        load_model(str(copy), with_tokenizer=False)


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(checkpoint, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    path, _, _ = checkpoint
    copy = tmp_path / "m"
    shutil.copytree(path, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"missing tensors \(1\): model.layers.0.mlp.experts.up_proj(.|\n)*"
                                         r"unexpected tensors \(3\): model.layers.0.mlp.experts.0.up_proj.weight"):
        load_model(str(copy), with_tokenizer=False)


def test_greedy_generation_matches_transformers(checkpoint):
    from asyncrl.config import EngineConfig
    from asyncrl.engine.jax_engine import JaxEngine
    from asyncrl.engine.protocol import GenerationRequest

    _, hf, lm = checkpoint
    graphdef, params = lm.split()
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(5, TINY_MOE["vocab_size"], size=n)] for n in (1, 6, 13)]
    engine = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids,
                       config=EngineConfig(slots=4, kv_capacity=40, decode_chunk=8, prefill_buckets=[16]))
    try:
        ours = [engine.generate(GenerationRequest(prompt_ids=p, greedy=True, max_new_tokens=12))[0] for p in prompts]
    finally:
        engine.shutdown()
    compared = 0
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_logits=True,
                              pad_token_id=0)
        want = out.sequences[0, len(prompt):].numpy()
        logits = torch.stack(out.logits, dim=1)[0].float().numpy()
        top2 = np.sort(logits, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-4
        upto = len(want) if clear.all() else int(np.argmin(clear))
        np.testing.assert_array_equal(got.output_ids[:upto], want[:upto])
        compared += upto
    assert compared >= 12


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_router_logits_are_sown_only_for_callers_who_pop_them(checkpoint):
    """per_token_logprobs(with_router=True) returns one float32 [B * L, E] per MoE layer; the
    plain call keeps its two outputs."""
    from asyncrl.model import per_token_logprobs

    _, _, lm = checkpoint
    ids, mask = padded_batch()
    graphdef, params = lm.split()
    assert len(per_token_logprobs(graphdef, params, jnp.asarray(ids), jnp.asarray(mask))) == 2
    _, _, router = per_token_logprobs(graphdef, params, jnp.asarray(ids), jnp.asarray(mask), with_router=True)
    assert len(router) == 1 and router[0].shape == (ids.size, 4) and router[0].dtype == jnp.float32


@pytest.mark.slow  # scanned layers without experts stay in the default selection (test_scanned_layers.py)
def test_router_logits_reach_the_trainer_with_scanned_layers(checkpoint):
    """model.scan_layers (the default on accelerators) must not lose the sown router logits: the
    captured forward runs unrolled, and the log-probs equal the scanned forward's."""
    from asyncrl.model import per_token_logprobs

    _, _, lm = checkpoint
    ids, mask = (jnp.asarray(a) for a in padded_batch())
    graphdef, params = lm.split()
    scanned_graphdef, _ = split_params(nnx_rebuild(lm.config.replace(scan_layers=True)))
    logprobs, _, router = per_token_logprobs(graphdef, params, ids, mask, with_router=True)
    scanned_logprobs, _, scanned_router = per_token_logprobs(scanned_graphdef, params, ids, mask, with_router=True)
    plain_scanned, _ = per_token_logprobs(scanned_graphdef, params, ids, mask)
    assert len(scanned_router) == len(router) == 1
    np.testing.assert_array_equal(scanned_router[0], router[0])
    np.testing.assert_allclose(scanned_logprobs, logprobs, atol=1e-6)
    np.testing.assert_allclose(plain_scanned, logprobs, atol=1e-5)


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_remat_gives_the_same_gradients(checkpoint):
    from asyncrl.model import per_token_logprobs

    _, _, lm = checkpoint
    ids, mask = (jnp.asarray(a) for a in padded_batch())
    graphdef, params = lm.split()
    remat_graphdef, _ = split_params(nnx_rebuild(lm.config.replace(remat=True)))

    def grads(g):
        return jax.jit(jax.grad(lambda p: jnp.sum(per_token_logprobs(g, p, ids, mask)[0])))(params)

    a, b = grads(graphdef), grads(remat_graphdef)
    diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert diff < 1e-5


def nnx_rebuild(cfg):
    from asyncrl.model.transformer import init_decoder

    return init_decoder(cfg)


def test_dense_families_are_unchanged():
    """A Qwen3 config has no experts and the same parameter tree as before."""
    from asyncrl.model.config import DecoderConfig

    cfg = DecoderConfig(model_type="qwen3", vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=4, qk_norm=True)
    assert not any(cfg.is_moe_layer(i) for i in range(2))
    assert dataclasses.replace(cfg).num_experts == 0


def test_lora_adapter_loads_in_peft_with_equal_logprobs(checkpoint, tmp_path):
    """Adapters go on attention (asyncrl/model/lora.py check_moe_targets); PEFT loads the exported
    adapter onto transformers' model and agrees. MLP targets are refused by name: PEFT would read
    them as the experts' fused weights."""
    from peft import PeftModel

    from asyncrl.model.lora import LoraSpec, attach_lora, combine_params, export_peft_adapter
    from tests.model.test_lora import hf_logprobs, random_adapters

    path, hf, lm = checkpoint
    with pytest.raises(ModelError, match="model.lora.target_modules: down_proj, gate_proj on a mixture-of-experts"):
        attach_lora(lm.config, lm.split()[1], LoraSpec(rank=4, target_modules=("q_proj", "gate_proj", "down_proj")))
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj"))
    lora = attach_lora(lm.config, lm.split()[1], spec, seed=0)
    adapters = random_adapters(lora.adapters, seed=2)
    export_peft_adapter(adapters, spec, tmp_path / "adapter", base_model=str(path))
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    try:
        ids, mask = padded_batch(seed=5)
        want = hf_logprobs(peft_model, ids, mask)
    finally:
        peft_model.unload()  # the module-scoped torch model goes back to the base weights
    got, _ = per_token_logprobs_jit(lora.graphdef, combine_params(lora.frozen, adapters), ids, mask, 1.0)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)
    plain, _ = per_token_logprobs_jit(*lm.split(), ids, mask, 1.0)
    assert np.max(np.abs(np.asarray(plain) - want)) > 1e-2


def test_config_reader_without_transformers_agrees_with_autoconfig(checkpoint):
    """The config.json reader (no transformers import) and AutoConfig give the same DecoderConfig,
    for what transformers writes (``num_local_experts``) and for the published Qwen3-30B-A3B file
    (``num_experts``)."""
    from transformers import AutoConfig

    from asyncrl.model.config import from_hf_config
    from asyncrl.model.hf import read_hf_config_file
    from tests.helpers import REPO_ROOT

    path, _, lm = checkpoint
    for directory in (path, REPO_ROOT / "configs" / "models" / "qwen3-30b-a3b"):
        ours = from_hf_config(read_hf_config_file(directory / "config.json"))
        assert ours == from_hf_config(AutoConfig.from_pretrained(str(directory))), directory
    assert from_hf_config(read_hf_config_file(path / "config.json")) == lm.config


SHARDED_CHILD = r"""
import json, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from asyncrl.model import forward, load_model
from asyncrl.model.sharding import param_partition_specs, shard_params

assert jax.device_count() == 8
lm = load_model(sys.argv[1], with_tokenizer=False)
graphdef, params = lm.split()
rng = np.random.RandomState(0)
ids = rng.randint(0, 40, (4, 9)).astype(np.int32)
mask = np.ones((4, 9), bool); mask[1, :2] = False
ref = np.asarray(jax.jit(forward, static_argnums=0)(graphdef, params, jnp.asarray(ids), None, jnp.asarray(mask))[0])
report = {}
for shape in ((1, 4, 2), (2, 2, 2)):
    mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "fsdp", "tensor"))
    sharded = shard_params(lm.config, params, mesh)
    batch = NamedSharding(mesh, P(("data", "fsdp"), None))
    out = jax.jit(forward, static_argnums=0)(graphdef, sharded, jax.device_put(ids, batch), None, jax.device_put(mask, batch))[0]
    specs = param_partition_specs(lm.config, params, mesh)["layers"][0]["mlp"]
    report[str(shape)] = {"diff": float(np.abs(np.asarray(out) - ref)[mask].max()),
                          "experts": [a for a in specs["experts"]["gate_proj"]],
                          "down": [a for a in specs["experts"]["down_proj"]], "router": [a for a in specs["gate"]["kernel"]]}
print("REPORT" + json.dumps(report))
"""


@pytest.mark.slow  # the dense model's sharded head stays in the default selection (test_model_sharding.py)
def test_experts_shard_over_fsdp_and_the_sharded_forward_matches(checkpoint):
    import json

    from tests.helpers import run_python, subprocess_env

    path, _, _ = checkpoint
    proc = run_python(SHARDED_CHILD, args=(str(path),), timeout=200,
                      env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    report = json.loads(proc.stdout.split("REPORT", 1)[1])
    for shape, result in report.items():
        assert result["diff"] < 1e-5, (shape, result)
    # 4 experts over fsdp 4, the expert width 16 over tensor 2; the router's hidden dimension over fsdp
    assert report["(1, 4, 2)"]["experts"] == ["fsdp", None, "tensor"]
    assert report["(1, 4, 2)"]["down"] == ["fsdp", "tensor", None]
    assert report["(1, 4, 2)"]["router"] == ["fsdp", None]
