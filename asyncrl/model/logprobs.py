"""Per-token log-probabilities: the one function the engine, trainer and reference model use.

``logprobs[b, t] = log_softmax(logits[b, t - 1] / T)[input_ids[b, t]]`` and
``entropy[b, t]`` = the entropy of that same distribution, float32. Both are 0 at
``t = 0`` and wherever token ``t`` or token ``t - 1`` is padding (so the first real
token of a left-padded row, which has no context, is 0 too; for right-padded rows
this is exactly "0 on padding"). Nothing else in asyncrl shifts logits.

Window. The trainer only needs the log-probs of trained (completion) tokens, and the lm
head (``hidden x vocab``) is a large share of a step's work: with ``window=W`` and
``window_start [B]`` only the ``W`` token positions ``window_start[b] + j`` of each row go
through the lm head, log-softmax and entropy, and the outputs are ``[B, W]`` (column ``j``
is position ``window_start[b] + j``; a position past ``L`` is 0). ``W`` is static, so a
window size compiles once; :func:`window_starts` picks starts that cover a mask.

Chunking. With a chunk size the lm head runs over ``chunk`` positions at a time under
``jax.checkpoint``, so neither the forward nor the backward pass holds more than
``[B, chunk, V]`` float32 logits: this is what bounds memory at large vocabularies.
With ``logprob_chunk_size`` null the chunk is chosen automatically
(:func:`auto_chunk_size`): none while one ``[B, positions, V]`` float32 logits tensor
fits ``logprob_chunk_budget_mb``, else the most positions that fit.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx


def token_logprobs_from_logits(logits: jax.Array, tokens: jax.Array, temperature: float | jax.Array = 1.0,
                               *, with_entropy: bool = True, allowed: Optional[jax.Array] = None):
    """``(log_softmax(logits / T)[tokens], entropy)`` float32, over the last axis.

    ``logits [..., V]``, ``tokens int [...]``. No shifting: the engine uses this on the
    logits it samples from; :func:`per_token_logprobs` uses it after shifting.
    ``with_entropy=False`` returns ``(logprobs, None)`` and skips the entropy's pass over
    the vocabulary (the chosen log-prob is ``z[token] - logsumexp(z)``: no ``[..., V]``
    log-softmax is materialised). ``temperature`` is a scalar or broadcasts against ``[..., 1]``;
    a scalar one takes the one-pass gradient of :func:`_chosen_logprob` (reverse mode only).

    ``allowed`` int32 ``[..., K]`` (optional): the tokens a trie constraint allowed at each
    position, ``-1`` padding; a position with any allowed token gets the log-prob (and entropy)
    of ``softmax(logits / T)`` restricted to them, which is the distribution the engine drew
    from (docs/decoding.md); positions with none are unconstrained.
    """
    if allowed is not None:
        return _masked_token_logprobs(logits, tokens, temperature, allowed, with_entropy)
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    tokens = tokens.astype(jnp.int32)
    tokens = jnp.where(tokens < 0, tokens + logits.shape[-1], tokens)  # as take_along_axis reads them
    if temperature.ndim == 0:
        chosen = _chosen_logprob(logits, tokens, temperature)
    else:  # a per-row temperature: plain autodiff (the one-pass backward assumes a scalar)
        chosen = _chosen_forward(logits, tokens, temperature)[0]
    if not with_entropy:
        return chosen, None
    z = logits / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    # H = lse - sum(p z): one reduction over z, no log_softmax tensor.
    p = jnp.exp(z - lse[..., None])
    entropy = lse - jnp.sum(p * z, axis=-1)
    return chosen, entropy


def _masked_token_logprobs(logits, tokens, temperature, allowed, with_entropy):
    """:func:`token_logprobs_from_logits` with a per-position allowed-token set (plain autodiff:
    the gradient reaches only the gathered ``[..., K]`` allowed logits and the chosen one)."""
    free, free_entropy = token_logprobs_from_logits(logits, tokens, temperature, with_entropy=with_entropy)
    z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    valid = allowed >= 0
    constrained = valid.any(axis=-1)
    z_allowed = jnp.where(valid, jnp.take_along_axis(z, jnp.maximum(allowed, 0), axis=-1), -jnp.inf)  # [..., K]
    lse = jax.nn.logsumexp(jnp.where(constrained[..., None], z_allowed, 0.0), axis=-1)
    chosen = jnp.take_along_axis(z, tokens.astype(jnp.int32)[..., None], axis=-1)[..., 0] - lse
    logprobs = jnp.where(constrained, chosen, free)
    if not with_entropy:
        return logprobs, None
    p = jnp.where(valid, jnp.exp(z_allowed - lse[..., None]), 0.0)
    entropy = lse - jnp.sum(p * jnp.where(valid, z_allowed, 0.0), axis=-1)
    return logprobs, jnp.where(constrained, entropy, free_entropy)


@jax.custom_vjp
def _chosen_logprob(logits: jax.Array, tokens: jax.Array, temperature: jax.Array) -> jax.Array:
    """``log_softmax(logits / T)[tokens]``: ``logits`` float32 ``[..., V]``, ``tokens`` int32 ``[...]``.

    Its own gradient because the automatic one takes several passes over ``[..., V]`` (softmax,
    the one-hot term, the temperature), each writing a tensor as large as the logits; here the
    logits' cotangent ``g * (onehot - softmax(z)) / T`` is one elementwise expression."""
    return _chosen_forward(logits, tokens, temperature)[0]


