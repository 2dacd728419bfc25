"""Per-token log-probabilities: the one function the engine, trainer and reference model use.

``logprobs[b, t] = log_softmax(logits[b, t - 1] / T)[input_ids[b, t]]`` and
``entropy[b, t]`` = the entropy of that same distribution, float32. Both are 0 at
``t = 0`` and wherever token ``t`` or token ``t - 1`` is padding (so the first real
token of a left-padded row, which has no context, is 0 too; for right-padded rows
this is exactly "0 on padding"). Nothing else in asyncrl shifts logits.

With a chunk size the lm head runs over ``chunk`` positions at a time under
``jax.checkpoint``, so neither the forward nor the backward pass holds more than
``[B, chunk, V]`` float32 logits: this is what bounds memory at large vocabularies.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx


def token_logprobs_from_logits(logits: jax.Array, tokens: jax.Array, temperature: float | jax.Array = 1.0):
    """``(log_softmax(logits / T)[tokens], entropy)`` float32, over the last axis.

    ``logits [..., V]``, ``tokens int [...]``. No shifting: the engine uses this on the
    logits it samples from; :func:`per_token_logprobs` uses it after shifting.
    """
    z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    log_p = jax.nn.log_softmax(z, axis=-1)
    chosen = jnp.take_along_axis(log_p, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    return chosen, entropy


def per_token_logprobs(
    graphdef: nnx.GraphDef,
    params: Any,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: Optional[int] = None,
    positions: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
    """``(logprobs [B, L], entropy [B, L])`` float32, aligned with ``input_ids``.

    ``graphdef, params`` come from ``nnx.split(model)`` (params: State or pure dict);
    ``attention_mask`` bool [B, L] marks real tokens; ``temperature`` > 0 divides the
    logits before ``log_softmax``. ``chunk_size`` (default: the model config's
    ``logprob_chunk_size``; None = no chunking) bounds the lm-head memory. Traceable
    and differentiable: call it inside your jitted loss, or use
    :data:`per_token_logprobs_jit`.
    """
    model = nnx.merge(graphdef, params)
    if chunk_size is None:
        chunk_size = model.cfg.logprob_chunk_size
    attention_mask = attention_mask.astype(bool)
    hidden, _ = model.hidden_states(input_ids, positions, attention_mask)  # [B, L, H]
    b, length, _ = hidden.shape
    # Position t's logits score token t + 1; the last position scores nothing.
    targets = jnp.concatenate([input_ids[:, 1:], jnp.zeros((b, 1), input_ids.dtype)], axis=1)

    if chunk_size is None or chunk_size >= length:
        lp, ent = token_logprobs_from_logits(model.logits(hidden), targets, temperature)
    else:
        n_chunks = -(-length // chunk_size)
        pad = n_chunks * chunk_size - length
        h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        tg = jnp.pad(targets, ((0, 0), (0, pad)))
        h = h.reshape(b, n_chunks, chunk_size, -1).swapaxes(0, 1)
        tg = tg.reshape(b, n_chunks, chunk_size).swapaxes(0, 1)

        @jax.checkpoint
        def one_chunk(args):
            h_c, t_c = args
            return token_logprobs_from_logits(model.logits(h_c), t_c, temperature)

        lp, ent = jax.lax.map(one_chunk, (h, tg))
        lp = lp.swapaxes(0, 1).reshape(b, -1)[:, :length]
        ent = ent.swapaxes(0, 1).reshape(b, -1)[:, :length]

    scored = attention_mask[:, 1:] & attention_mask[:, :-1]  # token t and its context t-1 are real
    zeros = jnp.zeros((b, 1), jnp.float32)
    logprobs = jnp.concatenate([zeros, jnp.where(scored, lp[:, :-1], 0.0)], axis=1)
    entropy = jnp.concatenate([zeros, jnp.where(scored, ent[:, :-1], 0.0)], axis=1)
    return logprobs, entropy


per_token_logprobs_jit = jax.jit(per_token_logprobs, static_argnums=0, static_argnames=("chunk_size",))
"""``per_token_logprobs`` jitted at module level (graphdef and chunk_size static)."""
