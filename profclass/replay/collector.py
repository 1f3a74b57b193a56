"""The ``remove_gc`` transform (``host_gc``) and the collector's pauses per step the pipeline
schedule adds: the garbage collector's time, from its NVTX ranges where the profile has them,
else each launching thread's pauses outside the steps' rhythm (``analyzers.host.host_pauses``).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..analyzers.host import host_pauses
from .scenario import Weights
from .trace import GpuTrace


def remove_gc(spec, pick, point, traces, weights) -> list[Weights] | None:
    """The collector's time leaves the host's gaps: inside its NVTX ranges where the profile has
    them, else each launching thread's pauses outside the steps' rhythm (``host.host_pauses``)."""
    share = pick(spec.get("removed", 1.0), point)
    gc = [t.calls.c_gc for t in traces]
    if not any(g.any() for g in gc):
        gc = [_pauses(t) for t in traces]
        if not any(g.any() for g in gc):
            return None
    return [replace(w, c_gap=np.maximum(w.c_gap - (g * share).astype(np.int64), 0))
            for g, w in zip(gc, weights)]


def pause_per_step(t: GpuTrace) -> float:
    """ns per step the host's collector held its busiest launching thread: its GC ranges, else
    its pauses outside the steps' rhythm (``_pauses``)."""
    gc = t.calls.c_gc if t.calls.c_gc.any() else _pauses(t)
    per_tid = [gc[t.calls.c_tid == tid].sum() for tid in np.unique(t.calls.c_tid)]
    return float(max(per_tid, default=0)) / max(t.iterations, 1)


def _pauses(t: GpuTrace) -> np.ndarray:
    out = np.zeros(len(t.calls.c_gap), np.int64)
    for tid in np.unique(t.calls.c_tid):
        mine = np.flatnonzero(t.calls.c_tid == tid)
        out[mine] = host_pauses(t.calls.c_gap[mine], t.iterations)
    return out
