"""The decoder's KV caches: a fixed-capacity pytree of every layer's keys and values (the slot
protocol below), and the paged cache the engine decodes over (:class:`PagedKVCache`).

A fixed-capacity pytree: ``layers``, one :class:`LayerKV` per decoder layer with ``k, v`` in
the compute dtype and in one of two layouts, chosen per platform by the engine
(:func:`asyncrl.engine.layouts.kv_cache_layout`; a layer's ``layout`` says which): ``bksd``, ``[B, kv_heads, capacity, head_dim]``
(heads before slots: a decode step's attention reads each head's keys as one contiguous
``[capacity, head_dim]`` matrix, which XLA's CPU dot and the GPU decode kernel want), or ``bskd``,
``[B, capacity, kv_heads, head_dim]`` (positions before heads: a decode step writes one
``[kv_heads, head_dim]`` tile per row, which XLA's TPU loop wants); ``valid: bool [B, capacity]``
(which slots hold a real token) and ``write_pos: int32 [B]`` (the slot where each row's
next token is written). The cache is per layer, not one stacked ``[layers, ...]`` array:
each layer reads and updates its own arrays in place, so a decode step never slices and
re-stacks (copies) the whole cache. A call with ``T`` new tokens writes row ``b``'s
token ``t`` into slot ``write_pos[b] + t`` (slots past the capacity are dropped: the
caller keeps rows within capacity), marks it valid iff ``attention_mask[b, t]``, and lets
it attend to the valid slots ``<= write_pos[b] + t``. Afterwards ``write_pos[b]`` moves
one past row ``b``'s last real token of the call (it stays put when the row had none). So:

* a left-padded prompt ``[pad pad a b c]`` fills slots 0..4 (0, 1 invalid) and the
  next token goes to slot 5; a right-padded one ``[a b c pad pad]`` fills 0..4 (3, 4
  invalid) and the next token overwrites slot 3;
* a row whose mask is all false in a call (an idle row) keeps its valid slots
  and write position (K/V at and after ``write_pos`` may be overwritten, but those
  slots are invalid: every valid slot lies before ``write_pos``);
* positions default to the number of valid slots before the call plus the running
  count of real tokens in the call (``cumsum(mask) - 1``), so pads never shift the
  rotary positions; pass ``positions`` only to override.

This cache serves a fixed batch of rows decoded together (beam search,
:mod:`asyncrl.engine.beam_search`, and direct calls of :func:`~asyncrl.model.transformer.forward`).
The engine keeps its sequences in the paged cache below (:class:`PagedKVCache`): a pool of pages
per layer, each row's page table and length, pages shared by reference between rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from asyncrl.model.blocks import dtype_of
from asyncrl.model.config import DecoderConfig

KV_LAYOUTS = ("bksd", "bskd")
"""A layer's cache as ``[B, kv_heads, capacity, head_dim]`` or ``[B, capacity, kv_heads, head_dim]``."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class LayerKV:
    """One decoder layer's keys and values in a :class:`KVCache` (compute dtype)."""

    k: jax.Array  # [B, kv_heads, capacity, head_dim] (bksd) or [B, capacity, kv_heads, head_dim] (bskd)
    v: jax.Array  # as k
    layout: str = "bksd"  # static: which of KV_LAYOUTS


class KVCache(NamedTuple):
    """Fixed-capacity KV cache (a pytree); see the module docstring for the protocol."""

    layers: tuple[LayerKV, ...]  # one per decoder layer
    valid: jax.Array  # bool [B, capacity]: slot holds a real token
    write_pos: jax.Array  # int32 [B]: slot of the row's next token

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @property
    def layout(self) -> str:
        """The layers' layout (:data:`KV_LAYOUTS`)."""
        return self.layers[0].layout if self.layers else "bksd"

    @property
    def lengths(self) -> jax.Array:
        """int32 [B]: real tokens held per row (the next token's default position)."""
        return self.valid.sum(axis=1).astype(jnp.int32)


