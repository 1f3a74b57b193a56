"""The communication stage: collectives matched across ranks, wait vs transfer, blame.

A rank inside a collective is partly moving data and partly waiting for the last peer to
arrive. For each collective instance matched across ranks, ``wait = last arrival - own
arrival`` (capped at the rank's own end) and the rest is transfer. Waiting is a symptom: the
rank that arrives last (the straggler) is where the time is really lost, so each instance's
delay (last arrival minus the median arrival) is *blamed* on the last arriver (the
``stragglers`` analyzer reads the blame). The job-level numbers, facts and evidence of
communication are ``communication``'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .. import intervals as iv
from ..timeline import comm_kernels
from . import comm_groups, iterations
from .job import GpuRecord
from .layout import Layout
from .results import CommAnalysis, RankComm

EP_COLLECTIVES = ("all_to_all",)
DP_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class RankViews:
    """What matching reads of every GPU (by record index), and each one's ``RankComm`` that it
    sums into."""

    windows: list[tuple[int, int]]
    compute_sets: list  # each GPU's compute interval set (C)
    iterations: list[int]
    comms: list[RankComm]


def _match(seqs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Start/end matrices [instance, member] of one collective type on one group's members,
    matched by order.

    Every member runs the same program, so the k-th collective of a type on one member is the
    k-th on every other. When counts differ (a capture that started mid-step), the sequences
    are aligned at their ends by nearest end time to the shortest one.
    """
    n = min(len(s[0]) for s in seqs)
    if n == 0:
        return np.empty((0, len(seqs)), np.int64), np.empty((0, len(seqs)), np.int64)
    shortest = min(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    ref_end = seqs[shortest][1]
    starts = np.empty((n, len(seqs)), np.int64)
    ends = np.empty((n, len(seqs)), np.int64)
    for j, (s, e) in enumerate(seqs):
        if len(s) == n:
            starts[:, j], ends[:, j] = s, e
        else:
            idx = np.clip(np.searchsorted(e, ref_end), 0, len(e) - 1)
            prev = np.clip(idx - 1, 0, len(e) - 1)
            idx = np.where(np.abs(e[prev] - ref_end) < np.abs(e[idx] - ref_end), prev, idx)
            starts[:, j], ends[:, j] = s[idx], e[idx]
    return starts, ends

def grouped_kernels(records: list[GpuRecord], layout: Layout) -> tuple[list[pd.DataFrame], list[dict]]:
    """Each GPU's communication kernels with their ``group`` and ``group_source``, and its
    members per group (group -> member ranks), by ``comm_groups``."""
    kernels = [comm_kernels(r.gpu).reset_index(drop=True) for r in records]
    ranks = [r.gpu.rank for r in records]
    # a GpuSummary carries its stretches; a whole GpuTimeline (keep_timelines, tests) has them found
    stretches = [r.gpu.boundary_gaps if hasattr(r.gpu, "boundary_gaps") else iterations.boundary_gaps(r.gpu)
                 for r in records]
    assigned = comm_groups.assign(kernels, ranks, layout, [r.iterations for r in records], stretches)
    grouped = [k.assign(group=group, group_source=source) for k, (group, source, _) in zip(kernels, assigned)]
    return grouped, [a[2] for a in assigned]


def analyse_ranks(records: list[GpuRecord], layout: Layout) -> CommAnalysis:
    """Match collectives across the members of their group: each rank's wait vs transfer,
    one row per (collective, group). PP send/recv is not matched: its peers are other stages
    running a different schedule, and its waiting is the pipeline bubble (``pipeline_bubbles``)."""
    kernels, members = grouped_kernels(records, layout)
    n = len(records)
    views = RankViews(windows=[r.gpu.window for r in records], compute_sets=[r.gpu.compute for r in records],
                      iterations=[r.iterations for r in records], comms=[RankComm() for _ in records])
    rank_of = [r.gpu.rank for r in records]
    rows, matched, imbalance = [], 0, 0.0
    fabric = [[] for _ in records]
    unseen = [0] * n
    # the distinct (collective, group) pairs of each GPU first: a few, not one per kernel
    pairs = sorted({(str(c), str(g)) for k in kernels
                    for c, g in k[["collective", "group"]].drop_duplicates().itertuples(index=False, name=None)})
    for ctype, group in pairs:
        subs = [k[(k["collective"] == ctype) & (k["group"] == group)] for k in kernels]
        row = _new_row(ctype, group, subs, members)
        for present in _instances(group, ctype, rank_of, members):
            starts, ends = _match([(subs[j]["start"].to_numpy(), subs[j]["end"].to_numpy()) for j in present]) \
                if len(present) > 1 else _unmatched(subs[present[0]])
            matched += len(starts) if len(present) > 1 else 0
            absent = _unseen_peers(present, group, ctype, members, layout, n)
            _add_instances(row, ctype, starts, ends, present, views, fabric if _over_fabric(group, ctype) else None,
                           *((_waits_with_unseen(starts, ends, [subs[j] for j in present], absent), unseen)
                             if absent else ()))
            if group == "EP" and ctype in EP_COLLECTIVES:
                imbalance += work_imbalance_ms(starts, ends, present, views) * len(present) / n
        rows.append({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    fabric_transfers = tuple((np.concatenate([e for e, _ in f]), np.concatenate([t for _, t in f])) if f
                             else (np.zeros(0, np.int64), np.zeros(0, np.int64)) for f in fabric)
    return CommAnalysis(ranks=tuple(views.comms), collectives=rows, kernels=tuple(kernels), members=tuple(members),
                        matched_instances=matched, ep_work_imbalance_ms=imbalance,
                        fabric_transfers=fabric_transfers, unseen_exposed_wait_ns=tuple(unseen))


def _over_fabric(group: str, ctype: str) -> bool:
    """The collectives the fabric model prices: EP all-to-alls and DP reductions."""
    return (group == "EP" and ctype in EP_COLLECTIVES) or (group in ("DP", "EDP") and ctype in DP_COLLECTIVES)


def work_imbalance_ms(starts: np.ndarray, ends: np.ndarray, members: list[int], views: RankViews) -> float:
    """Per step, the sum over the segments between consecutive matched instances (each rank
    from its end of one to its start of the next) of the busiest member's compute time minus
    the members' mean. Each instance is a sync point: all wait for the member with the most
    work since the last one, and equal work would bring the segment to the mean. Compute time,
    not arrival time: a late launch or a slow host shifts arrivals but not the work, so jitter
    stays out (balanced-routing runs measure 0.1-1 ms/step, docs/fixes.md)."""
    if starts.shape[0] < 2 or len(members) < 2:
        return 0.0
    busy = np.stack([iv.measure_within(views.compute_sets[j], ends[:-1, c], np.maximum(starts[1:, c], ends[:-1, c]))
                     for c, j in enumerate(members)], axis=1)
    lo, hi = max(views.windows[j][0] for j in members), min(views.windows[j][1] for j in members)
    inside = (starts[:-1].min(axis=1) >= lo) & (starts[1:].max(axis=1) < hi)
    its = float(np.mean([max(views.iterations[j], 1) for j in members]))
    return float((busy.max(axis=1) - busy.mean(axis=1))[inside].sum()) / its / 1e6


def _instances(group: str, ctype: str, rank_of: list, members: list[dict]) -> list[list[int]]:
    """Record indices of each instance of a group seen in this job (one list per instance);
    PP send/recv: each rank alone; no group or no layout: all ranks together. ``rank_of``:
    each record's global rank; ``members``: each record's group -> member ranks."""
    n = len(rank_of)
    if (group == "PP" and ctype == "all_to_all") or n < 2:
        return [[j] for j in range(n)]
    by_rank = {rank: j for j, rank in enumerate(rank_of)}
    seen, out = set(), []
    for groups in members:
        ranks = groups.get(group)
        if not ranks:
            return [list(range(n))]
        idx = tuple(by_rank[m] for m in ranks if m in by_rank)
        if idx not in seen:
            seen.add(idx)
            out.append(list(idx))
    return out


def _unmatched(sub: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """One rank's kernels as a one-member match (its waiting, if any, from ``_lone_waits``)."""
    return sub["start"].to_numpy()[:, None], sub["end"].to_numpy()[:, None]


def _unseen_peers(present: list[int], group: str, ctype: str, members: list[dict], layout: Layout,
                  n_gpus: int) -> int:
    """How many members of an instance's group the profile lacks (0: none, or PP send/recv,
    whose waiting is the pipeline bubble). A group of unknown members in a job bigger than
    the profile is taken to lack one rank (the least waiting)."""
    if group == "PP" and ctype == "all_to_all":
        return 0
    known = members[present[0]].get(group) if members else None
    if known:
        return max(len(known) - len(present), 0)
    world = layout.world if layout is not None else None
    return 1 if world and world > n_gpus else 0


def _waits_with_unseen(starts: np.ndarray, ends: np.ndarray, subs: list[pd.DataFrame], absent: int) -> np.ndarray:
    """Waiting [instance, member] of an instance whose group has ``absent`` members outside
    the profile: the measured waiting for the members present, plus, of the rest of each
    kernel (after the last present member arrived), what ``_lone_waits`` takes as waiting
    for the absent ones (the present members arrive as one, so 1 + ``absent`` arrivals)."""
    if starts.shape[1] == 1:
        return _lone_waits(subs[0], absent + 1)[:, None]
    measured = _measured_waits(starts, ends)
    # the k-th instance moves the same message on every member: the shortest sequence's rows
    # (one per matched instance, _match) give its size class
    ref = subs[int(np.argmin([len(x) for x in subs]))]
    out = measured.copy()
    for c in range(starts.shape[1]):
        after = pd.DataFrame({"start": starts[:, c] + measured[:, c], "end": ends[:, c]})
        for col in ("stream", "name", "grid", "block"):
            if col in ref:
                after[col] = ref[col].to_numpy()[:len(after)]
        out[:, c] += _lone_waits(after, absent + 1)
    return out


def _measured_waits(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Waiting [instance, member] for the last member present to arrive (``wait_r``, docs/comm.md)."""
    return np.clip(np.minimum(starts.max(axis=1)[:, None], ends) - starts, 0, None)


def _lone_waits(sub: pd.DataFrame, size: int) -> np.ndarray:
    """Per kernel of a rank whose group peers are not in the profile, the part of its time
    taken as waiting for them.

    Of ``size`` members, the rank arrives last (and waits for nobody) in about 1/size of the
    instances; the middle of those, the 1/(2 size) quantile of the kernel times, is taken as
    the transfer and the rest of each kernel as waiting. The quantile is taken per size
    class: NCCL picks the kernel (protocol) and the channel count (grid) from the message
    size, so one (stream, name, grid, block) holds messages of one size. Where NCCL runs
    every message on the same few channels (a slow path), small and large messages share a
    class and the transfer is underestimated (docs/comm.md)."""
    d = (sub["end"] - sub["start"]).to_numpy(np.int64)
    wait = np.zeros(len(d), np.int64)
    keys = [sub[c].to_numpy() for c in ("stream", "name", "grid", "block") if c in sub]
    for idx in (pd.Series(np.arange(len(d))).groupby(keys).indices.values() if keys and len(d)
                else [np.arange(len(d))]):
        q = np.quantile(d[idx], 1.0 / (2 * size))
        wait[idx] = d[idx] - np.minimum(d[idx], int(q))
    return wait


def _new_row(ctype: str, group: str, subs: list[pd.DataFrame], members: list[dict]) -> dict:
    sources = pd.concat([s["group_source"] for s in subs]).value_counts()
    member_sets = sorted({tuple(m[group]) for m in members if m.get(group)})
    return dict(collective=ctype, group=group, group_source=str(sources.index[0]) if len(sources) else None,
                members=[list(m) for m in member_sets] or None, instances=0,
                transfer_ms_per_step=0.0, wait_ms_per_step=0.0, exposed_transfer_ms_per_step=0.0,
                exposed_wait_ms_per_step=0.0, overlapped_ms_per_step=0.0)


def _add_instances(row: dict, ctype: str, starts, ends, members: list[int], views: RankViews, fabric: list | None = None,
                   wait: np.ndarray | None = None, unseen: list | None = None) -> None:
    """One group instance's matched collectives: their ms per step (a mean over all GPUs of
    the job) into ``row``, wait/transfer/blame into each member's ``RankComm``; with
    ``fabric``, each member's (ends, exposed transfer) appended to its list there. ``wait``
    and ``unseen``: the waiting [instance, member] with the part for members outside the
    profile estimated (``_waits_with_unseen``), and the per-GPU list its exposed part is
    added to."""
    if starts.size == 0:
        return
    last = starts.max(axis=1)
    wait = wait if unseen is not None else _measured_waits(starts, ends)
    blame_each = last - np.median(starts, axis=1)
    who = starts.argmax(axis=1)
    n = len(views.windows)
    for col, j in enumerate(members):
        lo, hi = views.windows[j]
        inside = (starts[:, col] >= lo) & (starts[:, col] < hi)
        if not inside.any():
            continue
        s, e, w = starts[inside, col], ends[inside, col], wait[inside, col]
        # compute inside each collective and inside its waiting part, in one pass over the set
        covered, covered_wait = np.split(iv.measure_within(views.compute_sets[j], np.r_[s, s], np.r_[e, s + w]), 2)
        t = (e - s) - w
        exposed_wait = int((w - covered_wait).sum())
        exposed_each = (t - (covered - covered_wait)).clip(min=0)
        exposed_transfer = int(exposed_each.sum())
        if fabric is not None:
            fabric[j].append((e, exposed_each))
        rc = views.comms[j]
        rc.wait_ns += int(w.sum())
        rc.transfer_ns += int(t.sum())
        rc.exposed_wait_ns += exposed_wait
        if unseen is not None:
            unseen[j] += exposed_wait
        rc.exposed_transfer_ns += exposed_transfer
        prev = rc.by_type.get(ctype, dict(wait_ns=0, transfer_ns=0, exposed_wait_ns=0, exposed_transfer_ns=0))
        rc.by_type[ctype] = dict(wait_ns=prev["wait_ns"] + int(w.sum()), transfer_ns=prev["transfer_ns"] + int(t.sum()),
                                 exposed_wait_ns=prev["exposed_wait_ns"] + exposed_wait,
                                 exposed_transfer_ns=prev["exposed_transfer_ns"] + exposed_transfer)
        its = max(views.iterations[j], 1)
        row["instances"] = max(row["instances"], int(inside.sum()))
        row["transfer_ms_per_step"] += t.sum() / its / n / 1e6
        row["wait_ms_per_step"] += w.sum() / its / n / 1e6
        row["exposed_wait_ms_per_step"] += exposed_wait / its / n / 1e6
        row["exposed_transfer_ms_per_step"] += exposed_transfer / its / n / 1e6
        row["overlapped_ms_per_step"] += covered.sum() / its / n / 1e6
        # blame only instances inside this rank's window, counted once (by the blamed rank)
        rc.blame_ns += int(blame_each[inside & (who == col)].sum())
