"""What capacity factor 1.0 costs a dropless MoE job in tokens, read from the capture: the trade
``moe_drop_and_pad`` makes for its static shapes.

Megatron-Core's capacity (``apply_router_token_dropping``) is ceil(tokens x top-k / experts x
factor) per expert, applied on each source rank to its own tokens: at factor 1.0 each expert keeps
the mean expert's load, and drops the rest. An expert's GEMM time in an experts' phase (between two
EP all-to-alls, ``collectives.expert_phase``) stands for its load, where the phase's GEMMs split
into the local experts (``_expert_work``); elsewhere each EP rank's total, whose experts together
keep the mean rank's load. With each GEMM costing a fixed part plus a part per token (its rows),
the work is more even than the tokens, and each source rank drops against its own capacity, which
the destination totals do not show: the share read is a lower bound of the tokens dropped. The
gradient accumulation beside the GEMMs is per weight and is left out; every phase weighs the same
(each routes one layer's micro-batch). No EP all-to-all (EP 1): nothing is claimed.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .collectives import expert_phase, segment_work
from .trace import COMPUTE

WHAT = "routed tokens dropped at capacity factor 1.0"


def dropped_tokens(traces, weights, ep_segments, op_groups) -> dict:
    """``{what, at_least_pct, basis}``: the share of the routed tokens capacity factor 1.0 would
    drop, at least (None where the trace holds no EP ranks to compare)."""
    segs = ep_segments or ()
    if len(traces) < 2 or not any(len(s) and s.max() >= 0 for s in segs):
        return _unmeasured()
    sels = [expert_phase(t, s, op_groups[gi] if op_groups and gi < len(op_groups) else None)
            & (t.ops.kind == COMPUTE) & (s >= 0) & t.ops.gemm for gi, (t, s) in enumerate(zip(traces, segs))]
    work = segment_work(traces, weights, segs, lambda gi, t, s: sels[gi])
    experts = [_expert_work(t, w, s, sel, gi) for gi, (t, w, s, sel) in enumerate(zip(traces, weights, segs, sels))]
    present = work > 0
    ranks = present.sum(axis=0)
    keep = ranks >= 2  # an experts' phase run by two ranks or more: their loads share one capacity
    if not keep.any():
        return _unmeasured()
    mean = work.sum(axis=0) / np.maximum(ranks, 1)
    share = np.where(present, np.clip(work - mean, 0, None), 0.0).sum(axis=0) / np.maximum(work.sum(axis=0), 1)
    by_expert, resolved = _expert_shares(pd.concat(experts), ranks)
    share[resolved] = by_expert[resolved]
    # every phase routes the same tokens (a layer's micro-batch): each weighs the same
    pct = round(100.0 * float(share[keep].mean()), 1)
    return {"what": WHAT, "at_least_pct": pct,
            "basis": (f"the expert GEMM work of each of {int(keep.sum())} experts' phases (between EP all-to-alls), "
                      f"per local expert in {int((resolved & keep).sum())} of them (two GEMMs an expert forward, four "
                      "backward), per EP rank in the rest: what the experts (ranks) compute above their mean over the "
                      "phase's whole, the phases' mean. Capacity 1.0 holds each to the mean load; a kernel's fixed "
                      "cost evens the work out more than the tokens, and each source rank's own capacity drops more "
                      "than the totals show: the tokens dropped are at least this (docs/fixes.md, 'What drop-and-pad "
                      "drops')")}


def _expert_work(t, w, seg: np.ndarray, sel: np.ndarray, gpu: int) -> pd.DataFrame:
    """(seg, gpu, expert, work) of one GPU's experts' phases whose GEMMs split into its local
    experts: a local expert runs its own two GEMMs forward (fc1, fc2) and four backward (each
    one's data and weight gradients), one expert after another (Megatron-Core's SequentialMLP).
    The forward count c is the even count of GEMMs a phase has whose double (the backward's) the
    GPU's phases have too, the most phases having either; other phases are left to the ranks'
    totals (a grouped GEMM's experts share one kernel: no phase splits)."""
    g = np.flatnonzero(sel)
    g = g[np.lexsort((t.ops.start[g], seg[g]))]
    sg = seg[g]
    _, first, counts = np.unique(sg, return_index=True, return_counts=True)
    sizes, seen = np.unique(counts, return_counts=True)
    fwd = (sizes % 2 == 0) & np.isin(2 * sizes, sizes)
    if not fwd.any():
        return pd.DataFrame({"seg": [], "gpu": [], "expert": [], "work": []})
    c = sizes[fwd][np.argmax(seen[fwd] + seen[np.searchsorted(sizes, 2 * sizes[fwd])])]
    per = np.repeat(np.select([counts == c, counts == 2 * c], [2, 4], 0), counts)
    rank = np.arange(len(g)) - np.repeat(first, counts)
    ok = per > 0
    return pd.DataFrame({"seg": sg[ok], "gpu": gpu, "expert": rank[ok] // per[ok], "work": w.op_dur[g][ok]})


def _expert_shares(df: pd.DataFrame, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per phase: the experts' share above their mean, and whether every rank that ran the phase
    split it into experts."""
    share, resolved = np.zeros(len(ranks)), np.zeros(len(ranks), bool)
    if df.empty:
        return share, resolved
    e = df.groupby(["seg", "gpu", "expert"], sort=False)["work"].sum().reset_index()
    seg = e["seg"].to_numpy(np.int64)
    mean = e.groupby("seg")["work"].transform("mean").to_numpy()
    over = np.bincount(seg, weights=np.clip(e["work"].to_numpy() - mean, 0, None), minlength=len(ranks))
    total = np.bincount(seg, weights=e["work"].to_numpy(), minlength=len(ranks))
    gpus = e.groupby("seg")["gpu"].nunique()
    resolved[gpus.index.to_numpy(np.int64)] = gpus.to_numpy() == ranks[gpus.index.to_numpy(np.int64)]
    return np.where(total > 0, over / np.maximum(total, 1), 0.0), resolved & (total > 0)


def _unmeasured() -> dict:
    return {"what": WHAT, "at_least_pct": None,
            "basis": "not measured: no experts' phase between EP all-to-alls on two ranks or more, so the ranks' "
                     "expert loads cannot be compared (check the router's token counts against the capacity)"}
