"""Attention over a paged KV cache (:class:`~asyncrl.model.kv_cache.PagedKVCache`): the new tokens'
keys and values written into their rows' pages, then attention over those pages, one function
(:func:`paged_decode_attention`) for every platform with the einsum reference beside it.

* the reference (:func:`reference_paged_attention`): each row's pages gathered in order, then the
  einsum of :func:`~asyncrl.model.attention.einsum_attention`; prefill chunks after a row's pages
  (several tokens) always take it;
* the CPU: one token per row over a decode chunk's view of the pages (:func:`with_views`, gathered
  once per chunk, the new keys and values written into it and the pool): each row's first pages
  by the einsum, or every row's pages listed flat (:func:`flat_paged_attention`: softmax and values
  summed per row, so a step costs the pages the rows hold, not the rows times the longest row);
* GPUs (:func:`~asyncrl.model.decode_attention.pallas_paged_decode_attention`): one Pallas kernel
  per layer and step walks each row's page table, writing the new key and value too;
* TPUs (:func:`tpu_ragged_paged_attention`): JAX's ``ragged_paged_attention`` over the pool in its
  layout (``ps2kd``), after the write;
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
from asyncrl.model.blocks import apply_rope, rms_norm
from asyncrl.model.kv_cache import FlatPages, PagedLayerKV, gather_rows, gather_view, write_pages, write_view

_ROW_AXES = ("data", "fsdp")  # the mesh axes rows (and their replicas' pages) are split over
TPU_LANES = 128  # ragged_paged_attention takes heads of whole lane tiles; others take the reference


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


@dataclasses.dataclass(frozen=True)
class QKPrologue:
    """What turns a layer's projected queries and keys into the ones attention takes: the rotary
    ``cos, sin`` float32 ``[B, T, D]`` (:func:`~asyncrl.model.transformer.rope_cos_sin`) after
    the q/k RMSNorms (``norms``: their weights ``[D]``, or None for models without them; ``eps``,
    ``plus_one`` as :class:`~asyncrl.model.transformer.RMSNorm`'s)."""

    cos: jax.Array
    sin: jax.Array
    norms: Optional[tuple[jax.Array, jax.Array]] = None
    eps: float = 1e-6
    plus_one: bool = False

    def apply(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``q [B, T, heads, D]`` and ``k [B, T, kv_heads, D]`` normed (when the model has the
        norms), then rotated: the attention module's own order of operations."""
        if self.norms is not None:
            q, k = (rms_norm(x, w, self.eps, self.plus_one) for x, w in zip((q, k), self.norms))
        return apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)


jax.tree_util.register_dataclass(QKPrologue, data_fields=["cos", "sin", "norms"], meta_fields=["eps", "plus_one"])


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, queries: PagedQueries, layer: PagedLayerKV,
                    choice: str, scale: Optional[float] = None,
                    prologue: Optional[QKPrologue] = None) -> tuple[jax.Array, PagedLayerKV]:
    """Attention of ``q [B, T, heads, D]`` over a paged layer after writing the new ``k, v``
    ``[B, T, kv_heads, D]`` into the rows' pages (:func:`~asyncrl.model.kv_cache.write_pages`).
    Returns ``(out [B, T, heads, D], the updated layer)``. With a ``prologue``, ``q`` and ``k`` are
    the projections it norms and rotates first (:meth:`QKPrologue.apply`; on the GPU decode
    kernel's path in the same fusion that lays the new tokens out for the kernel).

    A prefill into empty rows (``queries.fresh``) attends among its own tokens by
    ``model.attention``'s kernel, as a cache-free forward does. Otherwise
    :func:`paged_decode_attention` reads the rows' pages; one token per row on a CUDA GPU, the
    decode kernel (:func:`~asyncrl.model.decode_attention.pallas_paged_decode_attention`) writes the
    new key and value itself. On an engine mesh (:func:`compiled_for`: rows, and the pages their
    tables name, over ``data x fsdp``, KV heads over ``tensor``; page numbers local to each
    replica) everything runs per device in a ``shard_map``: XLA cannot know that a row's pages lie
    on its own device, and would gather the pool around every access (and does not partition the
    kernels)."""
    mesh = current_target().mesh
    on_gpu_kernel = layer.view is None and not queries.fresh and q.shape[1] == 1 and _gpu_kernel_takes(q, layer, choice)
    if prologue is not None and not on_gpu_kernel:
        q, k = prologue.apply(q, k)
        prologue = None
    if layer.view is not None:  # one token per row over the chunk's copy of its pages (the CPU)
        def viewed(q, k, v, layer, positions, page_table, real, *flat):
            here = dataclasses.replace(queries, positions=positions, page_table=page_table, real=real,
                                       flat=flat[0] if flat else None)
            return _decode_over_view(q, k, v, here, layer, scale)

        flat = () if queries.flat is None else (queries.flat,)
        kinds = ("kv", "kv", "kv", "viewed", "rows", "rows", "rows", "flat")[:7 + len(flat)]
        return _per_device(mesh, viewed, layer.layout, kinds, ("kv", "viewed"), q, k, v, layer, queries.positions,
                           queries.page_table, queries.real, *flat)
    if on_gpu_kernel:
        def fused(q, k, v, layer, positions, page_table, real, prologue, *flat):
            here = dataclasses.replace(queries, positions=positions, page_table=page_table, real=real,
                                       flat=flat[0] if flat else None)
            return _decode_on_gpu(q, k, v, here, layer, choice, scale, prologue)

        flat = () if queries.flat is None else (queries.flat,)
        kinds = ("kv", "kv", "kv", "pool", "rows", "rows", "rows", "prologue", "flat")[:8 + len(flat)]
        return _per_device(mesh, fused, layer.layout, kinds, ("kv", "pool"), q, k, v, layer, queries.positions,
                           queries.page_table, queries.real, prologue, *flat)
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


