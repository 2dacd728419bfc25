"""Moving rollout state between process counts: the ledger snapshots and queued groups a
checkpoint of N processes holds, redistributed over the M processes (or another batch size) of
the run that resumes it, with no sample lost or repeated (docs/scaling.md "What runs where").
Pure functions: the loop calls :func:`redistribute_states` on every process, each keeps its own."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from asyncrl.errors import RolloutError
from asyncrl.rollout.executor import STATE_FORMAT
from asyncrl.rollout.ledger import QUEUED, SampleShare, batch_shares

__all__ = ["redistribute", "redistribute_states"]


def redistribute(snapshots: list[dict[str, Any]], batch_size: int, processes: int) -> list[dict[str, Any]]:
    """The ledger snapshots of a run resumed on ``processes`` processes with ``rollout.batch_size``
    ``batch_size``, from the snapshots its checkpoint holds (one per process that wrote it, all at
    one version). Pure.

    Nothing is lost or repeated: every queued group and every episode to generate again (in
    flight, or awaiting reissue) goes to exactly one new ledger with its sample id (hence its
    seeds); the ids of the rounds any old process had started that some process had not drawn yet
    are handed out as ``fresh`` (drawn first); new draws start at the first round no process had
    started. Those items, in sample-id order, are dealt out in contiguous blocks proportional to
    the new shares. Queued groups and reissues get new tickets in sample-id order (each new
    snapshot's ``entries`` carry ``[ticket, ..., old process, old ticket]`` in ``moved``, so the
    caller moves the stored groups along). The accounting totals go to process 0's ledger.
    """
    versions = {int(s["version"]) for s in snapshots}
    if len(versions) != 1:
        raise ValueError(f"redistribute: the snapshots are at different versions {sorted(versions)}")
    version = versions.pop()
    shares = [SampleShare(**s["share"]) if s.get("share") else SampleShare(0, int(s["batch_size"]), 0, int(s["batch_size"]))
              for s in snapshots]
    if len({(sh.base, sh.round_size) for sh in shares}) != 1:
        raise ValueError("redistribute: the snapshots' shares are of different rounds")
    base, round_size = shares[0].base, shares[0].round_size
    rounds = max(-(-int(s["next_sample_id"]) // sh.count) for s, sh in zip(snapshots, shares))
    items: list[tuple[int, str, tuple]] = []  # (sample id, kind, details)
    for p, (snap, sh) in enumerate(zip(snapshots, shares)):
        for ticket, sample_id, state, admit_version, min_version, done_seq in snap["entries"]:
            if state == QUEUED:
                items.append((int(sample_id), QUEUED, (int(admit_version), int(min_version), int(done_seq), p, int(ticket))))
            else:
                items.append((int(sample_id), "reissue", (int(admit_version), p, int(ticket))))
        for ticket, sample_id, admit_version in snap["reissue"]:
            items.append((int(sample_id), "reissue", (int(admit_version), p, int(ticket))))
        undrawn = [sh.sample_id(j) for j in range(int(snap["next_sample_id"]), rounds * sh.count)]
        items += [(int(i), "fresh", ()) for i in [*snap.get("fresh", []), *undrawn]]
    items.sort(key=lambda item: item[0])
    in_progress = any(int(s["consumed"]) > version * int(s["batch_size"]) for s in snapshots)
    terminal: Counter[str] = Counter()
    for snap in snapshots:
        terminal.update({k: int(v) for k, v in snap["terminal"].items()})
    # Episodes in flight at the snapshot are generated again: reissued, as load_snapshot counts them.
    reissued_total = sum(int(s["reissued_total"]) + sum(e[2] != QUEUED for e in s["entries"]) for s in snapshots)
    out = []
    counts = batch_shares(batch_size, processes)
    for q in range(processes):
        offset = sum(counts[:q])
        mine = items[len(items) * offset // batch_size: len(items) * (offset + counts[q]) // batch_size]
        live = [item for item in mine if item[1] != "fresh"]
        queued_order = sorted((item for item in live if item[1] == QUEUED), key=lambda item: (item[2][2], item[2][3]))
        done_seq = {id(item): n for n, item in enumerate(queued_order)}
        entries, reissue, moved = [], [], []
        for ticket, item in enumerate(live):
            sample_id, kind, details = item
            if kind == QUEUED:
                admit_version, min_version, _, old_process, old_ticket = details
                entries.append([ticket, sample_id, QUEUED, admit_version, min_version, done_seq[id(item)]])
                moved.append([ticket, old_process, old_ticket])
            else:
                reissue.append([ticket, sample_id, details[0]])
        out.append({
            "version": version, "next_ticket": len(live), "next_sample_id": 0,
            "consumed": (version + in_progress) * counts[q], "batch_size": counts[q], "done_seq": len(queued_order),
            "entries": entries, "reissue": reissue,
            "terminal": dict(sorted(terminal.items())) if q == 0 else {},
            "reissued_total": reissued_total if q == 0 else 0,
            "share": dataclasses.asdict(SampleShare(base + rounds * round_size, batch_size, offset, counts[q])),
            "fresh": [item[0] for item in mine if item[1] == "fresh"],
            "moved": moved,
        })
    return out


def redistribute_states(states: Sequence[Mapping[str, Any]], batch_size: int, processes: int) -> list[dict[str, Any]]:
    """The rollout states (:meth:`WorkflowExecutor.state_dict`) of ``processes`` executors with
    ``batch_size`` groups per step between them, from those of the executors that wrote a
    checkpoint (another count, or another batch size): the ledgers by
    :func:`redistribute`, each queued group moved with its ticket. Pure."""
    for state in states:
        if state["meta"].get("format") != STATE_FORMAT:
            raise RolloutError(f"rollout state: format {state['meta'].get('format')!r}, this asyncrl reads {STATE_FORMAT}")
    out = []
    for snapshot in redistribute([state["meta"]["ledger"] for state in states], batch_size, processes):
        moved = snapshot.pop("moved")
        groups_meta: dict[str, Any] = {}
        arrays: dict[str, np.ndarray] = {}
        for ticket, old_process, old_ticket in moved:
            old = states[old_process]
            groups_meta[str(ticket)] = old["meta"]["groups"][str(old_ticket)]
            prefix = f"g{old_ticket}_"
            arrays.update({f"g{ticket}_{name[len(prefix):]}": array for name, array in old["arrays"].items()
                           if name.startswith(prefix)})
        out.append({"meta": {"format": STATE_FORMAT, "ledger": snapshot, "groups": groups_meta}, "arrays": arrays})
    return out
