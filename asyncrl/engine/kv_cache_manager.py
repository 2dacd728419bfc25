"""The KV cache manager of :class:`~asyncrl.engine.jax_engine.JaxEngine`: the page pool of each
engine replica, each sequence's page table, the pages' reference counts, the prefix tree, versions
and eviction. Host bookkeeping only: the pool's arrays are the model runner's.

A sequence holds pages for its own positions and grows page by page
(:meth:`KVCacheManager.grow`). Pages a sequence shares with others (a group's prompt, an earlier
turn, an agent's previous call, found by :class:`~asyncrl.engine.radix_tree.PrefixTree`) are
referenced, not copied; a shared page the sequence must write into next (a context ending inside
a page) is copied first (copy on write: one page). When a sequence ends its pages stay in the tree
for reuse until the pool needs them (least recently used first). On an engine mesh each replica
has a pool and a tree of its own (its sequences decode on its own devices): page numbers here are
local to a replica.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from asyncrl.engine.attention_buckets import chunk_bucket
from asyncrl.engine.radix_tree import Match, Node, PrefixTree
from asyncrl.model.kv_cache import FlatPages


@dataclasses.dataclass
class SequenceKV:
    """Where one sequence's KV lies: its replica, its pages in position order (its page table) and
    the tree nodes of the pages that hold tokens (``nodes[i]`` holds ``pages[i]``; pages past
    ``len(nodes)`` are allocated for positions not yet written), and how many positions are
    written or being written by the programs dispatched so far."""

    replica: int
    pages: list[int] = dataclasses.field(default_factory=list)
    nodes: list[Node] = dataclasses.field(default_factory=list)
    length: int = 0
    floor: Optional[int] = None
    """The oldest weights version of the reused positions, when older than the served one."""


@dataclasses.dataclass
class Chunk:
    """Tokens to prefill for a sequence after ``start`` positions (a prompt's chunk, or the rest of
    a context after a reused prefix), in the admission round's stage ``stage`` (a sequence's chunks
    run one stage after another). ``copy``: ``(source page, its copy)`` to make before (the page the
    chunk continues, shared and partial: copy on write)."""

    kv: SequenceKV
    start: int
    tokens: np.ndarray
    stage: int
    copy: Optional[tuple[int, int]] = None


@dataclasses.dataclass
class Part:
    """The samples of a request placed on one replica: ``kvs[0]`` (the leader) computes the context
    (``chunks``), the others share its pages; ``copies``: ``(sample index in the part, source page,
    copy)`` to make before the sample's first decode step (a partial last page); ``reused``: the
    context positions taken from the tree."""

    replica: int
    kvs: list[SequenceKV]
    chunks: list[Chunk]
    copies: list[tuple[int, int, int]]
    reused: int
    protected: list[Node]
    """Pages read by this part's copies (kept until the copies ran)."""