def _decode_over_view(q: jax.Array, k: jax.Array, v: jax.Array, queries: PagedQueries, layer: PagedLayerKV,
                      scale: Optional[float]) -> tuple[jax.Array, PagedLayerKV]:
    """One token per row (the CPU): the new key and value written into the pool and into the
    chunk's view of it (:func:`~asyncrl.model.kv_cache.gather_view`), attention over the view: each
    row's pages in order (:func:`~asyncrl.model.attention.einsum_attention`, the reference's numbers),
    or the flat list (:func:`flat_paged_attention`)."""
    written = write_pages(layer, k, v, queries.page_table, queries.positions, queries.real)
    view = write_view(layer.view, k, v, queries.positions, queries.real, layer.page_size, queries.flat)
    if queries.flat is not None:
        out = flat_paged_attention(q, view[0], view[1], queries, scale)
    else:
        keys = jnp.arange(view[0].shape[2], dtype=jnp.int32)
        mask = _key_mask(keys[None, None, :], queries.positions[:, :, None], queries.window)
        out = einsum_attention(q, view[0].astype(q.dtype), view[1].astype(q.dtype), mask, "bksd", scale)
    return out, PagedLayerKV(written.kv, layer.layout, view)


def with_views(pool: tuple, page_table: jax.Array, pages: int, flat: Optional[FlatPages]) -> tuple:
    """Every layer of ``pool`` with a view of the pages a decode chunk's rows read
    (:func:`~asyncrl.model.kv_cache.gather_view`: each row's first ``pages`` pages, or ``flat``'s),
    taken once before the chunk's steps (on the CPU a gather is a copy of what it reads: per step it
    would copy the attended KV every step); per device on an engine mesh (:func:`compiled_for`)."""
    mesh = current_target().mesh

    def one(layer: PagedLayerKV, page_table, *flat):
        return PagedLayerKV(layer.kv, layer.layout, gather_view(layer, page_table, pages, flat[0] if flat else None))

    extra = () if flat is None else (flat,)
    kinds = ("pool", "rows", "flat")[:2 + len(extra)]
    return tuple(_per_device(mesh, one, layer.layout, kinds, "viewed", layer, page_table, *extra) for layer in pool)


