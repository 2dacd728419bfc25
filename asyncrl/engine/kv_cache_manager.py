"""The KV cache manager of :class:`~asyncrl.engine.jax_engine.JaxEngine`: where each sequence's KV
lies and what of it can be reused (host bookkeeping only; the arrays are the model runner's).

Each of the engine's slots holds one sequence's KV; a finished sequence's KV stays in its slot until
the slot is needed again, and :mod:`asyncrl.engine.prefix_cache` finds the slot sharing the
longest prefix with a new request. The scheduler asks this manager where an admitted request goes
(:meth:`KVCacheManager.admission_round`) and tells it what the device did (tokens fed, samples
ended, a flush).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from asyncrl.config import EngineConfig
from asyncrl.engine.prefix_cache import Admission, AdmissionRound, PrefixStore


class _PlainRound:
    """An admission round without prefix reuse: every request takes free slots, in order."""

    def __init__(self, free: Sequence[int]):
        self.free = list(free)

    def take(self, context: np.ndarray, n: int) -> Optional[Admission]:
        if n > len(self.free):
            return None
        slots, self.free = self.free[:n], self.free[n:]
        return Admission(tuple(slots))


class KVCacheManager:
    """Which KV each slot holds and what a new request can start from.

    Args:
        config: the ``engine`` section (slots, capacity, ``prefix_cache``).
        replicas: the engine's replicas (each holds an equal share of the slots).
    """

    def __init__(self, config: EngineConfig, replicas: int = 1):
        reuse = config.prefix_cache
        slots = int(config.slots)
        self.replicas = replicas
        self.store = (PrefixStore(slots, config.kv_capacity, replicas, reuse.min_tokens, reuse.across_versions)
                      if reuse.enabled else None)

    @property
    def reuse(self) -> bool:
        return self.store is not None

    def admission_round(self, free: Sequence[int], version: int) -> "AdmissionRound | _PlainRound":
        """The planner of one admission between two chunks (free slots, the served version)."""
        if self.store is None:
            return _PlainRound(free)
        return AdmissionRound(self.store, free, version)

    def replica_of(self, slot: int) -> int:
        assert self.store is not None
        return self.store.replica_of(slot)

    def version_floor(self, slot: int, length: int, version: int) -> Optional[int]:
        """The oldest version of ``slot``'s first ``length`` positions when older than ``version`` and
        reused across versions (``engine.prefix_cache.across_versions``), else None."""
        store = self.store
        if store is None or not store.across_versions:
            return None
        floor = store.version_floor(slot, length)
        return floor if floor is not None and floor < version else None

    def fed(self, slot: int, tokens: Sequence[int], version: int) -> None:
        """A decode chunk fed ``tokens`` to ``slot`` (their KV now follows what it holds)."""
        if self.store is not None:
            self.store.fed(slot, tokens, version)

    def released(self, slot: int) -> None:
        """``slot``'s sequence ended: its KV is kept for reuse until the slot is taken again."""
        if self.store is not None:
            self.store.keep(slot)

    def flush(self) -> None:
        """Forget every kept prefix (running sequences keep theirs)."""
        if self.store is not None:
            self.store.forget()
