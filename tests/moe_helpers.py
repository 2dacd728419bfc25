"""A tiny random Qwen3-MoE checkpoint written by transformers (4 experts, top-2, layer 1 dense
through ``mlp_only_layers``), for the MoE tests of the model, the engine and the trainer."""

from __future__ import annotations

from typing import Any

from tests.model_helpers import randomize_weights

TINY_MOE: dict[str, Any] = dict(
    model_type="qwen3_moe", vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
    max_position_embeddings=128, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, eos_token_id=2, use_sliding_window=False,
)


def save_tiny_moe(out_dir, seed: int = 0, weight_std: float = 0.15, **overrides):
    """A random Qwen3-MoE checkpoint written by transformers; returns its torch model (float32, eval)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(seed)
    kwargs = {**TINY_MOE, **overrides}
    cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    cfg._attn_implementation = "eager"
    model = randomize_weights(AutoModelForCausalLM.from_config(cfg).eval(), weight_std)
    model.save_pretrained(out_dir)
    return model
