"""Prefix reuse: which KV the engine's slots hold, and which of it a new request can start from.

A slot's KV is kept after its sample ends, until the slot is needed again: a free slot holds the
last sample's context (its prompt and the tokens it generated, all but the last, whose KV is
never computed). A running slot's positions before its write position are fixed too. So every
slot is a store of one token sequence, with no memory beyond the KV cache itself; the engine's
scheduler (:mod:`asyncrl.engine.scheduler`) asks :meth:`PrefixStore.match` for the slot whose
tokens share the longest prefix with a request's context and copies or extends from it
(:mod:`asyncrl.engine.prefix_programs`).

Rules (docs/agents.md "Prefix reuse"):

* Token-exact: a prefix matches token for token from position 0.
* Versioned: a position's KV is valid for the weights it was computed with; by default a prefix is
  reused only where every position was computed with the weights the engine serves now
  (``engine.prefix_cache.across_versions: true`` also reuses older ones, and the request's tokens
  then carry the oldest version they attended to: :meth:`PrefixStore.version_floor`).
* Worth it: a whole context (a group's requests, which share one prompt) is always reused; a part
  of one only from ``engine.prefix_cache.min_tokens`` positions on.
* Bounded: nothing is stored beyond the slots; a slot is taken for a new request empty first,
  then the kept one used longest ago (a slot that is a source of the current admission round is
  never taken), so reuse never holds a request back.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

EMPTY, RUNNING, KEPT = 0, 1, 2
"""A slot's state: holds nothing reusable, decodes a sample, keeps a finished sample's KV."""


@dataclasses.dataclass(frozen=True)
class Match:
    """A slot whose first ``length`` KV positions are the first ``length`` tokens of a context."""

    slot: int
    length: int


class PrefixStore:
    """Per slot: the tokens whose KV it holds (position by position), the weights version each was
    computed with, its state and when it was last used. Owned by the engine's scheduler thread.

    Args:
        slots, capacity: the engine's slots and their KV capacity.
        replicas: engine replicas (a slot's replica: ``slot // (slots / replicas)``; a copy from a
            slot of the same replica moves nothing between devices).
        min_tokens: the shortest part of a context worth reusing (a whole context always is).
        across_versions: reuse positions computed with older weights.
    """

    def __init__(self, slots: int, capacity: int, replicas: int = 1, min_tokens: int = 64, across_versions: bool = False):
        self.slots, self.capacity, self.replicas = slots, capacity, replicas
        self.min_tokens, self.across_versions = min_tokens, across_versions
        self.tokens = np.zeros((slots, capacity), np.int32)
        self.versions = np.zeros((slots, capacity), np.int32)
        self.lengths = np.zeros((slots,), np.int64)
        self.state = np.full((slots,), EMPTY, np.int8)
        self.used = np.zeros((slots,), np.int64)  # a counter: larger = used more recently
        self._clock = 0

    # ------------------------------------------------------------------ queries

    def replica_of(self, slot: int) -> int:
        return slot // (self.slots // self.replicas)

    def reusable(self, version: int) -> np.ndarray:
        """int64 [slots]: per slot, how many leading positions may be reused at ``version``."""
        lengths = np.where(self.state == EMPTY, 0, self.lengths)
        if self.across_versions:
            return lengths
        stale = (self.versions != version) | (np.arange(self.capacity)[None, :] >= lengths[:, None])
        first_stale = np.where(stale.any(axis=1), stale.argmax(axis=1), self.capacity)
        return np.minimum(lengths, first_stale)

    def match(self, context: np.ndarray, version: int, exclude: Sequence[int] = ()) -> Optional[Match]:
        """The slot sharing the longest reusable prefix with ``context`` (int32 [T], T <= capacity)
        and that length, or None when no slot shares one worth reusing. Ties: a kept slot before a
        running one (it can take the request in place), then the one used last."""
        n = len(context)
        if n == 0:
            return None
        same = self.tokens[:, :n] == np.asarray(context, np.int32)[None, :]
        common = np.where(same.all(axis=1), n, (~same).argmax(axis=1))
        length = np.minimum(common, self.reusable(version))
        if len(exclude):
            length[list(exclude)] = 0
        if not length.any():
            return None
        order = np.lexsort((self.used, self.state == KEPT, length))  # last: longest, kept, most recent
        best = int(order[-1])
        best_length = int(length[best])
        if best_length < n and best_length < self.min_tokens:
            return None
        return Match(best, best_length)

    def version_floor(self, slot: int, length: int) -> Optional[int]:
        """The oldest version among the first ``length`` positions of ``slot`` (None: none)."""
        return int(self.versions[slot, :length].min()) if length else None

    def destinations(self, count: int, free: Sequence[int], protected: set[int], replica: Optional[int] = None) -> list[int]:
        """``count`` of the ``free`` slots to write, not ``protected`` ones: on ``replica`` first (when
        given), empty ones before kept ones, kept ones used longest ago first."""
        candidates = [s for s in free if s not in protected]
        candidates.sort(key=lambda s: (replica is not None and self.replica_of(s) != replica, self.state[s] == KEPT,
                                       self.used[s], s))
        return candidates[:count]

    # ------------------------------------------------------------------ updates (what the device did)

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self.used[slot] = self._clock

    def start(self, slot: int, context: np.ndarray, version: int, start: int = 0) -> None:
        """``slot`` now holds ``context`` (its positions from ``start`` computed at ``version``; those
        before it copied in already) and runs a sample."""
        n = len(context)
        self.tokens[slot, start:n] = context[start:]
        self.versions[slot, start:n] = version
        self.lengths[slot] = n
        self.state[slot] = RUNNING
        self._touch(slot)

    def copy(self, src: int, dst: int, length: int) -> None:
        """``dst`` holds the first ``length`` positions of ``src`` (and runs a sample)."""
        if src != dst:
            self.tokens[dst, :length] = self.tokens[src, :length]
            self.versions[dst, :length] = self.versions[src, :length]
        self.lengths[dst] = length
        self.state[dst] = RUNNING
        self._touch(dst)

    def fed(self, slot: int, tokens: Sequence[int], version: int) -> None:
        """Decode steps of ``slot`` fed ``tokens`` (their KV written at its next positions)."""
        start = int(self.lengths[slot])
        end = min(start + len(tokens), self.capacity)
        self.tokens[slot, start:end] = np.asarray(tokens[: end - start], np.int32)
        self.versions[slot, start:end] = version
        self.lengths[slot] = end

    def forget(self) -> None:
        """Nothing kept is reusable any more (``/flush_cache``); running slots keep what they hold."""
        kept = self.state == KEPT
        self.state[kept] = EMPTY
        self.lengths[kept] = 0

    def keep(self, slot: int) -> None:
        """``slot``'s sample ended: its KV is kept until the slot is taken again."""
        self.state[slot] = KEPT
        self._touch(slot)


