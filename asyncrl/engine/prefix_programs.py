"""The device programs of prefix reuse (:mod:`asyncrl.engine.prefix_cache` decides what to reuse):
copy a kept prefix from one slot to others (:func:`copy_prefix_jit`), and prefill the rest of a
prompt after it, attending over the kept positions (:func:`extend_jit`).

Both work on the engine's slot state (:class:`~asyncrl.engine.jax_programs.SlotState`, donated),
run the model only through its own forward (:func:`~asyncrl.model.transformer.hidden_states` over
a non-empty cache, the protocol of :mod:`asyncrl.model.transformer`), and on an engine mesh touch
each replica's own rows in a ``shard_map`` (XLA partitions a scatter by global row indices into
the slot-split cache as a gather of the whole cache on every device): a copy whose source lies on
another replica sums the source rows over the replicas first (``cross``, static).

Fixed row counts per call (:data:`COPY_ROWS` copies; ``extend_rows`` rows per replica), so a
prompt's numbers do not depend on what else is copied or extended beside it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.engine.jax_programs import SlotState, constrain_state, count_trace, kernel_context, replica_index, slot_key
from asyncrl.model.kv_cache import KVCache, LayerKV
from asyncrl.model.transformer import hidden_states

COPY_ROWS = 8
"""Copies per call (fewer are padded with entries that write nothing, more take several calls)."""


class CopyPlan(NamedTuple):
    """Copies of kept prefixes between slots, and the destinations' new sample keys. Host arrays."""

    src_rows: Any  # int32 [COPY_ROWS]: the slot copied from
    dst_rows: Any  # int32 [COPY_ROWS]: the slot written (>= slots: an unused entry, nothing written)
    lengths: Any  # int32 [COPY_ROWS]: positions [0, length) kept; the destination's others invalid, its next write at length
    sample_id: Any  # uint32 [COPY_ROWS]: the destination's key parts (as PrefillPlan's)
    turn: Any  # uint32 [COPY_ROWS]
    key_index: Any  # uint32 [COPY_ROWS]

    @classmethod
    def empty(cls, slots: int) -> "CopyPlan":
        rows = np.zeros((COPY_ROWS,), np.int32)
        return cls(rows, np.full((COPY_ROWS,), slots, np.int32), rows.copy(), *(np.zeros((COPY_ROWS,), np.uint32)
                                                                                 for _ in range(3)))


class ExtendPlan(NamedTuple):
    """Prompt tokens to prefill after the kept prefix of their slots. Host arrays; on an engine mesh
    replica ``r``'s rows are ``[r * per_replica, (r + 1) * per_replica)``, each one of its own slots."""

    rows: Any  # int32 [rows]: the slot extended (>= slots: an unused row)
    token_ids: Any  # int32 [rows, bucket]: the tokens after the slot's write position, right-padded
    token_mask: Any  # bool [rows, bucket]

    @classmethod
    def empty(cls, rows: int, bucket: int, slots: int) -> "ExtendPlan":
        ids = np.zeros((rows, bucket), np.int32)
        return cls(np.full((rows,), slots, np.int32), ids, np.zeros(ids.shape, bool))


def _copy_prefix(state: SlotState, plan: CopyPlan, root_key, layout=None, cross: bool = False) -> SlotState:
    """Each entry of ``plan``: the destination slot takes the source slot's K/V (all of it: positions
    past ``length`` are invalid, so their values do not matter), ``valid`` up to ``length``, write
    position ``length`` and a new sample key. Sources are read before anything is written, so a
    source may be a destination of the same call. ``layout`` (static): the state's shardings on an
    engine mesh; ``cross`` (static): some source lies on another replica than its destination."""
    count_trace("copy_prefix")
    keys = jax.vmap(slot_key, in_axes=(None, 0, 0, 0))(root_key, plan.sample_id, plan.key_index, plan.turn)
    if layout is None:
        return _copy_rows(state, plan.src_rows, plan.dst_rows, plan.lengths, keys, 0, state.keys.shape[0])
    from jax.sharding import PartitionSpec as P

    mesh, row_axes = layout.cache.valid.mesh, layout.cache.valid.spec[0]
    specs = jax.tree.map(lambda sharding: sharding.spec, layout)
    local = state.keys.shape[0] // _replicas(mesh, row_axes)

    def per_device(state: SlotState, src_rows, dst_rows, lengths, keys) -> SlotState:
        first = replica_index(mesh, row_axes) * local

        def gather(state: SlotState, i) -> SlotState:  # the source row from the replica that holds it, summed over all
            mine = (src_rows[i] >= first) & (src_rows[i] < first + local)
            row = jax.tree.map(lambda x: jnp.where(mine, x[jnp.clip(src_rows[i] - first, 0, local - 1)], jnp.zeros((), x.dtype)),
                               state)
            summed = jax.lax.psum(jax.tree.map(lambda x: x.astype(jnp.int8) if x.dtype == bool else x, row), row_axes)
            return jax.tree.map(lambda x, like: x.astype(bool) if like.dtype == bool else x, summed, row)

        if cross:  # a source may lie on another replica than its destination
            return _copy_rows(state, None, dst_rows, lengths, keys, first, local, gather)
        return _copy_rows(state, jnp.clip(src_rows - first, 0, local - 1), dst_rows, lengths, keys, first, local)

    return jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P(), P(), P(), P()), out_specs=specs,
                         check_vma=False)(state, plan.src_rows, plan.dst_rows, plan.lengths, keys)


