"""Clock alignment: separate per-rank reports onto one clock, before any cross-rank analysis.

Part of the timeline stage: it moves times, it does not measure anything.
"""
from __future__ import annotations

import numpy as np

from .timeline import GpuTimeline, comm_kernels


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
            shift_timeline(g, starts[g.source] - starts[ref])
    skew = {}
    ref_gpu = next(g for g in gpus if g.source == ref)
    for s in sources[1:]:
        mine = [g for g in gpus if g.source == s]
        diffs = _end_differences(ref_gpu, mine[0])
        if diffs.size:
            off = int(np.median(diffs))
            for g in mine:
                shift_timeline(g, off)
            skew[s] = int(np.median(np.abs(diffs - off)))
        else:
            skew[s] = -1  # nothing to match on: session start only
    return skew


def shift_timeline(g: GpuTimeline, off: int) -> None:
    """Move every time of one GPU by ``off`` ns (a per-rank summary moves its own too)."""
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


def _end_differences(a: GpuTimeline, b: GpuTimeline) -> np.ndarray:
    ka, kb = comm_kernels(a), comm_kernels(b)
    out = []
    for ctype, ga in ka.groupby("collective", observed=True):
        gb = kb[kb["collective"] == ctype]
        ea, eb = ga["end"].to_numpy(), gb["end"].to_numpy()
        if len(ea) and len(ea) == len(eb):
            out.append(ea - eb)
    return np.concatenate(out) if out else np.empty(0, np.int64)
