"""Partition rules on 8 forced CPU devices, in a spawned interpreter (the flag slows other tests)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_python, subprocess_env

CHILD = r"""
import json
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from asyncrl.model import forward, from_hf_config, init_decoder, split_params
from asyncrl.model.sharding import param_partition_specs, shard_params
from tests.model_helpers import FAMILIES, hf_config

assert jax.device_count() == 8
report = {}
rng = np.random.RandomState(0)
for family, mesh_shape in (("qwen2", (2, 2, 2)), ("qwen3", (1, 2, 4)), ("llama", (2, 1, 4)), ("gemma3", (2, 2, 2))):
    cfg = from_hf_config(hf_config(family))
    layers = 2 if cfg.layer_types else 1  # one layer: same rules, half the compile (Gemma 3: a sliding and a global one)
    cfg = cfg.replace(num_layers=layers, layer_types=cfg.layer_types and cfg.layer_types[:layers])
    graphdef, params = split_params(init_decoder(cfg, seed=1))
    # perturb every parameter, so zero biases and unit norms cannot hide a sharding error
    params = jax.tree.map(lambda x: x + jnp.asarray(0.05 * rng.standard_normal(x.shape), x.dtype), params)
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("data", "fsdp", "tensor"))
    sharded = shard_params(cfg, params, mesh)
    specs = param_partition_specs(cfg, params, mesh)
    flat = jax.tree_util.tree_flatten_with_path(sharded)[0]
    named = {".".join(str(k.key) for k in path): leaf for path, leaf in flat}
    assert len(named) == len(jax.tree.leaves(params))
    for name, leaf in named.items():
        assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh is mesh, name
        assert len(leaf.sharding.spec) == leaf.ndim, name  # every dimension named (axis or None)
    ids = rng.randint(0, cfg.vocab_size, (4, 9)).astype(np.int32)
    mask = np.ones((4, 9), bool); mask[1, :2] = False; mask[3, 6:] = False
    batch = NamedSharding(mesh, P(("data", "fsdp"), None))
    ref = np.asarray(jax.jit(forward, static_argnums=0)(graphdef, params, jnp.asarray(ids), None, jnp.asarray(mask))[0])
    out = jax.jit(forward, static_argnums=0)(graphdef, sharded, jax.device_put(ids, batch), None, jax.device_put(mask, batch))[0]
    report[family] = {
        "diff": float(np.abs(np.asarray(out) - ref)[mask].max()),
        "specs": {n: [a if a is None or isinstance(a, str) else list(a) for a in s] for n, s in
                  ((".".join(str(k.key) for k in p), s) for p, s in jax.tree_util.tree_flatten_with_path(
                      specs, is_leaf=lambda x: isinstance(x, P))[0])},
    }
print("REPORT" + json.dumps(report))
"""


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_every_parameter_sharded_and_sharded_forward_matches():
    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = run_python(CHILD, env=env, timeout=110)
    report = json.loads(proc.stdout.split("REPORT", 1)[1])
    for family, result in report.items():
        assert result["diff"] < 1e-5, (family, result["diff"])

    q2, q3, ll = report["qwen2"]["specs"], report["qwen3"]["specs"], report["llama"]["specs"]
    # data x fsdp x tensor = 2 x 2 x 2: everything splits as the rules say
    assert q2["embed_tokens.embedding"] == ["tensor", "fsdp"]
    assert q2["layers.0.self_attn.q_proj.kernel"] == ["fsdp", "tensor"]
    assert q2["layers.0.self_attn.k_proj.kernel"] == ["fsdp", "tensor"]  # 2 KV heads / 2
    assert q2["layers.0.self_attn.k_proj.bias"] == ["tensor"]
    assert q2["layers.0.self_attn.o_proj.kernel"] == ["tensor", "fsdp"]
    assert q2["layers.0.mlp.down_proj.kernel"] == ["tensor", "fsdp"]
    assert q2["layers.0.input_layernorm.weight"] == [None]
    # tensor = 4 with 2 KV heads: k/v replicate along heads, q/o (4 heads) still split
    assert q3["layers.0.self_attn.k_proj.kernel"] == ["fsdp", None]
    assert q3["layers.0.self_attn.q_proj.kernel"] == ["fsdp", "tensor"]
    assert q3["layers.0.self_attn.q_norm.weight"] == [None]
    assert q3["lm_head.kernel"] == ["fsdp", "tensor"]  # vocab 40 / 4
    # fsdp axis of size 1 is not used; vocab 44 / 4 splits; 1 KV head replicates
    assert ll["layers.0.self_attn.v_proj.kernel"] == [None, None]
    assert ll["embed_tokens.embedding"] == ["tensor", None]
    # Gemma 3's extra norms are replicated; its matrices split like the others'
    gm = report["gemma3"]["specs"]
    assert gm["layers.1.pre_feedforward_layernorm.weight"] == gm["layers.1.post_feedforward_layernorm.weight"] == [None]
    assert gm["layers.1.self_attn.k_proj.kernel"] == ["fsdp", "tensor"] and gm["layers.0.mlp.gate_proj.kernel"] == ["fsdp", "tensor"]


HEAD_CHILD = r"""
import json, re, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from asyncrl.model import from_hf_config, init_decoder, split_params
from asyncrl.model.attention import compiled_for
from asyncrl.model.logprobs import per_token_logprobs
from asyncrl.model.sharding import shard_params
from tests.model_helpers import hf_config

