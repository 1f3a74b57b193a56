"""Which parallel group (TP, CP, EP, ETP, DP, EDP, PP or other) each NCCL kernel belongs to.

The evidence, strongest first:

1. *Cross-rank end times.* The kernels of one collective instance finish together on all its
   members (each waits for the last byte); kernels of the same type on ranks outside the group
   finish together only by chance. For each (rank, stream, collective) bucket of kernels, each
   candidate group scores the median over the bucket of the largest gap between a kernel's
   end and the nearest end of a same-type kernel on each other member; the smallest wins.
   Streams split the buckets because ProcessGroupNCCL runs each communicator on its own
   (pooled, so possibly shared) stream. A kernel of the bucket that ended with no member of
   the winning group (beyond ``END_TOL_NS``) but with every member of another candidate goes
   to that group: two communicators on one stream.
2. *The layout alone*, where only one candidate group has more than one member, or on a
   single rank (no peers): SendRecv is PP when EP = 1 and EP when PP = 1; with both, the
   stream carrying most SendRecv kernels per step is EP (one all-to-all per MoE layer and
   micro-batch against PP's few per micro-batch), a guess.
3. *Where in the step, on a single rank*, when both a per-layer group (TP, CP, ETP) and a
   per-step one (DP, EDP) could carry the collective: Megatron reduces gradients once per
   step, after the last micro-batch's backward, while the per-layer groups' collectives sit
   inside every forward and backward, among GEMMs. A kernel in the GEMM-free stretch before a
   step boundary (``iterations.boundary_gaps``: the optimizer phase) is the per-step group's,
   the rest the per-layer group's. Misread by this, and so labelled a guess: gradient
   reductions overlapped with backward (called per-layer), and the per-layer groups'
   collectives of that phase (``finalize_model_grads``' layernorm-gradient all-reduce under
   SP, the optimizer's gradient-norm all-reduce: called per-step).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..kernels import COLLECTIVE_GROUP
from .layout import Layout
from .layout_infer import END_TOL_NS, end_gap

# which groups each collective type can run on, when its size is over 1
CANDIDATES = {"all_to_all": ("EP", "PP"), "all_gather": ("TP", "CP", "DP", "EDP", "ETP", "EP"),
              "reduce_scatter": ("TP", "CP", "DP", "EDP", "ETP", "EP"),
              "all_reduce": ("TP", "DP", "CP", "EDP", "ETP", "EP", "PP"),
              # MoE token all-gather-v / reduce-scatter-v under TP run as NCCL broadcast / reduce
              "broadcast": ("TP", "ETP", "EP", "DP"), "reduce": ("TP", "ETP", "EP", "DP")}


def _candidates(ctype: str, groups: dict[str, list[int]], layout: Layout) -> list[str] | None:
    if not groups and (ctype != "all_to_all" or not any(layout.size(x) for x in ("pp", "ep"))):
        return None  # no membership: only SendRecv can be split, by the PP and EP sizes
    sizes = {g: len(m) for g, m in groups.items()} if groups else \
        {g: layout.size(g.lower()) for g in ("TP", "CP", "DP", "EDP", "ETP", "EP", "PP")}
    return [g for g in CANDIDATES.get(ctype, ()) if (sizes.get(g) or 1) > 1]


def _member_gap(ends: np.ndarray, members: list[int], me: int, ends_by_rank: dict, ctype: str) -> np.ndarray:
    """Per kernel, the largest distance to the nearest same-type end on each other member."""
    gaps = [end_gap(ends, ends_by_rank.get((m, ctype), np.empty(0))) for m in members if m != me]
    return np.max(gaps, axis=0) if gaps else np.full(len(ends), np.inf)


# the groups whose collectives run inside every layer and micro-batch, and those Megatron
# issues once per step (gradient reduction, parameter gather)
PER_LAYER_GROUPS = ("TP", "CP", "ETP")
PER_STEP_GROUPS = ("DP", "EDP")


def assign(kernels: list[pd.DataFrame], ranks: list[int], layout: Layout, iterations: list[int],
           boundary_gaps: list[tuple] | None = None) -> list[tuple]:
    """Per GPU, (group per kernel as an array, source per kernel, members per group).
    ``boundary_gaps``: per GPU, ``iterations.boundary_gaps`` (the one-rank rule, 3 above)."""
    ends_by_rank = {}
    for k, r in zip(kernels, ranks):
        for ctype, sub in k.groupby("collective", observed=True):
            ends_by_rank[(r, str(ctype))] = np.sort(sub["end"].to_numpy())
    multi = len(kernels) > 1
    out = []
    stretches_of = boundary_gaps or [None] * len(kernels)
    for k, r, its, stretches in zip(kernels, ranks, iterations, stretches_of):
        groups = layout.groups_of(r)
        group = np.full(len(k), "other", dtype=object)
        source = np.full(len(k), "no layout", dtype=object)
        # buckets by (stream, collective), as integer codes: no text key built per kernel
        coll_codes, colls = pd.factorize(k["collective"], use_na_sentinel=False)
        stream = k["stream"].to_numpy(np.int64) if "stream" in k else np.zeros(len(k), np.int64)
        buckets = pd.Series(np.arange(len(k))).groupby([stream, coll_codes]).indices if len(k) else {}
        for (_, code), idx in buckets.items():
            ctype = str(colls[code])
            cands = _candidates(ctype, groups, layout)
            g, src = _decide(k.iloc[idx], ctype, cands, groups, r, ends_by_rank, multi, k, layout, stretches)
            group[idx], source[idx] = g, src
        out.append((group, source, groups))
    return out


def _per_kernel(best: str, gaps: dict[str, np.ndarray]):
    """The bucket's group, except for kernels that did not finish with its members but did
    with another candidate's (a communicator sharing the stream: DP's gradient all-reduce
    among TP's, when both run on one stream)."""
    names = list(gaps)
    stack = np.vstack([gaps[g] for g in names])
    other = np.argmin(stack, axis=0)
    move = (gaps[best] > END_TOL_NS) & (stack[other, np.arange(stack.shape[1])] <= END_TOL_NS)
    if not move.any():
        return best
    out = np.full(stack.shape[1], best, dtype=object)
    out[move] = np.asarray(names, dtype=object)[other[move]]
    return out


