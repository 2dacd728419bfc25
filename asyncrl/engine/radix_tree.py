"""The prefix tree of the KV cache manager: pages of token ids, shared by reference.

Every page a sequence holds is a :class:`Node`: the tokens whose KV it holds (at most a page of
them), the weights version each was computed with, its page in the pool, and how many sequences
reference it (their page tables hold it). A node's parent is the page before it in the sequence,
so a root-to-node path is a token sequence; the children of a node are keyed by their page's
tokens (full pages) or listed (a partial page: a sequence's last one). Positions of a page never
change once written, so a full page can be shared by any sequence that starts with its path, and
a partial one only by copying it (copy on write: the sharer writes its next tokens into its copy).

Rules (docs/agents.md "Prefix reuse"):

* Token-exact: a match is the longest run of pages whose tokens equal the context's from position
  0, then the longest common beginning with a partial page (or a full page's first tokens) after
  them; found in O(context length): a dict lookup per page.
* Versioned: positions are valid for the weights they were computed with. Without
  ``across_versions`` every node attached to the tree is of the weights served now (a publish
  detaches them all: :meth:`PrefixTree.detach_all`); with it they stay, and a match reports the
  oldest version among the positions it reuses.
* Kept while free pages exist: a node nobody references stays in the tree (its page kept) until
  the pool needs its page; then unreferenced leaves go least recently used first
  (:meth:`PrefixTree.evict`), so a kept history survives as long as there is room.
* Written first: a node whose page a program planned in this admission round has not yet written
  is ``pending``; a match that would use one says so (the scheduler ends the round there and
  admits that request after the pages are written).

A node that is not in the tree (``attached`` false: with prefix reuse off, after a publish, or a
page that duplicates one already there) is freed as soon as its last reference goes.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple, Optional, Sequence

import numpy as np


class Node:
    """One page of a token sequence (see the module docstring)."""

    __slots__ = ("parent", "tokens", "versions", "page", "children", "by_first", "partials", "refs", "used", "attached",
                 "pending", "serial")

    def __init__(self, parent: Optional["Node"], tokens: list[int], versions: list[int], page: int, attached: bool,
                 serial: int):
        self.parent = parent
        self.tokens = tokens  # the page's token ids so far (a full page: page_size of them)
        self.versions = versions  # the weights version of each of its positions
        self.page = page
        self.children: dict[tuple[int, ...], Node] = {}  # full pages after this one, by their tokens
        self.by_first: dict[int, list[Node]] = {}  # the same, by their first token (for a match inside a page)
        self.partials: list[Node] = []  # partial pages after this one
        self.refs = 0  # sequences whose page tables hold this page
        self.used = 0  # the tree's clock when last matched, written or released
        self.attached = attached
        self.pending = False  # planned in this admission round, not yet written
        self.serial = serial

    @property
    def leaf(self) -> bool:
        return not self.children and not self.partials


class Match(NamedTuple):
    """What a context can reuse: ``nodes``, whole pages from position 0, then ``partial``'s first
    ``extra`` positions (a copy of that page: copy on write), or none."""

    nodes: list[Node]
    partial: Optional[Node]
    extra: int
    pending: bool
    """A longer match exists through pages not yet written (planned in this admission round)."""

    def length(self, page_size: int) -> int:
        return len(self.nodes) * page_size + self.extra


class PrefixTree:
    """The pages of one engine replica's pool that hold tokens, as a tree of :class:`Node`.

    Args:
        page_size: positions per page.
        enabled: ``engine.prefix_cache.enabled``; off, no node is ever attached (matches find
            nothing; every page is freed with its last reference).
        across_versions: keep nodes across publishes (``engine.prefix_cache.across_versions``).
    """

    def __init__(self, page_size: int, enabled: bool = True, across_versions: bool = False):
        self.page_size = page_size
        self.enabled = enabled
        self.across_versions = across_versions
        self._serial = itertools.count()
        self.root = Node(None, [], [], -1, True, next(self._serial))
        self._clock = 0
        self._evictable: list[tuple[int, int, Node]] = []  # (used, serial, node): candidates, checked when popped
        self._pending: list[Node] = []
        self._pending_copies: list[Node] = []
        self.kept = 0  # attached nodes nobody references (their pages can be evicted)

    # ------------------------------------------------------------------ queries

    def match(self, context: "Sequence[int] | np.ndarray", version: int) -> Match:
        """The longest reusable beginning of ``context`` (module docstring). ``version``: the served
        weights' (only for the floor with ``across_versions``; without it every attached node is of
        these weights)."""
        if not self.enabled:
            return Match([], None, 0, False)
        size, n = self.page_size, len(context)
        node, nodes, i, pending = self.root, [], 0, False
        while i + size <= n:
            child = node.children.get(tuple(context[i : i + size]))
            if child is None:
                break
            if child.pending:
                pending = True
                break
            nodes.append(child)
            node, i = child, i + size
        best, extra = None, 0
        if i < n and not pending:
            want = list(context[i : i + size])
            for candidate in [*node.partials, *node.by_first.get(want[0], ())]:
                common = _common(candidate.tokens, want)
                if candidate.pending:
                    pending = pending or common > extra
                    continue
                if common > extra or (common == extra and best is not None and candidate.used > best.used):
                    best, extra = candidate, common
            if best is None:
                extra = 0
        for matched in [*nodes, *([best] if best is not None and extra else [])]:
            self._touch(matched)
        return Match(nodes, best if extra else None, extra, pending)

    def floor(self, match: Match) -> Optional[int]:
        """The oldest version among the positions ``match`` reuses (None: it reuses none)."""
        versions = [min(node.versions) for node in match.nodes]
        if match.partial is not None and match.extra:
            versions.append(min(match.partial.versions[: match.extra]))
        return min(versions) if versions else None

    # ------------------------------------------------------------------ nodes

    def add(self, parent: Node, tokens: list[int], versions: list[int], page: int, pending: str = "") -> Node:
        """A node for ``page`` after ``parent`` holding ``tokens`` (computed at ``versions``); attached
        unless reuse is off, ``parent`` is not in the tree, or a full page of the same tokens is
        already there (the duplicate stays its sequence's own and is freed with it). ``pending``:
        ``prefill`` (this round's prefills write it: :meth:`settle`) or ``copy`` (a copy the next
        decode chunk makes: :meth:`settle_copies`); "" when written already."""
        node = Node(parent, list(tokens), list(versions), page, self.enabled and parent.attached, next(self._serial))
        self._clock += 1
        node.used = self._clock
        if node.attached:
            if len(tokens) == self.page_size and tuple(tokens) in parent.children:
                node.attached = False
            elif len(tokens) == self.page_size:
                self._link_full(node)
            else:
                parent.partials.append(node)
        if node.attached:
            self.kept += 1  # until its sequence references it
        if pending and node.attached:
            node.pending = True
            (self._pending if pending == "prefill" else self._pending_copies).append(node)
        return node

    def extend(self, node: Node, tokens: Sequence[int], versions: Sequence[int]) -> None:
        """``node`` (a partial page, written only by the sequence that holds it) now also holds
        ``tokens``; once full it joins its parent's full pages (or leaves the tree: a duplicate)."""
        node.tokens.extend(int(t) for t in tokens)
        node.versions.extend(int(v) for v in versions)
        self._clock += 1
        node.used = self._clock
        if node.attached and len(node.tokens) == self.page_size:
            parent = node.parent
            assert parent is not None
            if tuple(node.tokens) in parent.children:
                self._detach(node)
            else:
                parent.partials.remove(node)
                self._link_full(node)

    def settle(self) -> None:
        """The pages this round's prefills write are written (the programs were dispatched)."""
        self._settle(self._pending)
        self._pending = []

    def settle_copies(self) -> None:
        """The pages the next decode chunk copies are written (the chunk was dispatched)."""
        self._settle(self._pending_copies)
        self._pending_copies = []

    def _settle(self, nodes: list[Node]) -> None:
        for node in nodes:
            node.pending = False
            if node.refs == 0 and node.attached:
                self._note_unreferenced(node)

    def reference(self, node: Node) -> None:
        if node.refs == 0 and node.attached:
            self.kept -= 1
        node.refs += 1

    def release(self, node: Node) -> Optional[int]:
        """One reference of ``node`` is gone; its page when it is now free (nobody references it and
        it is not in the tree), else None."""
        node.refs -= 1
        assert node.refs >= 0, "a page released more often than referenced"
        self._clock += 1
        node.used = self._clock
        if node.refs:
            return None
        if not node.attached:
            return node.page
        self.kept += 1
        self._note_unreferenced(node)
        return None

    def _touch(self, node: Node) -> None:
        """``node`` was used now (a kept leaf moves to the back of the eviction order)."""
        self._clock += 1
        node.used = self._clock
        if node.refs == 0 and node.attached:
            self._note_unreferenced(node)

    def _note_unreferenced(self, node: Node) -> None:
        if node.leaf and not node.pending and node is not self.root:
            heapq.heappush(self._evictable, (node.used, node.serial, node))

    # ------------------------------------------------------------------ freeing pages

    def evict(self, count: int) -> list[int]:
        """Free up to ``count`` pages: unreferenced leaves, least recently used first (a parent left
        without children becomes a leaf in its turn)."""
        freed: list[int] = []
        while len(freed) < count and self._evictable:
            used, _, node = heapq.heappop(self._evictable)
            if not (node.attached and node.refs == 0 and node.leaf and not node.pending and node.used == used):
                continue  # a stale entry: used, referenced or removed since it was pushed
            freed.append(self._remove(node))
        return freed

    def _remove(self, node: Node) -> int:
        """Take an unreferenced leaf out of the tree; returns its page."""
        parent = node.parent
        assert parent is not None
        self._unlink(node)
        node.attached = False
        self.kept -= 1
        if parent is not self.root and parent.attached and parent.refs == 0:
            self._note_unreferenced(parent)
        return node.page

    def _link_full(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None
        parent.children[tuple(node.tokens)] = node
        parent.by_first.setdefault(node.tokens[0], []).append(node)

    def _unlink(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None
        if len(node.tokens) == self.page_size and parent.children.get(tuple(node.tokens)) is node:
            del parent.children[tuple(node.tokens)]
            siblings = parent.by_first[node.tokens[0]]
            siblings.remove(node)
            if not siblings:
                del parent.by_first[node.tokens[0]]
        elif node in parent.partials:
            parent.partials.remove(node)

    def _detach(self, node: Node) -> list[int]:
        """Take ``node`` and everything under it out of the tree; returns the pages nobody
        references (freed), while referenced ones stay with their sequences."""
        self._unlink(node)
        freed, stack = [], [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            stack.extend(current.partials)
            current.children, current.by_first, current.partials = {}, {}, []
            if current.attached and current.refs == 0:
                self.kept -= 1
                freed.append(current.page)
            current.attached = False
            current.pending = False
        return freed

    def flush(self) -> list[int]:
        """Forget every kept page (``/flush_cache``): unreferenced nodes leave the tree and their
        pages are freed; pages running sequences hold stay (and stay matchable)."""
        freed: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in [*node.children.values(), *node.partials]:
                if child.refs == 0 and not child.pending:
                    freed += self._detach(child)
                else:
                    stack.append(child)
        self._evictable = []
        return freed

    def detach_all(self) -> list[int]:
        """A publish without ``across_versions``: nothing in the tree is of the served weights any
        more. Every node leaves it (unreferenced pages are freed now, the others with their last
        reference)."""
        freed: list[int] = []
        for child in [*self.root.children.values(), *self.root.partials]:
            freed += self._detach(child)
        self._evictable, self._pending, self._pending_copies = [], [], []
        return freed


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common beginning of ``a`` and ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
