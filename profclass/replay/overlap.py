"""The ``overlap`` transform: a collective moved to its own stream and started when its inputs
are ready (Megatron's --overlap-grad-reduce; assumptions and constants in docs/fixes.md,
"Replay transforms").

Without overlap, Megatron's DDP reduces each gradient buffer as one collective after the whole
forward-backward (its bucket size is unset), in the stream's order. With it, the buffer is cut
into buckets (``--ddp-bucket-size``, default max(40M, 1M x DP) parameters) that the backward
fills in reverse layer order; each bucket's reduction is launched on the communication stream
as soon as its last gradient is ready, and ``finish_grad_sync`` makes the optimizer wait for
all of them. Only the last micro-batch's backward fires the hooks (``no_sync`` holds the
others), in a pipeline too.

A captured reduction of time T (its matched transfer, else its duration) and B buckets: its
inputs are the compute ops of its GPU that ended before it started; their last W ns are the
last micro-batch's backward (W = BACKWARD_SHARE x the GPU's compute per step / micro-batches).
Bucket k is ready once the backward has run k/B of W (gradients produced evenly over it), and
the buckets reduce one after another, T/B each, so the reductions end at
max(r_1 + T, r_B + T/B) (r_1: the first bucket ready, r_B: the backward's end): the collective
starts at max(r_1, r_B - (1 - 1/B) T), for a matched collective and an unmatched one alike.
Each bucket past the first adds one collective's fixed cost (``NCCL_LAUNCH_MS``); a reduction
that followed another collective on its stream stays behind it. A reduction beside the backward
runs ``stretch`` times its captured transfer (NCCL's kernel shares HBM and SMs with the compute
beside it). Compute
kernels running while a moved reduction runs lose the SMs NCCL's kernel holds: the time they
overlap it (measured by a first replay) grows by each kernel's own factor (``wave_slowdown``: a
one-wave grid that no longer fits the SMs left runs a second wave), and the step is replayed
again.

With the distributed optimizer the parameters are all-gathered after the optimizer step, one
collective of time T before the next forward. --overlap-param-gather cuts it into the same B
buckets: the first forward pre-hook dispatches bucket 1 and waits for it; each bucket's wait, once
done, dispatches the next, which runs beside the forward of the layers just gathered (the first
micro-batch's forward, F = (1 - BACKWARD_SHARE) x the GPU's compute per step / micro-batches, F/B a
bucket). So the forward waits tau = stretch x T / B for bucket 1 and max(0, tau - F/B) for each
other, and the compute beside the hidden min(tau, F/B) slows by its waves: the gather keeps its
place and costs that (``_gathered``). With --overlap-grad-reduce alone the capture gathers n
buckets a step already (one after another, after the optimizer step): then there are max(B, n)
buckets, and the step's first gather alone is waited for whole (``reduce = 0``:
``dp_overlap_param_gather``, the reductions overlapped as captured).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import intervals as iv
from ..analyzers.communication import BACKWARD_SHARE, NCCL_LAUNCH_MS, param_gathers_in
from .scenario import stream_neighbours
from .trace import COMM, COMPUTE, GpuTrace

MOVABLE_GROUPS = ("DP", "EDP")  # the gradient reductions' groups
MOVABLE_COLLECTIVES = ("all_reduce", "reduce_scatter")
PARAM_GATHER = "all_gather"  # the distributed optimizer's parameter all-gather, in the same groups


def movable(t: GpuTrace, groups: np.ndarray, colls: np.ndarray) -> np.ndarray:
    """The ops the graph lets a scenario detach: the data-parallel gradient reductions."""
    if not len(groups):
        return np.zeros(t.n_ops, bool)
    return (t.ops.kind == COMM) & np.isin(groups, MOVABLE_GROUPS) & np.isin(colls, MOVABLE_COLLECTIVES)


def apply(spec: dict, pick, point: str, traces, weights, ctx):
    """Every GPU's weights with its gradient reductions overlapped; None without any."""
    buckets = max(pick(spec["buckets"], point), 1.0)
    slowdown = pick(spec["slowdown"], point)  # where a kernel's grid or the GPU's SM count is unknown
    taken = pick(spec.get("nccl_sms", -1), point)  # SMs NCCL's kernel holds; -1: the captured kernel's CTAs
    least = pick(spec.get("least", 1.0), point)  # the least any kernel under a reduction slows
    stretch = pick(spec.get("stretch", 1.0), point)  # a reduction's transfer beside compute over alone
    names = spec["ops"].split(":", 1)[1].split(",")
    if not ctx.detachable:  # a graph built without detachable ops: nothing can move
        return None
    param_gather = pick(spec.get("param_gather", 0), point)
    reduce = pick(spec.get("reduce", 1), point)  # 0: the reductions stay as captured (overlapped already)
    out, moved, gathered = [], [], False
    for gi, (t, w) in enumerate(zip(traces, weights)):
        sel = ctx.detachable[gi] & np.isin(ctx.op_groups[gi], names) & bool(reduce)
        w2, det = _overlapped(t, w, sel, buckets, ctx.microbatches, ctx.transfer[gi], stretch)
        if param_gather and gi < len(ctx.op_colls):
            gather = (t.ops.kind == COMM) & np.isin(ctx.op_groups[gi], names) & (ctx.op_colls[gi] == PARAM_GATHER)
            gather &= param_gathers_in(ctx.op_colls[gi], ctx.op_groups[gi], names)
            if gather.any():
                w2 = _gathered(t, w2, gather, (buckets, stretch, taken, least, slowdown), ctx.microbatches,
                               ctx.transfer[gi])
                gathered = True
        out.append(w2)
        moved.append(det)
    if not any(m.any() for m in moved):
        return out if gathered else None
    if slowdown <= 1.0 and taken == 0 and least <= 1.0:
        return out
    return _contended(traces, out, moved, (slowdown, taken, least), ctx)


