"""What GEMM shapes that repeat from step to step save the host (docs/replay.md, "Kernel loads
and new shapes"). cuBLAS loads a kernel the first time a shape picks it
(``analyzers.host.kernel_load_ns``), and the host spends more CPU time before an expert GEMM's
launch while its shapes keep changing (measured: call DG's padded twin, the corpus's balanced
ones); which library work that is is not settled (pre-warming every shape removed the loads,
not it). A dropless MoE job's expert token counts change its experts' GEMM shapes every step;
balanced or padded routing (static shapes) ends both. The launch calls stay.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from . import collectives
from .scenario import Weights
from .trace import MEMSET, GpuTrace


def drop_loads(t: GpuTrace, w: Weights, share: float) -> Weights:
    """Kernels no longer loaded at their first use inside the window (every step runs the
    kernels the steps before ran): the loads' CPU time (``Calls.c_load``) leaves the host's
    gaps, and of the loads that drained the device (``c_load_waits``) the first ``share``, in
    window order, no longer wait nor take time."""
    waits = t.calls.c_load_waits
    gone = waits & (np.cumsum(waits) <= np.ceil(share * waits.sum()))
    return replace(w, c_gap=np.maximum(w.c_gap - (t.calls.c_load * share).astype(np.int64), 0),
                   c_dur=np.where(gone, 0, w.c_dur), c_blocks=w.c_blocks & ~gone)


def loads_gone(spec, pick, point, traces, weights) -> list[Weights] | None:
    """The ``drop_loads`` transform: no kernel loaded at its first use inside the window on any
    GPU (``drop_loads``); None where no window holds a load."""
    if not any(t.calls.c_load.any() or t.calls.c_load_waits.any() for t in traces):
        return None
    share = pick(spec.get("recovered", 1.0), point)
    return [drop_loads(t, w, share) for t, w in zip(traces, weights)]


def repeat_shapes(t: GpuTrace, w: Weights, seg: np.ndarray | None, groups, share: float) -> Weights:
    """Each GEMM launch in the experts' phase (``collectives.expert_phase``) keeps at most the CPU
    time before it that the thread's GEMM launches outside that phase take (their median: dense
    layers' GEMMs, whose shapes repeat); ``share`` of the excess goes. Threads with no GEMM
    launch outside the phase keep theirs."""
    return _at_most_outside(t, w, seg, groups, share, t.ops.gemm)


def fixed_shapes(t: GpuTrace, w: Weights, seg: np.ndarray | None, groups, share: float) -> Weights:
    """Every launch in the experts' phase, not its GEMMs' alone, keeps at most the CPU time before
    it that the thread's launches of its kind outside the phase take (their median; kinds: a GEMM,
    a memset, else the kernel's name); ``share`` of the excess goes. Padding fixes the shapes
    exactly, so no per-shape work is left: cuBLAS's workspace memsets before its GEMMs and the
    phase's elementwise kernels carried it too (call EA's padded twin, docs/replay.md). Where no
    EP all-to-all bounds the phase (its stretches of varying GEMM shapes), a launch whose kind
    never runs outside it (the dropless path's own sorts, gathers and concatenations) keeps at
    most the thread's median launch gap outside it: padded, it runs on fixed shapes like any
    other launch of the thread, or not at all. Between EP all-to-alls such kinds are the
    dispatcher's permutations, which a padded job runs too, around the same host work: there
    they keep their time (measured: call FN's EP 2 pair, docs/notes.md, fiftieth session)."""
    return _at_most_outside(t, w, seg, groups, share, np.ones(t.n_ops, bool),
                            any_kind=not collectives.between_all_to_alls(seg))


def _at_most_outside(t: GpuTrace, w: Weights, seg, groups, share: float, which: np.ndarray,
                     any_kind: bool = False) -> Weights:
    """The launches of ops ``which`` inside the experts' phase cut to the median CPU time before
    the thread's launches of the same kind (a GEMM, a memset, else the kernel's name) outside it;
    with ``any_kind``, a kind with no launch outside it to the median of all the thread's there."""
    launch = t.ops.launch
    launched = which & (launch >= 0)
    inside = launched & collectives.expert_phase(t, seg, groups)
    if not inside.any():
        return w
    outside = launched & ~inside
    name = t.ops.name if t.ops.name is not None else np.zeros(t.n_ops, np.int64)
    kind = np.where(t.ops.gemm, -2, np.where(t.ops.kind == MEMSET, -3, name))
    tid = t.calls.c_tid
    ref = pd.DataFrame({"tid": tid[launch[outside]], "kind": kind[outside], "gap": w.c_gap[launch[outside]]}) \
        .groupby(["tid", "kind"])["gap"].median()
    calls = launch[inside]
    r = ref.reindex(pd.MultiIndex.from_arrays([tid[calls], kind[inside]])).to_numpy()
    if any_kind:
        typical = pd.Series(w.c_gap[launch[outside]]).groupby(tid[launch[outside]]).median()
        r = np.where(np.isnan(r), typical.reindex(tid[calls]).to_numpy(), r)
    has = ~np.isnan(r)
    gap = w.c_gap.copy()
    excess = np.clip(gap[calls[has]] - r[has], 0, None)
    gap[calls[has]] -= (excess * share).astype(np.int64)
    return replace(w, c_gap=gap)
