"""The device side of :class:`~asyncrl.engine.jax_engine.JaxEngine`: its state, its per-slot
controls, and the jitted programs that prefill and decode (module-level jits, shared by every
engine with the same model shapes).

The model is run only through its own forward (:mod:`asyncrl.model.transformer`: the
KV-cache protocol, :class:`~asyncrl.model.kv_cache.KVCache` and
:func:`~asyncrl.model.kv_cache.kv_cache_copy_rows`); this module adds scheduling state
and sampling, nothing of the network. It stays one file: the programs share the slot state's
layout and its shardings on an engine mesh, which each program pins (:func:`constrain_state`).

Compiled programs
-----------------
* ``prefill_insert``: one per prefill bucket; the prompts admitted at one chunk boundary
  are prefilled :data:`PREFILL_ROWS` at a time, so the weights are read once per call, not
  once per request;
* ``decode_chunk``: up to ``engine.decode_chunk`` steps in a ``lax.while_loop`` of
  ``engine.decode_inner_steps`` unrolled steps per iteration (:mod:`asyncrl.engine.platform`: 8 on
  GPUs, where the host reads the loop's predicate after every iteration; 1 elsewhere) (it exits
  early once every slot is done, or once a slot finished and enough slots are free for the
  scheduler to refill: ``SlotControls.refill_free``), in two variants: plain sampling, and sampling with
  top-k/top-p (two threshold searches over the vocabulary), used only for chunks in which
  some slot asks for it; each also with a trie mask (``_trie``), used only for chunks in which
  some slot is constrained (compiled once per size class of the engine's trie pool).

* ``beam_search``: one request's whole beam search (:mod:`asyncrl.engine.beam_search`), compiled per
  prompt bucket, width, ``max_new_tokens`` and trie size class; used only by beam requests.

Each decode variant is compiled once per sampler (``engine.sampler``), steps per iteration and attention bucket
(``engine.attention_buckets``: the chunk attends over the cache's first ``attend`` slots, the
smallest size class holding every active slot's context to the chunk's end; :func:`cache_prefix`).

So at most ``len(prefill_buckets) + 2 * attention_buckets`` programs per model without constraints or beams; :func:`compile_count` counts
traces (each trace is one compilation) and is reported as ``engine/compiles``.

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
from asyncrl.model.kv_cache import KVCache, LayerKV, init_kv_cache, kv_cache_copy_rows, positions_slice
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


# --------------------------------------------------------------------------- state and controls


_State = TypeVar("_State")  # the slot state, or its KV cache alone


class SlotState(NamedTuple):
    """Device state of the slots (donated to every call)."""

    cache: KVCache  # the model's cache: rows = slots, capacity = engine.kv_capacity
    keys: jax.Array  # uint32 [slots, 2]: each slot's sample key (before the token fold)


def init_slot_state(cfg: Any, slots: int, capacity: int, layout: str = "bksd") -> SlotState:
    """Empty slots for a :class:`~asyncrl.model.DecoderConfig`: no valid KV, zero keys; the cache in
    ``layout`` (:func:`~asyncrl.engine.layouts.kv_cache_layout` of the engine's platform)."""
    return SlotState(cache=init_kv_cache(cfg, slots, capacity, layout=layout), keys=jnp.zeros((slots, 2), jnp.uint32))


def slot_state_shardings(cfg: Any, slots: int, mesh: Any, layout: str = "bksd") -> SlotState:
    """How the slot state lies on an engine mesh (axes ``data``, ``fsdp``, ``tensor``): each
    layer's K/V (in ``layout``) split by KV heads over ``tensor`` (each device holds the heads its
    attention computes) and by slots over ``data`` x ``fsdp`` (the replicas decode different
    slots) when the slot count divides; the per-slot vectors (``valid``, ``write_pos``, keys)
    follow the slots. A pytree of ``NamedSharding`` shaped like :class:`SlotState` (hashable: it
    is a static argument of the programs)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicas = mesh.shape["data"] * mesh.shape["fsdp"]
    rows = ("data", "fsdp") if replicas > 1 and slots % replicas == 0 else None
    heads = "tensor" if mesh.shape["tensor"] > 1 and cfg.num_kv_heads % mesh.shape["tensor"] == 0 else None
    kv: Any = NamedSharding(mesh, P(rows, heads, None, None) if layout == "bksd" else P(rows, None, heads, None))
    per_slot: Any = NamedSharding(mesh, P(rows))
    per_slot_row: Any = NamedSharding(mesh, P(rows, None))
    return SlotState(
        cache=KVCache(layers=tuple(LayerKV(kv, kv, layout) for _ in range(cfg.num_layers)), valid=per_slot_row,
                      write_pos=per_slot),
        keys=per_slot_row,
    )


def constrain_state(state: _State, layout: Any) -> _State:
    """``state`` pinned to ``layout`` (:func:`slot_state_shardings`), so every call returns the
    state on the shardings it was given (donation reuses the buffers, no recompiles); with
    ``layout`` None (the engine on the trainer's arrays) the program is left to XLA as before."""
    return state if layout is None else jax.lax.with_sharding_constraint(state, layout)


class SlotControls(NamedTuple):
    """Per-slot controls of a decode chunk, one row per slot.

    The scheduler owns a host copy (numpy arrays, updated in place as requests are admitted,
    advance and end) and passes a snapshot to every chunk; idle rows have ``active`` false.
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


def idle_controls(slots: int, max_stop_ids: int) -> SlotControls:
    """Host controls of ``slots`` idle slots (numpy; every field writable)."""
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
    )


def snapshot(controls: SlotControls) -> SlotControls:
    """A copy to hand to a chunk: the call transfers its arguments asynchronously, and the
    scheduler edits its own copy right after."""
    return SlotControls(*(np.array(x, copy=True) for x in controls))


# --------------------------------------------------------------------------- prefill


class PrefillPlan(NamedTuple):
    """What one prefill-insert call does: the prompts to prefill and, per destination slot, the
    prompt row it copies and its sample key's parts. Host arrays, uploaded with the call."""

    prompt_ids: Any  # int32 [rows, bucket]: one right-padded prompt per row (rows past the admitted requests: padding)
    prompt_mask: Any  # bool [rows, bucket]
    src_rows: Any  # int32 [slots]: the prompt row each destination copies
    dst_rows: Any  # int32 [slots]: the destination slot (entries >= slots are ignored)
    sample_id: Any  # uint32 [slots]: the key's parts; a slot's key depends on these three only,
    turn: Any  # uint32 [slots]     never on the batch it was prefilled with
    key_index: Any  # uint32 [slots]: index_in_group + j

    @classmethod
    def empty(cls, rows: int, bucket: int, slots: int) -> "PrefillPlan":
        """All-padding prompts and no destination (every ``dst_rows`` entry is ``slots``), to fill in."""
        prompt_ids = np.zeros((rows, bucket), np.int32)
        return cls(prompt_ids, np.zeros(prompt_ids.shape, bool), np.zeros((slots,), np.int32),
                   np.full((slots,), slots, np.int32), *(np.zeros((slots,), np.uint32) for _ in range(3)))


def kernel_context(kernel: Optional[KernelTarget]) -> Any:
    """:func:`compiled_for` the engine's devices: its mesh, or their platform and count (no change
    for None: this process's backend)."""
    if kernel is None:
        return compiled_for()
    if kernel.mesh is not None:
        return compiled_for(mesh=kernel.mesh)
    return compiled_for(platform=kernel.platform, devices=kernel.devices)


def _prefill_insert(graphdef, params, state: SlotState, plan: PrefillPlan, root_key, layout=None, kernel=None):
    """Prefill ``plan``'s prompts and copy each into its request's slots (:class:`PrefillPlan`).
    ``layout`` (static): the state's shardings on an engine mesh, or None. ``kernel`` (static): the
    engine's devices as a :class:`~asyncrl.model.attention.KernelTarget` (platform and count),
    whose fused attention kernel the prefill runs (None: this process's default backend)."""
    count_trace("prefill_insert")
    cfg = graphdef_config(graphdef, params)
    small = init_kv_cache(cfg, plan.prompt_ids.shape[0], plan.prompt_ids.shape[1], state.cache.layers[0].k.dtype,
                          state.cache.layout)
    if layout is not None:  # each replica prefills its own PREFILL_ROWS prompts, as one device does alone
        rows = layout.cache.valid
        small = constrain_state(small, layout.cache)
        plan = plan._replace(prompt_ids=jax.lax.with_sharding_constraint(plan.prompt_ids, rows),
                             prompt_mask=jax.lax.with_sharding_constraint(plan.prompt_mask, rows))
    with kernel_context(kernel):
        _, small = hidden_states(graphdef, params, plan.prompt_ids, None, plan.prompt_mask, small, empty_cache=True)
    new_keys = jax.vmap(slot_key, in_axes=(None, 0, 0, 0))(root_key, plan.sample_id, plan.key_index, plan.turn)
    if layout is None:
        cache = kv_cache_copy_rows(state.cache, small, plan.src_rows, plan.dst_rows)
        return SlotState(cache, state.keys.at[plan.dst_rows].set(new_keys, mode="drop"))
    return _insert_on_replicas(state, small, plan.src_rows, plan.dst_rows, new_keys, layout)


def _insert_on_replicas(state: SlotState, small: KVCache, src_rows, dst_rows, new_keys, layout: Any) -> SlotState:
    """:func:`kv_cache_copy_rows` (and the slots' new keys) on an engine mesh, per device in a
    ``shard_map``: each replica writes the destination rows it holds, from the prefilled rows
    gathered whole (a few prompts), with the destinations shifted to its own rows (the others
    dropped). A scatter into the slot-split state by global rows is what XLA's partitioner
    otherwise makes of it: the whole cache gathered on every device at every prefill."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = layout.cache.valid.mesh
    row_axes = layout.cache.valid.spec[0]
    replicas = 1
    for axis in (row_axes if isinstance(row_axes, tuple) else (row_axes,) if row_axes else ()):
        replicas *= mesh.shape[axis]
    local = state.cache.valid.shape[0] // replicas
    whole_rows = lambda spec: P(None, *spec[1:])  # noqa: E731 - the same split but for the rows
    state_specs = jax.tree.map(lambda sharding: sharding.spec, layout)
    small_specs = jax.tree.map(lambda spec: whole_rows(spec), state_specs.cache,
                               is_leaf=lambda x: isinstance(x, P))
    small = jax.lax.with_sharding_constraint(small, jax.tree.map(lambda spec: NamedSharding(mesh, spec), small_specs,
                                                                 is_leaf=lambda x: isinstance(x, P)))

    def insert(state: SlotState, small: KVCache, src_rows, dst_rows, new_keys) -> SlotState:
        first = replica_index(mesh, row_axes) * local
        mine = (dst_rows >= first) & (dst_rows < first + local)
        dst = jnp.where(mine, dst_rows - first, local)  # local rows; others past the end: dropped
        cache = kv_cache_copy_rows(state.cache, small, src_rows, dst)
        return SlotState(cache, state.keys.at[dst].set(new_keys, mode="drop"))

    return jax.shard_map(insert, mesh=mesh, in_specs=(state_specs, small_specs, P(), P(), P()), out_specs=state_specs,
                         check_vma=False)(state, small, src_rows, dst_rows, new_keys)


def replica_index(mesh: Any, row_axes: Any) -> jax.Array:
    """Inside a ``shard_map``: this device's index along the mesh's row axes (major first)."""
    axes = row_axes if isinstance(row_axes, tuple) else (row_axes,) if row_axes else ()
    index = jnp.int32(0)
    for axis in axes:
        index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
    return index


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
    cache: KVCache
    last_token: jax.Array  # int32 [S]
    generated: jax.Array  # int32 [S]
    node: jax.Array  # int32 [S]: the trie node the next token is chosen at (-1: unconstrained)
    active: jax.Array  # bool [S]
    # The outputs, [S, steps rounded up to whole loop iterations] (written once per iteration):
    tokens: jax.Array  # int32: the token each slot produced at each step
    logprobs: jax.Array  # float32
    emitted: jax.Array  # bool: the slot was active at that step


def cache_prefix(cache: KVCache, size: int) -> KVCache:
    """The first ``size`` slots of every row of ``cache`` (K/V holding ``size`` positions, ``valid``
    ``[B, size]``; write positions unchanged): a decode step on it attends over ``size`` slots
    instead of the whole capacity. Rows whose write position is ``>= size`` must be idle (their
    writes fall past the prefix and are dropped)."""
    part = positions_slice(cache.layout, size)
    layers = tuple(LayerKV(layer.k[part], layer.v[part], layer.layout) for layer in cache.layers)
    return KVCache(layers, cache.valid[:, :size], cache.write_pos)


def cache_put_prefix(full: KVCache, prefix: KVCache) -> KVCache:
    """``full`` with its first ``prefix.capacity`` slots replaced by ``prefix`` (its write positions
    taken from ``prefix``): the inverse of :func:`cache_prefix` after the prefix was decoded into."""
    put = lambda whole, part: jax.lax.dynamic_update_slice(whole, part, (0,) * whole.ndim)
    layers = tuple(LayerKV(put(w.k, p.k), put(w.v, p.v), w.layout) for w, p in zip(full.layers, prefix.layers))
    return KVCache(layers, put(full.valid, prefix.valid), prefix.write_pos)


def _decode_chunk(graphdef, params, state: SlotState, controls: SlotControls, steps: int, filtered: bool, layout=None,
                  tries=None, max_branch: int = 0, *, sampler: str = "inverse_cdf", attend: int = 0, inner: int = 1,
                  kernel: Optional[KernelTarget] = None):
    """Decode up to ``steps`` tokens for every active slot: each step is the model's own
    KV-cache :func:`~asyncrl.model.transformer.forward` with ``T = 1`` (idle slots masked out).

    Returns the new state and ``tokens`` int32, ``logprobs`` float32, ``emitted`` bool, each
    [S, steps]: ``emitted`` marks the steps at which the slot was active and produced the token.
    ``layout`` (static): the state's shardings on an engine mesh, or None. ``tries``: the
    engine's trie pool (:class:`~asyncrl.engine.constraints.TrieTables`, device arrays) when
    some slot is constrained (``controls.node >= 0``), else None; ``max_branch`` (static) its
    widest node. A constrained slot samples from the masked distribution, ignores stop ids,
    and ends when it reaches a leaf. ``sampler`` (static): :func:`draw_tokens`' sampler.
    ``attend`` (static): decode over the cache's first ``attend`` slots only
    (:func:`cache_prefix`; 0 or the capacity: all of it); the caller picks it at least as large
    as every active slot's write position plus ``steps`` (:mod:`asyncrl.engine.attention_buckets`),
    so every valid slot and every write of the chunk lies inside it and the results equal the
    full cache's. ``inner`` (static): decode steps per iteration of the chunk's loop
    (``engine.decode_inner_steps``): the early exit is tested once every ``inner`` steps, so on a
    GPU the host, which reads the loop's predicate, is in the loop once per ``inner`` tokens;
    a slot that finished idles at most ``inner - 1`` more steps before the chunk can end. Steps
    past ``steps`` (when ``inner`` does not divide it) run with every slot idle and emit nothing.
    ``kernel`` (static): the engine's devices, as in :func:`_prefill_insert` (its mesh, when it has
    one, runs the decode attention kernel per device).
    """
    count_trace(("decode_chunk_topk_topp" if filtered else "decode_chunk") + ("_trie" if tries is not None else "")
                 + (f"_{sampler}" if sampler != "inverse_cdf" else "") + (f"_attend{attend}" if attend else ""))
    slots = controls.active.shape[0]
    vocab = params["embed_tokens"]["embedding"].shape[0]
    stop_vocab = jax.nn.one_hot(controls.stop_ids, vocab, dtype=bool).any(axis=1)  # [S, V]; -1 pads hit nothing

    def step(c: _Chunk) -> tuple[_Chunk, tuple[jax.Array, jax.Array, jax.Array]]:
        # One decode step: the next carry (its output buffers untouched) and what the step emits,
        # (token, log-prob, emitted) each [S], which ``body`` writes. Past ``steps`` no slot runs (an
        # idle slot's step changes nothing: its K/V land on its next, still invalid, cache position
        # and its write position stays).
        if inner > 1:
            c = c._replace(active=c.active & (c.step < steps))
        logits, cache = forward(graphdef, params, c.last_token[:, None], None, c.active[:, None], c.cache)
        assert cache is not None  # forward returns the updated cache when given one
        allowed = None if tries is None else allowed_vocab(tries, c.node, vocab, max_branch)
        token, log_p, is_stop = _choose_tokens(logits[:, 0], controls, stop_vocab, state.keys, c.generated, filtered, allowed,
                                               sampler)
        node = c.node
        if tries is not None:
            next_node = next_nodes(jnp, tries, c.node, token, max_branch)
            is_stop = jnp.where(c.node >= 0, is_leaf_node(jnp, tries, next_node), is_stop)
            node = jnp.where(c.active, next_node, c.node)
        generated = c.generated + c.active.astype(jnp.int32)
        done = is_stop | (generated >= controls.max_new_tokens)
        return c._replace(step=c.step + 1, cache=cache, last_token=jnp.where(c.active, token, c.last_token),
                          generated=generated, node=node, active=c.active & ~done), (token, log_p, c.active)

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
                cache, out = jax.lax.optimization_barrier((c.cache, out))
                c = c._replace(cache=cache)
            emitted.append(out)
        if inner == 1:
            block = lambda buffer, values: buffer.at[:, start].set(values[0], mode="drop")
        else:
            block = lambda buffer, values: jax.lax.dynamic_update_slice(buffer, jnp.stack(values, axis=1), (jnp.int32(0), start))
        token, log_p, was_active = zip(*emitted)
        return c._replace(tokens=block(c.tokens, token), logprobs=block(c.logprobs, log_p), emitted=block(c.emitted, was_active))

    bucketed = 0 < attend < state.cache.capacity
    written = -(-steps // inner) * inner  # the output buffers' steps: whole iterations (sliced to ``steps`` at the end)
    init = _Chunk(
        step=jnp.int32(0),
        cache=cache_prefix(state.cache, attend) if bucketed else state.cache,
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

    # The engine's devices pick the decode attention's path (asyncrl.model.decode_attention): on a
    # mesh the kernel runs per device in a shard_map.
    with kernel_context(kernel):
        out = jax.lax.while_loop(more, body, init)
    cache = cache_put_prefix(state.cache, out.cache) if bucketed else out.cache
    return (constrain_state(SlotState(cache, state.keys), layout), out.tokens[:, :steps], out.logprobs[:, :steps],
            out.emitted[:, :steps])


prefill_insert_jit = jax.jit(_prefill_insert, static_argnums=(0, 5, 6), donate_argnums=2)
decode_chunk_jit = jax.jit(_decode_chunk, static_argnums=(0, 4, 5, 6, 8),
                           static_argnames=("sampler", "attend", "inner", "kernel"), donate_argnums=2)