class KVCacheManager:
    """Pages, page tables, sharing and reuse for one engine.

    Args:
        page_size: positions per page.
        pages_per_replica: each replica's pool.
        replicas: the engine's replicas.
        capacity: ``engine.kv_capacity`` (a page table's width is ``capacity / page_size``).
        reuse: ``engine.prefix_cache.enabled``; across_versions: its ``across_versions``.
    """

    def __init__(self, page_size: int, pages_per_replica: int, replicas: int = 1, capacity: int = 512,
                 reuse: bool = True, across_versions: bool = False):
        self.page_size = page_size
        self.pages_per_replica = pages_per_replica
        self.replicas = replicas
        self.capacity = capacity
        self.pages_per_seq = capacity // page_size
        self.reuse = reuse
        self.across_versions = across_versions
        self.trees = [PrefixTree(page_size, reuse, across_versions) for _ in range(replicas)]
        self.free: list[list[int]] = [list(range(pages_per_replica - 1, -1, -1)) for _ in range(replicas)]

    # ------------------------------------------------------------------ queries

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def available(self, replica: int) -> int:
        """Pages a new sequence can get on ``replica``: free ones and kept (unreferenced) ones."""
        return len(self.free[replica]) + self.trees[replica].kept

    def used_fraction(self) -> float:
        """The share of the pools that running sequences hold (``engine/kv_pages_used``)."""
        total = self.pages_per_replica * self.replicas
        used = sum(self.pages_per_replica - len(free) - tree.kept for free, tree in zip(self.free, self.trees))
        return used / total

    def kept_fraction(self) -> float:
        """The share of the pools holding kept prefixes nobody runs on (reusable, evictable)."""
        return sum(tree.kept for tree in self.trees) / (self.pages_per_replica * self.replicas)

    def listed_pages(self, reach: Sequence[tuple[int, SequenceKV, int]], rows_per_replica: int) -> int:
        """The busiest replica's count of pages the flat list of ``reach`` (as :meth:`flat_pages`) holds."""
        counts = [0] * self.replicas
        for row, _, positions in reach:
            counts[row // rows_per_replica] += self.pages_for(positions)
        return max(counts)

    def flat_pages(self, reach: Sequence[tuple[int, SequenceKV, int]], rows_per_replica: int,
                   sizes: tuple[int, ...]) -> FlatPages:
        """The CPU decode attention's list (:class:`~asyncrl.model.kv_cache.FlatPages`): for each
        ``(row, kv, positions)``, the pages of ``kv`` holding its first ``positions`` positions, with
        the row and each page's first position; per replica (local rows and pages) in a segment of the
        smallest of ``sizes`` that holds the busiest replica's list (the rest attended by nobody)."""
        entries: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in range(self.replicas)]
        first = np.zeros((self.replicas * rows_per_replica,), np.int32)
        for row, kv, positions in reach:
            pages, rows, starts = entries[row // rows_per_replica]
            count = self.pages_for(positions)
            first[row] = len(pages)
            pages += kv.pages[:count]
            rows += [row % rows_per_replica] * count
            starts += range(0, count * self.page_size, self.page_size)
        size = chunk_bucket(sizes, max(len(pages) for pages, _, _ in entries))
        total = self.replicas * size
        flat = FlatPages(np.zeros((total,), np.int32), np.full((total,), rows_per_replica, np.int32),
                         np.zeros((total,), np.int32), first)
        for r, (pages, rows, starts) in enumerate(entries):
            flat.pages[r * size : r * size + len(pages)] = pages
            flat.rows[r * size : r * size + len(rows)] = rows
            flat.starts[r * size : r * size + len(starts)] = starts
        return flat

    def table(self, kv: SequenceKV) -> np.ndarray:
        """int32 [capacity / page_size]: ``kv``'s page table, past its pages the pool's size (no page)."""
        row = np.full((self.pages_per_seq,), self.pages_per_replica, np.int32)
        row[: len(kv.pages)] = kv.pages
        return row

    # ------------------------------------------------------------------ allocation

    def _allocate(self, replica: int, count: int) -> list[int]:
        free = self.free[replica]
        if len(free) < count:
            free.extend(self.trees[replica].evict(count - len(free)))
        if len(free) < count:
            raise RuntimeError(f"KV page pool of replica {replica}: {count} pages asked, {len(free)} free "
                               "(the scheduler checks availability first)")
        return [free.pop() for _ in range(count)]

    def _release_node(self, replica: int, node: Node) -> None:
        page = self.trees[replica].release(node)
        if page is not None:
            self.free[replica].append(page)

    # ------------------------------------------------------------------ admission

    def match(self, replica: int, context: "Sequence[int] | np.ndarray", version: int) -> Match:
        """What ``context`` can reuse on ``replica`` (reuse rule: at least a whole page, or the whole
        context)."""
        found = self.trees[replica].match(context, version)
        if found.pending:
            return found
        length = found.length(self.page_size)
        if length < self.page_size and length < len(context):
            return Match([], None, 0, False)
        return found

    def admit(self, context: np.ndarray, samples: int, free_rows: Sequence[int], busy: Sequence[int], version: int,
              growth_pages: int, chunk_tokens: int) -> Optional[list[Part]]:
        """Place ``samples`` samples of ``context`` on the replicas with free rows (``free_rows``: per
        replica; ``busy``: the sequences running there): the replica with the longest reusable
        prefix first (then the most free rows), each taking as many samples as its free rows and
        its pages hold, with room left for one more chunk (``growth_pages``) of every sequence on it
        unless nothing runs there. None when no sample fits, or when the best match is pages this
        admission round has not written yet (the request waits for them)."""
        options = []
        for r in range(self.replicas):
            if free_rows[r]:
                found = self.match(r, context, version)
                if found.pending:
                    return None
                options.append((found.length(self.page_size), free_rows[r], -r, r, found))
        options.sort(key=lambda option: option[:3], reverse=True)
        chosen, left = [], samples
        for *_, r, found in options:
            k = min(left, free_rows[r])
            pinned, available = self.pinned(found), self.available(r)
            while k and (self.pages_needed(len(context), found, k) + pinned
                         + (growth_pages * (busy[r] + k) if busy[r] else 0)) > available:
                k -= 1
            if k:
                chosen.append((r, k, found))
                left -= k
            if not left:
                break
        if not chosen:
            return None
        return [self.place(r, context, found, k, version, chunk_tokens) for r, k, found in chosen]

    def pages_needed(self, context_len: int, found: Match, samples: int) -> int:
        """New pages a part of ``samples`` samples needs for a context of ``context_len`` reusing ``found``."""
        leader = self.pages_for(context_len) - len(found.nodes)
        followers = (samples - 1) if context_len % self.page_size else 0
        return leader + followers

    def pinned(self, found: Match) -> int:
        """Kept (unreferenced) pages ``found`` reuses: an admission references them, so they do not
        count as available to it."""
        nodes = [*found.nodes, *([found.partial] if found.partial is not None else [])]
        return sum(1 for node in nodes if node.refs == 0)

    def place(self, replica: int, context: np.ndarray, found: Match, samples: int, version: int,
              chunk_tokens: int) -> Part:
        """Plan ``samples`` samples of a context on ``replica`` from ``found``: the leader references
        the matched pages, gets pages for the rest (a copy of a matched partial page first), and
        its chunks of at most ``chunk_tokens`` tokens; the followers reference the leader's whole
        pages and get a copy of its partial last page. Records the new pages in the tree as pending
        (written once this round's programs are dispatched: :meth:`settle`)."""
        tree, size = self.trees[replica], self.page_size
        total = len(context)
        leader = SequenceKV(replica)
        protected: list[Node] = []
        for node in found.nodes:
            tree.reference(node)
            leader.nodes.append(node)
            leader.pages.append(node.page)
        start = len(found.nodes) * size
        parent = found.nodes[-1] if found.nodes else tree.root
        copy = None
        if found.partial is not None and found.extra:
            (page,) = self._allocate(replica, 1)
            tree.reference(found.partial)
            protected.append(found.partial)
            copy = (found.partial.page, page)
            extra = found.extra
            # copied before the rest's first chunk, or (the whole context reused) before the first decode step
            node = tree.add(parent, list(context[start : start + extra]), found.partial.versions[:extra], page,
                            pending="prefill" if start + extra < total else "copy")
            tree.reference(node)
            leader.nodes.append(node)
            leader.pages.append(page)
            start += extra
            parent = node
        reused = start
        if self.across_versions:
            floor = tree.floor(found)
            leader.floor = floor if floor is not None and floor < version else None
        leader_copy = None
        if start == total and copy is not None:  # the whole context reused: the copy is made before the first decode step
            leader_copy, copy = copy, None
        # pages for the rest of the context, and their nodes (pending: this round's prefills write them)
        position = start
        while position < total:
            offset = position % size
            take = min(size - offset, total - position)
            tokens = [int(t) for t in context[position : position + take]]
            if offset:  # the page a copied partial page continues
                tree.extend(leader.nodes[-1], tokens, [version] * take)
            else:
                (page,) = self._allocate(replica, 1)
                node = tree.add(parent, tokens, [version] * take, page, pending="prefill")
                tree.reference(node)
                leader.nodes.append(node)
                leader.pages.append(page)
                parent = node
            position += take
        leader.length = total
        chunks = [Chunk(leader, s, context[s : s + chunk_tokens], i, copy if i == 0 else None)
                  for i, s in enumerate(range(reused, total, chunk_tokens))]
        kvs, copies = [leader], []
        if leader_copy is not None:
            copies.append((0, *leader_copy))
        whole = leader.nodes if total % size == 0 else leader.nodes[:-1]
        # the followers copy the leader's partial last page: from where the leader copies it when
        # that copy is still to be made (a chunk's copies all read before any writes)
        source = leader_copy[0] if leader_copy is not None else leader.pages[-1] if leader.pages else None
        for j in range(1, samples):
            follower = SequenceKV(replica, floor=leader.floor)
            for node in whole:
                tree.reference(node)
                follower.nodes.append(node)
                follower.pages.append(node.page)
            if total % size:
                last = leader.nodes[-1]
                (page,) = self._allocate(replica, 1)
                node = tree.add(whole[-1] if whole else tree.root, list(last.tokens[: total % size]),
                                last.versions[: total % size], page, pending="copy")
                tree.reference(node)
                follower.nodes.append(node)
                follower.pages.append(page)
                assert source is not None
                copies.append((j, source, page))
            follower.length = total
            kvs.append(follower)
        return Part(replica, kvs, chunks, copies, reused, protected)

    def settle(self) -> None:
        """This round's prefills were dispatched: the pages they write are matchable."""
        for tree in self.trees:
            tree.settle()

    def settle_copies(self) -> None:
        """A decode chunk was dispatched: the pages its copies write are matchable."""
        for tree in self.trees:
            tree.settle_copies()

    def unprotect(self, part: Part) -> None:
        """The copies of ``part`` ran: the pages they read need not be kept for them any more."""
        for node in part.protected:
            self._release_node(part.replica, node)
        part.protected = []

    # ------------------------------------------------------------------ running sequences

    def grow(self, kv: SequenceKV, positions: int) -> bool:
        """Give ``kv`` pages for its first ``positions`` positions; False (nothing allocated) when its
        replica's pool cannot, kept pages evicted included."""
        need = self.pages_for(positions) - len(kv.pages)
        if need <= 0:
            return True
        if self.available(kv.replica) < need:
            return False
        kv.pages.extend(self._allocate(kv.replica, need))
        return True

    def written(self, kv: SequenceKV, tokens: Sequence[int], version: int) -> None:
        """A decode chunk wrote ``tokens``' KV at ``kv``'s next positions (with weights ``version``)."""
        tree, size = self.trees[kv.replica], self.page_size
        position, i = kv.length, 0
        while i < len(tokens):
            offset = position % size
            take = min(size - offset, len(tokens) - i)
            part = [int(t) for t in tokens[i : i + take]]
            if offset:
                tree.extend(kv.nodes[-1], part, [version] * take)
            else:
                parent = kv.nodes[-1] if kv.nodes else tree.root
                node = tree.add(parent, part, [version] * take, kv.pages[len(kv.nodes)])
                tree.reference(node)
                kv.nodes.append(node)
            position += take
            i += take
        kv.length = position

    def release(self, kv: SequenceKV) -> None:
        """``kv``'s sequence ended or was preempted: its pages go back (those in the tree stay there,
        reusable, until the pool needs them)."""
        for node in reversed(kv.nodes):
            self._release_node(kv.replica, node)
        self.free[kv.replica].extend(kv.pages[len(kv.nodes):])
        kv.nodes, kv.pages = [], []

    # ------------------------------------------------------------------ the whole cache

    def flush(self) -> None:
        """Forget every kept prefix (``/flush_cache``): running sequences keep theirs."""
        for replica, tree in enumerate(self.trees):
            self.free[replica].extend(tree.flush())

    def published(self) -> None:
        """New weights are served: without ``across_versions`` nothing kept is reusable any more."""
        if not self.across_versions:
            for replica, tree in enumerate(self.trees):
                self.free[replica].extend(tree.detach_all())
