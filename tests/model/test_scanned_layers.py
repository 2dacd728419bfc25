"""``model.scan_layers``: identical decoder layers run as one ``lax.scan`` in training and scoring
(asyncrl/model/transformer.py: scanned_layers), with the same numbers as the unrolled layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncrl.config import load_config
from asyncrl.model import init_decoder, per_token_logprobs, split_params
from asyncrl.model.config import DecoderConfig
from asyncrl.model.loading import auto_scan_layers, runtime_options
from asyncrl.model.transformer import _identical_runs, forward

IDS = jnp.asarray(np.random.default_rng(0).integers(3, 60, (3, 12)), jnp.int32)
MASK = jnp.asarray(np.arange(12)[None] < np.array([12, 9, 5])[:, None])


def _config(layers: int = 3, **runtime) -> DecoderConfig:
    return DecoderConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=layers,
                         num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, **runtime)


def _loss_and_grads(cfg: DecoderConfig):
    graphdef, params = split_params(init_decoder(cfg, seed=1))

    def loss(p):
        logprobs, entropy = per_token_logprobs(graphdef, p, IDS, MASK, 0.9)
        return logprobs.sum() + 0.1 * entropy.sum()

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("remat", [None, pytest.param("save_dots", marks=pytest.mark.slow)])
def test_scanned_layers_give_the_unrolled_loss_and_gradients(remat):
    options = {} if remat is None else {"remat": True, "remat_policy": remat}
    loss, grads = _loss_and_grads(_config(**options))
    scanned_loss, scanned_grads = _loss_and_grads(_config(scan_layers=True, **options))
    np.testing.assert_allclose(scanned_loss, loss, rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(scanned_grads)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_the_scanned_program_compiles_one_layer_whatever_the_depth():
    """Scanned, the compiled forward has the same matmuls at 2 and 6 layers (one body in a while
    loop); unrolled, it grows with every layer."""

    def matmuls(cfg: DecoderConfig) -> int:
        graphdef, params = split_params(init_decoder(cfg))
        text = jax.jit(lambda p: forward(graphdef, p, IDS, None, MASK)[0]).lower(params).compile().as_text()
        return str(text).count(" dot(")

    assert matmuls(_config(2, scan_layers=True)) == matmuls(_config(6, scan_layers=True))
    assert matmuls(_config(6)) > matmuls(_config(2))


def test_layers_that_differ_are_scanned_in_runs_of_identical_ones():
    model = init_decoder(_config(4))
    runs = _identical_runs(model.layers)
    assert [len(states) for _, states in runs] == [4]
    # A layer with another structure (here its MLP without biases replaced by one with) splits the run.
    model.layers[2].mlp.up_proj = nnx.Linear(32, 64, use_bias=True, rngs=nnx.Rngs(0))
    assert [len(states) for _, states in _identical_runs(model.layers)] == [2, 1, 1]


def test_auto_scans_on_accelerators_and_not_on_cpu():
    assert auto_scan_layers("gpu") and auto_scan_layers("tpu") and not auto_scan_layers("cpu")
    section = load_config(data={}).model
    assert section.scan_layers == "auto"
    assert runtime_options(section, "gpu")["scan_layers"] is True
    assert runtime_options(section, "cpu")["scan_layers"] is False


def test_plan_counts_the_stacked_copy_only_when_scanning():
    from asyncrl.plan.activations import layer_share
    from asyncrl.plan.formulas import plan_config

    cfg = load_config(data={"model": {"compute_dtype": "float32"}})
    model_cfg = _config(4)
    on_gpu = {line.name: line.bytes for line in plan_config(cfg, model_cfg=model_cfg, backend="gpu").lines}
    on_cpu = {line.name: line.bytes for line in plan_config(cfg, model_cfg=model_cfg, backend="cpu").lines}
    layer_params = int(model_cfg.num_params() * layer_share(model_cfg))
    assert layer_params == 4 * (model_cfg.num_params() - 2 * 64 * 32 - 32) // 4
    assert on_gpu["stacked layers"] == layer_params * 4  # the float32 weights (their gradient is the micro-batch's)
    assert "stacked layers" not in on_cpu


@pytest.mark.slow  # the plain scanned layers stay in the default selection
def test_scanned_lora_layers_with_dropout_give_the_unrolled_loss_and_gradients():
    """Adapters, their dropout keys and the frozen base stack like any layer variable."""
    from asyncrl.model.lora import LoraSpec, attach_lora
    from asyncrl.trainer.losses import lora_weights

    key = jax.random.key_data(jax.random.key(3))
    results = []
    for scan in (False, True):
        cfg = _config(scan_layers=scan)
        lm = attach_lora(cfg, split_params(init_decoder(cfg, seed=1))[1], LoraSpec(rank=4, alpha=8, dropout=0.1), seed=2)
        adapters = jax.tree.map(lambda x: x + 0.05, lm.adapters)  # B = 0 at init: move off it

        def loss(a, lm=lm):
            return per_token_logprobs(lm.graphdef, lora_weights(lm.frozen, 0.1, a, key), IDS, MASK, 1.0)[0].sum()

        results.append(jax.jit(jax.value_and_grad(loss))(adapters))
    (loss, grads), (scanned_loss, scanned_grads) = results
    np.testing.assert_allclose(scanned_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(scanned_grads)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_a_run_of_one_layer_keeps_its_remat_and_only_runs_of_two_or_more_are_stacked():
    """A layer alone between layers of another kind (Gemma 3's global layers) is called outside any
    scan: its remat needs JAX's optimization barrier, else XLA merges the recompute with the forward
    and keeps the whole layer's activations (seen in XLA's buffer assignment for an L4). The plan
    stacks only the layers in runs of two or more."""
    from asyncrl.plan.activations import stacked_layers

    cfg = _config(3, remat=True, scan_layers=True).replace(
        layer_types=("sliding_attention", "sliding_attention", "full_attention"), sliding_window=4)
    assert stacked_layers(cfg) == [0, 1]
    graphdef, params = split_params(init_decoder(cfg, seed=1))
    jaxpr = str(jax.make_jaxpr(lambda p: per_token_logprobs(graphdef, p, IDS, MASK, 1.0)[0].sum())(params))
    assert jaxpr.count("prevent_cse=True") == 1 and jaxpr.count("prevent_cse=False") == 1  # the single layer, the scan
    uniform = cfg.replace(layer_types=None, sliding_window=None)
    assert stacked_layers(uniform) == [0, 1, 2]
