"""Attention over a paged KV cache (:class:`~asyncrl.model.kv_cache.PagedKVCache`): the new tokens'
keys and values written into their rows' pages, then attention over those pages, one function
(:func:`paged_decode_attention`) for every platform with the einsum reference beside it.

* the reference (:func:`reference_paged_attention`): each row's pages gathered in order, then the
  einsum of :func:`~asyncrl.model.attention.einsum_attention`; prefill chunks after a row's pages
  (several tokens) always take it;
* the CPU (:func:`flat_paged_attention`): one token per row over every row's pages listed flat,
  softmax and values summed per row, so a step costs the pages the rows hold, not the rows times
  the longest row;
* a prefill into empty rows attends among its own tokens by ``model.attention``'s kernel (cuDNN,
  splash), as a cache-free forward does.

On an engine mesh the pages a row's table names lie on the row's own replica: the write and the
attention run per device in a ``shard_map`` (XLA cannot know that, and would gather the pool).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from asyncrl.model.attention import SelfAttentionMask, attend, current_target, einsum_attention
from asyncrl.model.kv_cache import FlatPages, PagedLayerKV, gather_flat, gather_rows, write_pages

_ROW_AXES = ("data", "fsdp")  # the mesh axes rows (and their replicas' pages) are split over


@dataclasses.dataclass(frozen=True)
class PagedQueries:
    """The new tokens of a call over a paged cache (:class:`~asyncrl.model.kv_cache.PagedKVCache`):
    each token's cache (and rotary) ``positions`` int32 ``[B, T]``, which are ``real`` (bool
    ``[B, T]``: written; padding writes nothing), each row's ``page_table`` int32 ``[B, P]``, the
    rows' pages as one list (``flat``, one-token calls on the CPU; else None), Gemma 3's sliding
    ``window`` (static) and whether the rows held no token before (``fresh``, static: a prefill,
    whose tokens attend only among themselves through ``model.attention``'s kernel). A query at
    position ``p`` attends its row's positions ``<= p`` (within the window)."""

    positions: jax.Array
    real: jax.Array
    page_table: jax.Array
    flat: Optional[FlatPages] = None
    window: Optional[int] = None
    fresh: bool = False

    def with_window(self, window: Optional[int]) -> "PagedQueries":
        return dataclasses.replace(self, window=window)


jax.tree_util.register_dataclass(PagedQueries, data_fields=["positions", "real", "page_table", "flat"],
                                 meta_fields=["window", "fresh"])


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, queries: PagedQueries, layer: PagedLayerKV,
                    choice: str, scale: Optional[float] = None) -> tuple[jax.Array, PagedLayerKV]:
    """Attention of ``q [B, T, heads, D]`` over a paged layer after writing the new ``k, v``
    ``[B, T, kv_heads, D]`` into the rows' pages (:func:`~asyncrl.model.kv_cache.write_pages`).
    Returns ``(out [B, T, heads, D], the updated layer)``.

    A prefill into empty rows (``queries.fresh``) attends among its own tokens by
    ``model.attention``'s kernel, as a cache-free forward does. Otherwise
    :func:`paged_decode_attention` reads the rows' pages. On an engine mesh (:func:`compiled_for`:
    rows, and the pages their tables name, over ``data x fsdp``, KV heads over ``tensor``; page
    numbers local to each replica) both run per device in a ``shard_map``: XLA cannot know that a
    row's pages lie on its own device, and would gather the pool around every access."""
    mesh = current_target().mesh
    layer = _per_device(mesh, lambda layer, k, v, t, p, r: write_pages(layer, k, v, t, p, r), layer.layout,
                        ("pool", "kv", "kv", "rows", "rows", "rows"), "pool",
                        layer, k, v, queries.page_table, queries.positions, queries.real)
    if queries.fresh:
        k, v = k.astype(layer.kv.dtype).astype(q.dtype), v.astype(layer.kv.dtype).astype(q.dtype)
        return attend(q, k, v, SelfAttentionMask(queries.real, None, queries.window), choice, kv_spec="bskd",
                      scale=scale), layer

    def local(q, layer, positions, page_table, *flat):
        here = dataclasses.replace(queries, positions=positions, page_table=page_table, flat=flat[0] if flat else None)
        return paged_decode_attention(q, layer, here, choice, scale)

    flat = () if queries.flat is None else (queries.flat,)
    out = _per_device(mesh, local, layer.layout, ("kv", "pool", "rows", "rows", "flat")[:4 + len(flat)], "kv",
                      q, layer, queries.positions, queries.page_table, *flat)
    return out, layer


