"""One span of steady iterations for every GPU of a job.

Each GPU's window is found on its own (``trace._window``, per file and per process), so a job's
GPUs can keep unequal counts: a periodicity marker finds a leading partial step on one rank
that its peers' do not (``mcore_gb_ep4_slowfabric``: 4, 3, 3, 3). In the replay the extra
iteration's collectives have no peers and keep their captured time, so a fix that shortens
collectives moves that rank less than its peers. Here, where the job's GPUs first meet, every
GPU keeps as many consecutive iterations as the GPU with the fewest: those that overlap that
GPU's span the most (on the job's clock). The measured step each GPU reports is not changed:
the replay prices changes of the window, per iteration.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .host_calls import latest_ended_elsewhere
from .trace import Calls, Edges, GpuTrace, Ops


def common(traces: list[GpuTrace]) -> list[GpuTrace]:
    """The traces cut to one count of steady iterations, the fewest any GPU holds."""
    its = [t.iterations for t in traces]
    if len(traces) < 2 or min(its) < 1 or len(set(its)) < 2 \
            or any(len(t.iteration_starts) != t.iterations for t in traces):
        return traces
    k = min(its)
    ref = traces[int(np.argmin(its))]
    lo, hi = ref.lo + ref.shift_ns, ref.hi + ref.shift_ns
    out = []
    for t in traces:
        if t.iterations == k:
            out.append(t)
            continue
        s, e = _bounds(t)
        runs = np.arange(t.iterations - k + 1)
        overlap = np.clip(np.minimum(e[runs + k - 1] + t.shift_ns, hi) - np.maximum(s[runs] + t.shift_ns, lo), 0, None)
        first = int(runs[np.argmax(overlap)])
        out.append(trim(t, first, k))
    return out


def _bounds(t: GpuTrace) -> tuple[np.ndarray, np.ndarray]:
    """Each replayed iteration's (start, end): it ends where the next starts, the last at hi."""
    s = np.asarray(t.iteration_starts, np.int64)
    return s, np.append(s[1:], t.hi)


def trim(t: GpuTrace, first: int, k: int) -> GpuTrace:
    """Iterations ``first`` .. ``first + k - 1`` of a trace: the ops that start in them, the host
    calls that start in them plus each thread's next call (the host time after the span's last
    launch belongs to the span, as ``host_calls.window_calls`` keeps it at the window's end).
    Chain heads (a thread's first call, a stream's first op) stay where they were captured."""
    s, e = _bounds(t)
    lo, hi = int(s[first]), int(e[first + k - 1])
    if first == 0 and k == t.iterations:
        return t
    a, b = np.searchsorted(t.ops.start, [lo, hi])
    op_map = np.full(t.n_ops + 1, -1, np.int64)  # index -1 reads the last slot: -1
    op_map[a:b] = np.arange(b - a)
    calls, call_map = _cut_calls(t, lo, hi, op_map, b)
    sl = slice(a, b)
    o = t.ops
    ops = Ops(start=o.start[sl], dur=o.dur[sl], stream=o.stream[sl], kind=o.kind[sl], gemm=o.gemm[sl],
              fusion=o.fusion[sl], recomputed=o.recomputed[sl], offload=o.offload[sl],
              launch=call_map[o.launch[sl]], launch_lag=o.launch_lag[sl], stream_gap=o.stream_gap[sl],
              name=None if o.name is None else o.name[sl], grid=None if o.grid is None else o.grid[sl],
              side=None if o.side is None else o.side[sl], input=None if o.input is None else o.input[sl],
              mask=None if o.mask is None else o.mask[sl])
    ed = t.edges
    es, edst = op_map[ed.e_src], op_map[ed.e_dst]
    ek = (es >= 0) & (edst >= 0)
    hs, hd = call_map[ed.h_src], call_map[ed.h_dst]
    hk = (hs >= 0) & (hd >= 0)
    h_src, h_dst, h_lag = _handoffs(calls, ops, hs[hk], hd[hk], ed.h_lag[hk], np.unique(hd[(hs < 0) & (hd >= 0)]))
    edges = Edges(e_src=es[ek], e_dst=edst[ek], e_lag=ed.e_lag[ek], e_from_start=ed.e_from_start[ek],
                  h_src=h_src, h_dst=h_dst, h_lag=h_lag)
    end = ops.start + ops.dur
    measured_end = int(max(end.max(initial=lo), calls.c_start.max(initial=lo)))
    return replace(t, lo=lo, hi=hi, iterations=k, ops=ops, calls=calls, edges=edges, measured_end=measured_end,
                   # the waiting no edge explains, per iteration as measured over the whole window
                   unexplained_ns=int(t.unexplained_ns * k / max(t.iterations, 1)),
                   iteration_starts=np.asarray(t.iteration_starts, np.int64)[first:first + k])


