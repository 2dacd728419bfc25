"""How much of the KV cache a decode chunk attends over (``engine.attention_buckets``).

A decode step's attention reads each slot's keys and values over the cache's whole capacity,
valid or not; with ``kv_capacity`` sized for the longest request, most steps read mostly empty
slots. A chunk instead attends over the cache's first ``attend`` slots
(:func:`~asyncrl.engine.jax_programs.cache_prefix`), where ``attend`` is the smallest of a few
static size classes that holds every active slot's context up to the chunk's last write. Each
size class is one compiled decode program per variant, so the classes are few: the capacity
halved ``count - 1`` times, each rounded up to a multiple of :data:`ALIGN`.

Exactness: every valid slot of an active row and every write of the chunk lies inside the
prefix, and the slots past it are masked out of the full cache's attention (a weight of exactly
0), so tokens and log-probs are those of the full cache (tested).
"""

from __future__ import annotations

from typing import Iterable

ALIGN = 16
"""Size classes are multiples of this (tile-friendly on GPUs), except the capacity itself."""


def attention_buckets(capacity: int, count: int) -> tuple[int, ...]:
    """Ascending size classes for a cache of ``capacity`` slots: ``capacity / 2**k`` rounded up to
    a multiple of :data:`ALIGN` for ``k < count`` (duplicates merged), the capacity last.
    ``count == 1``: the capacity only (attention over the whole cache, as without buckets)."""
    if count < 1:
        raise ValueError(f"engine.attention_buckets must be >= 1 (given {count})")
    sizes = {capacity}
    for k in range(1, count):
        size = -(-capacity // 2**k)
        sizes.add(min(capacity, -(-size // ALIGN) * ALIGN))
    return tuple(sorted(sizes))


def chunk_bucket(buckets: tuple[int, ...], contexts: Iterable[int], steps: int) -> int:
    """The size class a chunk of ``steps`` decode steps attends over: the smallest of ``buckets``
    holding ``max(contexts) + steps``, where ``contexts`` are the active slots' write positions
    (tokens held: the prompt but its last token, plus the tokens generated so far); the largest
    (the capacity) when none does or no slot is active."""
    need = max(contexts, default=buckets[-1]) + steps
    return next((b for b in buckets if b >= need), buckets[-1])
