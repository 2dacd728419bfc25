"""The staleness ledger: admission, tickets and accounting as a pure state machine.

No threads, no clocks, no I/O: the executor calls it under its own lock, the hypothesis
state machine drives it directly, and its snapshot is part of every checkpoint.

Counts are in groups (1 group = 1 prompt = 1 episode). With ``B`` groups per trainer step,
``η`` the staleness bound and ``v`` the served version (docs/design.md "Staleness control"):

* admission: a new episode starts only while ``in_flight + queued + consumed < (v + η + 1)·B``
  and ``in_flight < max_concurrent``; it gets the next ticket and the next sample id;
* an episode ends ``queued`` (completed), ``failed:<reason>``, ``returned_none``, or
  ``dropped:<reason>``; a queued group ends ``trained`` (consumed) or ``dropped:<reason>``.
  Failed, none and dropped leave all three counts, so their slot is refilled;
* ``consumed`` counts groups handed to the trainer, the step in progress included;
* after :meth:`load_snapshot`, episodes that were in flight are ``reissued``: :meth:`admit`
  hands them out first, with their original ticket and sample id (hence the same seeds).

Which sample ids a ledger draws is its :class:`SampleShare`: all of them in a one-process run
(sample id ``j`` is draw ``j``); in a run of several processes, where every process has a
ledger of its own with ``B_p`` of the ``B`` groups of each step, process ``p``'s ``j``-th draw is
the ``j % B_p``-th id of its block of round ``j // B_p`` (a round is ``B`` consecutive ids, the
blocks in process order), so that with nothing dropped the processes together draw step ``k``'s
ids ``[k·B, (k+1)·B)``, as one process would. :func:`~asyncrl.rollout.redistribute.redistribute` turns the
snapshots of one process count into those of another, losing and repeating no sample.

Every sample id ever drawn is in exactly one category of :meth:`counts`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Literal, Optional

IN_FLIGHT, QUEUED = "in_flight", "queued"


@dataclasses.dataclass(frozen=True)
class SampleShare:
    """The sample ids one ledger draws (module docstring): draw ``j`` is
    ``base + (j // count) * round_size + offset + j % count``."""

    base: int = 0
    """The first id of round 0."""
    round_size: int = 1
    """Ids per round: ``rollout.batch_size`` (``B``)."""
    offset: int = 0
    """Where this ledger's block starts in each round (the shares of the processes before it)."""
    count: int = 1
    """Ids of each round this ledger draws (its share ``B_p`` of the batch)."""

    def sample_id(self, draw: int) -> int:
        rounds, position = divmod(draw, self.count)
        return self.base + rounds * self.round_size + self.offset + position

    @property
    def whole(self) -> bool:
        """Every id: ``sample_id(j) == base + j`` (one process)."""
        return self.offset == 0 and self.count == self.round_size


def batch_shares(batch_size: int, processes: int) -> list[int]:
    """Groups per step of each process: ``B // P``, one more for the first ``B % P`` processes."""
    if processes < 1 or batch_size < processes:
        raise ValueError(f"rollout.batch_size = {batch_size} is smaller than the {processes} processes of the run: every "
                         f"process generates and trains its share of each batch; use rollout.batch_size >= {processes}")
    return [batch_size // processes + (p < batch_size % processes) for p in range(processes)]


def process_share(batch_size: int, process: int, processes: int, base: int = 0) -> SampleShare:
    """Process ``process``'s :class:`SampleShare` of a run of ``processes`` with ``batch_size`` groups per step."""
    shares = batch_shares(batch_size, processes)
    return SampleShare(base, batch_size, sum(shares[:process]), shares[process])


@dataclasses.dataclass
class _Entry:
    sample_id: int
    state: str
    admit_version: int
    min_version: int = -1
    done_seq: int = -1


class StalenessLedger:
    """Admission and accounting of episodes; see the module docstring for the rules."""

    def __init__(self, batch_size: int, max_staleness: int, max_concurrent: int, version: int = 0,
                 share: Optional[SampleShare] = None):
        if batch_size < 1 or max_staleness < 0 or max_concurrent < 1 or version < 0:
            raise ValueError("StalenessLedger: need batch_size >= 1, max_staleness >= 0, max_concurrent >= 1, version >= 0")
        self.batch_size = batch_size
        """Groups per trainer step this ledger admits and hands over (a process's share in a multi-process run)."""
        self.share = share if share is not None else SampleShare(0, batch_size, 0, batch_size)
        if self.share.count != batch_size:
            raise ValueError(f"StalenessLedger: a share of {self.share.count} ids per round for batch_size {batch_size}")
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self.version = version
        self.next_ticket = 0
        self.next_sample_id = 0
        """Draws made from :attr:`share` (one process: the next sample id)."""
        self.fresh: list[int] = []
        """Ids never drawn that a redistribution handed this ledger: drawn first (after reissues)."""
        # Groups consumed by the trainer so far, the step in progress included. Starting at
        # version k means k steps of B groups were trained: without this, a run resumed (or
        # started) at k would admit k·B extra groups and train them with lag > η.
        self.consumed = version * batch_size
        self._done_seq = 0
        self._entries: dict[int, _Entry] = {}
        self._reissue: list[tuple[int, int, int]] = []  # (ticket, sample_id, admit_version), ascending tickets
        self._terminal: Counter[str] = Counter()
        self.reissued_total = 0

    # ------------------------------------------------------------------ queries

    @property
    def in_flight(self) -> int:
        return sum(1 for e in self._entries.values() if e.state == IN_FLIGHT)

    @property
    def queued(self) -> int:
        return sum(1 for e in self._entries.values() if e.state == QUEUED)

    @property
    def admission_limit(self) -> int:
        """``(v + η + 1)·B``: bound on ``in_flight + queued + consumed``."""
        return (self.version + self.max_staleness + 1) * self.batch_size

    def can_admit(self) -> bool:
        in_flight = self.in_flight
        return in_flight + self.queued + self.consumed < self.admission_limit and in_flight < self.max_concurrent

    def state_of(self, ticket: int) -> Optional[str]:
        """``in_flight``, ``queued``, ``reissued`` or None (ended, or never admitted)."""
        entry = self._entries.get(ticket)
        if entry is not None:
            return entry.state
        return "reissued" if any(t == ticket for t, _, _ in self._reissue) else None

    def sample_id(self, ticket: int) -> int:
        return self._entries[ticket].sample_id

    def admit_version(self, ticket: int) -> int:
        return self._entries[ticket].admit_version

    def in_flight_tickets(self) -> list[int]:
        return sorted(t for t, e in self._entries.items() if e.state == IN_FLIGHT)

    def candidates(self, order: Literal["admission", "completion"]) -> list[int]:
        """Queued tickets in the order ``WorkflowExecutor.next_batch`` considers them.

        ``admission``: the smallest live tickets, up to (not past) the first one still in
        flight or awaiting reissue, since the batch must wait for it. ``completion``: every
        queued ticket, in completion order.
        """
        if order == "completion":
            queued = [(e.done_seq, t) for t, e in self._entries.items() if e.state == QUEUED]
            return [t for _, t in sorted(queued)]
        pending = min((t for t, _, _ in self._reissue), default=None)
        out = []
        for ticket in sorted(self._entries):
            if pending is not None and ticket > pending:
                break
            if self._entries[ticket].state != QUEUED:
                break
            out.append(ticket)
        return out

    def counts(self) -> dict[str, int]:
        """Samples per accounting category; they sum to the number of samples drawn."""
        out: dict[str, int] = {"in_flight": self.in_flight, "queued": self.queued, "reissued": len(self._reissue)}
        out.update(self._terminal)
        out.setdefault("trained", 0)
        out.setdefault("dropped:stale", 0)
        out.setdefault("returned_none", 0)
        return out

    # ------------------------------------------------------------------ transitions

    def admit(self) -> tuple[int, int]:
        """Start an episode: ``(ticket, sample_id)``. Reissues come first, with their old ticket."""
        if not self.can_admit():
            raise ValueError("admit: the admission rule does not allow another episode now")
        if self._reissue:
            ticket, sample_id, admit_version = self._reissue.pop(0)
            self._entries[ticket] = _Entry(sample_id, IN_FLIGHT, admit_version)
            return ticket, sample_id
        ticket = self.next_ticket
        if self.fresh:
            sample_id = self.fresh.pop(0)
        else:
            sample_id = self.share.sample_id(self.next_sample_id)
            self.next_sample_id += 1
        self.next_ticket += 1
        self._entries[ticket] = _Entry(sample_id, IN_FLIGHT, self.version)
        return ticket, sample_id

    def _take(self, ticket: int, states: tuple[str, ...], action: str) -> _Entry:
        entry = self._entries.get(ticket)
        if entry is None or entry.state not in states:
            now = entry.state if entry is not None else "not live"
            raise ValueError(f"{action}: ticket {ticket} is {now}, expected {' or '.join(states)}")
        return entry

    def complete(self, ticket: int, min_version: int) -> None:
        """The episode returned a group whose oldest trained token has ``min_version``."""
        entry = self._take(ticket, (IN_FLIGHT,), "complete")
        entry.state, entry.min_version, entry.done_seq = QUEUED, min_version, self._done_seq
        self._done_seq += 1

    def fail(self, ticket: int, reason: str) -> None:
        """The episode raised, timed out or broke the schema: ``failed:<reason>``."""
        self._take(ticket, (IN_FLIGHT,), "fail")
        del self._entries[ticket]
        self._terminal[f"failed:{reason}"] += 1

    def returned_none(self, ticket: int) -> None:
        self._take(ticket, (IN_FLIGHT,), "returned_none")
        del self._entries[ticket]
        self._terminal["returned_none"] += 1

    def drop(self, ticket: int, reason: str) -> None:
        """A group (queued, or an episode that skipped its sample) is dropped: ``dropped:<reason>``."""
        self._take(ticket, (IN_FLIGHT, QUEUED), "drop")
        del self._entries[ticket]
        self._terminal[f"dropped:{reason}"] += 1

    def consume(self, tickets: list[int]) -> None:
        """Queued groups handed to the trainer for the step starting from the current version."""
        for ticket in tickets:
            self._take(ticket, (QUEUED,), "consume")
        for ticket in tickets:
            del self._entries[ticket]
        self.consumed += len(tickets)
        self._terminal["trained"] += len(tickets)

    def publish(self, version: int) -> None:
        """The engine now serves ``version``; versions only move forward."""
        if version < self.version:
            raise ValueError(f"publish: version {version} is older than the current version {self.version}")
        self.version = version

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> dict[str, Any]:
        """The whole state as JSON-serialisable data."""
        return {
            "version": self.version,
            "next_ticket": self.next_ticket,
            "next_sample_id": self.next_sample_id,
            "consumed": self.consumed,
            "batch_size": self.batch_size,
            "done_seq": self._done_seq,
            "entries": [
                [t, e.sample_id, e.state, e.admit_version, e.min_version, e.done_seq] for t, e in sorted(self._entries.items())
            ],
            "reissue": [list(r) for r in self._reissue],
            "terminal": dict(sorted(self._terminal.items())),
            "reissued_total": self.reissued_total,
            "share": dataclasses.asdict(self.share),
            "fresh": list(self.fresh),
        }

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        """Continue from ``snap``; its in-flight episodes become ``reissued`` (admitted first).

        Batch size, staleness bound and concurrency stay this ledger's own (a resume may change
        them); the draws continue the snapshot's share where it covers every id (one process),
        or where this ledger draws the same share of the same batch size. Another share is a
        :func:`~asyncrl.rollout.redistribute.redistribute` first (the loop does that when the
        process count or batch size changed).
        """
        self.version = int(snap["version"])
        self.next_ticket = int(snap["next_ticket"])
        share = SampleShare(**snap["share"]) if snap.get("share") else None
        draws = int(snap["next_sample_id"])
        if (share is None or share.whole) and self.share.whole:  # base + j, whatever the batch size
            base = share.base if share is not None else 0
            self.share, self.next_sample_id = SampleShare(base, self.batch_size, 0, self.batch_size), draws
        elif share is not None and share == dataclasses.replace(self.share, base=share.base):
            self.share, self.next_sample_id = share, draws
        else:
            raise ValueError(f"load_snapshot: the snapshot draws {share}, this ledger {self.share}; redistribute() it first")
        self.fresh = [int(i) for i in snap.get("fresh", [])]
        # Re-base ``consumed`` on this ledger's batch size (a resume may change it): v·B, plus
        # one batch if a step was in progress when the snapshot was taken.
        in_progress = int(snap["consumed"]) > self.version * int(snap["batch_size"])
        self.consumed = (self.version + in_progress) * self.batch_size
        self._done_seq = int(snap["done_seq"])
        self._terminal = Counter({k: int(v) for k, v in snap["terminal"].items()})
        self._entries = {}
        reissue: list[tuple[int, int, int]] = [(int(r[0]), int(r[1]), int(r[2])) for r in snap["reissue"]]
        for ticket, sample_id, state, admit_version, min_version, done_seq in snap["entries"]:
            if state == IN_FLIGHT:
                reissue.append((int(ticket), int(sample_id), int(admit_version)))
            else:
                self._entries[int(ticket)] = _Entry(int(sample_id), state, int(admit_version), int(min_version), int(done_seq))
        self._reissue = sorted(reissue)
        self.reissued_total = int(snap["reissued_total"]) + sum(1 for e in snap["entries"] if e[2] == IN_FLIGHT)

