"""The ``tp_overlap`` transform: each tensor-parallel collective pipelined with the GEMM beside it
(Megatron's --tp-comm-overlap through Transformer Engine's userbuffers; assumptions and constants
in docs/fixes.md, "Replay transforms").

With sequence parallelism a layer's column-parallel GEMM waits for an all-gather of its input,
and its row-parallel GEMM's output is reduce-scattered. The overlap splits both into n chunks
(n = the TP size): the ring exchange moves one chunk while the GEMM runs on the chunk that
arrived (the reduce-scatter the other way round). A collective of transfer c beside a GEMM of g
then takes c + g - min(c, g (n - 1) / n) together: each of the n - 1 exchange steps hides
behind a 1/n slice of the GEMM. The transform shortens each matched TP collective's transfer by
that much; the GEMMs it pipelines with run slower by ``slowdown`` (the reduce-scatter's
reduction takes SMs from them). Without sequence parallelism (an all-reduce after the row
GEMM), Megatron turns the overlap on only with sequence parallelism, which splits the all-reduce
into a reduce-scatter after that GEMM and an all-gather before the next column GEMM, half its
bytes each.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .trace import COMM, COMPUTE

TP_GROUPS = ("TP", "ETP")
# a collective's GEMM is the nearest one on its stream within this many ops, no collective between
# (the bias, layout and norm kernels Megatron runs between them are a few)
NEIGHBOUR_OPS = 4


def _nearest_gemms(t) -> tuple[np.ndarray, np.ndarray]:
    """Per op: the nearest GEMM on its stream after it and before it, within NEIGHBOUR_OPS ops
    and with no collective between; -1 where there is none."""
    order = np.lexsort((t.ops.start, t.ops.stream))  # ops by stream, then time
    pos = np.empty(t.n_ops, np.int64)
    pos[order] = np.arange(t.n_ops)
    return _nearest_gemm(t, order, pos, +1), _nearest_gemm(t, order, pos, -1)


def _nearest_gemm(t, order: np.ndarray, pos: np.ndarray, step: int) -> np.ndarray:
    found = np.full(t.n_ops, -1, np.int64)
    blocked = np.zeros(t.n_ops, bool)
    for k in range(1, NEIGHBOUR_OPS + 1):
        p = pos + step * k
        ok = (p >= 0) & (p < t.n_ops) & (found < 0) & ~blocked
        cand = np.where(ok, order[np.clip(p, 0, t.n_ops - 1)], 0)
        ok &= t.ops.stream[cand] == t.ops.stream
        gemm = ok & t.ops.gemm[cand] & (t.ops.kind[cand] == COMPUTE)
        found[gemm] = cand[gemm]
        blocked |= ok & (t.ops.kind[cand] == COMM)
    return found


def apply(spec, pick, point, traces, weights, ctx):
    slowdown = pick(spec["slowdown"], point)
    out, hit = [], False
    for gi, (t, w, groups, colls, x) in enumerate(zip(traces, weights, ctx.op_groups, ctx.op_colls, ctx.transfer)):
        sel = (t.ops.kind == COMM) & np.isin(groups, TP_GROUPS) & (x > 0)
        n = len(ctx.members[gi].get("TP", ())) if ctx.members else 0
        if not sel.any() or n < 2:
            out.append(w)
            continue
        hit = True
        cur = x * w.transfer_scale  # the transfer as the weights hold it (earlier fixes applied)
        gather = sel & (colls == "all_gather")
        scatter = sel & (colls == "reduce_scatter")
        allred = sel & (colls == "all_reduce")
        after, before = _nearest_gemms(t)
        dur = w.op_dur.astype(np.float64)
        hide = (n - 1) / n

        def hidden(part, gemm):
            g = np.where(gemm >= 0, dur[np.maximum(gemm, 0)], 0.0)
            return np.minimum(part, g * hide)

        # what hides behind the GEMM after the collective (an all-gather feeds it) and before it
        # (a reduce-scatter drains it); an all-reduce is half of each
        s_after, s_before = np.zeros(t.n_ops), np.zeros(t.n_ops)
        s_after[gather] = hidden(cur[gather], after[gather])
        s_after[allred] = hidden(cur[allred] / 2, after[allred])
        s_before[scatter] = hidden(cur[scatter], before[scatter])
        s_before[allred] = hidden(cur[allred] / 2, before[allred])
        saved = s_after + s_before
        scale = np.where(sel, np.maximum(cur - saved, 0) / np.maximum(x, 1), w.transfer_scale)
        used = np.unique(np.concatenate([after[s_after > 0], before[s_before > 0]]))
        op_dur = w.op_dur.copy()
        op_dur[used] = (op_dur[used] * slowdown).astype(np.int64)
        out.append(replace(w, transfer_scale=scale, op_dur=op_dur))
    return out if hit else None
