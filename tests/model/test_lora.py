"""LoRA: parity with transformers + PEFT, frozen base, merged serving, export.

References are independent of our LoRA code: PEFT's own ``LoraModel`` on the exported
adapter (log-probs), and our LoRA forward without merging (the engine's greedy tokens).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.model import forward_jit, load_model, per_token_logprobs_jit
from asyncrl.model.lora import (
    LoraSpec,
    attach_lora,
    combine_params,
    export_peft_adapter,
    merge_lora_jit,
    partition_params,
)
from tests.model_helpers import FAMILIES, save_hf_model
from tests.trainer_fixtures import make_batch, tiny_model, trainer_config

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapters(adapters: dict, seed: int, std: float = 0.05) -> dict:
    """Non-zero A and B (a fresh adapter has B = 0, which would hide a wrong B or scale)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * std, x.dtype), adapters)


def hf_logprobs(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Our log-prob convention (aligned with ids, 0 at t = 0 and on padding) from a torch model."""
    import torch

    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=(torch.tensor(mask, dtype=torch.long).cumsum(-1) - 1).clamp(min=0),
        ).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, torch.tensor(ids[:, 1:, None], dtype=torch.long))[..., 0]
    out = np.zeros(ids.shape, np.float32)
    out[:, 1:] = np.where(mask[:, 1:] & mask[:, :-1], logp.numpy(), 0.0)  # a token after a pad has no context: 0
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "gemma3"])
def test_logprobs_match_transformers_peft_on_the_exported_adapter(family, tmp_path):
    from peft import PeftModel

    torch_model = save_hf_model(family, tmp_path / "base", seed=1)
    lm = load_model(str(tmp_path / "base"), with_tokenizer=False)
    _, base = lm.split()
    # Not every module (k_proj and up_proj stay plain); rank 4, alpha 8: scale 2.
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    lora = attach_lora(lm.config, base, spec, seed=0)
    adapters = random_adapters(lora.adapters, seed=2)
    export_peft_adapter(adapters, spec, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"

    peft_model = PeftModel.from_pretrained(torch_model, str(tmp_path / "adapter")).eval()
    rng = np.random.default_rng(3)
    ids = rng.integers(5, FAMILIES[family]["vocab_size"], size=(3, 12)).astype(np.int32)
    mask = np.ones(ids.shape, bool)
    mask[1, 9:] = False  # right padding
    mask[2, :3] = False  # left padding
    want = hf_logprobs(peft_model, ids, mask)
    got, _ = per_token_logprobs_jit(lora.graphdef, combine_params(lora.frozen, adapters), ids, mask, 1.0)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)
    # Not vacuous: the adapters move the log-probs well beyond the tolerance.
    plain, _ = per_token_logprobs_jit(lora.graphdef, combine_params(lora.frozen, lora.adapters), ids, mask, 1.0)
    assert np.max(np.abs(np.asarray(plain) - want)) > 1e-2


def test_training_step_changes_only_adapters_and_optimizer_state_is_adapters_only():
    from flax import nnx

    from asyncrl.trainer import Trainer

    graphdef, params = tiny_model(layers=1)
    cfg = trainer_config(model={"lora": {"rank": 4, "dropout": 0.1}}, algo={"kl_coef": 0.1})
    lora = attach_lora(nnx.merge(graphdef, params).cfg, params, LoraSpec.from_config(cfg.model.lora))
    trainer = Trainer(cfg, lora.graphdef, lora.adapters, frozen=lora.frozen)
    base_before = jax.tree.map(np.array, trainer.base_params)
    adapters_before = jax.tree.map(np.array, trainer.params)
    for seed in (1, 2):
        metrics = trainer.step(make_batch(seed=seed))
    base_after = jax.tree.map(np.asarray, trainer.base_params)
    assert jax.tree.structure(base_after) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(base_after)))
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(adapters_before), jax.tree.leaves(trainer.params))]
    assert len(moved) == 2 * len(ALL_TARGETS) and min(moved) > 0
    paths = [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
             for path, leaf in jax.tree_util.tree_flatten_with_path(trainer.opt_state)[0] if np.ndim(leaf) > 0]
    assert paths and all(".lora.lora_" in p for p in paths), paths
    # Bytes: optimizer state is two Adam moments of the adapters (+ scalar counts); the KL
    # reference is the stage's starting adapters, not a second copy of the base.
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters_before))
    assert metrics["memory/trainable_param_bytes"] == adapter_bytes
    assert 2 * adapter_bytes <= metrics["memory/opt_state_bytes"] < 2 * adapter_bytes + 64
    assert metrics["memory/frozen_param_bytes"] >= sum(x.nbytes for x in jax.tree.leaves(base_before))
    assert sum(x.nbytes for x in jax.tree.leaves(trainer.ref_params)) == adapter_bytes
    assert metrics["train/kl_ref"] != 0  # step 2 moved away from the reference

    # Published weights are the merged model in the base structure.
    published = trainer.params_for_publish()
    assert jax.tree.structure(published) == jax.tree.structure(params)


def greedy_reference(graphdef, params, prompt: list[int], new_tokens: int, length: int = 32) -> list[int]:
    """Greedy decoding by a full forward over the (right-padded) sequence per token: no KV cache."""
    seq = list(prompt)
    for _ in range(new_tokens):
        ids = np.zeros((1, length), np.int32)
        mask = np.zeros((1, length), bool)
        ids[0, : len(seq)] = seq
        mask[0, : len(seq)] = True
        logits, _ = forward_jit(graphdef, params, ids, None, mask)
        seq.append(int(np.argmax(np.asarray(logits)[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_engine_greedy_output_with_lora_equals_the_unmerged_lora_model():
    from asyncrl.config import EngineConfig
    from asyncrl.engine.jax_engine import JaxEngine
    from asyncrl.engine.protocol import GenerationRequest

    lm = load_model("tiny", with_tokenizer=False)
    graphdef, base = lm.split()
    spec = LoraSpec(rank=8, alpha=16.0, target_modules=ALL_TARGETS)
    lora = attach_lora(lm.config, base, spec)
    adapters = random_adapters(lora.adapters, seed=5, std=0.3)
    merged = merge_lora_jit(partition_params(lora.frozen)[0], adapters, scale=spec.scale, model_cfg=lm.config, mesh=None)
    engine = JaxEngine(graphdef, base, stop_token_ids=lm.stop_token_ids, seed=0,
                       config=EngineConfig(slots=4, kv_capacity=32, decode_chunk=4, prefill_buckets=[8]))
    try:
        engine.update_weights(merged, 1)  # the publish path: merged weights, next version
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(6, 28, size=n)] for n in (3, 5, 7)]
        differs = False
        for prompt in prompts:
            (response,) = engine.generate(GenerationRequest(prompt_ids=prompt, greedy=True, max_new_tokens=12, stop_token_ids=[]))
            want = greedy_reference(lora.graphdef, combine_params(lora.frozen, adapters), prompt, 12)
            assert list(response.output_ids) == want
            assert set(response.versions.tolist()) == {1}
            differs |= want != greedy_reference(graphdef, base, prompt, 12)
        assert differs  # the adapters change the greedy continuation (the comparison is not vacuous)
    finally:
        engine.shutdown()