def _chosen_forward(logits, tokens, temperature):
    z = logits / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    chosen = jnp.take_along_axis(z, tokens[..., None], axis=-1)[..., 0] - lse
    return chosen, (logits, tokens, temperature, lse)


def _chosen_backward(residuals, g):
    logits, tokens, temperature, lse = residuals
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    onehot = (vocab == tokens[..., None]).astype(logits.dtype)
    d_logits = (onehot - jnp.exp(logits / temperature - lse[..., None])) * (g / temperature)[..., None]
    # z = logits / T, so dz/dT = -logits / T^2 = -(dz/dlogits) * logits / T.
    d_temperature = -jnp.sum(d_logits * logits) / temperature
    return d_logits, None, d_temperature.astype(temperature.dtype).reshape(temperature.shape)


_chosen_logprob.defvjp(_chosen_forward, _chosen_backward)


def auto_chunk_size(rows: int, positions: int, vocab: int, budget_mb: Optional[float]) -> Optional[int]:
    """Positions per lm-head chunk so that one float32 ``[rows, chunk, vocab]`` logits tensor fits
    ``budget_mb`` MiB; None (no chunking) when all ``positions`` fit or the budget is None/0."""
    if not budget_mb:
        return None
    per_position = rows * vocab * 4
    fits = int(budget_mb * 2**20 // max(per_position, 1))
    return None if fits >= positions else max(1, fits)


def window_starts(mask: jax.Array, window: int) -> jax.Array:
    """int32 ``[B]``: per row, the first position of a ``window``-wide span that holds every true
    entry of ``mask`` bool ``[B, L]`` (when the row's span fits ``window``): the first true
    position, moved left so that the window ends by ``L``. Rows without a true entry start at 0."""
    length = mask.shape[1]
    first = jnp.argmax(mask, axis=1).astype(jnp.int32)  # 0 for a row with no true entry
    return jnp.clip(first, 0, max(length - window, 0)).astype(jnp.int32)


def take_window(x: jax.Array, starts: jax.Array, window: int) -> jax.Array:
    """``x [B, L, ...]`` -> ``[B, window, ...]``: row b's positions ``starts[b] + j`` (clipped to
    ``L - 1``; callers mask those past the end)."""
    length = x.shape[1]
    idx = jnp.minimum(starts[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :], length - 1)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def _head_logprobs(model: Any, hidden: jax.Array, targets: jax.Array, temperature: Any, chunk_size: Optional[int],
                   with_entropy: bool, allowed: Optional[jax.Array] = None) -> tuple[jax.Array, Optional[jax.Array]]:
    """Log-probs (and entropy) of ``targets [B, P]`` from ``hidden [B, P, H]`` through the lm head,
    ``chunk_size`` positions at a time (None: all at once); ``allowed [B, P, K]``: a constraint's
    allowed tokens (:func:`token_logprobs_from_logits`)."""
    b, length, _ = hidden.shape
    if chunk_size is None or chunk_size >= length:
        return token_logprobs_from_logits(model.logits(hidden), targets, temperature, with_entropy=with_entropy,
                                          allowed=allowed)
    n_chunks = -(-length // chunk_size)
    pad = n_chunks * chunk_size - length
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n_chunks, chunk_size, -1).swapaxes(0, 1)
    tg = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n_chunks, chunk_size).swapaxes(0, 1)
    al = None if allowed is None else jnp.pad(allowed, ((0, 0), (0, pad), (0, 0)), constant_values=-1).reshape(
        b, n_chunks, chunk_size, -1).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(args):
        h_c, t_c, a_c = args
        lp_c, ent_c = token_logprobs_from_logits(model.logits(h_c), t_c, temperature, with_entropy=with_entropy,
                                                 allowed=a_c)
        return lp_c, (ent_c if with_entropy else jnp.zeros_like(lp_c))

    lp, ent = jax.lax.map(one_chunk, (h, tg, al))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, -1)[:, :length]
    return unchunk(lp), (unchunk(ent) if with_entropy else None)