def kv_shape(cfg: DecoderConfig, batch: int, capacity: int, layout: str = "bksd") -> tuple[int, int, int, int]:
    """One layer's K (or V) shape in ``layout``."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"KV cache layout {layout!r}: one of {KV_LAYOUTS}")
    if layout == "bksd":
        return (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    return (batch, capacity, cfg.num_kv_heads, cfg.head_dim)


def init_kv_cache(cfg: DecoderConfig, batch: int, capacity: int, dtype: Any = None, layout: str = "bksd") -> KVCache:
    """An empty cache (every slot invalid, write positions 0) in the compute dtype and ``layout``
    (:data:`KV_LAYOUTS`)."""
    dtype = dtype or dtype_of(cfg.compute_dtype)
    shape = kv_shape(cfg, batch, capacity, layout)
    return KVCache(
        layers=tuple(LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), layout) for _ in range(cfg.num_layers)),
        valid=jnp.zeros((batch, capacity), bool),
        write_pos=jnp.zeros((batch,), jnp.int32),
    )


# --------------------------------------------------------------------------- the paged cache

PAGE_LAYOUTS = ("2kpsd", "ps2kd")
"""A layer's page pool as ``[2, kv_heads, pages, page_size, head_dim]`` (keys at 0, values at 1) or
``[pages, page_size, 2 * kv_heads, head_dim]`` (each head's key then its value, interleaved: the
layout of JAX's TPU ``ragged_paged_attention``)."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kv", "view"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class PagedLayerKV:
    """One decoder layer's keys and values in pages of a fixed number of positions (compute dtype);
    ``view``: a decode chunk's copy of the pages its rows read (:func:`gather_view`; the CPU's), or None."""

    kv: jax.Array  # 2kpsd: [2, kv_heads, pages, page_size, head_dim]; ps2kd: [pages, page_size, 2 * kv_heads, head_dim]
    layout: str = "2kpsd"  # static: which of PAGE_LAYOUTS
    view: Any = None  # (keys, values) each [B, kv_heads, positions, head_dim] (each row's first pages) or [N, kv_heads, page_size, head_dim] (flat)

    @property
    def pages(self) -> int:
        return self.kv.shape[2] if self.layout == "2kpsd" else self.kv.shape[0]

    @property
    def page_size(self) -> int:
        return self.kv.shape[3] if self.layout == "2kpsd" else self.kv.shape[1]


class FlatPages(NamedTuple):
    """The pages of a decode chunk's rows as one flat list (the CPU's ragged attention): entry ``i``
    is page ``pages[i]`` of row ``rows[i]`` (``>= B``: padding, attended by nobody), holding that
    row's positions ``[starts[i], starts[i] + page_size)``; a row's pages are consecutive entries
    from ``first[row]`` on."""

    pages: Any  # int32 [N] (host or device arrays)
    rows: Any  # int32 [N]
    starts: Any  # int32 [N]
    first: Any  # int32 [B]


class PagedKVCache(NamedTuple):
    """A paged KV cache (a pytree): per layer a pool of pages shared by every row, and each row's
    page table. The protocol: a call with ``T`` new tokens per row (right-padded, real tokens
    first: ``attention_mask``) writes row ``b``'s real token ``t`` at position ``lengths[b] + t``,
    i.e. into page ``page_table[b, position // page_size]`` at offset ``position % page_size``
    (entries past the pool are dropped: unallocated positions), lets it attend to the row's
    positions up to its own, and returns ``lengths`` advanced by the real tokens. Padding writes
    nothing. Positions are contiguous from 0, so a row's valid positions are ``[0, lengths[b])``
    and the rotary position of a token is its cache position."""

    layers: tuple[PagedLayerKV, ...]
    page_table: jax.Array  # int32 [B, pages per row]
    lengths: jax.Array  # int32 [B]: positions each row holds
    flat: Optional[FlatPages] = None  # one-token calls on the CPU: the rows' pages as one list

    @property
    def page_size(self) -> int:
        return self.layers[0].page_size


def page_pool_shape(cfg: DecoderConfig, pages: int, page_size: int, layout: str = "2kpsd") -> tuple[int, ...]:
    """One layer's page pool shape in ``layout``."""
    if layout not in PAGE_LAYOUTS:
        raise ValueError(f"KV page layout {layout!r}: one of {PAGE_LAYOUTS}")
    if layout == "2kpsd":
        return (2, cfg.num_kv_heads, pages, page_size, cfg.head_dim)
    return (pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)


def init_page_pool(cfg: DecoderConfig, pages: int, page_size: int, layout: str = "2kpsd",
                   dtype: Any = None) -> tuple[PagedLayerKV, ...]:
    """Every layer's page pool, zeros, in the compute dtype and ``layout``."""
    dtype = dtype or dtype_of(cfg.compute_dtype)
    shape = page_pool_shape(cfg, pages, page_size, layout)
    return tuple(PagedLayerKV(jnp.zeros(shape, dtype), layout) for _ in range(cfg.num_layers))


def write_pages(layer: PagedLayerKV, k: jax.Array, v: jax.Array, page_table: jax.Array, positions: jax.Array,
                real: jax.Array) -> PagedLayerKV:
    """``layer`` with the new ``k, v`` ``[B, T, kv_heads, D]`` written at ``positions`` int32 [B, T]
    of each row (through ``page_table`` [B, P]) where ``real`` (bool [B, T]); nothing elsewhere."""
    page_size = layer.page_size
    rows = jnp.arange(positions.shape[0])[:, None]
    slot = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    page = jnp.where(real & (positions < page_table.shape[1] * page_size), page_table[rows, slot], layer.pages)
    offset = positions % page_size
    dtype = layer.kv.dtype
    if layer.layout == "2kpsd":  # adjacent advanced indices (page, offset) stay in place: the block is [2, kv_heads, B, T, D]
        values = jnp.stack([k, v]).transpose(0, 3, 1, 2, 4).astype(dtype)
        return PagedLayerKV(layer.kv.at[:, :, page, offset].set(values, mode="drop"), layer.layout)
    b, t, heads, d = k.shape
    values = jnp.stack([k, v], axis=3).reshape(b, t, 2 * heads, d).astype(dtype)  # each head's key, then its value
    return PagedLayerKV(layer.kv.at[page, offset].set(values, mode="drop"), layer.layout)


def gather_rows(layer: PagedLayerKV, page_table: jax.Array) -> tuple[jax.Array, jax.Array, str]:
    """Each row's pages in order, as keys and values over its positions ``[0, P * page_size)``:
    ``(k, v, spec)`` with ``spec`` the einsum letters of their layout (``kbsd`` or ``bskd``)."""
    if layer.layout == "2kpsd":
        kv = layer.kv[:, :, page_table]  # [2, kv_heads, B, P, page_size, D]
        two, heads, b, p, size, d = kv.shape
        kv = kv.reshape(two, heads, b, p * size, d)
        return kv[0], kv[1], "kbsd"
    kv = layer.kv[page_table]  # [B, P, page_size, 2 * kv_heads, D]
    b, p, size, combined, d = kv.shape
    kv = kv.reshape(b, p * size, combined // 2, 2, d)
    return kv[..., 0, :], kv[..., 1, :], "bskd"


def gather_view(layer: PagedLayerKV, page_table: jax.Array, pages: int,
                flat: Optional[FlatPages] = None) -> tuple[jax.Array, jax.Array]:
    """A copy of the pages a decode chunk's rows read, keys and values apart and rows (or list
    entries) first whatever the pool's layout, so each step's attention reads them as they lie (a
    slice of one array would be copied at every step): each row's first ``pages`` pages in order
    (``[B, kv_heads, pages x page_size, D]`` each: the ``bksd`` of a contiguous cache), or with
    ``flat`` its listed pages (``[N, kv_heads, page_size, D]`` each)."""
    if flat is not None:
        if layer.layout == "2kpsd":  # (a scalar and an array index around a slice: the listed pages first)
            return layer.kv[0, :, flat.pages], layer.kv[1, :, flat.pages]  # [N, kv_heads, page_size, D]
        kv = layer.kv[flat.pages]  # [N, page_size, 2 * kv_heads, D]
        n, size, combined, d = kv.shape
        kv = kv.reshape(n, size, combined // 2, 2, d)
        return kv[..., 0, :].transpose(0, 2, 1, 3), kv[..., 1, :].transpose(0, 2, 1, 3)
    table = page_table[:, :pages]
    b, p = table.shape
    if layer.layout == "2kpsd":
        k, v = layer.kv[0, :, table], layer.kv[1, :, table]  # [B, pages, kv_heads, page_size, D]
        heads, size, d = k.shape[2:]
        return tuple(x.transpose(0, 2, 1, 3, 4).reshape(b, heads, p * size, d) for x in (k, v))  # type: ignore[return-value]
    kv = layer.kv[table]  # [B, pages, page_size, 2 * kv_heads, D]
    size, combined, d = kv.shape[2:]
    kv = kv.reshape(b, p * size, combined // 2, 2, d)
    return kv[..., 0, :].transpose(0, 2, 1, 3), kv[..., 1, :].transpose(0, 2, 1, 3)


def write_view(view: tuple[jax.Array, jax.Array], k: jax.Array, v: jax.Array, positions: jax.Array, real: jax.Array,
               page_size: int, flat: Optional[FlatPages] = None) -> tuple[jax.Array, jax.Array]:
    """``view`` (:func:`gather_view`) with the new ``k, v`` ``[B, 1, kv_heads, D]`` written where
    their rows' positions lie in it (the pool gets them too: :func:`write_pages`)."""
    view_k, view_v = view
    b = positions.shape[0]
    position = positions[:, 0]
    if flat is None:  # [B, kv_heads, positions, D]: advanced indices around a slice, the block is [B, kv_heads, D]
        where: tuple = (jnp.arange(b), slice(None), jnp.where(real[:, 0] & (position < view_k.shape[2]), position,
                                                              view_k.shape[2]))
    else:  # [N, kv_heads, page_size, D]
        where = (jnp.where(real[:, 0], flat.first + position // page_size, view_k.shape[0]), slice(None),
                 position % page_size)
    return (view_k.at[where].set(k[:, 0].astype(view_k.dtype), mode="drop"),
            view_v.at[where].set(v[:, 0].astype(view_v.dtype), mode="drop"))


def copy_pages(layer: PagedLayerKV, src: jax.Array, dst: jax.Array) -> PagedLayerKV:
    """``layer`` with pages ``dst`` (int32 [C]; entries past the pool: none) holding pages ``src``'
    contents (all read before any is written)."""
    if layer.layout == "2kpsd":
        return PagedLayerKV(layer.kv.at[:, :, dst].set(layer.kv[:, :, src], mode="drop"), layer.layout)
    return PagedLayerKV(layer.kv.at[dst].set(layer.kv[src], mode="drop"), layer.layout)
