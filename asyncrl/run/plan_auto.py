"""``model.remat_policy: auto`` and ``model.logprob_chunk_size: auto`` chosen for a target by
``asyncrl plan --target`` (issue 46): the cheapest setting whose XLA peak fits the device.

Cheapest means least recomputation: ``remat_policy: save_dots`` (the backward recomputes norms,
rope, attention and activations) before ``full`` (the whole layer), and the largest lm-head
chunk (the trained window whole, then halves of it down to :data:`SMALLEST_CHUNK` positions:
each chunk is recomputed in the backward, and smaller chunks are more loop steps). An explicit
value in the config always wins: only fields left ``auto`` are chosen (``remat_policy`` only
with ``model.remat``; without it there is no policy to pick). In a run, ``auto`` is what
:data:`asyncrl.model.loading.RUN_AUTO` says (``full``; the chunk under
``model.logprob_chunk_budget_mb``); the choice printed here is the ``--set`` that pins it.

Compiles are the cost (tens of seconds to minutes each here), so the calibrated formulas
(:mod:`asyncrl.run.plan_formulas`, within :data:`PLAN_TOLERANCE` of XLA on the shipped configs)
skip the candidates that cannot fit, and XLA's figure decides each candidate compiled, at most
``max_compiles`` of them; when none fits, the least-memory candidate is returned as not fitting.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from asyncrl.config import Config

SMALLEST_CHUNK = 32
"""The smallest lm-head chunk ``auto`` tries (positions)."""
PLAN_TOLERANCE = 0.10
"""How far the plan's formulas may be from XLA's figures (docs/performance.md's calibration table):
a candidate whose formula total exceeds the budget by more is not compiled."""


@dataclasses.dataclass(frozen=True)
class MemoryChoice:
    """What ``auto`` became for a target."""

    overrides: tuple[str, ...]
    """The chosen values as ``--set`` overrides (empty: nothing was ``auto``)."""
    peak_bytes: Optional[int]
    """XLA's per-device peak with them (None: nothing compiled)."""
    fits: bool
    tried: tuple[tuple[tuple[str, ...], int], ...] = ()
    """Each candidate compiled, in order, with XLA's per-device peak."""

    def describe(self, budget: int) -> str:
        """One line for ``asyncrl plan``: the choice, its peak against the budget, what was tried."""
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        if not self.overrides:
            return "model.remat_policy / model.logprob_chunk_size: set in the config (nothing auto to choose)"
        sets = " ".join(f"--set {o}" for o in self.overrides)
        tried = "; ".join(f"{' '.join(o.split('.', 1)[1] for o in c)}: {gib(p)}" for c, p in self.tried)
        verdict = "fits" if self.fits else "does NOT fit; the least memory tried"
        return f"auto -> {sets} (XLA peak {gib(self.peak_bytes or 0)} of {gib(budget)}: {verdict}; compiled: {tried})"


def auto_candidates(cfg: Config, window: int) -> list[tuple[str, ...]]:
    """The settings ``auto`` may take for ``cfg``, cheapest first, as ``--set`` overrides: every
    remat policy left ``auto`` (``save_dots``, ``full``) with every chunk left ``auto`` (``window``,
    then halves down to :data:`SMALLEST_CHUNK`). ``[()]`` when nothing is ``auto``."""
    model = cfg.model
    policies: list[Optional[str]] = ["save_dots", "full"] if (model.remat and model.remat_policy == "auto") else [None]
    chunks: list[Optional[int]] = [None]
    if model.logprob_chunk_size == "auto":
        chunks, size = [], window
        while size >= SMALLEST_CHUNK or not chunks:
            chunks.append(size)
            size //= 2
    out = []
    for policy in policies:
        for chunk in chunks:
            sets = ([f"model.remat_policy={policy}"] if policy else []) + ([f"model.logprob_chunk_size={chunk}"] if chunk else [])
            out.append(tuple(sets))
    return out


def choose_auto(candidates: Sequence[tuple[str, ...]], budget: int, estimate: Callable[[tuple[str, ...]], int],
                measure: Callable[[tuple[str, ...]], int], max_compiles: int = 3) -> MemoryChoice:
    """The first of ``candidates`` (cheapest first) whose XLA peak (``measure``: bytes per device,
    trainer and engine where they share it) fits ``budget`` bytes. Candidates whose formula total
    (``estimate``) is over the budget by more than :data:`PLAN_TOLERANCE` are not compiled; after
    ``max_compiles`` compiles without a fit, the least-memory candidate is measured and returned
    as not fitting."""
    if candidates == [()] or not candidates or candidates[0] == ():
        return MemoryChoice((), None, True)
    tried: list[tuple[tuple[str, ...], int]] = []
    for candidate in candidates:
        if estimate(candidate) > budget * (1 + PLAN_TOLERANCE) and candidate != candidates[-1]:
            continue
        peak = measure(candidate)
        tried.append((candidate, peak))
        if peak <= budget:
            return MemoryChoice(candidate, peak, True, tuple(tried))
        if len(tried) >= max_compiles:
            break
    last = candidates[-1]
    peak = next((p for c, p in tried if c == last), None)
    if peak is None:
        peak = measure(last)
        tried.append((last, peak))
    return MemoryChoice(last, peak, peak <= budget, tuple(tried))