@dataclasses.dataclass(frozen=True)
class Admission:
    """Where one request goes: its destination slots (the context is built in ``slots[0]``, then
    copied to the others), and what it starts from: ``source``'s first ``length`` positions
    (``source == slots[0]``: in place), or nothing (``source`` None: a fresh prefill)."""

    slots: tuple[int, ...]
    source: Optional[int] = None
    length: int = 0
    stage: int = 0
    """When it runs in its round: after the requests of earlier stages (its source is one of them)."""

    @property
    def fresh(self) -> bool:
        return self.source is None


class AdmissionRound:
    """The requests admitted together between two decode chunks. Fresh prefills run first; then,
    stage by stage, the copies from kept prefixes, the extensions and the copies to a request's
    other slots (:meth:`~asyncrl.engine.scheduler.Scheduler._reuse`), so within a round:

    * a request may start from any slot, one that another request of the round fills included:
      from a fresh one (complete once the fresh prefills ran) in the first stage, from a reusing
      one in the stage after that one's;
    * a slot read by a copy is never a destination of the round (a fresh prefill would overwrite
      it first); such a request waits for the next round rather than go without a slot.
    """

    def __init__(self, store: PrefixStore, free: Sequence[int], version: int):
        self.store, self.version = store, version
        self.free = list(free)
        self.protected: set[int] = set()  # sources of this round's copies
        self.ready_after: dict[int, int] = {}  # a slot this round fills -> the stage after which it is complete (-1: before any)

    def take(self, context: np.ndarray, n: int) -> Optional[Admission]:
        """Plan a request of ``n`` samples whose context (its prompt but the last token) is
        ``context``; None when it does not fit in the slots left (it waits for the next round).
        Records in the store what its slots will hold."""
        store = self.store
        match = store.match(context, self.version)
        admission = None
        if match is not None:
            src, length = match.slot, match.length
            replica = store.replica_of(src)
            if store.state[src] == KEPT and src in self.free and src not in self.protected:
                rest = store.destinations(n - 1, [s for s in self.free if s != src], self.protected, replica)
                slots = [src, *rest]
            else:
                slots = store.destinations(n, self.free, self.protected | {src}, replica)
            if len(slots) == n:
                admission = Admission(tuple(slots), src, length, self.ready_after.get(src, -1) + 1)
        if admission is None:  # no reuse, or no room for it: a fresh prefill if that fits
            slots = store.destinations(n, self.free, self.protected)
            if len(slots) < n:
                return None
            admission = Admission(tuple(slots))
        for slot in admission.slots:
            self.free.remove(slot)
        first = admission.slots[0]
        if admission.fresh:
            for slot in admission.slots:
                store.start(slot, context, self.version)
                self.ready_after[slot] = -1
            return admission
        self.protected.add(admission.source)  # type: ignore[arg-type]
        store.copy(admission.source, first, admission.length)  # type: ignore[arg-type]
        store.start(first, context, self.version, start=admission.length)
        for slot in admission.slots[1:]:
            store.copy(first, slot, len(context))
        # A whole context reused in place is complete from the round's start (its copy keeps what it
        # holds); the others once their stage has run.
        whole_in_place = admission.source == first and admission.length == len(context)
        for slot in admission.slots:
            self.ready_after[slot] = -1 if whole_in_place and slot == first else admission.stage
        return admission
