"""Analyzer: communication. Per GPU, how much communication compute hides (by collective and
library); across ranks, collective matching and wait vs transfer.

A rank inside a collective is partly moving data and partly waiting for the last peer to
arrive. For each collective instance matched across ranks, ``wait = last arrival - own
arrival`` (capped at the rank's own end) and the rest is transfer. Waiting is a symptom: the
rank that arrives last (the straggler) is where the time is really lost, so each instance's
delay (last arrival minus the median arrival) is *blamed* on the last arriver (the
``stragglers`` analyzer reads the blame).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import pandas as pd

from .. import intervals as iv
from ..config import run_flags
from ..kernels import COLLECTIVE_TYPES, collective_name
from ..timeline import GpuTimeline, comm_kernels
from . import comm_groups, iterations, layout
from .gainmodel import Gain, gain, share_of
from .job import Job, evidence_row, mean_per_step_ms
from .pipeline_gains import PP_GAINS, pipelined
from .sets import WindowSets, clipped_set

EP_COLLECTIVES = ("all_to_all",)
DP_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
# exposed DP / TP / EP collectives above this share of the step are worth a fix
DP_EXPOSED_MIN = 0.02
COMM_WAIT_MIN = 0.05  # waiting for peers above this share of the step, with no straggler


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
    matched_instances: int = 0
    # the busiest EP member's compute over the members' mean between consecutive EP
    # collectives, summed per step (mean over the job's EP groups): work, not timing
    ep_work_imbalance_ms: float = 0.0
    # per GPU: (end, exposed transfer ns) of each EP and DP collective in its window, the
    # traffic a faster fabric speeds up (``fabric_bankable``)
    fabric_transfers: list = field(default_factory=list)
    # per GPU: of its exposed waiting, ns estimated for collectives whose peers are not in the
    # profile (``_lone_waits``): waiting for ranks nobody saw, for reasons nobody measured
    unseen_exposed_wait_ns: list = field(default_factory=list)


@dataclass
class CommResult:
    """One GPU's communication over its window, against its own compute (no peers needed)."""

    comm_ns: int = 0  # |M|
    exposed_comm_ns: int = 0  # |M - C|
    overlapped_comm_ns: int = 0  # |M & C|
    comm_by_type_ns: dict[str, int] = field(default_factory=dict)
    exposed_comm_by_type_ns: dict[str, int] = field(default_factory=dict)
    comm_libraries: dict[str, int] = field(default_factory=dict)  # kernels per library


def analyse(gpu: GpuTimeline, prof, sets: WindowSets) -> CommResult:
    C, M, comm = sets.compute, sets.comm, sets.comm_ops
    r = CommResult(comm_ns=iv.total(M), overlapped_comm_ns=iv.total(iv.intersect(M, C)))
    r.exposed_comm_ns = r.comm_ns - r.overlapped_comm_ns
    for ctype in COLLECTIVE_TYPES:
        sub = comm[comm["collective"] == ctype]
        if sub.empty:
            continue
        Mt = clipped_set(sub, sets.lo, sets.hi)
        r.comm_by_type_ns[ctype] = iv.total(Mt)
        r.exposed_comm_by_type_ns[ctype] = iv.total(iv.subtract(Mt, C))
    r.comm_libraries = {str(k): int(v) for k, v in comm.groupby("library", observed=True).size().items()}
    return r


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
    S = np.empty((n, len(seqs)), np.int64)
    E = np.empty((n, len(seqs)), np.int64)
    for j, (s, e) in enumerate(seqs):
        if len(s) == n:
            S[:, j], E[:, j] = s, e
        else:
            idx = np.clip(np.searchsorted(e, ref_end), 0, len(e) - 1)
            prev = np.clip(idx - 1, 0, len(e) - 1)
            idx = np.where(np.abs(e[prev] - ref_end) < np.abs(e[idx] - ref_end), prev, idx)
            S[:, j], E[:, j] = s[idx], e[idx]
    return S, E


