"""How much of the KV pool a CPU decode chunk's attention reads (``engine.attention_buckets``).

On the CPU a decode chunk copies the pages its steps read once, before its loop, into a view
(:func:`~asyncrl.model.paged_attention.with_views`; a gather per step would copy the attended KV
every step): either each slot's first pages in order (a dense view, ``slots x pages``), or every
active slot's pages as one flat list (a page shared by several slots once for each), whichever is
smaller. Both lengths are static in the compiled program, so each is one of a few size classes:
the most there can be (a slot's ``kv_capacity / page_size`` pages; the slots times that for the
list) halved ``count - 1`` times, each rounded up to a multiple of :data:`ALIGN`; a chunk takes
the smallest class that holds what its active slots reach by its end. Each class is one compiled
decode program per variant. GPUs and TPUs read each slot's page table in their kernels and need
no class.
"""

from __future__ import annotations

ALIGN = 16
"""Size classes are multiples of this many pages, except the pool itself."""


def attention_buckets(most: int, count: int) -> tuple[int, ...]:
    """Ascending size classes (in pages) up to ``most``: ``most / 2**k`` rounded up to a multiple of
    :data:`ALIGN` for ``k < count`` (duplicates merged), ``most`` last. ``count == 1``: ``most`` only."""
    if count < 1:
        raise ValueError(f"engine.attention_buckets must be >= 1 (given {count})")
    sizes = {most}
    for k in range(1, count):
        size = -(-most // 2**k)
        sizes.add(min(most, -(-size // ALIGN) * ALIGN))
    return tuple(sorted(sizes))


def chunk_bucket(buckets: tuple[int, ...], pages: int) -> int:
    """The size class holding ``pages`` (a slot's reach, or the busiest replica's list): the
    smallest of ``buckets`` holding them."""
    return next((b for b in buckets if b >= pages), buckets[-1])