def paged_decode_attention(q: jax.Array, layer: PagedLayerKV, queries: PagedQueries, choice: str,
                           scale: Optional[float] = None) -> jax.Array:
    """Attention of ``q [B, T, heads, D]`` over the rows' pages already holding the new tokens:
    the one function every platform's path goes through. One token per row with ``queries.flat``
    (the CPU): :func:`flat_paged_attention`, whose cost follows the rows' own lengths; otherwise
    (and ``model.attention: reference``) :func:`reference_paged_attention`, the einsum over each
    row's gathered pages that every path is tested against."""
    if q.shape[1] == 1 and queries.flat is not None and choice != "reference":
        return flat_paged_attention(q, layer, queries, scale)
    return reference_paged_attention(q, layer, queries, scale)


def _key_mask(key_positions: jax.Array, query_positions: jax.Array, window: Optional[int]) -> jax.Array:
    """Keys at ``key_positions`` a query at ``query_positions`` attends (broadcast): those at or
    before it, within the sliding window."""
    ok = key_positions <= query_positions
    if window is not None:
        ok = ok & (key_positions > query_positions - window)
    return ok


def reference_paged_attention(q: jax.Array, layer: PagedLayerKV, queries: PagedQueries,
                              scale: Optional[float] = None) -> jax.Array:
    """The reference: each row's pages gathered in order (``[B, P * page_size]`` positions), then
    :func:`einsum_attention` under the mask of :class:`PagedQueries` (the contiguous cache's
    numbers, position for position)."""
    k, v, spec = gather_rows(layer, queries.page_table)
    keys = jnp.arange(k.shape[spec.index("s")], dtype=jnp.int32)
    mask = _key_mask(keys[None, None, :], queries.positions[:, :, None], queries.window)
    return einsum_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, spec, scale)


def flat_paged_attention(q: jax.Array, layer: PagedLayerKV, queries: PagedQueries,
                         scale: Optional[float] = None) -> jax.Array:
    """One query per row (``q [B, 1, heads, D]``) over the pages of ``queries.flat``: every listed
    page is scored against its row's query, and each row's softmax and weighted values are
    summed over its own pages (segment sums), so a step costs the rows' pages, not rows x the
    longest row. Float32 scores and softmax, as :func:`einsum_attention`."""
    flat = queries.flat
    assert flat is not None
    b, _, heads, d = q.shape
    k, v, spec = gather_flat(layer, flat.pages)
    kv_heads = k.shape[spec.index("k")]
    group = heads // kv_heads
    rows = jnp.clip(flat.rows, 0, b - 1)
    q_flat = q[:, 0].reshape(b, kv_heads, group, d)[rows]  # [N, kv_heads, group, D]
    scores = jnp.einsum(f"nkgd,{spec}->nkgp", q_flat, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5 if scale is None else scale)
    keys = flat.starts[:, None] + jnp.arange(k.shape[spec.index("p")], dtype=jnp.int32)[None, :]  # [N, page_size]
    ok = _key_mask(keys, queries.positions[rows, :1], queries.window) & (flat.rows < b)[:, None]
    scores = jnp.where(ok[:, None, None, :], scores, -jnp.inf)
    top = jax.ops.segment_max(jnp.max(scores, axis=-1), flat.rows, num_segments=b)  # [B, kv_heads, group]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.where(ok[:, None, None, :], jnp.exp(scores - top[rows][..., None]), 0.0)
    total = jax.ops.segment_sum(jnp.sum(weights, axis=-1), flat.rows, num_segments=b)
    values = jnp.einsum(f"nkgp,{spec}->nkgd", weights.astype(v.dtype), v.astype(q.dtype),
                        preferred_element_type=jnp.float32)
    summed = jax.ops.segment_sum(values, flat.rows, num_segments=b)  # [B, kv_heads, group, D]
    out = summed / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(b, 1, heads, d).astype(q.dtype)


def _per_device(mesh: Any, fn: Any, layout: str, kinds: tuple[str, ...], out_kind: str, *args: Any) -> Any:
    """``fn(*args)`` per device of an engine ``mesh`` in a ``shard_map`` (directly without one, or
    on one device). ``kinds`` name each argument's split: ``pool`` (a page pool in ``layout``: its
    pages over the replicas, KV heads over ``tensor``), ``kv`` (``[B, T, heads, D]``: rows and
    heads), ``rows`` (rows first), ``flat`` (a :class:`~asyncrl.model.kv_cache.FlatPages`, each
    replica's part in turn)."""
    if mesh is None or mesh.size == 1:
        return fn(*args)
    from jax.sharding import PartitionSpec as P

    replicas = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    rows = _ROW_AXES if replicas > 1 else None
    heads = "tensor" if mesh.shape.get("tensor", 1) > 1 else None
    pool = PagedLayerKV(P(None, heads, rows, None, None) if layout == "2kpsd" else P(rows, None, heads, None), layout)  # type: ignore[arg-type]
    spec_of = {"pool": pool, "kv": P(rows, None, heads, None), "rows": P(rows), "flat": FlatPages(P(rows), P(rows), P(rows))}
    in_specs = tuple(spec_of[kind] for kind in kinds)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec_of[out_kind], check_vma=False)(*args)