def _overlapped(t: GpuTrace, w, sel: np.ndarray, buckets: float, microbatches, transfer: np.ndarray,
                stretch: float = 1.0):
    """(weights, detached ops) of one GPU: each selected reduction detached from its stream,
    launch and event waits, and held by its readiness edges instead."""
    comp = np.flatnonzero(t.ops.kind == COMPUTE)
    c = np.flatnonzero(sel)
    if not len(comp) or not len(c):
        return w, np.zeros(t.n_ops, bool)
    cend = t.ops.start[comp] + t.ops.dur[comp]
    order = np.argsort(cend, kind="stable")
    comp, cend = comp[order], cend[order]
    cum = np.cumsum(w.op_dur[comp])
    window = BACKWARD_SHARE * float(cum[-1]) / max(t.iterations, 1) / max(microbatches or 1, 1)
    k = np.searchsorted(cend, t.ops.start[c], side="right") - 1  # the last input ended before it
    matched = transfer[c] > 0
    base = np.where(matched, transfer[c] * w.transfer_scale[c], w.op_dur[c]).astype(np.int64)
    own = (base * stretch).astype(np.int64)
    extra = int(round((buckets - 1) * NCCL_LAUNCH_MS * 1e6))  # one collective's fixed cost per extra bucket
    share = np.ones(t.n_ops)  # the new time over the old of each reduction
    share[c] = (own + extra) / np.maximum(base, 1)
    # a reduction whose backward lies before the window (the window opens with it) started right
    # after its backward: overlapped, it starts (1 - 1/B) min(T, W) before that
    lead = k < 0
    ahead = w.ahead.copy()
    ahead[c[lead]] = ((1 - 1 / buckets) * np.minimum(own[lead], window)).astype(np.int64)
    keep = ~lead
    c, k, T = c[keep], k[keep], own[keep] + extra
    k1 = np.minimum(np.searchsorted(cum, cum[k] - window * (1 - 1 / buckets), side="left"), k)
    gap = w.stream_gap[c]
    prev = stream_neighbours(t)[0][c]
    # a reduction that followed another collective on its stream stays behind it (a
    # communication stream runs its collectives in order); one that followed compute leaves it
    chained = (prev >= 0) & (t.ops.kind[np.clip(prev, 0, None)] == COMM)
    src = np.concatenate([comp[k1], comp[k], prev[chained]])
    dst = np.concatenate([c, c, c[chained]])
    lag = np.concatenate([gap, gap - (T * (1 - 1 / buckets)).astype(np.int64), gap[chained]])
    detached = w.detached.copy()
    detached[c] = True
    detached[np.flatnonzero(sel)[lead]] = True
    is_m = transfer > 0
    return replace(w, transfer_scale=np.where(sel & is_m, w.transfer_scale * share, w.transfer_scale),
                   op_dur=np.where(sel & ~is_m, (w.op_dur * share).astype(np.int64), w.op_dur),
                   detached=detached, ahead=ahead, ready_src=np.concatenate([w.ready_src, src]),
                   ready_dst=np.concatenate([w.ready_dst, dst]), ready_lag=np.concatenate([w.ready_lag, lag])), detached


