"""Beam search in the engine: one request's whole search in one program call
(:func:`beam_search_jit`), run by the scheduler between two decode chunks (it takes no slots), for
eval's ``eval.decoding.strategy: beam`` and requests with ``beam=True`` (docs/decoding.md)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from asyncrl.engine.constraints import is_leaf_node, next_nodes
from asyncrl.engine.jax_programs import allowed_vocab, count_trace, graphdef_config, kernel_context
from asyncrl.model.attention import KernelTarget
from asyncrl.model.kv_cache import KVCache, init_kv_cache
from asyncrl.model.transformer import forward, hidden_states


class BeamResult(NamedTuple):
    """The ``k`` best finished beams of one :func:`_beam_search`, best first."""

    tokens: jax.Array  # int32 [k, max_new]: each beam's tokens (past its length: 0)
    logprobs: jax.Array  # float32 [k, max_new]: each token's log-prob (T = 1, masked under a constraint)
    length: jax.Array  # int32 [k]: tokens in the beam (0: fewer than k beams exist)
    score: jax.Array  # float32 [k]: sum(logprobs) / length ** length_penalty (-inf: no beam)


def _beam_search(graphdef, params, prompt_ids, prompt_mask, last_token, stop_vocab, length_penalty, tries=None,
                 k: int = 1, max_new: int = 1, capacity: int = 2, max_branch: int = 0,
                 kernel: Optional[KernelTarget] = None, cache_layout: str = "bksd") -> BeamResult:
    """Beam search of width ``k`` for one prompt: ``prompt_ids``/``prompt_mask`` [bucket] hold
    ``prompt[:-1]`` right-padded and ``last_token`` [] the last prompt token (fed by the first
    step, as in the engine's decode). ``stop_vocab`` bool [V]: the stop ids (free decoding);
    ``tries``: ``(trie pool tables, the constraint's root node)`` or None (unconstrained);
    ``max_branch`` (static) the pool's widest node; ``kernel`` (static) the engine's devices (a
    :class:`~asyncrl.model.attention.KernelTarget`, as in :func:`~asyncrl.engine.jax_programs._prefill`);
    ``cache_layout`` (static) the beams' own contiguous KV cache layout
    (:func:`~asyncrl.engine.layouts.kv_cache_layout` of the engine's platform).

    Each step extends the ``k`` live beams by every token (log-softmax of the masked logits,
    T = 1), keeps the ``2k`` best extensions, moves those that end (a stop id, a trie leaf, or
    ``max_new`` tokens) into the pool of finished beams ranked by
    ``sum(logprobs) / length ** length_penalty`` (the ``k`` best kept), and continues with the
    ``k`` best that do not end. It stops when no live beam is left. With ``2k`` >= all
    extensions of ``k`` beams that hold every prefix (small vocabulary or trie) this is exhaustive.
    """
    count_trace("beam_search")
    cfg = graphdef_config(graphdef, params)
    vocab = params["embed_tokens"]["embedding"].shape[0]
    rows = jnp.arange(k)
    cache = init_kv_cache(cfg, k, capacity, layout=cache_layout)
    ids = jnp.broadcast_to(prompt_ids[None], (k, prompt_ids.shape[0]))
    mask = jnp.broadcast_to(prompt_mask[None], ids.shape)
    with kernel_context(kernel):  # the prompt's prefill: the engine's platform's attention kernel
        _, cache = hidden_states(graphdef, params, ids, None, mask, cache, empty_cache=True)
    table, root = (None, None) if tries is None else tries

    class Carry(NamedTuple):
        step: jax.Array
        cache: KVCache
        last: jax.Array  # int32 [k]
        beam_logp: jax.Array  # float32 [k]: summed log-prob (-inf: no beam)
        node: jax.Array  # int32 [k]
        tokens: jax.Array  # int32 [k, max_new]
        logps: jax.Array  # float32 [k, max_new]
        pool: BeamResult

    empty = BeamResult(jnp.zeros((k, max_new), jnp.int32), jnp.zeros((k, max_new), jnp.float32),
                       jnp.zeros((k,), jnp.int32), jnp.full((k,), -jnp.inf, jnp.float32))
    init = Carry(jnp.int32(0), cache, jnp.full((k,), last_token, jnp.int32),
                 jnp.where(rows == 0, 0.0, -jnp.inf).astype(jnp.float32),  # the k beams start equal: expand one
                 jnp.full((k,), -1, jnp.int32) if root is None else jnp.full((k,), root, jnp.int32),
                 jnp.zeros((k, max_new), jnp.int32), jnp.zeros((k, max_new), jnp.float32), empty)

    def body(c: Carry) -> Carry:
        live = jnp.isfinite(c.beam_logp)
        logits, cache = forward(graphdef, params, c.last[:, None], None, live[:, None], c.cache)
        assert cache is not None
        z = logits[:, 0].astype(jnp.float32)
        if table is not None:
            z = jnp.where(allowed_vocab(table, c.node, vocab, max_branch), z, -jnp.inf)
        logp = jax.nn.log_softmax(z, axis=-1)  # [k, V]
        cand = jnp.where(live[:, None], c.beam_logp[:, None] + logp, -jnp.inf).reshape(-1)
        cand_score, flat = jax.lax.top_k(cand, 2 * k)  # [2k], best first
        parent, token = flat // vocab, (flat % vocab).astype(jnp.int32)
        token_logp = logp[parent, token]
        length = c.step + 1
        if table is not None:
            child = next_nodes(jnp, table, c.node[parent], token, max_branch)
            ends = is_leaf_node(jnp, table, child)
        else:
            child = jnp.full((2 * k,), -1, jnp.int32)
            ends = stop_vocab[token]
        ends = ends | (length >= max_new)
        valid = jnp.isfinite(cand_score)
        history = c.tokens[parent].at[:, c.step].set(token)  # [2k, max_new]
        history_logp = c.logps[parent].at[:, c.step].set(token_logp)
        # Finished candidates join the pool; the pool keeps its k best by score.
        score = jnp.where(valid & ends, cand_score / jnp.power(length.astype(jnp.float32), length_penalty), -jnp.inf)
        all_score = jnp.concatenate([c.pool.score, score])
        best_score, best = jax.lax.top_k(all_score, k)
        pick = lambda old, new: jnp.concatenate([old, new])[best]
        pool = BeamResult(pick(c.pool.tokens, history), pick(c.pool.logprobs, history_logp),
                          pick(c.pool.length, jnp.full((2 * k,), length, jnp.int32)), best_score)
        # The k best candidates that go on become the beams (stable: best first).
        order = jnp.argsort(jnp.where(valid & ~ends, 0, 1), stable=True)[:k]
        keep = (valid & ~ends)[order]
        cache = jax.tree.map(lambda x: x[parent[order]], cache)
        return Carry(c.step + 1, cache, token[order], jnp.where(keep, cand_score[order], -jnp.inf), child[order],
                     history[order], history_logp[order], pool)

    def more(c: Carry) -> jax.Array:
        return (c.step < max_new) & jnp.any(jnp.isfinite(c.beam_logp))

    return jax.lax.while_loop(more, body, init).pool


beam_search_jit = jax.jit(_beam_search, static_argnums=0,
                          static_argnames=("k", "max_new", "capacity", "max_branch", "kernel", "cache_layout"))


def run_beam_request(runner: Any, pending: Any, buckets: tuple[int, ...], version: int, tries: Any = None) -> None:
    """Run the beam search of ``pending`` (a :class:`~asyncrl.engine.requests.Pending` with
    ``beam=True``) on ``runner``'s serving copy (:class:`~asyncrl.engine.model_runner.ModelRunner`):
    its prompt in the smallest of ``buckets`` that holds it (else a multiple of the largest); the
    ``n`` best beams become its samples, best first, their tokens of weights ``version``. ``tries``:
    ``(the trie pool's device tables, the constraint's root node, the pool's widest node)`` or None."""
    import numpy as np

    request = pending.request
    prompt = np.asarray(request.prompt_ids, np.int32)
    context = len(prompt) - 1
    largest = buckets[-1]
    bucket = next((b for b in buckets if b >= max(context, 1)), -(-context // largest) * largest)
    ids = np.zeros(bucket, np.int32)
    ids[:context] = prompt[:context]
    stop_vocab = np.zeros(runner.vocab_size, bool)
    stop_vocab[list(pending.stop_ids)] = True
    max_branch = 0
    if tries is not None:
        *tries, max_branch = tries
        tries = tuple(tries)
    out = runner.beam_search(ids, np.arange(bucket) < context, np.int32(prompt[-1]), stop_vocab,
                             np.float32(request.length_penalty), tries, k=request.n, max_new=request.max_new_tokens,
                             capacity=bucket + request.max_new_tokens, max_branch=max_branch)
    tokens, logprobs, lengths, scores = (np.asarray(x) for x in out)
    trie = request.constraint
    for j, sequence in enumerate(pending.sequences):
        n = int(lengths[j])
        sequence.tokens, sequence.logprobs = tokens[j, :n].tolist(), logprobs[j, :n].tolist()
        sequence.versions = [version] * n
        sequence.score = float(scores[j])
        if trie is not None:
            sequence.stop_reason = "stop" if trie.contains(sequence.tokens) else "length"
        else:
            sequence.stop_reason = "eos" if n and sequence.tokens[-1] in pending.stop_set else "length"
