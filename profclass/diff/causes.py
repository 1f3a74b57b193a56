"""Charge a rise in waiting to its cause: the wall that grew on the rank(s) being waited for.

A rank that falls behind (a host stall, a slow GPU) shows up on the *other* ranks as time
inside collectives waiting for it: their communication wall grows while nothing moved more
data. Per rank, both sides, from each GPU's own walls (before the job-level straggler move)
and its exposed wait / exposed transfer:

- the waited-for ranks are those whose stall idle (GPU gaps of milliseconds: the host was
  away, ``idle.STALL_GAP_NS``) grew by at least 1% of the step, at least half the largest
  such rise: in a synchronous job every peer waits for a stalled rank. Without a new stall,
  those whose blame (time the others waited for them) grew most, at least half the largest
  rise;
- the cause is host for a stall; otherwise the non-communication wall that grew most on them
  *relative to their peers* (their rise minus the median rise of the others), so what grew
  on every rank alike (run-to-run drift) is not blamed on one;
- the rise of exposed wait on the other ranks moves from communication to that wall (for a
  stall at least the waiting it implies: stall x others / ranks, since launch jitter in the
  others' wait can hide the rise between two runs); the rise of exposed transfer stays
  communication.
"""
from __future__ import annotations

import numpy as np

from ..classify import WALLS

CAUSE_WALLS = ("compute", "host", "memory")
WAITED_FOR_SHARE = 0.5  # ranks within this share of the largest rise are waited for too
STALL_MIN_SHARE = 0.01  # a stall rise below 1% of the step is not resolved over a few steps


def _per_rank(d) -> dict[int, dict]:
    """rank -> ms per step of its walls, exposed wait, exposed transfer and blame."""
    out = {}
    for dv in d.devices:
        c, it = dv.get("comm"), max(dv["iterations"], 1)
        if not c or dv["rank"] is None:
            continue
        out[dv["rank"]] = {**{w: dv["walls"][w]["ms_per_step"] for w in WALLS},
                           "wait": c["exposed_wait_ns"] / it / 1e6, "transfer": c["exposed_transfer_ns"] / it / 1e6,
                           "blame": c["blame_ns"] / it / 1e6,
                           "stall": (dv["features"].get("idle_stall_ns") or 0) / it / 1e6}
    return out


def _waited_for(delta: dict[int, dict], step_ms: float) -> tuple[list[int], str]:
    """Ranks the others waited for and how they were found: a new stall, else the largest
    rise in blame."""
    for key, floor in (("stall", STALL_MIN_SHARE * step_ms), ("blame", 0.0)):
        top = max(v[key] for v in delta.values())
        if top > floor:
            return sorted(k for k, v in delta.items() if v[key] >= WAITED_FOR_SHARE * top), key
    return [], ""


def _cause_wall(delta: dict[int, dict], rank: int, found_by: str) -> tuple[str, float]:
    """The wall that grew on ``rank``: host for a stall (idle with the host away), else the
    one that grew most beyond its peers' median rise; and by how much."""
    peers = [k for k in delta if k != rank]
    excess = {w: delta[rank][w] - float(np.median([delta[k][w] for k in peers])) for w in CAUSE_WALLS}
    if found_by == "stall":
        return "host", delta[rank]["stall"]
    wall = max(excess, key=excess.get)
    return wall, excess[wall]


def attribute(b, c) -> dict | None:
    """The ``causes`` section of a diff; None when the runs' ranks cannot be matched (one GPU,
    different rank sets)."""
    rb, rc = _per_rank(b), _per_rank(c)
    if len(rb) < 2 or set(rb) != set(rc):
        return None
    delta = {k: {m: rc[k][m] - rb[k][m] for m in rb[k]} for k in rb}
    waited, found_by = _waited_for(delta, b.window["step_ms"]["mean"])
    others = [k for k in delta if k not in waited]
    n = len(delta)
    by_cause = {w: float(np.mean([v[w] for v in delta.values()])) for w in WALLS}
    rows, charged = [], None
    if waited and others:
        for k in waited:
            wall, grew = _cause_wall(delta, k, found_by)
            rows.append(dict(rank=k, wall=wall, found_by=found_by, wall_delta_ms=round(delta[k][wall], 3),
                             cause_ms=round(grew, 3), blame_delta_ms=round(delta[k]["blame"], 3),
                             stall_delta_ms=round(delta[k]["stall"], 3)))
        lead = max(rows, key=lambda r: r["cause_ms"])
        # the others' rise in waiting (job mean per step); for a stall at least what it
        # implies (every peer waits for it), as launch jitter in their wait can hide the rise
        moved = float(np.sum([max(delta[k]["wait"], 0.0) for k in others])) / n
        if found_by == "stall":
            moved = max(moved, lead["cause_ms"] * len(others) / n)
        if moved > 0 and lead["cause_ms"] > 0:
            by_cause["communication"] -= moved
            by_cause[lead["wall"]] += moved
            charged = dict(wall=lead["wall"], ranks=waited, ms_per_step=round(moved, 3))
    wait_d = float(np.mean([v["wait"] for v in delta.values()]))
    transfer_d = float(np.mean([v["transfer"] for v in delta.values()]))
    return dict(wait_delta_ms=round(wait_d, 3), transfer_delta_ms=round(transfer_d, 3), waited_for=rows,
                charged=charged, walls_delta_ms={w: round(v, 3) for w, v in by_cause.items()},
                summary=_summary(wait_d, transfer_d, rows, charged))


def _summary(wait_d: float, transfer_d: float, rows: list[dict], charged: dict | None) -> str:
    head = f"exposed wait {wait_d:+.1f} ms/step, exposed transfer {transfer_d:+.1f} ms/step"
    if not charged:
        return head + "; no rank's rise in blame to charge the waiting to"
    who = ", ".join(f"rank {r['rank']} (" + (f"stalled {r['stall_delta_ms']:+.1f} ms/step" if r["found_by"] == "stall"
                    else f"{r['wall']} {r['cause_ms']:+.1f} ms/step beyond its peers") + ")" for r in rows)
    return (f"{head}; the others waited for {who}: {charged['ms_per_step']:.1f} ms/step of waiting is "
            f"charged to {charged['wall']}")