def _gpu_kernel_takes(q: jax.Array, layer: PagedLayerKV, choice: str) -> bool:
    """Whether one token per row goes to the GPU paged decode kernel: ``model.attention`` allows it
    (:func:`~asyncrl.model.attention.attention_kernel`), the pool is in the GPU's layout, and the
    shapes make whole ``tl.dot`` tiles (a block of pages of a power of two of at least 16 positions,
    heads of 16 or more); CUDA lowerings only: others take the reference there (:func:`_decode_on_gpu`)."""
    from asyncrl.model.attention import attention_kernel
    from asyncrl.model.decode_attention import pages_per_block

    if layer.layout != "2kpsd" or attention_kernel(choice, q.dtype, q.shape[-1], decode=True) != "pallas":
        return False
    span = layer.page_size * pages_per_block(layer.page_size)
    return span >= 16 and span & (span - 1) == 0 and q.shape[-1] % 16 == 0 and q.shape[2] % layer.kv.shape[1] == 0


def _decode_on_gpu(q, k, v, queries: PagedQueries, layer: PagedLayerKV, choice: str, scale: Optional[float],
                   prologue: Optional[QKPrologue] = None) -> tuple[jax.Array, PagedLayerKV]:
    """One token per row on a CUDA GPU: the paged decode kernel writes the new key and value and
    attends, in one kernel per layer, reading the new tokens from one fusion that norms and rotates
    the queries and keys (``prologue``) in the projections' order where the heads allow
    (:func:`_prologue_in_projection_order`); other lowerings (``jax.lax.platform_dependent`` picks
    when the program is lowered) apply the prologue, write, then attend by
    :func:`paged_decode_attention`, its reference."""
    from asyncrl.model.decode_attention import grouped_new_tokens, paged_decode_kernel, projections_fit

    d = q.shape[-1]
    scale_ = d**-0.5 if scale is None else scale
    in_order = prologue is not None and projections_fit(q.shape[2], k.shape[2])

    def kernel(q, k, v, kv, positions, page_table, real, prologue):
        if in_order:
            new = _prologue_in_projection_order(q[:, 0], k[:, 0], v[:, 0], prologue)
        else:
            if prologue is not None:
                q, k = prologue.apply(q, k)
            new = grouped_new_tokens(q[:, 0], k[:, 0], v[:, 0])
        out, kv = paged_decode_kernel(new, kv, page_table, positions[:, 0], real[:, 0], scale_, queries.window,
                                      projections=in_order)
        return out[:, None], kv

    def reference(q, k, v, kv, positions, page_table, real, prologue):
        if prologue is not None:
            q, k = prologue.apply(q, k)
        written = write_pages(PagedLayerKV(kv, layer.layout), k, v, page_table, positions, real)
        here = dataclasses.replace(queries, positions=positions, page_table=page_table, real=real)
        return paged_decode_attention(q, written, here, choice, scale), written.kv

    out, kv = jax.lax.platform_dependent(q, k, v, layer.kv, queries.positions, queries.page_table, queries.real,
                                         prologue, cuda=kernel, default=reference)
    return out, PagedLayerKV(kv, layer.layout)


