"""How many pages a CPU decode chunk's attention reads (``engine.attention_buckets``).

On the CPU a decode step's attention reads the pages of every active sequence as one flat list
(:func:`~asyncrl.model.attention.flat_paged_attention`; a page shared by several sequences appears
once for each): its cost is the pages the sequences hold, not the slots times the longest sequence.
The list's length is static in the compiled program, so it is one of a few size classes: the most
a replica's rows can list (its slots x ``kv_capacity / page_size``) halved ``count - 1`` times,
each rounded up to a multiple of :data:`ALIGN`; a chunk takes the smallest class that holds the
pages its active sequences reach by the chunk's end (padding entries are attended by nobody).
Each class is one compiled decode program per variant. GPUs and TPUs read each slot's page table
in their kernels and need no class.
"""

from __future__ import annotations

ALIGN = 16
"""Size classes are multiples of this many pages, except the pool itself."""


def attention_buckets(most: int, count: int) -> tuple[int, ...]:
    """Ascending size classes (in list entries, pages) for a replica whose rows can list ``most``:
    ``most / 2**k`` rounded up to a multiple of :data:`ALIGN` for ``k < count`` (duplicates merged),
    ``most`` last. ``count == 1``: ``most`` only."""
    if count < 1:
        raise ValueError(f"engine.attention_buckets must be >= 1 (given {count})")
    sizes = {most}
    for k in range(1, count):
        size = -(-most // 2**k)
        sizes.add(min(most, -(-size // ALIGN) * ALIGN))
    return tuple(sorted(sizes))


def chunk_bucket(buckets: tuple[int, ...], pages: int) -> int:
    """The size class of a chunk whose active sequences list ``pages`` pages (on its busiest
    replica): the smallest of ``buckets`` holding them."""
    return next((b for b in buckets if b >= pages), buckets[-1])
