"""A small greedy decoder for SFT tests and ``scripts/sft_demo.py``: the model's own
forward with a KV cache, no engine. Left-pads the prompts to one bucket, prefills them in
one call, then decodes every row one token per call until EOS or ``max_new_tokens``."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from asyncrl.model import forward_jit, init_kv_cache


def greedy_completions(
    graphdef: Any, params: Any, model_cfg: Any, workflow: Any, samples: Sequence[Mapping[str, Any]],
    *, max_new_tokens: int, stop_token_ids: Sequence[int], prompt_bucket: int = 16,
) -> list[str]:
    """Greedy completion text of each sample's chat-templated prompt (EOS excluded)."""
    tokenizer = workflow.tokenizer
    prompts = [
        workflow.prompt_ids(workflow.messages(s)[0])
        for s in samples
    ]
    width = -(-max(len(p) for p in prompts) // prompt_bucket) * prompt_bucket
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for row, prompt in enumerate(prompts):  # left padding: every row's last prompt token is at -1
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = True
    cache = init_kv_cache(model_cfg, batch=len(prompts), capacity=width + max_new_tokens)
    logits, cache = forward_jit(graphdef, params, jnp.asarray(ids), None, jnp.asarray(mask), cache)
    stops = np.asarray(list(stop_token_ids))
    done = np.zeros(len(prompts), bool)
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        next_ids = np.asarray(jnp.argmax(logits[:, -1], axis=-1)).astype(np.int32)
        for row in np.flatnonzero(~done).tolist():
            if next_ids[row] in stops:
                done[row] = True
            else:
                outputs[row].append(int(next_ids[row]))
        if done.all():
            break
        logits, cache = forward_jit(graphdef, params, jnp.asarray(next_ids[:, None]), None,
                                    jnp.asarray(~done[:, None]), cache)
    return [tokenizer.decode(out, skip_special_tokens=True) for out in outputs]


def greedy_exact_match(graphdef: Any, params: Any, model_cfg: Any, workflow: Any,
                       samples: Sequence[Mapping[str, Any]], **kwargs: Any) -> float:
    """Fraction of samples whose stripped greedy completion equals their ``answer``."""
    completions = greedy_completions(graphdef, params, model_cfg, workflow, samples, **kwargs)
    return float(np.mean([c.strip() == s["answer"] for c, s in zip(completions, samples)]))
