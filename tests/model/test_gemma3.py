"""Gemma 3 text models: what the family-parametrised tests (logit, KV-cache, export and LoRA parity in
tests/model/, greedy generation in tests/engine/test_engine_hf.py) leave unsaid: that the tiny config
exercises every Gemma option (each one moves the logits), a ``gemma3`` config's text part, and the
one-line refusals of what is not implemented."""

from __future__ import annotations

import json
from typing import cast

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncrl.cli import main
from asyncrl.errors import ModelError
from asyncrl.model import load_model
from asyncrl.model.config import from_hf_config, hf_config_from_dict
from asyncrl.model.transformer import forward_jit, init_decoder, split_params
from tests.helpers import REPO_ROOT
from tests.model_helpers import FAMILIES, hf_config, hf_logits, save_hf_model

torch = pytest.importorskip("torch")

SEQ = 12
GEMMA = FAMILIES["gemma3"]
VOCAB = cast(int, GEMMA["vocab_size"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    hf = save_hf_model("gemma3", path, seed=4)
    return path, hf, load_model(str(path), with_tokenizer=False)


def _batch(seed: int = 0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(5, VOCAB, size=(2, SEQ)).astype(np.int32)
    mask = np.ones(ids.shape, bool)
    mask[1, :3] = False  # left padding: the window counts tokens, not pads
    return ids, mask


def _logits(graphdef, params, ids, mask) -> np.ndarray:
    return np.asarray(forward_jit(graphdef, params, jnp.asarray(ids), None, jnp.asarray(mask))[0])


@pytest.mark.slow  # 10 s cold; a check of the parity test's reach, not of the model
def test_every_gemma_option_moves_the_logits_the_parity_test_checks(checkpoint):
    _, hf, lm = checkpoint
    cfg = lm.config
    assert {"sliding_attention", "full_attention"} <= set(cfg.layer_types) and cfg.sliding_window < SEQ
    assert cfg.norm_plus_one and cfg.sandwich_norms and cfg.scale_embeddings and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.rope_type == "linear" and cfg.rope_local_theta == 100.0
    ids, mask = _batch()
    ref = hf_logits(hf, ids, mask)
    assert np.abs(_logits(*lm.split(), ids, mask) - ref)[mask].max() < 1e-4
    variants = {
        "no sliding window": dict(layer_types=None, sliding_window=None),
        "no soft-capping": dict(final_logit_softcap=None),
        "head_dim scaling": dict(query_pre_attn_scalar=None),
        "one rope base": dict(rope_local_theta=cfg.rope_theta),
        "silu": dict(hidden_act="silu"),
        "plain norms": dict(norm_plus_one=False),
        "unscaled embeddings": dict(scale_embeddings=False),
    }
    for name, change in variants.items():
        model = init_decoder(cfg.replace(**change))
        nnx.update(model, nnx.state(lm.model))
        diff = np.abs(_logits(*split_params(model), ids, mask) - ref)[mask].max()
        assert diff > 1e-3, f"{name}: the tiny config does not exercise it ({diff})"


def test_a_gemma3_config_without_vision_tower_is_its_text_model(checkpoint, tmp_path):
    """A ``gemma3`` checkpoint of the language model alone: ``text_config`` + ``model.language_model.*`` tensors."""
    from safetensors.numpy import load_file, save_file

    path, hf, lm = checkpoint
    text = json.loads((path / "config.json").read_text())
    outer = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
             "eos_token_id": text["eos_token_id"]}
    (tmp_path / "config.json").write_text(json.dumps(outer))
    tensors = load_file(str(path / "model.safetensors"))
    save_file({name.replace("model.", "model.language_model.", 1): value for name, value in tensors.items()},
              str(tmp_path / "model.safetensors"))
    wrapped = load_model(str(tmp_path), with_tokenizer=False)
    assert wrapped.config == lm.config and wrapped.stop_token_ids == lm.stop_token_ids
    ids, mask = _batch(1)
    assert np.array_equal(_logits(*wrapped.split(), ids, mask), _logits(*lm.split(), ids, mask))


def _raw(**changes):
    raw = {k: v for k, v in GEMMA.items()}
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


@pytest.mark.parametrize("raw,option", [
    ({"model_type": "gemma3", "text_config": _raw(), "vision_config": {"model_type": "siglip_vision_model"}},
     "vision_config"),
    (_raw(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (_raw(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (_raw(hidden_activation="gelu"), "hidden_activation"),
    (_raw(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "sliding_attention.rope_type"),
    (_raw(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types"),
], ids=["vision", "attn-softcap", "bidirectional", "gelu", "sliding-rope-scaling", "layer-type"])
def test_unsupported_options_are_refused_in_one_line_naming_them(raw, option, tmp_path, capsys):
    with pytest.raises(ModelError, match=option.replace(".", r"\.")):
        from_hf_config(hf_config_from_dict(raw))
    # before step 1: `asyncrl plan` (and a run's model load) stop on the config alone
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["plan", str(REPO_ROOT / "configs" / "quickstart.yaml"), "--set", f"model.path={tmp_path}"]) == 1
    err = capsys.readouterr().err.strip()
    assert option in err and len(err.splitlines()) == 1, err


def test_transformers_own_gemma3_config_is_refused_for_its_vision_tower():
    from transformers import Gemma3Config

    with pytest.raises(ModelError, match="vision_config"):
        from_hf_config(Gemma3Config(text_config=hf_config("gemma3").to_dict()))


def test_a_gemma3_critic_is_refused_before_training(checkpoint):
    """transformers has no Gemma3ForTokenClassification to export a value model as (hf_critic/)."""
    from asyncrl.model.critic import critic_from_policy, load_critic

    path, _, lm = checkpoint
    with pytest.raises(ModelError, match="critic.*gemma3_text"):
        critic_from_policy(lm.config, lm.split()[1])
    with pytest.raises(ModelError, match="critic.path.*gemma3_text"):
        load_critic(path, vocab_size=VOCAB)


TENSOR_PARALLEL_CODE = """
import numpy as np, jax
from asyncrl.cluster.placement import engine_mesh, resolve_placement
from asyncrl.config import EngineConfig, load_config
from asyncrl.engine.jax_engine import JaxEngine
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.model import load_model
assert jax.device_count() == 4
lm = load_model("tiny:family=gemma3", with_tokenizer=False)  # 2 KV heads; a sliding layer (window 8), a global one
graphdef, params = lm.split()
ENGINE = {"slots": 4, "kv_capacity": 48, "decode_chunk": 4, "prefill_buckets": [16]}
requests = [GenerationRequest(prompt_ids=[int(t) for t in np.random.default_rng(i).integers(6, 28, size=11)], n=2,
                              greedy=True, max_new_tokens=14, stop_token_ids=[]) for i in range(2)]

def tokens(engine):
    return [r.output_ids.tolist() for q in requests for r in engine.generate(q)]

single = JaxEngine(graphdef, params, config=EngineConfig(**ENGINE))
reference = tokens(single)
single.shutdown()
cfg = load_config(data={"placement": {"trainer": "0:2", "engine": "2:4"}, "engine": {**ENGINE, "tensor_parallel": 2},
                        "data": {"max_prompt_tokens": 16}, "rollout": {"max_new_tokens": 16, "group_size": 2}})
engine = JaxEngine(graphdef, params, config=cfg.engine, mesh=engine_mesh(resolve_placement(cfg)))
assert tokens(engine) == reference
assert {s.data.shape[1] for s in engine.runner.pool[0].kv.addressable_shards} == {1}  # one KV head per device
engine.shutdown()
print("tensor-parallel gemma3 engine matches")
"""


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_tensor_parallel_engine_decodes_the_tiny_gemma3_as_one_device_does():
    """Prompts of 11 tokens and 14 new ones: the sliding layer's window (8) is crossed in prefill and decode."""
    from tests.helpers import run_python, subprocess_env

    proc = run_python(TENSOR_PARALLEL_CODE, env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=4"),
                      timeout=200)
    assert "tensor-parallel gemma3 engine matches" in proc.stdout


@pytest.mark.slow  # over the default selection's time on the CI machine (tests/README.md)
def test_scanned_gemma3_layers_give_the_unrolled_logits_and_gradients(checkpoint):
    """``model.scan_layers`` (on by default on GPUs and TPUs): runs of sliding layers and global ones each
    take their own rope and mask, so scanning matches the unrolled layers (and transformers)."""
    import jax

    from asyncrl.model import per_token_logprobs

    _, hf, lm = checkpoint
    cfg = lm.config.replace(num_layers=5, layer_types=("sliding_attention",) * 2 + ("full_attention",) + ("sliding_attention",) * 2)
    ids, mask = _batch(2)

    def loss_and_grads(model_cfg):
        graphdef, params = split_params(init_decoder(model_cfg, seed=3))
        loss = lambda p: per_token_logprobs(graphdef, p, jnp.asarray(ids), jnp.asarray(mask), 0.9)[0].sum()  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    loss, grads = loss_and_grads(cfg)
    scanned_loss, scanned_grads = loss_and_grads(cfg.replace(scan_layers=True))
    np.testing.assert_allclose(scanned_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(scanned_grads)):  # float32 rounding of another op order
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    scanned = load_model(str(checkpoint[0]), with_tokenizer=False).config.replace(scan_layers=True)
    model = init_decoder(scanned)
    nnx.update(model, nnx.state(lm.model))
    assert np.abs(_logits(*split_params(model), ids, mask) - hf_logits(hf, ids, mask))[mask].max() < 1e-4
