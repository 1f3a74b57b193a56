"""What capacity factor 1.0 costs a dropless MoE job in tokens, read from the capture: the trade
``moe_drop_and_pad`` makes for its static shapes.

Megatron-Core's capacity (``apply_router_token_dropping``) is ceil(tokens x top-k / experts x
factor) per expert, applied on each source rank to its own tokens; at factor 1.0 an EP rank's
experts together take the mean rank's load, and whatever a rank receives beyond it is dropped
(more, where the experts inside a rank or the source ranks are uneven too). A rank's expert work
between two EP all-to-alls (``collectives.expert_phase``) stands for its load: with each kernel
costing a fixed part plus a part per token, the work is more even than the tokens, so the share
read from it is a lower bound of the tokens dropped. Only the phase's GEMMs count (their rows are
its tokens; the gradient accumulation beside them is per weight), and every phase weighs the same
(each routes one layer's micro-batch). No EP all-to-all (EP 1): the ranks' loads
are not on the timeline, and nothing is claimed.
"""
from __future__ import annotations

import numpy as np

from .collectives import expert_phase
from ..kernels import GEMM
from .trace import COMPUTE

WHAT = "routed tokens dropped at capacity factor 1.0"


def dropped_tokens(traces, weights, ep_segments, op_groups) -> dict:
    """``{what, at_least_pct, basis}``: the share of the routed tokens the busier EP ranks would
    drop at capacity factor 1.0, at least (None where the trace holds no EP ranks to compare)."""
    segs = ep_segments or ()
    n = max((int(s.max()) for s in segs if len(s)), default=-1) + 1
    if len(traces) < 2 or n <= 0:
        return _unmeasured()
    work = np.zeros((len(traces), n))
    for gi, (t, w, s) in enumerate(zip(traces, weights, segs)):
        groups = op_groups[gi] if op_groups and gi < len(op_groups) else None
        sel = expert_phase(t, s, groups) & (t.ops.kind == COMPUTE) & (s >= 0) & t.ops_named(GEMM.search)
        work[gi] = np.bincount(s[sel], weights=w.op_dur[sel], minlength=n)[:n]
    present = work > 0
    ranks = present.sum(axis=0)
    keep = ranks >= 2  # an experts' phase run by two ranks or more: their loads share one capacity
    if not keep.any():
        return _unmeasured()
    w_k = work[:, keep]
    mean = w_k.sum(axis=0) / ranks[keep]
    # every phase routes the same tokens (a layer's micro-batch): each weighs the same
    share = np.where(present[:, keep], np.clip(w_k - mean, 0, None), 0.0).sum(axis=0) / w_k.sum(axis=0)
    pct = round(100.0 * float(share.mean()), 1)
    return {"what": WHAT, "at_least_pct": pct,
            "basis": (f"the EP ranks' expert GEMM work in each of {int(keep.sum())} experts' phases (between EP "
                      "all-to-alls): what the ranks compute above the phase's mean rank over the phase's whole, the "
                      "phases' mean (capacity 1.0 holds a rank to the mean load; a kernel's fixed cost evens the "
                      "work out more than the tokens, and uneven experts inside a rank drop more: the tokens "
                      "dropped are at least this; docs/fixes.md, 'What drop-and-pad drops')")}


def _unmeasured() -> dict:
    return {"what": WHAT, "at_least_pct": None,
            "basis": "not measured: no experts' phase between EP all-to-alls on two ranks or more, so the ranks' "
                     "expert loads cannot be compared (check the router's token counts against the capacity)"}
