"""The policy model: a Flax NNX decoder (Qwen2/2.5, Qwen3, Llama, Gemma 3) with Hugging Face interop.

API guide
---------
Load (a local HF directory, ``tiny`` / ``tiny:hidden=128,layers=4``, a hub id, or a
``ModelConfig`` section)::

    from asyncrl.model import load_model, split_params, forward_jit, per_token_logprobs
    lm = load_model("tiny")                 # or load_model(cfg.model)
    model, tokenizer = lm.model, lm.tokenizer
    lm.stop_token_ids                        # generation_config.json eos ids (tuple)
    lm.pad_token_id                          # may equal an EOS id: use masks, never ids

Split into a static graphdef and an immutable params pytree (pure dict of
``jax.Array``; this is what the trainer publishes to the engine)::

    graphdef, params = split_params(model)   # == lm.split()

Forward without a cache (training; ``attention_mask`` bool [B, T], positions default
to ``cumsum(mask) - 1`` so left padding is fine)::

    logits, _ = forward_jit(graphdef, params, input_ids, None, attention_mask)  # float32 [B, T, V]

Forward with a KV cache (prefill, then decode 1 or more tokens per call; see
:mod:`asyncrl.model.kv_cache` for the slot/position protocol and the paged cache the engine uses)::

    cache = init_kv_cache(model.cfg, batch=B, capacity=C)
    logits, cache = forward_jit(graphdef, params, prompt_ids, None, prompt_mask, cache)
    logits, cache = forward_jit(graphdef, params, next_ids[:, None], None, active[:, None], cache)

Log-probabilities (docs/design.md "Log-probabilities": aligned with input_ids, 0 at t=0 and on padding,
temperature before log_softmax, float32, entropy alongside; differentiable)::

    logprobs, entropy = per_token_logprobs(graphdef, params, input_ids, attention_mask, temperature)
    # chunk_size=... overrides model.cfg.logprob_chunk_size (ModelConfig.logprob_chunk_size)
    lp, ent = token_logprobs_from_logits(step_logits, sampled_ids, temperature)  # engine: no shift

Export an HF directory (``AutoModelForCausalLM.from_pretrained`` loads it)::

    export_hf(model, tokenizer, out_dir)                     # or export_hf(graphdef, tok, out, params=params)

Shard parameters on a mesh with axes ``data``, ``fsdp``, ``tensor``::

    from asyncrl.model.sharding import param_shardings, shard_params
    params = shard_params(model.cfg, params, mesh)   # param_shardings(...) for jit in/out_shardings

Reference configs: ``tiny`` (on disk, cached; :data:`TINY_ALPHABET` is its character
set), ``tiny-qwen3`` (on disk, cached: Qwen3-shaped with a BPE tokenizer trained on GSM8K,
:mod:`asyncrl.model.tiny_qwen3`) and ``bench_40m_config()`` (in memory).
"""

from asyncrl.model.config import DecoderConfig, from_hf_config, to_hf_config
from asyncrl.model.hf import LoadedModel, export_hf
from asyncrl.model.kv_cache import KVCache, init_kv_cache
from asyncrl.model.loading import load_model
from asyncrl.model.logprobs import per_token_logprobs, per_token_logprobs_jit, token_logprobs_from_logits
from asyncrl.model.tiny import TINY_ALPHABET, bench_40m_config, build_tiny_tokenizer, ensure_tiny
from asyncrl.model.transformer import Decoder, forward, forward_jit, hidden_states, init_decoder, split_params

__all__ = [
    "DecoderConfig",
    "from_hf_config",
    "to_hf_config",
    "LoadedModel",
    "export_hf",
    "load_model",
    "per_token_logprobs",
    "per_token_logprobs_jit",
    "token_logprobs_from_logits",
    "TINY_ALPHABET",
    "bench_40m_config",
    "build_tiny_tokenizer",
    "ensure_tiny",
    "Decoder",
    "KVCache",
    "forward",
    "forward_jit",
    "hidden_states",
    "init_decoder",
    "init_kv_cache",
    "split_params",
]