def _gathered(t: GpuTrace, w, sel: np.ndarray, params: tuple, microbatches, transfer: np.ndarray):
    """One GPU's weights with each selected parameter all-gather bucketed under the next forward:
    its time becomes what the forward waits for plus what the compute beside it loses (module
    docstring). ``params``: buckets, stretch, the SMs NCCL holds (< 0: the gather's own CTAs),
    the least slowdown, the fallback slowdown."""
    buckets, stretch, taken, least, fallback = params
    comp = t.ops.kind == COMPUTE
    if not comp.any():
        return w
    c = np.flatnonzero(sel)
    matched = transfer[c] > 0
    time_ = np.where(matched, transfer[c] * w.transfer_scale[c], w.op_dur[c]).astype(np.float64)
    # a capture with --overlap-grad-reduce gathers bucket by bucket already (n a step): each of its
    # gathers splits into buckets / n more, and only the step's first waits whole
    n = max(int(round(len(c) / max(t.iterations, 1))), 1)
    split = max(buckets / n, 1.0)
    first = np.zeros(len(c), bool)
    first[np.argsort(t.ops.start[c], kind="stable")[::n]] = True
    per_bucket = stretch * time_ / split + NCCL_LAUNCH_MS * 1e6
    fwd = (1.0 - BACKWARD_SHARE) * float(w.op_dur[comp].sum()) / max(t.iterations, 1) / max(microbatches or 1, 1)
    slice_ = fwd / (split * n)  # the forward of one bucket's layers
    f = _compute_slowdown(t, sel, taken, fallback, least)
    mean_f = float(np.average(f, weights=np.maximum(w.op_dur[comp], 1)))  # over the GPU's compute time
    after = per_bucket * first + (split - first) * (np.maximum(per_bucket - slice_, 0.0)
                                                    + np.minimum(per_bucket, slice_) * (mean_f - 1.0))
    share = np.ones(t.n_ops)
    share[c] = after / np.maximum(time_, 1.0)
    is_m = transfer > 0
    return replace(w, transfer_scale=np.where(sel & is_m, w.transfer_scale * share, w.transfer_scale),
                   op_dur=np.where(sel & ~is_m, np.rint(w.op_dur * share).astype(np.int64), w.op_dur))


def wave_slowdown(grid: np.ndarray | None, sms: int, taken: float, fallback: float) -> np.ndarray | float:
    """Per op, how many times longer a kernel of ``grid`` CTAs runs while NCCL's kernel holds
    ``taken`` of the GPU's ``sms`` SMs. A grid of at most one wave (cuBLAS's persistent Hopper
    GEMMs launch one CTA per SM) that no longer fits the SMs left runs a second wave, twice as
    long; one that still fits is not slowed; a larger grid runs its waves on the SMs left, sms /
    (sms - taken). ``fallback`` where the grid or the SM count is unknown. Measured on the two
    committed overlapped DP twins (132 SMs; tests/test_replay_overlap.py, docs/fixes.md): 132-CTA
    GEMMs under a reduction 1.93x (24-CTA all-reduces) and 1.90x (4-CTA ones) their time beside
    none; many-wave kernels 1.03x beside the 4-CTA kernels, as the rule says, and 1.51x beside the
    24-CTA ones, more than its 1.22 (the transform's ``least`` covers that at the low point)."""
    if grid is None or sms <= 0:
        return fallback
    left = max(sms - taken, 1.0)
    f = np.where(grid <= sms, np.where(grid > left, 2.0, 1.0), sms / left)
    return np.where(grid > 0, f, fallback)


def _compute_slowdown(t: GpuTrace, nccl: np.ndarray, taken: float, fallback: float, least: float) -> np.ndarray:
    """Per compute op of ``t``, in order, its ``wave_slowdown`` beside the NCCL kernels ``nccl``
    (a mask), at least ``least``; ``taken`` < 0: those kernels hold as many SMs as the most CTAs
    any of them launched."""
    n = taken if taken >= 0 or t.ops.grid is None else float(t.ops.grid[nccl].max(initial=0))
    f = np.broadcast_to(wave_slowdown(t.ops.grid, t.sm_count, n, fallback), (t.n_ops,))
    return np.maximum(f[t.ops.kind == COMPUTE], least)


def _contended(traces, weights, moved, factors: tuple, ctx):
    """The compute time that runs under a moved reduction (and did not in the capture) grows by
    its kernel's ``wave_slowdown``, at least ``least`` (``factors``: the fallback slowdown, the
    SMs NCCL holds, < 0: as many as the moved kernels' CTAs, the most of them, and ``least``):
    replayed once to find it, then the weights with it."""
    slowdown, taken, least = factors
    out = ctx.replay(weights)
    g = ctx.graph
    res = []
    for gi, (t, w, mv) in enumerate(zip(traces, weights, moved)):
        if not mv.any():
            res.append(w)
            continue
        s = out.t[g.op_node[gi]]
        en = g.end_node[gi]
        e = np.where(en >= 0, out.t[np.clip(en, 0, None)], s + w.op_dur)
        c = np.flatnonzero(mv)
        comp = t.ops.kind == COMPUTE
        now = iv.measure_within(iv.union(s[c], e[c]), s[comp], s[comp] + w.op_dur[comp])
        cap_end = t.ops.start + t.ops.dur
        before = iv.measure_within(iv.union(t.ops.start[c], cap_end[c]), t.ops.start[comp], cap_end[comp])
        factor = _compute_slowdown(t, mv, taken, slowdown, least)
        dur = w.op_dur.copy()
        dur[comp] += ((factor - 1.0) * np.clip(now - before, 0, None)).astype(np.int64)
        res.append(replace(w, op_dur=dur))
    return res
