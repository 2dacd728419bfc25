"""The device side of :class:`~asyncrl.engine.jax_engine.JaxEngine`: its state (the KV page pool),
its per-slot controls, and the jitted programs that prefill and decode (module-level jits, shared
by every engine with the same model shapes).

The model is run only through its own forward over a paged cache (:mod:`asyncrl.model.transformer`,
:class:`~asyncrl.model.kv_cache.PagedKVCache`: every layer's pool of pages, each row's page table
and length); this module adds scheduling state and sampling, nothing of the network. It stays one
file: the programs share the pool's layout and its shardings on an engine mesh, which each program
pins (:func:`constrain_state`).

Compiled programs
-----------------
* ``prefill``: one per prefill bucket: the first chunk of the prompts admitted at one chunk
  boundary, :data:`PREFILL_ROWS` rows per replica and call (the weights are read once per call,
  not once per request), each row's tokens attending among themselves;
* ``prefill_after_cache``: one per extension bucket (``engine.prefix_cache.extend_buckets`` and
  the prefill buckets): tokens written after what a row's pages hold (a prompt's later chunks, the
  rest of a prompt after a reused prefix), attending over those pages too;
* ``decode_chunk``: up to ``engine.decode_chunk`` steps in a ``lax.while_loop`` of
  ``engine.decode_inner_steps`` unrolled steps per iteration (:mod:`asyncrl.engine.platform`: 8 on
  GPUs, where the host reads the loop's predicate after every iteration; 1 elsewhere) (it exits
  early once every slot is done, or once a slot finished and enough slots are free for the
  scheduler to refill: ``SlotControls.refill_free``), in two variants: plain sampling, and sampling with
  top-k/top-p (two threshold searches over the vocabulary), used only for chunks in which
  some slot asks for it; each also with a trie mask (``_trie``), used only for chunks in which
  some slot is constrained (compiled once per size class of the engine's trie pool);
* ``copy_pages``: a prefill's or a decode chunk's page copies (copy on write), before it, when any.

* ``beam_search``: one request's whole beam search (:mod:`asyncrl.engine.beam_search`), compiled per
  prompt bucket, width, ``max_new_tokens`` and trie size class; used only by beam requests.

Each decode variant is compiled once per sampler (``engine.sampler``), steps per iteration and, on
the CPU, size class of the pages its attention reads (each row's first pages, or a flat list) and
of the rows it runs (``engine.attention_buckets``: :mod:`asyncrl.engine.attention_buckets`). :func:`compile_count` counts traces (each trace is one
compilation) and is reported as ``engine/compiles``.

Sampling (docs/design.md "Randomness", "Log-probabilities")
---------------------------------------------------
Per slot, on float32 logits: stop ids are masked while fewer than ``min_new_tokens`` tokens
were generated; greedy takes the argmax; otherwise the ``i``-th generated token is drawn from
``softmax(logits / T)`` (after top-k, then top-p, when asked) by inverting its CDF at
``uniform(fold_in(key, i))``. The reported log-prob is ``log_softmax(logits / T)[token]`` of
the untruncated, unmasked logits (T = 1 for greedy). A slot under a trie constraint
(docs/decoding.md) first sets the logits of the tokens its trie node does not allow to
``-inf``; its draw, its argmax and its reported log-prob are all of that masked distribution.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, NamedTuple, Optional, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.engine.constraints import TrieTables, allowed_tokens, is_leaf_node, next_nodes
from asyncrl.model.attention import KernelTarget, compiled_for
from asyncrl.model.kv_cache import FlatPages, PagedKVCache, PagedLayerKV, copy_pages, init_page_pool
from asyncrl.model.paged_attention import with_views
from asyncrl.model.transformer import forward, hidden_states

_compiles: collections.Counter = collections.Counter()
_compiles_lock = threading.Lock()


def compile_count() -> int:
    """Programs compiled by engines in this process (a jit trace is a compilation)."""
    with _compiles_lock:
        return sum(_compiles.values())


def count_trace(name: str) -> None:
    # Runs only while jax traces (i.e. on a cache miss, right before compiling).
    with _compiles_lock:
        _compiles[name] += 1


# --------------------------------------------------------------------------- the page pool and the controls


Pool = tuple  # tuple[PagedLayerKV, ...]: every layer's page pool, the engine's device state (donated to every call)
_State = TypeVar("_State")  # the pool, or a pytree of it


def init_pool(cfg: Any, pages: int, page_size: int, layout: str = "2kpsd") -> Pool:
    """An empty page pool for a :class:`~asyncrl.model.DecoderConfig`: ``pages`` pages of
    ``page_size`` positions per layer in ``layout`` (:func:`~asyncrl.engine.layouts.kv_page_layout`
    of the engine's platform; on an engine mesh ``pages`` counts every replica's)."""
    return init_page_pool(cfg, pages, page_size, layout)


def pool_shardings(cfg: Any, mesh: Any, layout: str = "2kpsd") -> Pool:
    """How the pool lies on an engine mesh (axes ``data``, ``fsdp``, ``tensor``): its pages split
    over the replicas (``data`` x ``fsdp``: each replica's sequences use its own pages) and its KV
    heads over ``tensor``. A pytree of ``NamedSharding`` shaped like the pool (hashable: a static
    argument of the programs)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicas = mesh.shape["data"] * mesh.shape["fsdp"]
    rows = ("data", "fsdp") if replicas > 1 else None
    heads = "tensor" if mesh.shape["tensor"] > 1 and cfg.num_kv_heads % mesh.shape["tensor"] == 0 else None
    spec = P(None, heads, rows, None, None) if layout == "2kpsd" else P(rows, None, heads, None)
    return tuple(PagedLayerKV(NamedSharding(mesh, spec), layout) for _ in range(cfg.num_layers))  # type: ignore[arg-type]


def row_sharding(mesh: Any) -> Any:
    """Arrays with a row per decode slot or prefill row: split over the replicas."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicas = mesh.shape["data"] * mesh.shape["fsdp"]
    return NamedSharding(mesh, P(("data", "fsdp") if replicas > 1 else None))


def constrain_state(state: _State, layout: Any) -> _State:
    """``state`` pinned to ``layout`` (:func:`pool_shardings`), so every call returns the pool on
    the shardings it was given (donation reuses the buffers, no recompiles); with ``layout`` None
    (the engine on the trainer's arrays) the program is left to XLA."""
    return state if layout is None else jax.lax.with_sharding_constraint(state, layout)


class SlotControls(NamedTuple):
    """Per-slot (decode row) controls of a decode chunk, one row per slot.

    The scheduler owns a host copy (numpy arrays, updated in place as sequences start, advance,
    grow and end) and passes a snapshot to every chunk; idle rows have ``active`` false. On an
    engine mesh page numbers are local to the row's replica.
    """

    last_token: Any  # int32 [slots]: the token the next step feeds (the last prompt token at first)
    generated: Any  # int32 [slots]: tokens generated so far (the next token's index and key fold)
    active: Any  # bool [slots]: the slot holds a running sample
    greedy: Any  # bool [slots]: argmax instead of a draw
    temperature: Any  # float32 [slots]: logits are divided by it (1 for greedy)
    top_k: Any  # int32 [slots]: keep the k most likely tokens (0: off)
    top_p: Any  # float32 [slots]: keep the smallest nucleus with this mass (1: off)
    min_new_tokens: Any  # int32 [slots]: stop ids are masked before this many tokens
    max_new_tokens: Any  # int32 [slots]: the sample ends at this many tokens
    stop_ids: Any  # int32 [slots, max_stop_ids]: ids that end the sample (-1 pads)
    node: Any  # int32 [slots]: the slot's node in the engine's trie pool (-1: unconstrained; docs/decoding.md)
    refill_free: Any  # int32 []: end the chunk early once a slot finished in it and this many slots are free
    lengths: Any  # int32 [slots]: KV positions the slot's sequence holds (its next token's position)
    page_table: Any  # int32 [slots, kv_capacity / page_size]: the sequence's pages (past its last: the pool size)
    sample_id: Any  # uint32 [slots]: the sample key's parts (docs/design.md "Randomness"):
    key_index: Any  # uint32 [slots]     the key depends on these three only,
    turn: Any  # uint32 [slots]          never on the slot or the batch
    copy_src: Any  # int32 [slots]: a page copied to copy_dst before the chunk (a shared partial page's copy)
    copy_dst: Any  # int32 [slots]: (the pool size: no copy)


def idle_controls(slots: int, max_stop_ids: int, pages_per_seq: int = 1, pool_pages: int = 1) -> SlotControls:
    """Host controls of ``slots`` idle slots (numpy; every field writable); ``pages_per_seq``:
    the page table's width, ``pool_pages``: the pages of one replica's pool (an unused entry)."""
    return SlotControls(
        last_token=np.zeros((slots,), np.int32),
        generated=np.zeros((slots,), np.int32),
        active=np.zeros((slots,), bool),
        greedy=np.zeros((slots,), bool),
        temperature=np.ones((slots,), np.float32),
        top_k=np.zeros((slots,), np.int32),
        top_p=np.ones((slots,), np.float32),
        min_new_tokens=np.zeros((slots,), np.int32),
        max_new_tokens=np.zeros((slots,), np.int32),
        stop_ids=np.full((slots, max_stop_ids), -1, np.int32),
        node=np.full((slots,), -1, np.int32),
        refill_free=np.array(1, np.int32),
        lengths=np.zeros((slots,), np.int32),
        page_table=np.full((slots, pages_per_seq), pool_pages, np.int32),
        sample_id=np.zeros((slots,), np.uint32),
        key_index=np.zeros((slots,), np.uint32),
        turn=np.zeros((slots,), np.uint32),
        copy_src=np.zeros((slots,), np.int32),
        copy_dst=np.full((slots,), pool_pages, np.int32),
    )


def snapshot(controls: SlotControls) -> SlotControls:
    """A copy to hand to a chunk: the call transfers its arguments asynchronously, and the
    scheduler edits its own copy right after."""
    return SlotControls(*(np.array(x, copy=True) for x in controls))


def empty_flat(entries: int, rows: int, replicas: int = 1) -> FlatPages:
    """A :class:`~asyncrl.model.kv_cache.FlatPages` of ``entries`` padding entries per replica (row
    ``rows``: nobody's), for ``rows`` rows per replica."""
    total = entries * replicas
    return FlatPages(np.zeros((total,), np.int32), np.full((total,), rows, np.int32), np.zeros((total,), np.int32),
                     np.zeros((rows * replicas,), np.int32))


# --------------------------------------------------------------------------- prefill


class PrefillPlan(NamedTuple):
    """One prefill call: per row, tokens to write after the positions its pages hold (a prompt's
    first chunk into empty pages, or its next chunk, or what follows a reused prefix). Host
    arrays; on an engine mesh replica ``r``'s rows are ``[r * rows_per_replica, (r + 1) *
    rows_per_replica)`` and their page numbers are local to it."""

    token_ids: Any  # int32 [rows, bucket]: right-padded
    token_mask: Any  # bool [rows, bucket]
    page_table: Any  # int32 [rows, kv_capacity / page_size]: the row's pages (unused rows: the pool size)
    lengths: Any  # int32 [rows]: positions the row's pages hold before the call (0 for a first chunk)
    copy_src: Any  # int32 [rows]: a page copied to copy_dst before the call (the shared partial page the row continues)
    copy_dst: Any  # int32 [rows]: (the pool size: no copy)

    @classmethod
    def empty(cls, rows: int, bucket: int, pages_per_seq: int, pool_pages: int) -> "PrefillPlan":
        """All-padding rows, to fill in (a call of it writes nothing)."""
        ids = np.zeros((rows, bucket), np.int32)
        return cls(ids, np.zeros(ids.shape, bool), np.full((rows, pages_per_seq), pool_pages, np.int32),
                   np.zeros((rows,), np.int32), np.zeros((rows,), np.int32), np.full((rows,), pool_pages, np.int32))


def kernel_context(kernel: Optional[KernelTarget]) -> Any:
    """:func:`compiled_for` the engine's devices: its mesh, or their platform and count (no change
    for None: this process's backend)."""
    if kernel is None:
        return compiled_for()
    if kernel.mesh is not None:
        return compiled_for(mesh=kernel.mesh)
    return compiled_for(platform=kernel.platform, devices=kernel.devices)


def _prefill(graphdef, params, pool: Pool, plan: PrefillPlan, layout=None, kernel=None, fresh: bool = True) -> Pool:
    """Write ``plan``'s tokens into their rows' pages: the model's forward over the paged cache
    (:class:`~asyncrl.model.kv_cache.PagedKVCache`), each token attending over what its row held and
    the tokens before it (the plan's page copies are made before the call: :func:`_copy_pages`).
    ``fresh`` (static): every row held nothing (a first chunk), so the tokens attend among
    themselves by ``model.attention``'s kernel, as a cache-free forward. ``layout`` (static): the
    pool's shardings on an engine mesh, or None; ``kernel`` (static): the engine's devices as a
    :class:`~asyncrl.model.attention.KernelTarget`."""
    count_trace("prefill" if fresh else "prefill_after_cache")
    if layout is not None:  # each replica prefills its own rows, as one device does alone
        rows = row_sharding(layout[0].kv.mesh)
        plan = PrefillPlan(*(jax.lax.with_sharding_constraint(x, rows) for x in plan))
    cache = PagedKVCache(pool, plan.page_table, plan.lengths)
    with kernel_context(kernel):
        _, cache = hidden_states(graphdef, params, plan.token_ids, None, plan.token_mask, cache, empty_cache=fresh)
    return constrain_state(cache.layers, layout)


def _copy_pages(pool: Pool, src, dst, layout=None) -> Pool:
    """Every layer's pages ``dst`` take pages ``src``' contents (int32 [rows]; ``dst`` past the
    pool: no copy); on an engine mesh each replica copies its own (page numbers local to it).

    A program of its own, which the runner calls only when some row has a copy to make
    (:meth:`~asyncrl.engine.model_runner.ModelRunner.copy_pages`, before a prefill or a decode
    chunk): a branch over the pool inside those programs (copy or not) would make the pool a
    conditional's result, a buffer apart from the donated one: XLA:GPU then holds a second pool
    through the whole program and copies it back at its end."""
    count_trace("copy_pages")

    def copy(pool, src, dst):
        return tuple(copy_pages(layer, src, dst) for layer in pool)

    if layout is None:
        return copy(pool, src, dst)
    mesh = layout[0].kv.mesh
    specs = jax.tree.map(lambda sharding: sharding.spec, layout)
    rows = row_sharding(mesh).spec
    pool = jax.shard_map(copy, mesh=mesh, in_specs=(specs, rows, rows), out_specs=specs, check_vma=False)(pool, src, dst)
    return constrain_state(pool, layout)


def slot_key(root_key, sample_id, key_index, turn):
    """``fold_in(fold_in(fold_in(root_key, sample_id), key_index), turn)`` (uint32 [2])."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(root_key, sample_id), key_index), turn)


PREFILL_ROWS = 2
"""Prompts per prefill call and device (fewer are padded with empty rows, more take several
calls; an engine of several replicas prefills this many on each of them at once). One
fixed row count keeps a prompt's KV and so its log-probs bitwise the same whatever is
prefilled beside it: XLA:CPU's results for a row change in the last bits with the row count of
the call (up to 7e-7 in the hidden states), never with the other rows' contents. Two because
a short prompt's prefill mostly reads the weights: two cost about what one costs (79 vs 70 ms
for 32-token prompts on bench-40m, where four cost 134 ms), and refills come in pairs."""


def prefill_rows(slots: int, replicas: int) -> int:
    """Prompts one prefill call takes: :data:`PREFILL_ROWS` per engine replica (each prefills what
    one device alone would), at most the slots."""
    return min(PREFILL_ROWS * replicas, slots)


def graphdef_config(graphdef: Any, params: Any) -> Any:
    """The :class:`~asyncrl.model.DecoderConfig` the graphdef was built with (None if it has none)."""
    from flax import nnx

    return getattr(nnx.merge(graphdef, params), "cfg", None)



# --------------------------------------------------------------------------- sampling


def _ordered_int(x: jax.Array) -> jax.Array:
    """int32 keys that order like the float32 values ``x`` (for exact bisection on floats)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _largest_threshold(keys: jax.Array, ok, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Per row, the largest int32 ``t`` in ``[lo, hi]`` with ``ok(keys, t)`` (monotone: true up to
    some point); ``lo`` when none. 32 halvings of the int32 range, each a pass over ``keys``."""

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1) + ((lo ^ hi) & 1)  # ceil((lo + hi) / 2) without overflow
        good = ok(keys, mid[:, None]) & (mid <= hi)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def _top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask ``scaled`` [S, V] to each row's top-k, then to the smallest set of its most likely
    remaining tokens with probability mass >= top-p (ties at a threshold are kept). Rows with
    ``top_k == 0`` / ``top_p >= 1`` are left exactly as they are.

    Thresholds are found by bisection over the float bit patterns rather than by sorting the
    vocabulary: a sort of [S, V] costs ~100x more than a sampling step on CPU.
    """
    rows = scaled.shape[0]
    int_min = jnp.full((rows,), jnp.iinfo(jnp.int32).min, jnp.int32)
    int_max = jnp.full((rows,), jnp.iinfo(jnp.int32).max, jnp.int32)
    keys = _ordered_int(scaled)
    kth = _largest_threshold(keys, lambda k, t: jnp.sum(k >= t, axis=-1) >= top_k, int_min, int_max)
    after_k = jnp.where((top_k[:, None] > 0) & (keys < kth[:, None]), -jnp.inf, scaled)
    probs = jax.nn.softmax(after_k, axis=-1)
    prob_keys = _ordered_int(probs)  # probs >= 0: keys are the bit patterns, in [0, inf bits]
    mass_ok = lambda k, t: jnp.sum(jnp.where(k >= t, probs, 0.0), axis=-1) >= top_p
    nucleus = _largest_threshold(prob_keys, mass_ok, jnp.zeros((rows,), jnp.int32), jnp.full((rows,), 0x7F800000, jnp.int32))
    return jnp.where((top_p[:, None] < 1.0) & (prob_keys < nucleus[:, None]), -jnp.inf, after_k)


_SAMPLE_BLOCK = 128  # tokens per block of the two-level inverse CDF


def _last_positive(weights: jax.Array) -> jax.Array:
    """int32 [S]: per row of ``weights`` [S, N] the last index holding a positive weight."""
    return (weights.shape[-1] - 1 - jnp.argmax(weights[:, ::-1] > 0, axis=-1)).astype(jnp.int32)


def _sample(keys: jax.Array, scaled: jax.Array) -> jax.Array:
    """One draw per row from ``softmax(scaled)`` [S, V] by inverting its CDF at one uniform
    per row (one random number per token instead of V Gumbels: the RNG is most of a
    sampling step's cost on CPU). Zero-probability tokens are never drawn.

    The CDF is inverted in two levels, never over the whole vocabulary: the uniform picks a
    block of ``_SAMPLE_BLOCK`` tokens from the running sum of the block masses, then a token
    from the running sum inside that block. A scan over V (``jnp.cumsum``) is a log-depth
    ``reduce-window`` on XLA:CPU costing ~6% of a bench-40m decode step; this costs one
    fused exp-and-sum pass over the vocabulary plus scans of length V / 128 and 128.
    """
    rows, vocab = scaled.shape
    blocks = -(-vocab // _SAMPLE_BLOCK)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # unnormalised probs, 0 where masked
    weights = jnp.pad(weights, ((0, 0), (0, blocks * _SAMPLE_BLOCK - vocab))).reshape(rows, blocks, _SAMPLE_BLOCK)
    mass = weights.sum(axis=-1)  # [S, blocks]
    cum_mass = jnp.cumsum(mass, axis=-1)
    x = u * cum_mass[:, -1]
    # The first block whose running mass exceeds x has positive mass; rounding can push the
    # count past the end, so it is clamped to the last block with mass.
    block = jnp.minimum(jnp.sum(cum_mass <= x[:, None], axis=-1), _last_positive(mass)).astype(jnp.int32)
    inside = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]  # [S, block]
    before = jnp.where(block > 0, jnp.take_along_axis(cum_mass, jnp.maximum(block - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    cdf = jnp.cumsum(inside, axis=-1)
    offset = jnp.minimum(jnp.sum(cdf <= (x - before)[:, None], axis=-1), _last_positive(inside))
    return jnp.minimum(block * _SAMPLE_BLOCK + offset, vocab - 1).astype(jnp.int32)


def _sample_gumbel(keys: jax.Array, scaled: jax.Array) -> jax.Array:
    """One draw per row from ``softmax(scaled)`` [S, V] by the Gumbel-max trick:
    ``argmax(scaled + G)`` with ``G`` standard Gumbel noise from the row's key. One pass over
    the vocabulary (noise, add and argmax fuse into one reduction on a GPU) instead of the
    inverse CDF's exp, block sums and two scans; it draws V random numbers per row, which is
    what makes it slower on XLA:CPU. Masked (-inf) tokens are never drawn."""
    return jnp.argmax(scaled + _gumbel_noise(keys, scaled.shape[-1]), axis=-1).astype(jnp.int32)


def _gumbel_noise(keys: jax.Array, vocab: int) -> jax.Array:
    """float32 [S, vocab]: standard Gumbel noise, one row per key [S, 2]."""
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)


def draw_tokens(sampler: str, keys: jax.Array, scaled: jax.Array) -> jax.Array:
    """int32 [S]: one draw per row of ``softmax(scaled)`` [S, V] with each row's key [S, 2], by
    ``sampler`` (``engine.sampler`` resolved: :func:`asyncrl.engine.platform.resolve_sampler`).
    Both samplers draw from the same distribution with different random numbers."""
    if sampler == "gumbel":
        return _sample_gumbel(keys, scaled)
    if sampler == "inverse_cdf":
        return _sample(keys, scaled)
    raise ValueError(f"engine.sampler: unknown sampler {sampler!r} (inverse_cdf or gumbel)")


def _max_and_argmax(values: jax.Array, choose: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(jnp.max(values, -1), jnp.argmax(choose, -1))`` for ``values, choose`` float32 [S, V], exactly
    (the argmax's ties go to the first index and a NaN counts as the largest, as in jax's own
    reducer), as one variadic reduction: one pass over the vocabulary on a GPU instead of two."""

    def combine(a, b):
        (a_max, a_value, a_index), (b_max, b_value, b_index) = a, b
        pick_a = (a_value > b_value) | (a_value != a_value)
        pick_a_index = pick_a | ((a_value == b_value) & (a_index < b_index))
        return (jax.lax.max(a_max, b_max), jax.lax.select(pick_a, a_value, b_value),
                jax.lax.select(pick_a_index, a_index, b_index))

    index = jax.lax.broadcasted_iota(jnp.int32, choose.shape, 1)
    top, _, arg = jax.lax.reduce((values, choose, index), (np.float32(-np.inf), np.float32(-np.inf), np.int32(0)),
                                 combine, (1,))
    return top, arg


def allowed_vocab(tries: TrieTables, node: jax.Array, vocab: int, max_branch: int) -> jax.Array:
    """bool [S, V]: the tokens each slot may take at its trie ``node`` [S] (every token where -1)."""
    allowed = allowed_tokens(jnp, tries, node, max_branch)  # [S, K], -1 pads
    rows = jnp.arange(node.shape[0])[:, None]
    mask = jnp.zeros((node.shape[0], vocab), bool).at[rows, jnp.where(allowed < 0, vocab, allowed)].set(True, mode="drop")
    return mask | (node < 0)[:, None]


def _choose_tokens(logits, controls: SlotControls, stop_vocab, keys, generated, filtered: bool, allowed=None,
                   sampler: str = "inverse_cdf"):
    """One token per slot from float32 ``logits`` [S, V] (see the module docstring), drawn by
    ``sampler`` (:func:`draw_tokens`).

    ``stop_vocab`` bool [S, V] marks each slot's stop ids; ``keys`` uint32 [S, 2] the slot
    keys; ``generated`` int32 [S] each slot's token index; ``allowed`` bool [S, V] or None:
    each slot's trie mask (the distribution is renormalised over it, and the log-prob is the
    masked one). Returns ``(token int32 [S], log-prob float32 [S], is_stop bool [S])``.
    """
    rows = jnp.arange(logits.shape[0])
    unmasked = logits / controls.temperature[:, None]  # T = 1 for greedy rows
    if allowed is not None:  # "unmasked" below means: not masked by stops or top-k/top-p
        unmasked = jnp.where(allowed, unmasked, -jnp.inf)
    scaled = jnp.where((generated < controls.min_new_tokens)[:, None] & stop_vocab, -jnp.inf, unmasked)
    kept = _top_k_top_p(scaled, controls.top_k, controls.top_p) if filtered else scaled  # greedy rows: argmax of scaled
    keys = jax.vmap(jax.random.fold_in)(keys, generated)
    if sampler == "gumbel":  # _sample_gumbel's draw, the greedy argmax and the log-prob's maximum in one reduction
        choose = jnp.where(controls.greedy[:, None], scaled, kept + _gumbel_noise(keys, scaled.shape[-1]))
        top, token = _max_and_argmax(unmasked, choose)
    else:
        token = jnp.where(controls.greedy, jnp.argmax(scaled, axis=-1), draw_tokens(sampler, keys, kept)).astype(jnp.int32)
        top = jnp.max(unmasked, axis=-1)
    # log_softmax(unmasked)[token] without materialising the [S, V] log-softmax: same order of operations
    top = jax.lax.stop_gradient(top)
    log_p = (unmasked[rows, token] - top) - jnp.log(jnp.sum(jnp.exp(unmasked - top[:, None]), axis=-1))
    is_stop = stop_vocab[rows, token] & (generated >= controls.min_new_tokens)
    return token, log_p, is_stop


# --------------------------------------------------------------------------- decode


class _Chunk(NamedTuple):
    """The ``while_loop`` carry of a decode chunk."""

    step: jax.Array  # int32 []: steps taken
    pool: Pool
    lengths: jax.Array  # int32 [S]
    last_token: jax.Array  # int32 [S]
    generated: jax.Array  # int32 [S]
    node: jax.Array  # int32 [S]: the trie node the next token is chosen at (-1: unconstrained)
    active: jax.Array  # bool [S]
    # The outputs, [S, steps rounded up to whole loop iterations] (written once per iteration):
    tokens: jax.Array  # int32: the token each slot produced at each step
    logprobs: jax.Array  # float32
    emitted: jax.Array  # bool: the slot was active at that step


def _decode_chunk(graphdef, params, pool: Pool, controls: SlotControls, flat: Optional[FlatPages], root_key, steps: int,
                  filtered: bool, layout=None, tries=None, max_branch: int = 0, *, sampler: str = "inverse_cdf",
                  inner: int = 1, kernel: Optional[KernelTarget] = None, view_pages: int = 0):
    """Decode up to ``steps`` tokens for every active slot: each step is the model's own forward
    over the paged cache with ``T = 1`` (idle slots masked out: they write nothing), then sampling.

    The controls' page copies (a shared partial page copied for the sequence that writes into it
    next) are made before the call, by :func:`_copy_pages`. Before the loop each slot's key is made
    from its parts. On the CPU the steps attend over a view of the pages they read, gathered once
    here (:func:`~asyncrl.model.paged_attention.with_views`): ``view_pages`` (static) > 0, each slot's
    first that many pages; else ``flat``, every active slot's pages as one list covering its
    positions to the chunk's end (its length a size class). Neither (GPUs, TPUs): attention reads
    each slot's page table itself.

    Returns the new pool and ``tokens`` int32, ``logprobs`` float32, ``emitted`` bool, each
    [S, steps]: ``emitted`` marks the steps at which the slot was active and produced the token.
    ``layout`` (static): the pool's shardings on an engine mesh, or None. ``tries``: the
    engine's trie pool (:class:`~asyncrl.engine.constraints.TrieTables`, device arrays) when
    some slot is constrained (``controls.node >= 0``), else None; ``max_branch`` (static) its
    widest node. A constrained slot samples from the masked distribution, ignores stop ids,
    and ends when it reaches a leaf. ``sampler`` (static): :func:`draw_tokens`' sampler.
    ``inner`` (static): decode steps per iteration of the chunk's loop
    (``engine.decode_inner_steps``): the early exit is tested once every ``inner`` steps, so on a
    GPU the host, which reads the loop's predicate, is in the loop once per ``inner`` tokens;
    a slot that finished idles at most ``inner - 1`` more steps before the chunk can end. Steps
    past ``steps`` (when ``inner`` does not divide it) run with every slot idle and emit nothing.
    ``kernel`` (static): the engine's devices, as in :func:`_prefill`.
    """
    count_trace(("decode_chunk_topk_topp" if filtered else "decode_chunk") + ("_trie" if tries is not None else "")
                 + (f"_{sampler}" if sampler != "inverse_cdf" else "")
                 + (f"_flat{flat.pages.shape[0]}" if flat is not None else "")
                 + (f"_view{view_pages}" if view_pages else ""))
    slots = controls.active.shape[0]
    vocab = params["embed_tokens"]["embedding"].shape[0]
    stop_vocab = jax.nn.one_hot(controls.stop_ids, vocab, dtype=bool).any(axis=1)  # [S, V]; -1 pads hit nothing
    keys = jax.vmap(slot_key, in_axes=(None, 0, 0, 0))(root_key, controls.sample_id, controls.key_index, controls.turn)
    page_table = jnp.asarray(controls.page_table, jnp.int32)
    if view_pages or flat is not None:
        with kernel_context(kernel):
            pool = with_views(pool, page_table, view_pages, None if view_pages else flat)
        flat = None if view_pages else flat

    def step(c: _Chunk) -> tuple[_Chunk, tuple[jax.Array, jax.Array, jax.Array]]:
        # One decode step: the next carry (its output buffers untouched) and what the step emits,
        # (token, log-prob, emitted) each [S], which ``body`` writes. Past ``steps`` no slot runs (an
        # idle slot's step writes nothing and keeps its length).
        if inner > 1:
            c = c._replace(active=c.active & (c.step < steps))
        cache = PagedKVCache(c.pool, page_table, c.lengths, flat)
        logits, cache = forward(graphdef, params, c.last_token[:, None], None, c.active[:, None], cache)
        assert cache is not None  # forward returns the updated cache when given one
        allowed = None if tries is None else allowed_vocab(tries, c.node, vocab, max_branch)
        token, log_p, is_stop = _choose_tokens(logits[:, 0], controls, stop_vocab, keys, c.generated, filtered, allowed,
                                               sampler)
        node = c.node
        if tries is not None:
            next_node = next_nodes(jnp, tries, c.node, token, max_branch)
            is_stop = jnp.where(c.node >= 0, is_leaf_node(jnp, tries, next_node), is_stop)
            node = jnp.where(c.active, next_node, c.node)
        generated = c.generated + c.active.astype(jnp.int32)
        done = is_stop | (generated >= controls.max_new_tokens)
        return c._replace(step=c.step + 1, pool=cache.layers, lengths=cache.lengths,
                          last_token=jnp.where(c.active, token, c.last_token), generated=generated, node=node,
                          active=c.active & ~done), (token, log_p, c.active)

    def body(c: _Chunk) -> _Chunk:
        # ``inner`` steps, then their outputs written as one [S, inner] block per buffer at the
        # iteration's first step: on a GPU three in-place writes per iteration instead of three per
        # step, and no bounds check (the buffers hold whole iterations, so the block always fits).
        # One step per iteration (the CPU's): the column write it always had, which keeps XLA:CPU's
        # fusions, and so the log-probs' last bits, as they were.
        # The barrier ties each step's outputs to its cache: without it XLA computed the log-probs
        # in the iteration's final write and kept every step's [S, V] logits alive until then
        # (0.5 GiB more temporaries at Qwen2.5-0.5B's vocabulary and 128 slots, on the h100 target).
        start, emitted = c.step, []
        for _ in range(inner):
            c, out = step(c)
            if inner > 1:
                pool, out = jax.lax.optimization_barrier((c.pool, out))
                c = c._replace(pool=pool)
            emitted.append(out)
        if inner == 1:
            block = lambda buffer, values: buffer.at[:, start].set(values[0], mode="drop")
        else:
            block = lambda buffer, values: jax.lax.dynamic_update_slice(buffer, jnp.stack(values, axis=1), (jnp.int32(0), start))
        token, log_p, was_active = zip(*emitted)
        return c._replace(tokens=block(c.tokens, token), logprobs=block(c.logprobs, log_p), emitted=block(c.emitted, was_active))

    written = -(-steps // inner) * inner  # the output buffers' steps: whole iterations (sliced to ``steps`` at the end)
    init = _Chunk(
        step=jnp.int32(0),
        pool=pool,
        lengths=jnp.asarray(controls.lengths, jnp.int32),
        last_token=jnp.asarray(controls.last_token, jnp.int32),
        generated=jnp.asarray(controls.generated, jnp.int32),
        node=jnp.asarray(controls.node, jnp.int32),
        active=jnp.asarray(controls.active, bool),
        tokens=jnp.zeros((slots, written), jnp.int32),
        logprobs=jnp.zeros((slots, written), jnp.float32),
        emitted=jnp.zeros((slots, written), bool),
    )
    free_at_start = slots - jnp.sum(init.active.astype(jnp.int32))

    def more(c: _Chunk) -> jax.Array:
        # A slot that finished inside the chunk idles until the host refills it at the chunk's
        # end: end the chunk as soon as a refill can happen (continuous batching).
        free = slots - jnp.sum(c.active.astype(jnp.int32))
        refill = (free > free_at_start) & (free >= controls.refill_free)
        return (c.step < steps) & jnp.any(c.active) & ~refill

    # The engine's devices pick the decode attention's path (asyncrl.model.attention.paged_decode_attention);
    # on a mesh it runs per device in a shard_map.
    with kernel_context(kernel):
        out = jax.lax.while_loop(more, body, init)
    pool = tuple(PagedLayerKV(layer.kv, layer.layout) for layer in out.pool)  # the views end with the chunk
    return (constrain_state(pool, layout), out.tokens[:, :steps], out.logprobs[:, :steps], out.emitted[:, :steps])


prefill_jit = jax.jit(_prefill, static_argnums=(0, 4, 5, 6), donate_argnums=2)
copy_pages_jit = jax.jit(_copy_pages, static_argnums=3, donate_argnums=0)
decode_chunk_jit = jax.jit(_decode_chunk, static_argnums=(0, 6, 7, 8, 10),
                           static_argnames=("sampler", "inner", "kernel", "view_pages"), donate_argnums=2)