def grouped_kernels(job: Job) -> list[pd.DataFrame]:
    """Each GPU's communication kernels with their ``group`` and ``group_source``
    (``comm_groups``); sets ``job.comm_members`` (group -> member lists)."""
    kernels = [comm_kernels(r.gpu).reset_index(drop=True) for r in job.records]
    ranks = [r.gpu.rank for r in job.records]
    # a GpuSummary carries its stretches; a whole GpuTimeline (keep_timelines, tests) has them found
    stretches = [r.gpu.boundary_gaps if hasattr(r.gpu, "boundary_gaps") else iterations.boundary_gaps(r.gpu)
                 for r in job.records]
    assigned = comm_groups.assign(kernels, ranks, job.layout, [r.iterations for r in job.records], stretches)
    out = []
    for k, (group, source, _) in zip(kernels, assigned):
        out.append(k.assign(group=group, group_source=source))
    job.members = [a[2] for a in assigned]
    job.comm_kernels = out
    return out


def analyse_ranks(job: Job) -> CommAnalysis:
    """Match collectives across the members of their group; sets each record's ``comm``
    (wait vs transfer). PP send/recv is not matched: its peers are other stages running a
    different schedule, and its waiting is the pipeline bubble (``pipeline_bubbles``)."""
    gpus = [r.gpu for r in job.records]
    kernels = grouped_kernels(job)
    ranks = [RankComm() for _ in gpus]
    for rec, rc in zip(job.records, ranks):
        rec.comm = rc
    ctx = (gpus, [g.compute for g in gpus], [r.iterations for r in job.records], ranks)
    rows, matched, imbalance = [], 0, 0.0
    fabric = [[] for _ in gpus]
    unseen = [0] * len(gpus)
    # the distinct (collective, group) pairs of each GPU first: a few, not one per kernel
    pairs = sorted({(str(c), str(g)) for k in kernels
                    for c, g in k[["collective", "group"]].drop_duplicates().itertuples(index=False, name=None)})
    for ctype, group in pairs:
        subs = [k[(k["collective"] == ctype) & (k["group"] == group)] for k in kernels]
        row = _new_row(ctype, group, subs, job.members)
        for members in _instances(group, ctype, job, len(gpus)):
            S, E = _match([(subs[j]["start"].to_numpy(), subs[j]["end"].to_numpy()) for j in members]) \
                if len(members) > 1 else _unmatched(subs[members[0]])
            matched += len(S) if len(members) > 1 else 0
            absent = _unseen_peers(job, members, group, ctype)
            _add_instances(row, ctype, S, E, members, ctx, fabric if _over_fabric(group, ctype) else None,
                           *((_waits_with_unseen(S, E, [subs[j] for j in members], absent), unseen)
                             if absent else ()))
            if group == "EP" and ctype in EP_COLLECTIVES:
                imbalance += work_imbalance_ms(S, E, members, ctx) * len(members) / len(gpus)
        rows.append({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    return CommAnalysis(ranks, rows, matched, imbalance,
                        [(np.concatenate([e for e, _ in f]), np.concatenate([t for _, t in f])) if f
                         else (np.zeros(0, np.int64), np.zeros(0, np.int64)) for f in fabric], unseen)


def missing(job: Job) -> list[str]:
    """The waiting a lone rank's collectives hold for ranks outside the profile (estimated)."""
    if not job.comm or not any(job.comm.unseen_exposed_wait_ns):
        return []
    per_step = float(np.mean([u / max(r.iterations, 1) for u, r in
                              zip(job.comm.unseen_exposed_wait_ns, job.records)])) / 1e6
    share = per_step / job.step_ms if job.step_ms else 0.0
    out = (f"ranks outside the profile: {per_step:.1f} ms/step ({100 * share:.0f}% of the step) of exposed "
           "collective time is taken as waiting for them, estimated from the profiled ranks' own kernel times "
           "(docs/comm.md); what made them late is not in this capture")
    if job.unseen_reading:
        out += f"; without that waiting the verdict would be {job.unseen_reading} (confidence at most 0.5)"
    return [out]


def _over_fabric(group: str, ctype: str) -> bool:
    """The collectives the fabric model prices: EP all-to-alls and DP reductions."""
    return (group == "EP" and ctype in EP_COLLECTIVES) or (group in ("DP", "EDP") and ctype in DP_COLLECTIVES)


def work_imbalance_ms(S: np.ndarray, E: np.ndarray, members: list[int], ctx) -> float:
    """Per step, the sum over the segments between consecutive matched instances (each rank
    from its end of one to its start of the next) of the busiest member's compute time minus
    the members' mean. Each instance is a sync point: all wait for the member with the most
    work since the last one, and equal work would bring the segment to the mean. Compute time,
    not arrival time: a late launch or a slow host shifts arrivals but not the work, so jitter
    stays out (balanced-routing runs measure 0.1-1 ms/step, docs/fixes.md)."""
    gpus, compute_sets, iterations, _ = ctx
    if S.shape[0] < 2 or len(members) < 2:
        return 0.0
    busy = np.stack([iv.measure_within(compute_sets[j], E[:-1, c], np.maximum(S[1:, c], E[:-1, c]))
                     for c, j in enumerate(members)], axis=1)
    lo, hi = max(gpus[j].window[0] for j in members), min(gpus[j].window[1] for j in members)
    inside = (S[:-1].min(axis=1) >= lo) & (S[1:].max(axis=1) < hi)
    its = float(np.mean([max(iterations[j], 1) for j in members]))
    return float((busy.max(axis=1) - busy.mean(axis=1))[inside].sum()) / its / 1e6


def _instances(group: str, ctype: str, job: Job, n: int) -> list[list[int]]:
    """Record indices of each instance of a group seen in this job (one list per instance);
    PP send/recv: each rank alone; no group or no layout: all ranks together."""
    if (group == "PP" and ctype == "all_to_all") or n < 2:
        return [[j] for j in range(n)]
    by_rank = {r.gpu.rank: j for j, r in enumerate(job.records)}
    seen, out = set(), []
    for j, members in enumerate(job.members):
        ranks = members.get(group)
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


def _unseen_peers(job: Job, members: list[int], group: str, ctype: str) -> int:
    """How many members of an instance's group the profile lacks (0: none, or PP send/recv,
    whose waiting is the pipeline bubble). A group of unknown members in a job bigger than
    the profile is taken to lack one rank (the least waiting)."""
    if group == "PP" and ctype == "all_to_all":
        return 0
    known = job.members[members[0]].get(group) if job.members else None
    if known:
        return max(len(known) - len(members), 0)
    world = job.layout.world if job.layout is not None else None
    return 1 if world and world > len(job.records) else 0


def _waits_with_unseen(S: np.ndarray, E: np.ndarray, subs: list[pd.DataFrame], absent: int) -> np.ndarray:
    """Waiting [instance, member] of an instance whose group has ``absent`` members outside
    the profile: the measured waiting for the members present, plus, of the rest of each
    kernel (after the last present member arrived), what ``_lone_waits`` takes as waiting
    for the absent ones (the present members arrive as one, so 1 + ``absent`` arrivals)."""
    if S.shape[1] == 1:
        return _lone_waits(subs[0], absent + 1)[:, None]
    measured = _measured_waits(S, E)
    # the k-th instance moves the same message on every member: the shortest sequence's rows
    # (one per matched instance, _match) give its size class
    ref = subs[int(np.argmin([len(x) for x in subs]))]
    out = measured.copy()
    for c in range(S.shape[1]):
        after = pd.DataFrame({"start": S[:, c] + measured[:, c], "end": E[:, c]})
        for col in ("stream", "name", "grid", "block"):
            if col in ref:
                after[col] = ref[col].to_numpy()[:len(after)]
        out[:, c] += _lone_waits(after, absent + 1)
    return out


def _measured_waits(S: np.ndarray, E: np.ndarray) -> np.ndarray:
    """Waiting [instance, member] for the last member present to arrive (``wait_r``, docs/comm.md)."""
    return np.clip(np.minimum(S.max(axis=1)[:, None], E) - S, 0, None)


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


def _add_instances(row: dict, ctype: str, S, E, members: list[int], ctx, fabric: list | None = None,
                   wait: np.ndarray | None = None, unseen: list | None = None) -> None:
    """One group instance's matched collectives: their ms per step (a mean over all GPUs of
    the job) into ``row``, wait/transfer/blame into each member's ``RankComm``; with
    ``fabric``, each member's (ends, exposed transfer) appended to its list there. ``wait``
    and ``unseen``: the waiting [instance, member] with the part for members outside the
    profile estimated (``_waits_with_unseen``), and the per-GPU list its exposed part is
    added to."""
    gpus, compute_sets, iterations, ranks = ctx
    if S.size == 0:
        return
    last = S.max(axis=1)
    wait = wait if unseen is not None else _measured_waits(S, E)
    blame_each = last - np.median(S, axis=1)
    who = S.argmax(axis=1)
    n = len(gpus)
    for col, j in enumerate(members):
        lo, hi = gpus[j].window
        inside = (S[:, col] >= lo) & (S[:, col] < hi)
        if not inside.any():
            continue
        s, e, w = S[inside, col], E[inside, col], wait[inside, col]
        # compute inside each collective and inside its waiting part, in one pass over the set
        covered, covered_wait = np.split(iv.measure_within(compute_sets[j], np.r_[s, s], np.r_[e, s + w]), 2)
        t = (e - s) - w
        exposed_wait = int((w - covered_wait).sum())
        exposed_each = (t - (covered - covered_wait)).clip(min=0)
        exposed_transfer = int(exposed_each.sum())
        if fabric is not None:
            fabric[j].append((e, exposed_each))
        rc = ranks[j]
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
        its = max(iterations[j], 1)
        row["instances"] = max(row["instances"], int(inside.sum()))
        row["transfer_ms_per_step"] += t.sum() / its / n / 1e6
        row["wait_ms_per_step"] += w.sum() / its / n / 1e6
        row["exposed_wait_ms_per_step"] += exposed_wait / its / n / 1e6
        row["exposed_transfer_ms_per_step"] += exposed_transfer / its / n / 1e6
        row["overlapped_ms_per_step"] += covered.sum() / its / n / 1e6
        # blame only instances inside this rank's window, counted once (by the blamed rank)
        rc.blame_ns += int(blame_each[inside & (who == col)].sum())


# ---------------------------------------------------------------------------------------------
# job level

# gain models (ms per step) from the job numbers; each constant's basis is in docs/fixes.md
BACKWARD_SHARE = 2.0 / 3.0  # backward ~ 2x the forward's FLOPs: 2/3 of a step's compute
NCCL_LAUNCH_MS = 0.02  # one collective's launch and proxy set-up (nccl-tests small-message latency)
NCCL_SM_SHARE = 32 / 132  # NCCL's default 32 channels (one SM each) of an H100/H200's 132 SMs
# a slow path's bandwidth over NVLink's: PCIe Gen5 x16 through host memory (~50 GB/s achieved,
# or an InfiniBand NDR port, 50 GB/s) vs H100/H200 NVLink 4 (450 GB/s per direction)
SLOW_OVER_NVLINK = 50.0 / 450.0


def _dp_overlap(n: dict) -> Gain:
    """Each layer's gradients reduce while the layers after them in backward compute: the
    reductions start once the first layer's backward is done (B/L) and the last-ready layer's
    (T/L) runs after backward, so exposed = max(T - B(L-1)/L, T/L) (L layers; unknown: no tail)."""
    t, backward, layers = n["exposed_dp_transfer_ms"], BACKWARD_SHARE * n["compute_ms"], n["num_layers"]
    tail, under = (t / layers, backward * (layers - 1) / layers) if layers else (0.0, backward)
    hideable = min(t - tail, under)
    est = hideable - n["dp_reductions_per_step"] * NCCL_LAUNCH_MS
    # range: overlap can cost (NCCL's SMs are taken from the backward it runs under), and the
    # reduction is a job-wide sync point, so overlap can also free rank skew paid in waits
    return gain("dp_overlap", est, -NCCL_SM_SHARE * hideable, n["exposed_dp_ms"] + n["comm_wait_ms"],
                n["exposed_dp_ms"],
                f"exposed DP transfer {t:.1f} less the last layer's {tail:.1f}, hideable under the backward "
                f"compute after the first layer's {under:.1f} ms/step, minus "
                f"{n['dp_reductions_per_step']:.0f} launches x {NCCL_LAUNCH_MS} ms")


def _fabric(n: dict) -> Gain:
    t = n["exposed_ep_ms"] + n["exposed_dp_transfer_ms"]
    if not n["slow_fabric"]:
        return gain("fabric_ratio", 0.0, 0.0, n["exposed_ep_ms"], n["exposed_ep_ms"],
                    "no slow path in evidence (NCCL_P2P_DISABLE not set): the traffic already takes NVLink")
    # the transfer falls to the bandwidth ratio; the step banks the share the hosts' waits allow
    # (low 0: in a host-bound step a faster transfer only lengthens the wait for the next launch)
    f = n.get("fabric_bankable", 1.0)
    return gain("fabric_ratio", t * (1 - SLOW_OVER_NVLINK) * f, 0.0, t, t,
                f"exposed transfer {t:.1f} ms/step x (1 - {SLOW_OVER_NVLINK:.2f} slow/NVLink bandwidth)"
                f" x {f:.2f} (the share the hosts' waits for the GPU let the step bank)")


GAINS = {
    # no measured DeepEP/NCCL ratio yet: the midpoint of [0, exposed all-to-all transfer]
    "exposed_ep_transfer": lambda n: share_of("exposed_ep_transfer", n["exposed_ep_ms"], 0.5, 0.0, 1.0,
                                              "exposed all-to-all transfer"),
    # EP overlap hides the all-to-all behind the other micro-batch's compute: the smaller of the two
    "ep_overlap": lambda n: share_of("ep_overlap", min(n["exposed_ep_ms"], n["compute_ms"]), 1.0, 0.5, 1.0,
                                     "exposed all-to-all transfer hideable under compute"),
    "dp_overlap": _dp_overlap,
    "exposed_tp": lambda n: None if n.get("exposed_tp_ms") is None else share_of(
        "exposed_tp", n["exposed_tp_ms"], 1.0, 0.5, 1.0, "exposed TP collectives"),
    # arrivals evened to the mean save the mean wait; jitter may not be removable (low 0)
    "rank_skew": lambda n: share_of("rank_skew", n["comm_wait_ms"], 1.0, 0.0, 1.0, "mean wait for peers"),
    "fabric_ratio": _fabric,
    **PP_GAINS,
}

def exposed_ms(job: Job, types: tuple[str, ...], transfer_only: bool) -> float:
    """Exposed time of these collectives, ms per step (transfer only: without peer waiting).

    Exposed time is the per-GPU half's (collective time compute does not hide); the matched
    half only says how much of it was waiting for peers (none for a lone rank, or one whose
    collectives matched none of its peers').
    """
    vals = []
    for rec in job.records:
        exposed = rec.analysis.communication.exposed_comm_by_type_ns
        v = sum(exposed.get(t, 0) for t in types)
        if transfer_only:
            v -= sum(rec.comm.by_type.get(t, {}).get("exposed_wait_ns", 0) for t in types)
        vals.append(max(v, 0) / rec.iterations)
    return float(np.mean(vals)) / 1e6 if vals else 0.0


def group_share(job: Job, groups: tuple[str, ...], types: tuple[str, ...]) -> float:
    """The share of these collectives' exposed time (matched rows) that belongs to ``groups``:
    per-type exposed time is measured per GPU, its group split from the ``collectives`` rows."""
    rows = [c for c in job.comm.collectives if c["collective"] in types]
    total = sum(c["exposed_transfer_ms_per_step"] + c["exposed_wait_ms_per_step"] for c in rows)
    if not total:
        return 1.0 if any(c["group"] in groups for c in rows) else 0.0
    return sum(c["exposed_transfer_ms_per_step"] + c["exposed_wait_ms_per_step"]
               for c in rows if c["group"] in groups) / total


def by_group(job: Job) -> dict[str, float]:
    """``walls.communication.by_group``: exposed ms per step of each group's collectives."""
    out: dict[str, float] = {}
    for c in job.comm.collectives:
        out[c["group"]] = out.get(c["group"], 0.0) + c["exposed_transfer_ms_per_step"] + c["exposed_wait_ms_per_step"]
    return {g: round(v, 3) for g, v in sorted(out.items())}


def numbers(job: Job) -> dict:
    comm_wait_ms = float(np.mean([r.comm.exposed_wait_ns / r.iterations for r in job.records])) / 1e6
    tp_types = DP_COLLECTIVES + ("broadcast", "reduce")
    dp_share = group_share(job, ("DP", "EDP"), DP_COLLECTIVES)
    dp_calls = sum(c["instances"] for c in job.comm.collectives
                   if c["collective"] in DP_COLLECTIVES and c["group"] in ("DP", "EDP"))
    slow = str(job.cfg.get("NCCL_P2P_DISABLE", {}).get("value", "")) == "1"
    flags = run_flags(job.cfg)
    layers = next((int(flags[f]) for f in ("--num-layers", "--layers") if str(flags.get(f, "")).isdigit()), None)
    ep_share = group_share(job, ("EP",), EP_COLLECTIVES)
    exposed_a2a, exposed_a2a_transfer = exposed_ms(job, EP_COLLECTIVES, False), exposed_ms(job, EP_COLLECTIVES, True)
    # PP send/recv is an all-to-all type too, with no waiting of its own (never matched): the
    # EP share of the exposed time, less all of the type's waiting (EP's), is EP's transfer
    exposed_ep = (exposed_a2a_transfer if ep_share == 1.0 else
                  max(exposed_a2a * ep_share - (exposed_a2a - exposed_a2a_transfer), 0.0))
    return dict(comm_wait_ms=comm_wait_ms,
                exposed_ep_ms=exposed_ep,
                # the ranks' wait for their EP peers inside the dispatcher's collectives
                ep_wait_ms=max(exposed_a2a * ep_share - exposed_ep, 0.0),
                ep_work_imbalance_ms=job.comm.ep_work_imbalance_ms,
                exposed_dp_ms=exposed_ms(job, DP_COLLECTIVES, False) * dp_share,
                exposed_dp_transfer_ms=exposed_ms(job, DP_COLLECTIVES, True) * dp_share,
                exposed_tp_ms=exposed_ms(job, tp_types, False) * group_share(job, ("TP", "ETP"), tp_types),
                dp_reductions_per_step=dp_calls / float(np.median([r.iterations for r in job.records])),
                slow_fabric=slow, num_layers=layers, fabric_bankable=fabric_bankable(job))


def fabric_bankable(job: Job) -> float:
    """The share of a faster fabric's saving the hosts let the step bank. Between two host
    waits for the GPU (``idle.host_waits``) the GPU's queue was filled by a host that then sat
    waiting: a saving in that segment lets the host's next work start earlier by at most the
    time it waited; beyond that the GPU just idles until the host catches up. Each EP and DP
    collective's exposed transfer counts in the segment of the first wait ending after it; those
    after the window's last wait (no sign of the host pacing them) count whole. Sum over GPUs
    of what is banked over the sum of the savings (1 where nothing is known)."""
    banked = total = 0.0
    for rec, (ends, saved) in zip(job.records, job.comm.fabric_transfers):
        wait_start, wait_end = getattr(rec.gpu, "host_waits", (np.zeros(0), np.zeros(0)))
        if not len(saved):
            continue
        seg = np.searchsorted(wait_end, ends)  # a collective ending by wait j's end is in segment j
        by_seg = np.bincount(seg, weights=saved.astype(float), minlength=len(wait_end) + 1)
        banked += float(np.minimum(by_seg[:-1], wait_end - wait_start).sum() + by_seg[-1])
        total += float(saved.sum())
    return banked / total if total else 1.0


def facts(job: Job, numbers: dict) -> dict:
    return dict(
        dp_comm_exposed=numbers["exposed_dp_ms"] >= DP_EXPOSED_MIN * job.step_ms,
        comm_wait_dominant=bool(not job.stragglers and numbers["comm_wait_ms"] > numbers["exposed_ep_ms"]
                                and numbers["comm_wait_ms"] >= COMM_WAIT_MIN * job.step_ms),
        tp_comm_exposed=numbers["exposed_tp_ms"] >= DP_EXPOSED_MIN * job.step_ms,
        # EP fixes need expert parallelism and all-to-all time that compute does not hide
        ep_comm_exposed=numbers["exposed_ep_ms"] >= DP_EXPOSED_MIN * job.step_ms,
        tp_within_node=layout.tp_within_node(job.layout) if getattr(job, "layout", None) else False,
        pp_bubble_known=pipelined(numbers))


def evidence(job: Job, numbers: dict) -> list[dict]:
    ev = [evidence_row("communication", "exposed communication",
                       mean_per_step_ms(job, lambda a: a.communication.exposed_comm_ns), "ms/step",
                       "communication not overlapped by compute"),
          evidence_row("communication", "overlapped communication",
                       mean_per_step_ms(job, lambda a: a.communication.overlapped_comm_ns), "ms/step",
                       "communication hidden under compute")]
    for c in job.comm.collectives:
        ev.append(evidence_row("communication", f"{collective_name(c['collective'], c['group'])} exposed transfer",
                               c["exposed_transfer_ms_per_step"], "ms/step",
                               f"{c['group']} group; wait {c['exposed_wait_ms_per_step']} ms/step"))
    return ev
