"""Decoding constraints: a :class:`TokenTrie` of the token sequences a completion may be.

Generative recommendation decodes item IDs (each a short sequence of tokens) and must never
produce one that does not exist; a trie of the valid sequences gives, at every step, the
tokens that keep the completion on a valid path. The engine applies it as a per-slot mask
inside its jitted decode loop (:mod:`asyncrl.engine.jax_programs`), and the trainer applies
the same mask when it recomputes log-probs, so RL under a constraint is exact: the behaviour
log-prob of a token is that of the masked distribution it was drawn from (docs/decoding.md).

Nodes are numbered from 0 (the root); a node's children are a contiguous run of edges,
sorted by token (CSR). A completion under a trie ends when it reaches a leaf (a node without
children), so the sequences must be prefix-free: a sequence that is a prefix of another
could never end. Append an end token (EOS) to every sequence to allow both.

Device form (:meth:`TokenTrie.tables`): ``first_edge int32 [N + 1]``, ``edge_token int32 [E]``,
``edge_child int32 [E]``; node ``n``'s children are edges ``first_edge[n] : first_edge[n + 1]``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Optional, Sequence

import numpy as np

FREE = -1
"""The node id of a token decoded without a constraint (in ``constraint_nodes`` arrays)."""


class TrieTables(NamedTuple):
    """A trie (or several, concatenated) as device-ready arrays (host numpy)."""

    first_edge: Any  # int32 [N + 1]: node n's children are edges first_edge[n] : first_edge[n + 1]
    edge_token: Any  # int32 [E]: the token of each edge (sorted within a node)
    edge_child: Any  # int32 [E]: the node each edge leads to


class TokenTrie:
    """The token sequences a constrained completion may be, as a trie.

    Args:
        sequences: the allowed token-id sequences (each non-empty, prefix-free, no duplicates
            needed: repeats are merged).
        name: what error messages and docs call it (a file name, say).

    Example::

        trie = TokenTrie([[5, 7, 9], [5, 8, 2], [6, 1, 1]])
        trie.allowed(0)            # array([5, 6]): the first tokens
        trie.walk([5, 8])          # [0, 1, 4]: the node before each token and after the last
    """

    def __init__(self, sequences: Iterable[Sequence[int]], *, name: str = "trie"):
        self.name = name
        children: list[dict[int, int]] = [{}]
        ends: set[int] = set()
        count = 0
        for i, seq in enumerate(sequences):
            seq = [int(t) for t in seq]
            if not seq:
                raise ValueError(f"{name}: sequence {i} is empty")
            if min(seq) < 0:
                raise ValueError(f"{name}: sequence {i} has a negative token id")
            node = 0
            for token in seq:
                if node in ends:
                    raise ValueError(f"{name}: sequence {i} {seq} extends another sequence (the trie must be prefix-free: "
                                     "append an end token to every sequence)")
                nxt = children[node].get(token)
                if nxt is None:
                    nxt = len(children)
                    children.append({})
                    children[node][token] = nxt
                node = nxt
            if children[node]:
                raise ValueError(f"{name}: sequence {i} {seq} is a prefix of another sequence (the trie must be "
                                 "prefix-free: append an end token to every sequence)")
            if node not in ends:  # a repeated sequence is merged
                ends.add(node)
                count += 1
        if count == 0:
            raise ValueError(f"{name}: no sequences")
        self.num_sequences = count
        self.num_nodes = len(children)
        first = np.zeros(self.num_nodes + 1, np.int32)
        tokens: list[int] = []
        childs: list[int] = []
        for n, kids in enumerate(children):
            first[n] = len(tokens)
            for token in sorted(kids):
                tokens.append(token)
                childs.append(kids[token])
        first[-1] = len(tokens)
        self._tables = TrieTables(first, np.asarray(tokens, np.int32), np.asarray(childs, np.int32))
        self.max_branch = int(np.max(np.diff(first)))
        """Most children of any node (the width of the per-step allowed-token gather)."""
        self.max_token = int(np.max(self._tables.edge_token))
        depth = np.zeros(self.num_nodes, np.int32)
        for n in range(self.num_nodes):  # children are numbered after their parents
            kids = self._tables.edge_child[first[n]:first[n + 1]]
            depth[kids] = depth[n] + 1
        self.max_depth = int(depth.max())
        """Tokens of the longest sequence (a constrained request needs ``max_new_tokens`` >= this)."""
        self.fingerprint = hashlib.sha256(b"".join(a.tobytes() for a in self._tables)).hexdigest()[:16]
        """A short hash of the trie's contents (two tries with equal fingerprints allow the same sequences)."""

    # ------------------------------------------------------------------ building

    @classmethod
    def from_file(cls, path: str | Path) -> "TokenTrie":
        """One sequence per line: token ids separated by spaces or commas (blank lines and
        lines starting with ``#`` are skipped)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"constraint file {path}: not found (one sequence of token ids per line)")
        sequences = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                sequences.append([int(t) for t in line.replace(",", " ").split()])
            except ValueError:
                raise ValueError(f"constraint file {path}, line {lineno}: {line[:60]!r} is not token ids "
                                 "separated by spaces or commas") from None
        return cls(sequences, name=str(path))

    @classmethod
    def from_strings(cls, strings: Iterable[str], tokenizer: Any, *, end_token_id: Optional[int] = None,
                     name: str = "trie") -> "TokenTrie":
        """Each string tokenised once (``tokenizer.encode(s, add_special_tokens=False)``, a
        transformers tokenizer, or a ``tokenizers.Tokenizer``), ``end_token_id`` appended when
        given (which makes any set of strings prefix-free)."""
        sequences = []
        for s in strings:
            encoded = tokenizer.encode(s, add_special_tokens=False)
            ids = list(getattr(encoded, "ids", encoded))
            sequences.append(ids + ([int(end_token_id)] if end_token_id is not None else []))
        return cls(sequences, name=name)

    # ------------------------------------------------------------------ queries

    def tables(self) -> TrieTables:
        """The CSR arrays (module docstring)."""
        return self._tables

    def allowed(self, node: int) -> np.ndarray:
        """int32: the tokens that may follow at ``node`` (empty at a leaf)."""
        first = self._tables.first_edge
        return self._tables.edge_token[first[node]:first[node + 1]]

    def child(self, node: int, token: int) -> int:
        """The node after ``token`` at ``node``; ValueError when ``token`` is not allowed there."""
        first = self._tables.first_edge
        lo, hi = int(first[node]), int(first[node + 1])
        i = lo + int(np.searchsorted(self._tables.edge_token[lo:hi], token))
        if i >= hi or self._tables.edge_token[i] != token:
            raise ValueError(f"{self.name}: token {token} is not allowed at node {node} (allowed: {self.allowed(node).tolist()})")
        return int(self._tables.edge_child[i])

    def is_leaf(self, node: int) -> bool:
        first = self._tables.first_edge
        return bool(first[node] == first[node + 1])

    def walk(self, tokens: Sequence[int]) -> list[int]:
        """The nodes ``[len(tokens) + 1]``: the node each token was chosen at, then the node after
        the last. ValueError when ``tokens`` leave the trie."""
        nodes = [0]
        for t in tokens:
            nodes.append(self.child(nodes[-1], int(t)))
        return nodes

    def contains(self, tokens: Sequence[int]) -> bool:
        """True when ``tokens`` is one of the sequences (a full path from the root to a leaf)."""
        try:
            return self.is_leaf(self.walk(tokens)[-1])
        except ValueError:
            return False

    def sequences(self) -> list[list[int]]:
        """Every sequence, in token order (depth-first)."""
        out: list[list[int]] = []

        def visit(node: int, prefix: list[int]) -> None:
            if self.is_leaf(node):
                out.append(prefix)
            first = self._tables.first_edge
            for e in range(first[node], first[node + 1]):
                visit(int(self._tables.edge_child[e]), prefix + [int(self._tables.edge_token[e])])

        visit(0, [])
        return out

    def __repr__(self) -> str:
        return f"TokenTrie({self.name!r}, {self.num_sequences} sequences, {self.num_nodes} nodes, max depth {self.max_depth})"


def pad_tables(tables: TrieTables, nodes: int, edges: int) -> TrieTables:
    """``tables`` padded to ``nodes`` nodes and ``edges`` edges (padding nodes are leaves), so
    that programs taking them compile once per size class, not once per trie."""
    n, e = len(tables.first_edge) - 1, len(tables.edge_token)
    assert nodes >= n and edges >= e
    first = np.concatenate([tables.first_edge, np.full(nodes - n, tables.first_edge[-1], np.int32)])
    token = np.concatenate([tables.edge_token, np.zeros(edges - e, np.int32)])
    child = np.concatenate([tables.edge_child, np.zeros(edges - e, np.int32)])
    return TrieTables(first.astype(np.int32), token.astype(np.int32), child.astype(np.int32))


def allowed_tokens(xp: Any, tables: TrieTables, nodes: Any, max_branch: int) -> Any:
    """int32 ``[..., max_branch]``: the tokens allowed at each node of ``nodes`` (int ``[...]``),
    ``-1`` past a node's children and everywhere for :data:`FREE` nodes. ``xp`` is numpy or
    jax.numpy (the same code runs on the host and inside the jitted programs)."""
    free = nodes < 0
    n = xp.where(free, 0, nodes)
    lo = tables.first_edge[n]
    hi = tables.first_edge[n + 1]
    idx = lo[..., None] + xp.arange(max_branch, dtype=xp.int32)
    valid = (idx < hi[..., None]) & ~free[..., None]
    edges = len(tables.edge_token)
    tokens = tables.edge_token[xp.clip(idx, 0, max(edges - 1, 0))]
    return xp.where(valid, tokens, -1).astype(xp.int32)


def next_nodes(xp: Any, tables: TrieTables, nodes: Any, tokens: Any, max_branch: int) -> Any:
    """The node after ``tokens`` at ``nodes`` (int ``[...]``); :data:`FREE` stays free, and a
    token not allowed at its node gives :data:`FREE` (the engine never draws one)."""
    free = nodes < 0
    n = xp.where(free, 0, nodes)
    lo = tables.first_edge[n]
    idx = lo[..., None] + xp.arange(max_branch, dtype=xp.int32)
    edges = len(tables.edge_token)
    clipped = xp.clip(idx, 0, max(edges - 1, 0))
    match = (idx < tables.first_edge[n + 1][..., None]) & (tables.edge_token[clipped] == tokens[..., None])
    found = match.any(axis=-1)
    child = tables.edge_child[xp.take_along_axis(clipped, xp.argmax(match, axis=-1)[..., None], axis=-1)[..., 0]]
    return xp.where(free | ~found, FREE, child).astype(xp.int32)


def is_leaf_node(xp: Any, tables: TrieTables, nodes: Any) -> Any:
    """bool ``[...]``: ``nodes`` are constrained leaves (the completion must end there)."""
    n = xp.where(nodes < 0, 0, nodes)
    return (nodes >= 0) & (tables.first_edge[n] == tables.first_edge[n + 1])


def _size_class(n: int, floor: int) -> int:
    """The power of two >= ``max(n, floor)``."""
    return 1 << max(int(n), floor, 1).__sub__(1).bit_length()


class TriePool:
    """The tries of an engine's running constrained requests, as one set of tables: trie ``i``'s
    node ``n`` is pool node ``offset[i] + n``. Sizes are padded to powers of two (so a decode
    program compiles once per size class); the pool is rebuilt from the tries still in use
    whenever a request brings a new one, so it never grows past what runs."""

    def __init__(self) -> None:
        self._offsets: dict[str, int] = {}
        self.tables: Optional[TrieTables] = None
        self.max_branch = 0

    def offset(self, trie: TokenTrie) -> Optional[int]:
        """``trie``'s node offset, or None when it is not in the pool."""
        return self._offsets.get(trie.fingerprint)

    def require(self, trie: TokenTrie) -> int:
        """``trie``'s node offset; KeyError when it is not in the pool."""
        return self._offsets[trie.fingerprint]

    def rebuild(self, tries: Sequence[TokenTrie]) -> None:
        """Make the pool exactly ``tries`` (duplicates by fingerprint merged); offsets change."""
        unique = list({t.fingerprint: t for t in tries}.values())
        self._offsets = {}
        if not unique:
            self.tables, self.max_branch = None, 0
            return
        firsts, tokens, childs = [], [], []
        nodes = edges = 0
        for trie in unique:
            t = trie.tables()
            self._offsets[trie.fingerprint] = nodes
            firsts.append(t.first_edge[:-1] + edges)
            tokens.append(t.edge_token)
            childs.append(t.edge_child + nodes)
            nodes += len(t.first_edge) - 1
            edges += len(t.edge_token)
        tables = TrieTables(np.concatenate([*firsts, [edges]]).astype(np.int32), np.concatenate(tokens).astype(np.int32),
                            np.concatenate(childs).astype(np.int32))
        # + 1 node: pool node ``n + 1`` is read for every n (first_edge[n + 1]); padding nodes are leaves.
        self.tables = pad_tables(tables, _size_class(nodes + 1, 64), _size_class(edges, 64))
        self.max_branch = _size_class(max(t.max_branch for t in unique), 8)


_LOADED: dict[tuple[str, int, int], TokenTrie] = {}


def load_trie(path: str | Path) -> TokenTrie:
    """:meth:`TokenTrie.from_file`, read once per file version (the config's
    ``rollout.decoding.constraint``: the workflow, the eval and the trainer share one trie)."""
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise FileNotFoundError(f"decoding.constraint {path}: not found (a file of token-id sequences, one per line)")
    stat = resolved.stat()
    key = (str(resolved), stat.st_mtime_ns, stat.st_size)
    if key not in _LOADED:
        _LOADED[key] = TokenTrie.from_file(resolved)
    return _LOADED[key]
