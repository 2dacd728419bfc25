"""Random-weight Hugging Face checkpoints written by transformers (PyTorch), for model tests.

Every weight (norms and biases included) is drawn at random, so a wrong bias, norm or
transpose cannot hide behind HF's zero/one initialisation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Tiny configs of the three families; each exercises a different option.
FAMILIES = {
    # Qwen2: q/k/v bias, tied head (transformers 5 omits lm_head.weight from the file).
    "qwen2": dict(
        model_type="qwen2", vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=[3, 4], pad_token_id=0, use_sliding_window=False,
    ),
    # Qwen3: per-head q/k norm, untied head, head_dim (32) != hidden / heads (16).
    "qwen3": dict(
        model_type="qwen3", vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, eos_token_id=2,
        use_sliding_window=False,
    ),
    # Llama: Llama-3 rope scaling (original context 32 so the scaling changes frequencies here).
    "llama": dict(
        model_type="llama", vocab_size=44, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-5, max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        eos_token_id=[1, 2], bos_token_id=1,
    ),
    # Gemma 3: (1 + w) norms, sandwich norms, GeGLU, scaled embeddings, q/k norms, head_dim (32) != hidden / heads,
    # sliding layers (window 4 < the tests' sequences) between global ones with their own rope bases (the global
    # one linearly scaled), query_pre_attn_scalar != head_dim, final-logit soft-capping that bites, tied head.
    "gemma3": dict(
        model_type="gemma3_text", vocab_size=52, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=128,
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
        query_pre_attn_scalar=24, final_logit_softcapping=3.0, tie_word_embeddings=True,
        eos_token_id=[1, 3], bos_token_id=2, pad_token_id=0,
    ),
}


def hf_config(family: str, **overrides):
    from transformers import AutoConfig

    kwargs = {**FAMILIES[family], **overrides}
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def make_hf_model(family: str, seed: int = 0, *, weight_std: float = 0.08, **config_overrides):
    """A transformers model of ``family`` with every parameter random (eager attention, eval).
    A larger ``weight_std`` gives sharper logits (fewer near-ties for greedy comparisons)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(seed)
    cfg = hf_config(family, **config_overrides)
    cfg._attn_implementation = "eager"
    return randomize_weights(AutoModelForCausalLM.from_config(cfg).eval(), weight_std)


def randomize_weights(model, weight_std: float = 0.08):
    """Non-trivial random weights in place (norms near 1, small biases): a random init leaves norms
    at exactly 1 and biases at 0, which would hide a norm or bias bug. Returns ``model``."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(weight_std * torch.randn_like(p))
    return model


def save_hf_model(family: str, out_dir: Path, seed: int = 0, dtype=None, *, weight_std: float = 0.08,
                  config_overrides: dict | None = None, **save_kwargs):
    """Write a random ``family`` checkpoint with transformers; returns the torch model (float32)."""
    import torch

    model = make_hf_model(family, seed, weight_std=weight_std, **(config_overrides or {}))
    if dtype is not None:
        model.to(dtype).save_pretrained(out_dir, **save_kwargs)
        model.to(torch.float32)
    else:
        model.save_pretrained(out_dir, **save_kwargs)
    return model


def hf_logits(model, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """float32 logits [B, T, V] from a transformers model; positions count real tokens only,
    as ``generate`` computes them, so left padding matches our default positions."""
    import torch

    ids = torch.tensor(np.asarray(input_ids), dtype=torch.long)
    kwargs = {}
    if attention_mask is not None:
        mask = torch.tensor(np.asarray(attention_mask), dtype=torch.long)
        kwargs["attention_mask"] = mask
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(ids, **kwargs).logits.float().numpy()


def rewrite_config(model_dir: Path, **changes) -> dict:
    """Edit ``config.json`` in place (a value of None deletes the key); returns the new dict."""
    path = Path(model_dir) / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2))
    return data
