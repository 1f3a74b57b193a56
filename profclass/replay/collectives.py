"""Collectives matched across ranks inside the replay windows.

The communication analyzer named each NCCL kernel's group (TP, EP, DP, ...) and its members;
here the k-th kernel of a (group, collective) on each member's replay window is one instance
(every member runs the same program). Its transfer starts when the last member arrives, so
each member's waiting is an outcome of the replay, not an input. Not matched, and replayed
with their captured duration (their peers taken to move as this rank does): PP send/recv
(its peers run another stage's schedule; the pipeline's schedule model prices PP changes),
instances whose members' windows hold different counts, and ranks whose peers are not in
the profile (their waiting is the captured one: ``missing``).
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ..analyzers.layout_infer import MOE_ROUTER
from ..kernels import ATTENTION
from .engine import Instance
from .trace import COMM, GpuTrace

# members of one collective end within this of each other (NCCL's completion is one exchange;
# clock alignment leaves a few us of skew, docs/comm.md)
CO_TIMED_NS = 200_000


def match(traces: list[GpuTrace], comm_kernels: list[pd.DataFrame], members: list[dict],
          ranks: list) -> tuple[list[Instance], int, int]:
    """(instances, matched comm ops, comm ops replayed as captured)."""
    keyed = [_keyed(t, k) for t, k in zip(traces, comm_kernels)]
    by_rank = {r: j for j, r in enumerate(ranks) if r is not None}
    out, matched = [], 0
    total = sum(int((t.ops.kind == COMM).sum()) for t in traces)
    pairs = sorted({(g, c) for kd in keyed for g, c in zip(kd["group"], kd["collective"]) if g and g != "PP"})
    for group, ctype in pairs:
        seen = set()
        for j, mem in enumerate(members):
            ids = mem.get(group) if mem else None
            gpus = tuple(sorted(by_rank[m] for m in ids if m in by_rank)) if ids else tuple(range(len(traces)))
            if len(gpus) < 2 or gpus in seen or j not in gpus:
                continue
            seen.add(gpus)
            seqs = [keyed[gj]["op"][(keyed[gj]["group"] == group) & (keyed[gj]["collective"] == ctype)]
                    for gj in gpus]
            ops = _co_timed(traces, gpus, seqs)
            if ops is None:
                continue
            n = len(ops)
            gi = np.broadcast_to(np.array(gpus), ops.shape)
            starts = np.stack([traces[g].ops.start[ops[:, j]] + traces[g].shift_ns for j, g in enumerate(gpus)], axis=1)
            ends = np.stack([traces[g].ops.start[ops[:, j]] + traces[g].ops.dur[ops[:, j]] + traces[g].shift_ns
                             for j, g in enumerate(gpus)], axis=1)
            transfer = np.clip(ends - starts.max(axis=1, keepdims=True), 0, None)
            k = np.broadcast_to(np.arange(n)[:, None], ops.shape)
            out.append(Instance(gpu=gi.ravel().astype(np.int64), op=ops.ravel().astype(np.int64),
                                transfer=transfer.ravel().astype(np.int64), k=k.ravel().astype(np.int64),
                                group=group))
            matched += ops.size
    return out, matched, total - matched


def _keyed(t: GpuTrace, kernels: pd.DataFrame) -> dict:
    """The trace's comm ops with the group and collective the analyzer gave them (by start)."""
    ci = np.flatnonzero(t.ops.kind == COMM)
    if kernels is None or kernels.empty or not len(ci):
        return {"op": ci, "group": np.array([""] * len(ci), object), "collective": np.array([""] * len(ci), object)}
    ks = kernels["start"].to_numpy(np.int64)
    order = np.argsort(ks, kind="stable")
    s = t.ops.start[ci] + t.shift_ns
    pos = np.clip(np.searchsorted(ks[order], s), 0, len(ks) - 1)
    hit = ks[order][pos] == s
    row = order[pos]
    group = np.where(hit, kernels["group"].astype(str).to_numpy()[row], "")
    coll = np.where(hit, kernels["collective"].astype(str).to_numpy()[row], "")
    return {"op": ci, "group": group, "collective": coll}