def _cut_calls(t: GpuTrace, lo: int, hi: int, op_map: np.ndarray, b: int) -> tuple[Calls, np.ndarray]:
    """(the span's calls, old call index -> kept index, -1 for the others): those that start in
    it and each thread's next call; ``op_map`` re-indexes the ops, ``b`` the first op after it."""
    c = t.calls
    cs = c.c_start
    inside = ((cs >= lo) | (lo == t.lo)) & ((cs < hi) | (hi == t.hi))
    # each thread's first call at or after the span's end closes it
    after = (cs >= hi) & (hi < t.hi)
    tid_a = c.c_tid[after]
    _, first_after = np.unique(tid_a, return_index=True)  # calls are sorted by (tid, start)
    keep = inside.copy()
    keep[np.flatnonzero(after)[first_after]] = True
    kept = np.flatnonzero(keep)
    call_map = np.full(len(cs) + 1, -1, np.int64)
    call_map[kept] = np.arange(len(kept))
    old = c.c_target[kept]
    target = op_map[old]
    lost = (old >= 0) & (target < 0)
    o = t.ops
    ret = np.where(lost, o.start[old] + o.dur[old] + c.c_wake[kept], 0)  # when a lost call returned
    past = lost & (old >= b)
    # a call whose awaited op starts after the span waited past its end: it ends at the span's
    # end and the thread's next call (the closing one) moves back by the overhang, as
    # ``host_calls.window_calls`` cuts a call still blocked when the window closes; one whose
    # awaited op started before the span keeps its measured return as its own time
    dur = np.where(past, np.clip(hi - cs[kept], 0, None), np.where(lost, ret - cs[kept], c.c_dur[kept]))
    start = cs[kept].copy()
    tid = c.c_tid[kept]
    nxt = np.flatnonzero(past) + 1
    nxt = nxt[(nxt < len(kept)) & (tid[np.clip(nxt, 0, len(kept) - 1)] == tid[nxt - 1])]
    start[nxt] -= np.clip(ret[nxt - 1] - hi, 0, None)
    calls = Calls(c_start=start, c_dur=dur, c_tid=tid, c_kind=c.c_kind[kept], c_gap=c.c_gap[kept],
                  c_gc=c.c_gc[kept], c_load=c.c_load[kept], c_load_waits=c.c_load_waits[kept] & (target >= 0),
                  c_target=target, c_wake=np.where(lost, 0, c.c_wake[kept]),
                  c_recomputed=c.c_recomputed[kept], c_folded=c.c_folded[kept])
    return calls, call_map


def _handoffs(calls: Calls, ops: Ops, src, dst, lag, orphans):
    """The thread hand-offs kept, plus one for each call whose hand-off came from a call the cut
    left out (a helper thread's closing call, woken by a main-thread call after the span): from
    the latest-ending kept call of another thread that ended before it, with the measured lag."""
    if not len(orphans):
        return src, dst, lag
    blocking = calls.c_target >= 0
    tgt = np.clip(calls.c_target, 0, None)
    ce = np.where(blocking, ops.start[tgt] + ops.dur[tgt] + calls.c_wake, calls.c_start + calls.c_dur) \
        if len(ops.start) else calls.c_start + calls.c_dur
    new = latest_ended_elsewhere(calls.c_start, ce, calls.c_tid, orphans)
    ok = new >= 0
    return (np.concatenate([src, new[ok]]), np.concatenate([dst, orphans[ok]]),
            np.concatenate([lag, calls.c_start[orphans[ok]] - ce[new[ok]]]).astype(np.int64))