def _prologue_in_projection_order(q: jax.Array, k: jax.Array, v: jax.Array, prologue: QKPrologue) -> jax.Array:
    """:meth:`QKPrologue.apply` over one token per row's ``q [B, heads, D]`` and ``k [B, kv_heads,
    D]``, the values ``v`` passed through, as one expression over the three in the projections'
    order (``[B, heads + 2 kv_heads, D]``, every head normed and rotated, the values' rows then
    taken as they were), so that the norms, the rotation and the values are one fusion and the
    kernel reads its result as it lies (``projections`` of
    :func:`~asyncrl.model.decode_attention.paged_decode_kernel`): ``[B, (heads + 2 kv_heads) /
    group, group, D]``."""

    b, heads, d = q.shape
    kv_heads = k.shape[1]
    x = jnp.concatenate([q, k.astype(q.dtype), v.astype(q.dtype)], axis=1)  # [B, heads + 2 kv_heads, D]
    head = jnp.arange(heads + 2 * kv_heads)[:, None]
    turned = x
    if prologue.norms is not None:  # per-row weights by a select (elementwise: it fuses; a concatenation would not)
        q_weight, k_weight = prologue.norms
        turned = rms_norm(x, jnp.where(head < heads, q_weight[None, :], k_weight[None, :]), prologue.eps, prologue.plus_one)
    turned = apply_rope(turned[:, None], prologue.cos, prologue.sin)[:, 0]
    group = heads // kv_heads
    return jnp.where(head >= heads + kv_heads, x, turned).reshape(b, (heads + 2 * kv_heads) // group, group, d)


def paged_decode_attention(q: jax.Array, layer: PagedLayerKV, queries: PagedQueries, choice: str,
                           scale: Optional[float] = None) -> jax.Array:
    """Attention of ``q [B, T, heads, D]`` over the rows' pages already holding the new tokens:
    the one function every platform's path goes through. One token per row with ``queries.flat``
    (the CPU): :func:`flat_paged_attention`, whose cost follows the rows' own lengths; otherwise
    (and ``model.attention: reference``) :func:`reference_paged_attention`, the einsum over each
    row's gathered pages that every path is tested against."""
    if q.shape[1] == 1 and queries.flat is not None and choice != "reference":
        view = gather_view(layer, queries.page_table, 0, queries.flat)
        return flat_paged_attention(q, view[0], view[1], queries, scale)
    if (q.shape[1] == 1 and layer.layout == "ps2kd" and choice not in ("reference", "xla")
            and q.shape[-1] % TPU_LANES == 0):  # TPU lowerings: the kernel (heads of whole 128-lane tiles)
        return jax.lax.platform_dependent(q, layer.kv, queries.positions, queries.page_table,
                                          tpu=lambda q, kv, p, t: tpu_ragged_paged_attention(q, kv, p, t, queries.window,
                                                                                             scale),
                                          default=lambda *_: reference_paged_attention(q, layer, queries, scale))
    return reference_paged_attention(q, layer, queries, scale)


def tpu_ragged_paged_attention(q: jax.Array, kv: jax.Array, positions: jax.Array, page_table: jax.Array,
                               window: Optional[int], scale: Optional[float] = None) -> jax.Array:
    """One token per row (``q [B, 1, heads, D]``) over its pages by JAX's TPU kernel,
    ``ragged_paged_attention`` (the pool ``kv`` in its layout, ``ps2kd``, the new keys and values
    already written: it does not write), each row a sequence of one query at its position. Rows
    past their pages' tables (the pool's size: none) read page 0, masked by their lengths."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    b, _, heads, d = q.shape
    pool = kv.shape[0]
    table = jnp.where(page_table < pool, page_table, 0).astype(jnp.int32)
    lengths = (positions[:, 0] + 1).astype(jnp.int32)  # the query is the last of its row's positions
    out = ragged_paged_attention(q[:, 0], kv, lengths, table, jnp.arange(b + 1, dtype=jnp.int32),
                                 jnp.array([b], jnp.int32), sm_scale=d**-0.5 if scale is None else scale,
                                 sliding_window=window, num_kv_pages_per_block=min(16, table.shape[1]),
                                 num_queries_per_block=min(32, b))
    return out.reshape(b, 1, heads, d)


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


def flat_paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, queries: PagedQueries,
                         scale: Optional[float] = None) -> jax.Array:
    """One query per row (``q [B, 1, heads, D]``) over the pages of ``queries.flat``, whose keys and
    values are ``k, v [N, kv_heads, page_size, D]`` (the listed pages, in order): every listed page is
    scored against its row's query, and each row's softmax and weighted values are summed over its
    own pages (segment sums), so a step costs the pages the rows hold, not rows x the longest row.
    Float32 scores and softmax, as :func:`~asyncrl.model.attention.einsum_attention`."""
    flat = queries.flat
    assert flat is not None
    b, _, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    rows = jnp.clip(flat.rows, 0, b - 1)
    q_flat = q[:, 0].reshape(b, kv_heads, group, d)[rows]  # [N, kv_heads, group, D]
    scores = jnp.einsum("nkgd,nkpd->nkgp", q_flat, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5 if scale is None else scale)
    keys = flat.starts[:, None] + jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]  # [N, page_size]
    ok = _key_mask(keys, queries.positions[rows, :1], queries.window) & (flat.rows < b)[:, None]
    scores = jnp.where(ok[:, None, None, :], scores, -jnp.inf)
    top = jax.ops.segment_max(jnp.max(scores, axis=-1), flat.rows, num_segments=b)  # [B, kv_heads, group]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.where(ok[:, None, None, :], jnp.exp(scores - top[rows][..., None]), 0.0)
    total = jax.ops.segment_sum(jnp.sum(weights, axis=-1), flat.rows, num_segments=b)
    values = jnp.einsum("nkgp,nkpd->nkgd", weights.astype(v.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
    summed = jax.ops.segment_sum(values, flat.rows, num_segments=b)  # [B, kv_heads, group, D]
    out = summed / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(b, 1, heads, d).astype(q.dtype)


def _prologue_spec(prologue: Optional[QKPrologue], rows: Any) -> Any:
    """A :class:`QKPrologue`'s split on an engine mesh: rotations by row, norm weights whole."""
    from jax.sharding import PartitionSpec as P

    if prologue is None:
        return None
    norms = None if prologue.norms is None else (P(), P())
    return QKPrologue(P(rows), P(rows), norms, prologue.eps, prologue.plus_one)  # type: ignore[arg-type]


def _per_device(mesh: Any, fn: Any, layout: str, kinds: tuple[str, ...], out_kind: "str | tuple[str, ...]",
                *args: Any) -> Any:
    """``fn(*args)`` per device of an engine ``mesh`` in a ``shard_map`` (directly without one, or
    on one device). ``kinds`` name each argument's split: ``pool`` (a page pool in ``layout``: its
    pages over the replicas, KV heads over ``tensor``), ``viewed`` (such a pool with a decode chunk's
    view: its rows or listed pages over the replicas), ``kv`` (``[B, T, heads, D]``: rows and
    heads), ``rows`` (rows first), ``flat`` (a :class:`~asyncrl.model.kv_cache.FlatPages`, each
    replica's part in turn), ``prologue`` (a :class:`QKPrologue` or None)."""
    if mesh is None or mesh.size == 1:
        return fn(*args)
    from jax.sharding import PartitionSpec as P

    replicas = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    rows = _ROW_AXES if replicas > 1 else None
    heads = "tensor" if mesh.shape.get("tensor", 1) > 1 else None
    # a pool's pages (and a view's rows or listed pages) over the replicas, its KV heads over tensor
    pages = P(None, heads, rows, None, None) if layout == "2kpsd" else P(rows, None, heads, None)
    view = (P(rows, heads, None, None), P(rows, heads, None, None))
    spec_of = {"pool": PagedLayerKV(pages, layout, None), "viewed": PagedLayerKV(pages, layout, view),  # type: ignore[arg-type]
               "kv": P(rows, None, heads, None), "rows": P(rows),
               "flat": FlatPages(P(rows), P(rows), P(rows), P(rows))}
    in_specs = tuple(_prologue_spec(arg, rows) if kind == "prologue" else spec_of[kind] for kind, arg in zip(kinds, args))
    out_specs = tuple(spec_of[kind] for kind in out_kind) if isinstance(out_kind, tuple) else spec_of[out_kind]
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