def per_token_logprobs(
    graphdef: nnx.GraphDef,
    params: Any,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: Optional[int] = None,
    positions: Optional[jax.Array] = None,
    window: Optional[int] = None,
    window_start: Optional[jax.Array] = None,
    with_entropy: bool = True,
    allowed: Optional[jax.Array] = None,
    with_router: bool = False,
    segment_ids: Optional[jax.Array] = None,
) -> Any:
    """``(logprobs, entropy)`` float32, ``[B, L]`` aligned with ``input_ids`` (or ``[B, W]`` with a window).

    ``graphdef, params`` come from ``nnx.split(model)`` (params: State or pure dict);
    ``attention_mask`` bool [B, L] marks real tokens; ``temperature`` > 0 divides the
    logits before ``log_softmax``. ``chunk_size`` (default: the model config's
    ``logprob_chunk_size``, or :func:`auto_chunk_size` under ``logprob_chunk_budget_mb``)
    bounds the lm-head memory. ``window`` (static int) with ``window_start`` int32 ``[B]``:
    only token positions ``window_start[b] + j``, ``j < window``, are scored (module
    docstring). ``with_entropy=False``: entropy is None and not computed. ``allowed`` int32
    ``[B, L, K]`` (optional, aligned with ``input_ids``): the tokens a trie constraint allowed
    for each token, ``-1`` padding; constrained tokens are scored under the masked distribution
    (:func:`token_logprobs_from_logits`; built by :func:`asyncrl.engine.constraints.allowed_tokens`).
    ``segment_ids`` int32 ``[B, L]`` (packed rows, 0 = padding; docs/performance.md "Sequence
    packing"): each segment is scored as if it were a row of its own: attention and positions stay
    within it and its first token gets 0, like ``t = 0``. Traceable and differentiable: call it
    inside your jitted loss, or use :data:`per_token_logprobs_jit`.
    ``with_router=True`` (mixture-of-experts models): a third output, the router logits of every
    MoE layer (float32 ``[B * L, experts]`` each, :func:`asyncrl.model.moe.hidden_states_with_router`).
    """
    model = nnx.merge(graphdef, params)
    attention_mask = attention_mask.astype(bool)
    router: list[jax.Array] = []
    if with_router:
        from asyncrl.model.moe import hidden_states_with_router

        hidden, router = hidden_states_with_router(model, input_ids, positions, attention_mask, segment_ids)
    else:
        hidden, _ = model.hidden_states(input_ids, positions, attention_mask, segment_ids=segment_ids)  # [B, L, H]
    b, length, _ = hidden.shape
    # scored[b, t]: token t and its context t-1 are real (t >= 1) and, packed, of one segment;
    # position t-1's logits score token t.
    scored = jnp.concatenate([jnp.zeros((b, 1), bool), attention_mask[:, 1:] & attention_mask[:, :-1]], axis=1)
    if segment_ids is not None:
        scored = scored & jnp.concatenate([jnp.zeros((b, 1), bool), segment_ids[:, 1:] == segment_ids[:, :-1]], axis=1)
    context = jnp.concatenate([hidden[:, :1], hidden[:, :-1]], axis=1)  # [B, L, H]: hidden of position t-1
    targets = input_ids
    if window is not None:
        if window_start is None:
            raise ValueError("per_token_logprobs: window needs window_start [B]")
        in_range = (window_start[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]) < length
        scored = take_window(scored, window_start, window) & in_range
        context = take_window(context, window_start, window)
        targets = take_window(targets, window_start, window)
        allowed = None if allowed is None else take_window(allowed, window_start, window)
    if chunk_size is None:
        chunk_size = model.cfg.logprob_chunk_size
    if chunk_size is None:
        chunk_size = auto_chunk_size(b, context.shape[1], model.cfg.vocab_size, model.cfg.logprob_chunk_budget_mb)
    lp, ent = _head_logprobs(model, context, targets, temperature, chunk_size, with_entropy, allowed)
    logprobs = jnp.where(scored, lp, 0.0)
    entropy = jnp.where(scored, ent, 0.0) if ent is not None else None
    if with_router:
        return logprobs, entropy, router
    return logprobs, entropy


per_token_logprobs_jit = jax.jit(
    per_token_logprobs, static_argnums=0, static_argnames=("chunk_size", "window", "with_entropy")
)
"""``per_token_logprobs`` jitted at module level (graphdef, chunk_size, window and with_entropy static)."""
