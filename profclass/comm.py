"""Multi-rank communication analysis: clock alignment, collective matching, wait vs transfer,
stragglers.

A rank inside a collective is partly moving data and partly waiting for the last peer to
arrive. For each collective instance matched across ranks, ``wait = last arrival - own
arrival`` (capped at the rank's own end) and the rest is transfer. Waiting is a symptom: the
rank that arrives last (the straggler) is where the time is really lost, so each instance's
delay (last arrival minus the median arrival) is *blamed* on the last arriver.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from . import intervals as iv
from .kernels import COLLECTIVE_GROUP
from .timeline import GpuTimeline

STRAGGLER_BLAME_SHARE = 0.5  # a straggler causes at least half of all blamed delay...
# ...costs at least this share of the step (corpus: balanced runs 5-10%, stragglers >= 22%)...
STRAGGLER_MIN_COST = 0.15
STRAGGLER_MIN_WAIT = 0.05  # ...and the others wait at least this share of the step for it


@dataclass
class RankComm:
    wait_ns: int = 0
    exposed_wait_ns: int = 0
    transfer_ns: int = 0
    exposed_transfer_ns: int = 0
    blame_ns: int = 0
    by_type: dict = field(default_factory=dict)  # type -> dict(wait_ns, transfer_ns, exposed_*)


@dataclass
class CommAnalysis:
    ranks: list[RankComm]
    collectives: list[dict]  # one row per collective type (job level, ms per step)
    stragglers: list[dict]  # gpu index, blame_ms_per_step, blame_share
    clock_skew_ns: dict[int, int]  # source -> residual skew after alignment
    matched_instances: int = 0


def align_clocks(gpus: list[GpuTimeline], session_start: dict[int, int | None]) -> dict[int, int]:
    """Shift separate reports onto the first one's clock; returns the residual skew per source.

    Coarse: each report's session start (UTC ns). Fine: collectives finish together on every
    rank, so the median difference of matched collective end times is the remaining offset.
    """
    sources = sorted({g.source for g in gpus})
    if len(sources) < 2:
        return {}
    ref = sources[0]
    starts = {s: session_start.get(s) for s in sources}
    for g in gpus:
        if starts.get(ref) is not None and starts.get(g.source) is not None:
            _shift(g, starts[g.source] - starts[ref])
    skew = {}
    ref_gpu = next(g for g in gpus if g.source == ref)
    for s in sources[1:]:
        mine = [g for g in gpus if g.source == s]
        diffs = _end_differences(ref_gpu, mine[0])
        if diffs.size:
            off = int(np.median(diffs))
            for g in mine:
                _shift(g, off)
            skew[s] = int(np.median(np.abs(diffs - off)))
        else:
            skew[s] = -1  # nothing to match on: session start only
    return skew


def _shift(g: GpuTimeline, off: int) -> None:
    if off == 0:
        return
    on_shift = getattr(g, "on_shift", None)  # a per-rank summary moves its window and sets too
    if on_shift is not None:
        on_shift(off)
    for df, cols in ((g.ops, ("start", "end")), (g.runtime, ("start", "end")), (g.nvtx, ("start", "end"))):
        for c in cols:
            df[c] = df[c] + off
    for c in ("launch_start", "launch_end"):
        g.ops[c] = np.where(g.ops[c] >= 0, g.ops[c] + off, -1)


def _comm_kernels(g: GpuTimeline) -> pd.DataFrame:
    o = g.ops
    return o[o["is_comm"] & (o["op"] == "kernel")]


def _end_differences(a: GpuTimeline, b: GpuTimeline) -> np.ndarray:
    ka, kb = _comm_kernels(a), _comm_kernels(b)
    out = []
    for ctype, ga in ka.groupby("collective", observed=True):
        gb = kb[kb["collective"] == ctype]
        ea, eb = ga["end"].to_numpy(), gb["end"].to_numpy()
        if len(ea) and len(ea) == len(eb):
            out.append(ea - eb)
    return np.concatenate(out) if out else np.empty(0, np.int64)


def _match(gpus: list[GpuTimeline], ctype: str) -> tuple[np.ndarray, np.ndarray]:
    """Start/end matrices [instance, gpu] of one collective type, matched by order.

    Every rank runs the same program, so the k-th collective of a type on one rank is the
    k-th on every other (per type). When counts differ (a capture that started mid-step),
    the sequences are aligned at their ends by nearest end time to the shortest one.
    """
    seqs = []
    for g in gpus:
        k = _comm_kernels(g)
        k = k[k["collective"] == ctype]
        seqs.append((k["start"].to_numpy(), k["end"].to_numpy()))
    n = min(len(s[0]) for s in seqs)
    if n == 0:
        return np.empty((0, len(gpus)), np.int64), np.empty((0, len(gpus)), np.int64)
    shortest = min(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    ref_end = seqs[shortest][1]
    S = np.empty((n, len(gpus)), np.int64)
    E = np.empty((n, len(gpus)), np.int64)
    for j, (s, e) in enumerate(seqs):
        if len(s) == n:
            S[:, j], E[:, j] = s, e
        else:
            idx = np.clip(np.searchsorted(e, ref_end), 0, len(e) - 1)
            prev = np.clip(idx - 1, 0, len(e) - 1)
            idx = np.where(np.abs(e[prev] - ref_end) < np.abs(e[idx] - ref_end), prev, idx)
            S[:, j], E[:, j] = s[idx], e[idx]
    return S, E


def analyse(gpus: list[GpuTimeline], compute_sets: list[iv.IntervalSet],
            iterations: list[int]) -> CommAnalysis:
    ranks = [RankComm() for _ in gpus]
    rows = []
    matched = 0
    if len(gpus) < 2:
        return CommAnalysis(ranks, _single_rows(gpus, compute_sets, iterations), [], {}, 0)
    types = sorted(set().union(*[set(_comm_kernels(g)["collective"]) for g in gpus]))
    for ctype in types:
        S, E = _match(gpus, ctype)
        if S.size == 0:
            continue
        last = S.max(axis=1)
        wait = np.clip(np.minimum(last[:, None], E) - S, 0, None)
        blame_each = last - np.median(S, axis=1)
        who = S.argmax(axis=1)
        row = dict(collective=ctype, group=COLLECTIVE_GROUP.get(ctype, "other"), instances=0,
                   transfer_ms_per_step=0.0, wait_ms_per_step=0.0, exposed_transfer_ms_per_step=0.0,
                   exposed_wait_ms_per_step=0.0, overlapped_ms_per_step=0.0)
        for j, g in enumerate(gpus):
            lo, hi = g.window
            inside = (S[:, j] >= lo) & (S[:, j] < hi)
            if not inside.any():
                continue
            s, e, w = S[inside, j], E[inside, j], wait[inside, j]
            covered = iv.measure_within(compute_sets[j], s, e)
            covered_wait = iv.measure_within(compute_sets[j], s, s + w)
            dur = e - s
            t = dur - w
            rc = ranks[j]
            rc.wait_ns += int(w.sum())
            rc.transfer_ns += int(t.sum())
            rc.exposed_wait_ns += int((w - covered_wait).sum())
            rc.exposed_transfer_ns += int((t - (covered - covered_wait)).clip(min=0).sum())
            rc.by_type[ctype] = dict(wait_ns=int(w.sum()), transfer_ns=int(t.sum()),
                                     exposed_wait_ns=int((w - covered_wait).sum()),
                                     exposed_transfer_ns=int((t - (covered - covered_wait)).clip(min=0).sum()))
            its = max(iterations[j], 1)
            n = len(gpus)
            row["instances"] = max(row["instances"], int(inside.sum()))
            row["transfer_ms_per_step"] += t.sum() / its / n / 1e6
            row["wait_ms_per_step"] += w.sum() / its / n / 1e6
            row["exposed_wait_ms_per_step"] += (w - covered_wait).sum() / its / n / 1e6
            row["exposed_transfer_ms_per_step"] += (t - (covered - covered_wait)).clip(min=0).sum() / its / n / 1e6
            row["overlapped_ms_per_step"] += covered.sum() / its / n / 1e6
            # blame only instances inside this rank's window, counted once (by the blamed rank)
            mine = inside & (who == j)
            rc.blame_ns += int(blame_each[mine].sum())
        matched += len(S)
        rows.append({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    stragglers = _stragglers(gpus, ranks, iterations)
    return CommAnalysis(ranks, rows, stragglers, {}, matched)


def _single_rows(gpus, compute_sets, iterations) -> list[dict]:
    """One rank: no peers to wait for, everything inside a collective counts as transfer."""
    rows = []
    for j, g in enumerate(gpus):
        k = _comm_kernels(g)
        lo, hi = g.window
        k = k[(k["start"] >= lo) & (k["start"] < hi)]
        for ctype, sub in k.groupby("collective", observed=True):
            s, e = sub["start"].to_numpy(), sub["end"].to_numpy()
            cov = iv.measure_within(compute_sets[j], s, e)
            its = max(iterations[j], 1)
            rows.append(dict(collective=ctype, group=COLLECTIVE_GROUP.get(ctype, "other"),
                             instances=len(sub), transfer_ms_per_step=round((e - s).sum() / its / 1e6, 3),
                             wait_ms_per_step=0.0,
                             exposed_transfer_ms_per_step=round(((e - s) - cov).sum() / its / 1e6, 3),
                             exposed_wait_ms_per_step=0.0,
                             overlapped_ms_per_step=round(cov.sum() / its / 1e6, 3)))
    return rows


def _stragglers(gpus, ranks: list[RankComm], iterations: list[int]) -> list[dict]:
    blame = np.array([r.blame_ns / max(it, 1) for r, it in zip(ranks, iterations)], dtype=float)
    total = blame.sum()
    if total <= 0:
        return []
    steps = np.array([g.window[1] - g.window[0] for g in gpus], float) / np.maximum(iterations, 1)
    out = []
    for j in np.argsort(-blame):
        share = blame[j] / total
        others = [k for k in range(len(gpus)) if k != j]
        waited = np.mean([ranks[k].exposed_wait_ns / max(iterations[k], 1) for k in others]) if others else 0
        step = np.median(steps)
        if (share >= STRAGGLER_BLAME_SHARE and blame[j] >= STRAGGLER_MIN_COST * step
                and waited >= STRAGGLER_MIN_WAIT * step):
            out.append(dict(gpu=int(j), blame_ms_per_step=round(blame[j] / 1e6, 3),
                            blame_share=round(float(share), 3),
                            others_wait_ms_per_step=round(float(waited) / 1e6, 3)))
    return out
