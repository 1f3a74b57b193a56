"""Clock alignment: separate per-rank reports onto one clock, before any cross-rank analysis.

Part of the timeline stage: it moves times, it does not measure anything.
"""
from __future__ import annotations

import numpy as np

from .timeline import GpuTimeline, comm_kernels


# the most a matched collective's end times may still spread once the offset is taken out:
# one instance's members end within 6-90 us (docs/comm.md); ends of different instances (a TP
# group in another pipeline stage) differ by milliseconds, and then the session starts, which
# already agree to ~7 us on these machines, are the better clock
FINE_MAX_RESIDUAL_NS = 200_000


def align_clocks(gpus: list[GpuTimeline], session_start: dict[int, int | None]) -> dict[int, int]:
    """Shift separate reports onto the first one's clock; returns the residual skew per source.

    Coarse: each report's session start (UTC ns). Fine: the kernels of one collective finish
    together on its members, so the median difference of matched end times is the remaining
    offset. Each report is matched against whichever report already aligned shares its
    collectives (a TP peer, a pipeline neighbour), one collective type at a time: of the
    matches whose ends agree to ``FINE_MAX_RESIDUAL_NS``, the one with the most kernels.
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
    aligned = [_ends_by_type(g) for g in gpus if g.source == ref]
    for s in sources[1:]:
        mine = [g for g in gpus if g.source == s]
        ends = _ends_by_type(mine[0])
        # of the matches that agree, the one with the most kernels behind its median
        fits = [f for a in aligned for f in _offsets(a, ends) if f[1] <= FINE_MAX_RESIDUAL_NS]
        off, residual, _ = max(fits, key=lambda f: (f[2], -f[1])) if fits else (0, -1, 0)
        if residual >= 0:
            for g in mine:
                shift_timeline(g, off)
            skew[s] = residual
        else:
            skew[s] = -1  # nothing that matches: session start only
        aligned.extend(_ends_by_type(g) for g in mine)  # read after the shift
    return skew


def shift_timeline(g: GpuTimeline, off: int) -> None:
    """Move every time of one GPU by ``off`` ns (a per-rank summary moves its own too)."""
    if off == 0:
        return
    on_shift = getattr(g, "on_shift", None)  # a per-rank summary moves its window and sets too
    if on_shift is not None:
        on_shift(off)
    # a per-rank summary keeps no API calls or NVTX ranges (ranks.GpuSummary)
    for df in (g.ops, g.runtime, g.nvtx) if isinstance(g, GpuTimeline) else (g.ops,):
        for c in ("start", "end"):
            df[c] = df[c] + off
    for c in ("launch_start", "launch_end"):
        g.ops[c] = np.where(g.ops[c] >= 0, g.ops[c] + off, -1)


def _ends_by_type(g: GpuTimeline) -> dict[str, np.ndarray]:
    """A GPU's collective kernel end times by collective type, in capture order."""
    k = comm_kernels(g)
    return {str(c): sub["end"].to_numpy() for c, sub in k.groupby("collective", observed=True)}


def _offsets(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[tuple[int, int, int]]:
    """(offset, residual, kernels) per collective type the two GPUs ran equally often: the
    median end difference of the k-th kernels, and the median distance from it."""
    out = []
    for ctype, ea in a.items():
        eb = b.get(ctype)
        if eb is not None and len(ea) and len(ea) == len(eb):
            diffs = ea - eb
            off = int(np.median(diffs))
            out.append((off, int(np.median(np.abs(diffs - off))), len(diffs)))
    return out
