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
# a report is matched against at most this many aligned GPUs per (collective type, kernel count),
# the most recently aligned (per-rank reports come in rank order: TP and DP peers are near), and
# against all of them only when none of those fits. The work per report is then bounded, so
# alignment grows linearly with the reports (every pair: 28 s of a 61 s reduction at 512 ranks,
# bench/RESULTS.md); jobs of up to this many GPUs are matched against every aligned GPU, as before.
FINE_CANDIDATES = 64


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
    by_source: dict[int, list] = {}
    for g in gpus:
        by_source.setdefault(g.source, []).append(g)
    aligned = _Aligned()
    for g in by_source[ref]:
        aligned.add(_ends_by_type(g))
    for s in sources[1:]:
        mine = by_source[s]
        ends = _ends_by_type(mine[0])
        # of the matches that agree, the one with the most kernels behind its median (the first
        # in alignment order among equals); the most recently aligned reports first
        fits = aligned.fits(ends, FINE_CANDIDATES) or aligned.fits(ends, None)
        off, residual = max(fits, key=lambda f: (f[2], -f[1], -f[3], -f[4]))[:2] if fits else (0, -1)
        if residual >= 0:
            for g in mine:
                shift_timeline(g, off)
            skew[s] = residual
        else:
            skew[s] = -1  # nothing that matches: session start only
        for g in mine:  # read after the shift
            aligned.add(_ends_by_type(g))
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


class _Aligned:
    """The aligned GPUs' collective end times, by (collective type, kernel count): only equal
    counts are matched (the k-th kernels against each other)."""

    def __init__(self):
        self.by_key: dict[tuple[str, int], tuple[list, list]] = {}
        self.count = 0

    def add(self, ends: dict[str, np.ndarray]) -> None:
        for ctype, e in ends.items():
            if len(e):
                arrays, order = self.by_key.setdefault((ctype, len(e)), ([], []))
                arrays.append(e)
                order.append(self.count)
        self.count += 1

    def fits(self, ends: dict[str, np.ndarray], recent: int | None) -> list[tuple[int, int, int, int, int]]:
        """(offset, residual, kernels, aligned GPU's order, type's order) of the matches whose
        ends agree to ``FINE_MAX_RESIDUAL_NS``: per collective type, the median end difference of
        the k-th kernels and the median distance from it, over the last ``recent`` candidates
        (all when None) at once."""
        out = []
        for t, (ctype, eb) in enumerate(ends.items()):
            arrays, order = self.by_key.get((ctype, len(eb)), ([], []))
            if not arrays:
                continue
            if recent is not None:
                arrays, order = arrays[-recent:], order[-recent:]
            diffs = np.stack(arrays) - eb
            # int() of each median as before: truncation toward zero
            off = np.median(diffs, axis=1).astype(np.int64)
            residual = np.median(np.abs(diffs - off[:, None]), axis=1).astype(np.int64)
            out += [(int(o), int(r), len(eb), i, t) for o, r, i in zip(off, residual, order)
                    if r <= FINE_MAX_RESIDUAL_NS]
        return out