def _by_step_position(bucket, cands: list[str], stretches) -> tuple | None:
    """The one-rank rule: per kernel, the first per-step candidate inside a step-boundary
    stretch, the first per-layer one elsewhere; None where it does not apply."""
    per_step = [g for g in cands if g in PER_STEP_GROUPS]
    others = [g for g in cands if g not in PER_STEP_GROUPS]
    if not (per_step and others and others[0] in PER_LAYER_GROUPS) or stretches is None or not len(stretches[0]):
        return None
    lo, hi = stretches
    starts = bucket["start"].to_numpy()
    i = np.searchsorted(lo, starts, side="right") - 1  # the stretch starting last at or before
    inside = (i >= 0) & (starts < hi[np.maximum(i, 0)])
    out = np.where(inside, per_step[0], others[0]).astype(object)
    return (out if 0 < inside.sum() < len(out) else out[0],
            f"one rank: {per_step[0]} in the optimizer phase, {others[0]} among the GEMMs (a guess)")


def _decide(bucket, ctype, cands, groups, rank, ends_by_rank, multi, all_k, layout,
            stretches=None) -> tuple[str, str]:
    if cands is None:  # no (complete) layout
        if ctype in layout.per_layer and not layout.moe_router:
            # issued inside every layer of a dense model: TP's, not a per-step gradient reduction
            return "TP", "per-layer collective (no layout: a guess)"
        return COLLECTIVE_GROUP.get(ctype, "other"), "collective type (no layout: a guess)"
    if not cands:
        return "other", "layout: no group of this collective has more than one rank"
    if len(cands) == 1:
        return cands[0], "layout"
    if multi and groups:
        ends = bucket["end"].to_numpy()
        gaps = {g: _member_gap(ends, groups[g], rank, ends_by_rank, ctype) for g in cands}
        scores = {g: float(np.median(v)) for g, v in gaps.items()}
        best = min(scores, key=scores.get)
        if np.isfinite(scores[best]):
            return _per_kernel(best, gaps), "cross-rank end times"
    by_position = _by_step_position(bucket, cands, stretches)
    if by_position is not None:
        return by_position
    if ctype == "all_to_all":  # a single rank with both PP and EP: the busier stream is EP
        per_stream = all_k[all_k["collective"] == ctype].groupby("stream").size()
        busiest = per_stream.idxmax() if len(per_stream) else None
        if "stream" in bucket and len(per_stream) > 1:
            return ("EP" if bucket["stream"].iloc[0] == busiest else "PP"), "stream kernel count (guess)"
        return "EP", "layout (guess: PP p2p and EP all-to-all share one stream)"
    return cands[0], "layout (guess: the first candidate group)"