def _replicas(mesh: Any, row_axes: Any) -> int:
    axes = row_axes if isinstance(row_axes, tuple) else (row_axes,) if row_axes else ()
    count = 1
    for axis in axes:
        count *= mesh.shape[axis]
    return count


def _copy_rows(state: SlotState, src_rows: Optional[jax.Array], dst_rows: jax.Array, lengths: jax.Array, keys: jax.Array,
               first, local: int, gather: Optional[Any] = None) -> SlotState:
    """The copies on the rows ``[first, first + local)`` of ``state`` (all of it on one device), one
    entry after the other (a device holds one copied row beside the state, not all of them): each
    source row is ``state``'s own row ``src_rows[i]`` (local indices), or ``gather(state, i)``
    (the row from whichever replica holds it)."""
    capacity = state.cache.capacity
    positions = jnp.arange(capacity)

    def one(i, state: SlotState) -> SlotState:
        if gather is not None:
            row = gather(state, i)
        else:
            assert src_rows is not None  # rows of this device's own state
            row = jax.tree.map(lambda x: x[src_rows[i]], state)
        dst = dst_rows[i] - first
        at = jnp.where((dst >= 0) & (dst < local), dst, local)  # another replica's row (or an unused entry): dropped
        put = lambda whole, value: whole.at[at].set(value, mode="drop")  # noqa: E731
        valid = row.cache.valid & (positions < lengths[i])
        layers = tuple(LayerKV(put(d.k, s.k), put(d.v, s.v), d.layout) for d, s in zip(state.cache.layers, row.cache.layers))
        cache = KVCache(layers, put(state.cache.valid, valid), put(state.cache.write_pos, lengths[i].astype(jnp.int32)))
        return SlotState(cache, put(state.keys, keys[i]))

    return jax.lax.fori_loop(0, dst_rows.shape[0], one, state)


def _extend(graphdef, params, state: SlotState, plan: ExtendPlan, layout=None, kernel=None) -> SlotState:
    """Prefill ``plan``'s tokens into their slots after the positions the slots hold: each row is
    the model's forward over a cache (:func:`~asyncrl.model.transformer.hidden_states`: the tokens
    attend over the slot's valid positions and each other, and are written from its write
    position on). ``layout``, ``kernel`` (static): as :func:`~asyncrl.engine.jax_programs._prefill_insert`'s."""
    count_trace("extend_prefill")
    slots = state.keys.shape[0]
    if layout is None:
        rows = jnp.minimum(plan.rows, slots - 1)
        small = jax.tree.map(lambda x: x[rows], state.cache)
        with kernel_context(kernel):
            _, small = hidden_states(graphdef, params, plan.token_ids, None, plan.token_mask, small)
        put = lambda whole, part: whole.at[plan.rows].set(part, mode="drop")  # noqa: E731
        return SlotState(jax.tree.map(put, state.cache, small), state.keys)
    from jax.sharding import PartitionSpec as P

    mesh, row_axes = layout.cache.valid.mesh, layout.cache.valid.spec[0]
    cache_specs = jax.tree.map(lambda sharding: sharding.spec, layout.cache)
    local = slots // _replicas(mesh, row_axes)

    def gather(cache: KVCache, rows):
        first = replica_index(mesh, row_axes) * local
        return jax.tree.map(lambda x: x[jnp.clip(rows - first, 0, local - 1)], cache)

    def scatter(cache: KVCache, small: KVCache, rows):
        first = replica_index(mesh, row_axes) * local
        mine = (rows >= first) & (rows < first + local)
        dst = jnp.where(mine, rows - first, local)
        return jax.tree.map(lambda whole, part: whole.at[dst].set(part, mode="drop"), cache, small)

    small = jax.shard_map(gather, mesh=mesh, in_specs=(cache_specs, P(row_axes)), out_specs=cache_specs,
                          check_vma=False)(state.cache, plan.rows)
    token_ids = jax.lax.with_sharding_constraint(plan.token_ids, layout.cache.valid)
    token_mask = jax.lax.with_sharding_constraint(plan.token_mask, layout.cache.valid)
    with kernel_context(kernel):
        _, small = hidden_states(graphdef, params, token_ids, None, token_mask, small)
    small = constrain_state(small, layout.cache)
    cache = jax.shard_map(scatter, mesh=mesh, in_specs=(cache_specs, cache_specs, P(row_axes)), out_specs=cache_specs,
                          check_vma=False)(state.cache, small, plan.rows)
    return SlotState(cache, state.keys)


copy_prefix_jit = jax.jit(_copy_prefix, static_argnums=(3, 4), donate_argnums=0)
extend_jit = jax.jit(_extend, static_argnums=(0, 4, 5), donate_argnums=2)