def _co_timed(traces, gpus, seqs) -> np.ndarray | None:
    """[instance, member] op indices: each kernel of the member with the fewest matched to the
    kernel of every other member that ends nearest it (a collective completes on all members
    together), kept where all of them end within CO_TIMED_NS and no kernel is used twice.
    Window edges differ by a kernel or two between ranks, so counts alone would misalign."""
    if any(len(s) == 0 for s in seqs):
        return None
    ends = [traces[g].ops.start[s] + traces[g].ops.dur[s] + traces[g].shift_ns for g, s in zip(gpus, seqs)]
    ref = int(np.argmin([len(s) for s in seqs]))
    # a long collective (a slow path) ends less sharply together: half its time at most
    tol = np.maximum(CO_TIMED_NS, traces[gpus[ref]].ops.dur[seqs[ref]] // 2)
    cols, ok = [], np.ones(len(seqs[ref]), bool)
    for j, e in enumerate(ends):
        if j == ref:
            cols.append(np.arange(len(e)))
            continue
        i = np.clip(np.searchsorted(e, ends[ref]), 0, len(e) - 1)
        prev = np.clip(i - 1, 0, len(e) - 1)
        i = np.where(np.abs(e[prev] - ends[ref]) < np.abs(e[i] - ends[ref]), prev, i)
        ok &= np.abs(e[i] - ends[ref]) <= tol
        cols.append(i)
    idx = np.stack(cols, axis=1)[ok]
    for j in range(idx.shape[1]):  # one kernel, one instance
        _, first = np.unique(idx[:, j], return_index=True)
        keep = np.zeros(len(idx), bool)
        keep[first] = True
        idx = idx[keep]
    if not len(idx):
        return None
    return np.stack([s[idx[:, j]] for j, s in enumerate(seqs)], axis=1)


def segments(traces: list[GpuTrace], instances: list, group: str) -> list[np.ndarray]:
    """Per GPU, per op: which matched ``group`` collective instance last started before it
    (ids shared by the members: the k-th all-to-all on every EP rank is one), -1 before the
    first. What runs between two such collectives on every member is one phase of the step."""
    out = []
    offsets, base = [], 0
    for inst in instances:
        offsets.append(base)
        base += int(inst.k.max()) + 1 if len(inst.k) else 0
    for gi, t in enumerate(traces):
        starts, ids = [], []
        for inst, off in zip(instances, offsets):
            if inst.group != group:
                continue
            mine = inst.gpu == gi
            starts.append(t.ops.start[inst.op[mine]])
            ids.append(inst.k[mine] + off)
        if not starts:
            out.append(np.full(t.n_ops, -1, np.int64))
            continue
        s, i = np.concatenate(starts), np.concatenate(ids)
        order = np.argsort(s, kind="stable")
        pos = np.searchsorted(s[order], t.ops.start, side="right") - 1
        out.append(np.where(pos >= 0, i[order][np.clip(pos, 0, None)], -1))
    return out


# the kernels that mark a transformer layer's dense part: attention (fused, or its softmax) and
# the router's softmax; none runs between a MoE layer's dispatch and combine
DENSE_PART = re.compile(ATTENTION.pattern + r"|softmax", re.I)


def segment_work(traces, weights, segs, select) -> np.ndarray:
    """Per GPU (rows), per ``segments`` phase (columns): the time of the ops ``select(gi, t, seg)``
    picks in it, ns; no columns where no GPU has a phase."""
    n = max((int(s.max()) for s in segs if len(s)), default=-1) + 1
    work = np.zeros((len(traces), max(n, 0)))
    for gi, (t, w, s) in enumerate(zip(traces, weights, segs)):
        sel = select(gi, t, s) & (s >= 0)
        work[gi] = np.bincount(s[sel], weights=w.op_dur[sel], minlength=n)[:n]
    return work


def between_all_to_alls(seg: np.ndarray | None) -> bool:
    """Whether EP all-to-alls bound a GPU's experts' phase (``segments`` marks any op), else the
    phase is its stretches of varying GEMM shapes (``varying_stretches``)."""
    return seg is not None and bool(len(seg)) and bool((seg >= 0).any())


def expert_phase(t: GpuTrace, seg: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
    """Per op: inside a MoE layer's expert phase, where a dropless job's token counts change the
    shapes from step to step: an EP collective, or an op in a phase between EP all-to-alls
    (``segments``) that runs no ``DENSE_PART`` kernel (forward: dispatch, permute, experts,
    unpermute, combine; backward the same in reverse). Before the first all-to-all is dense.
    With no EP all-to-all (EP 1, or experts split by TP alone): ``varying_stretches``."""
    out = np.zeros(t.n_ops, bool)
    if t.ops.name is None:
        return out
    if not between_all_to_alls(seg):
        return varying_stretches(t)
    ids, at = np.unique(seg, return_inverse=True)
    dense = np.zeros(len(ids), bool)
    np.logical_or.at(dense, at, t.ops_named(DENSE_PART.search))
    out = ~dense[at] & (seg >= 0)
    if groups is not None:
        out |= (t.ops.kind == COMM) & (np.asarray(groups) == "EP")
    return out


def varying_stretches(t: GpuTrace) -> np.ndarray:
    """Per op: in a stretch of its stream between two ``DENSE_PART`` or router (``MOE_ROUTER``: the
    top-k opens the forward's experts' phase, whatever the router's score function) kernels whose
    GEMMs (kernel and CTAs, in order) no other stretch of the window repeats. A dense stretch
    recurs in every layer and micro-batch with the same shapes; a dropless MoE layer's expert GEMMs
    take the token counts' shapes, new each micro-batch. A stretch with no GEMM is not counted, nor
    any on a GPU that runs no router: a dense model's stretches have no expert to vary."""
    out = np.zeros(t.n_ops, bool)
    if t.ops.name is None or t.ops.grid is None or not t.ops_named(MOE_ROUTER.search).any():
        return out
    order = np.lexsort((t.ops.start, t.ops.stream))
    cuts = t.ops_named(lambda n: DENSE_PART.search(n) or MOE_ROUTER.search(n))
    cut = cuts[order]
    cut[1:] |= t.ops.stream[order][1:] != t.ops.stream[order][:-1]
    stretch = np.empty(t.n_ops, np.int64)
    stretch[order] = np.cumsum(cut)
    g = np.flatnonzero(t.ops.gemm & (t.ops.kind != COMM))
    if not len(g):
        return out
    g = g[np.lexsort((t.ops.start[g], stretch[g]))]
    st = stretch[g]
    first = np.r_[0, np.flatnonzero(st[1:] != st[:-1]) + 1]
    rank = np.arange(len(g)) - np.repeat(first, np.diff(np.r_[first, len(g)]))
    # each stretch's GEMM sequence hashed (wrapping 64-bit arithmetic: a collision only merges two stretches)
    code = (t.ops.name[g].astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15) \
        ^ t.ops.grid[g].astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
    mix = code * (np.uint64(0x100000001B3) ** rank.astype(np.uint64) | np.uint64(1))
    sig = np.add.reduceat(mix, first)
    _, at, counts = np.unique(sig, return_inverse=True, return_counts=True)
    once = st[first][counts[at] == 1]
    return np.isin(stretch, once) & ~cuts  # a cut is the dense part (or the router) itself