mesh = Mesh(np.array(jax.devices()).reshape(1, 8, 1), ("data", "fsdp", "tensor"))
rows = NamedSharding(mesh, P(("data", "fsdp"), None))
rng = np.random.RandomState(0)
report = {}
for family in sys.argv[1:]:
    cfg = from_hf_config(hf_config(family)).replace(num_layers=1)
    graphdef, params = split_params(init_decoder(cfg, seed=1))
    ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (8, 12)).astype(np.int32))
    mask = jnp.ones((8, 12), bool)

    def loss(params, ids, mask, on_mesh):
        if on_mesh:
            with compiled_for(mesh):
                lp, _ = per_token_logprobs(graphdef, params, ids, mask, chunk_size=4, with_entropy=False)
        else:
            lp, _ = per_token_logprobs(graphdef, params, ids, mask, chunk_size=4, with_entropy=False)
        return jnp.sum(lp * jnp.arange(12.0))

    ref = jax.jit(jax.grad(loss), static_argnums=3)(params, ids, mask, False)
    step = jax.jit(jax.grad(loss), static_argnums=3)
    sharded = shard_params(cfg, params, mesh)
    lowered = step.lower(sharded, jax.device_put(ids, rows), jax.device_put(mask, rows), True)
    compiled = lowered.compile()
    got = compiled(sharded, jax.device_put(ids, rows), jax.device_put(mask, rows))
    diff = max(float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    # collectives moving a whole-vocabulary dimension (logits [N, V], the head or its gradient)
    collective = re.compile(r"= (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all)\(")
    whole = [line.strip()[:120] for line in compiled.as_text().splitlines()
             if (m := collective.search(line)) and any(str(cfg.vocab_size) in dims.split(",")
                                                       for dims in re.findall(r"\[([\d,]*)\]", m.group(1)))]
    report[family] = {"diff": diff, "whole_vocabulary_collectives": whole}
print("REPORT" + json.dumps(report))
"""


@pytest.mark.parametrize("family", [
    "qwen2",  # a tied embedding [V, H]
    pytest.param("qwen3", marks=pytest.mark.slow),  # an untied lm head [H, V]: 12 s more in a fresh clone's suite
])
def test_the_lm_head_runs_vocabulary_parallel_on_the_trainer_mesh(family):
    """With rows split over fsdp, each device computes its vocabulary slice of the lm head: no
    collective moves a whole-vocabulary tensor (logits, the head or its gradient: 1.8 GiB per
    v6e chip for Qwen3-1.7B), and the gradients equal the single-device ones."""
    proc = run_python(HEAD_CHILD, env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"), timeout=110,
                      args=(family,))
    report = json.loads(proc.stdout.split("REPORT", 1)[1])
    for family, result in report.items():
        assert result["diff"] < 1e-5, (family, result)  # relative to each gradient's largest entry
        assert result["whole_vocabulary_collectives"] == [], (family, result)
