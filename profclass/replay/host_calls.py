"""The replay window's host API calls (``trace.build``): which calls of the launching threads
the window holds, each call's own time and the CPU time before it, the op a blocking call
waited for, and the hand-offs between threads. The window's edges cut through calls: a call it
opens inside is its from its start; a call still blocked when it closes ends at its end.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .. import intervals as iv
from ..analyzers.host import GC_RANGES, kernel_load_ns
from ..analyzers.idle import ALLOC_CALLS, FREE_CALLS, SYNC_CALLS, UNMAP_CALLS
from ..analyzers.sets import contains_per_distinct, name_matches
from ..analyzers.capture_start import capture_start_calls
from ..timeline import GpuTimeline
from .constants import QUEUE_FULL_SHARE, QUEUE_MIN_DEPTH, THREAD_WAIT_NS

# call kinds
LAUNCH, SYNC, ALLOC, OTHER = 0, 1, 2, 3


def window_calls(gpu: GpuTimeline, lo: int, hi: int) -> pd.DataFrame:
    """The window's API calls on the threads that launched its ops, sorted by (tid, start)."""
    rt = gpu.runtime
    if rt.empty:
        return pd.DataFrame({c: np.zeros(0, np.int64) for c in ("start", "end", "tid", "correlation")}
                            | {"name": np.zeros(0, object), "closing": np.zeros(0, bool)})
    own = ~capture_start_calls(rt)  # the runtime's and the profiler's start: not the job's calls
    s = rt["start"].to_numpy(np.int64)
    # a call the window opens inside (a sync waiting for the window's first collective) is
    # the window's from its start: where it returns depends on the window's ops
    inside = (s < hi) & ((s >= lo) | (rt["end"].to_numpy(np.int64) > lo)) & own
    w = rt[inside]
    w = w.assign(start=np.maximum(w["start"].to_numpy(np.int64), lo))
    launched = set(np.unique(w.loc[w["correlation"].isin(gpu.ops["correlation"]), "tid"].to_numpy()))
    # each launching thread's first call after the window closes it: the host time after the
    # window's last launch (the optimizer's Python, a GC pause, logging) is the CPU time
    # before that call, part of the step the replay must hold
    later = np.searchsorted(s, hi) if bool(np.all(s[:-1] <= s[1:])) else None
    tail_tid = rt["tid"].to_numpy()[later:] if later is not None else rt["tid"].to_numpy()
    tail_ok = np.isin(tail_tid, list(launched)) & (own[later:] if later is not None else own & (s >= hi))
    _, first = np.unique(np.where(tail_ok, tail_tid, -1), return_index=True)
    first = first[tail_ok[first]]
    after = rt.iloc[(later or 0) + first] if later is not None else rt.iloc[first]
    w = w[w["tid"].isin(launched)] if launched else w
    w = pd.concat([w.assign(closing=False), after.assign(closing=True)], ignore_index=True)
    w = w.sort_values(["tid", "start"], kind="stable").reset_index(drop=True)
    # a driver call inside a runtime call (cuLaunchKernel inside cudaLaunchKernel) is the same
    # CPU time: keep the outer one
    e = w["end"].to_numpy(np.int64)
    tid = w["tid"].to_numpy()
    run_end = _running_max_by_group(e, tid)
    nested = np.zeros(len(w), bool)
    nested[1:] = (tid[1:] == tid[:-1]) & (w["start"].to_numpy(np.int64)[1:] < run_end[:-1])
    # a thread still inside a call when the window closes waits for the next step's work: in
    # the window that call ends at the window's end, and its closing call follows it by the CPU
    # time it measured after the real return, not by the next step's wait
    closing = w["closing"].to_numpy(bool)
    over = np.zeros(len(w), np.int64)
    over[1:] = np.where(closing[1:] & (tid[1:] == tid[:-1]), np.clip(run_end[:-1] - hi, 0, None), 0)
    w = w.assign(start=w["start"].to_numpy(np.int64) - over,
                 end=np.where(closing, e - over, np.minimum(e, hi)))
    return w[~nested].reset_index(drop=True)


def _running_max_by_group(v: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Running maximum of ``v`` restarted at each new ``group`` (rows sorted by group)."""
    if len(v) == 0:
        return v
    seg = np.concatenate([[0], np.cumsum(group[1:] != group[:-1])])
    off = seg.astype(np.int64) * (2 ** 62 // max(int(seg[-1]) + 1, 1))
    base = v - v.min()
    return np.maximum.accumulate(base + off) - off + v.min()


def call_frame(calls: pd.DataFrame, start, end, launch, recomputed, nvtx, lo, hi) -> dict:
    """The host threads' calls: own time, CPU time before each, GC inside it, and what a
    blocking call waited for."""
    cs = calls["start"].to_numpy(np.int64)
    ce = calls["end"].to_numpy(np.int64)  # already cut at the window's edges (``window_calls``)
    closing = calls["closing"].to_numpy(bool)
    tid = calls["tid"].to_numpy(np.int64)
    m = len(cs)
    kind = _call_kinds(calls["name"], launch, m)
    same = np.zeros(m, bool)
    same[1:] = tid[1:] == tid[:-1]
    gap = np.zeros(m, np.int64)
    gap[1:] = np.where(same[1:], np.clip(cs[1:] - ce[:-1], 0, None), 0)
    gc = _gc_in_gaps(nvtx, cs, ce, same, lo, hi)
    load = kernel_load_ns(calls["name"], tid, cs, ce, kind == LAUNCH)
    # a kernel load that returned with the device drained waited for it, as a device sync does
    # (cuBLAS's first launch of a kernel: docs/replay.md, "Kernel loads"); shorter ones are CPU time
    kind = np.where((load > 0) & (kind == OTHER) & _drained(ce, start, end), SYNC, kind).astype(np.int8)
    # a free that waited is a device sync, not CPU time (call GA: the first cudaFree of an emptying
    # returned 157 ms after its call, when the GPU drained)
    frees = (kind == ALLOC) & np.asarray(name_matches(calls["name"], FREE_CALLS), bool)
    # the sync the allocator makes before unmapping an expandable segment's pages is its own: an
    # allocator call that waits, as a free does (call GD)
    unmap = np.asarray(name_matches(calls["name"], UNMAP_CALLS), bool)
    pre = np.zeros(m, bool)
    pre[:-1] = (kind[:-1] == SYNC) & unmap[1:] & same[1:]
    kind[pre], frees = ALLOC, frees | pre
    target, wake, dur = _blocking(cs, ce, kind, start, end, launch, frees)
    load_waits = (load > 0) & (target >= 0)
    rec_calls = _recomputed_calls(cs, ce, launch, recomputed)
    # calls that neither launch, block nor allocate are CPU time like any other: folded into
    # the gap before the next kept call of their thread (a third of the graph's host nodes)
    keep = (kind == LAUNCH) | (kind == ALLOC) | (target >= 0) | closing
    gap, gc, load, folded, sel, remap = _fold(keep, gap, gc, load, ce - cs, same)
    gap, h = _thread_waits(cs[sel], ce[sel], tid[sel], gap[sel])
    return dict(c_start=cs[sel], c_dur=dur[sel].astype(np.int64), c_tid=tid[sel], c_kind=kind[sel],
                c_gap=gap, c_gc=gc[sel], c_load=load[sel], c_load_waits=load_waits[sel],
                c_target=target[sel].astype(np.int64),
                c_wake=wake[sel].astype(np.int64), c_recomputed=rec_calls[sel], c_folded=folded[sel],
                remap=remap, **h)


def _call_kinds(names, launch, m) -> np.ndarray:
    kind = np.full(m, OTHER, np.int8)
    if m:
        kind[np.asarray(name_matches(names, ALLOC_CALLS), bool)] = ALLOC
        kind[np.asarray(name_matches(names, SYNC_CALLS), bool)] = SYNC
    is_launch = np.zeros(m, bool)
    is_launch[launch[launch >= 0]] = True
    kind[is_launch & (kind == OTHER)] = LAUNCH
    return kind


def _blocking(cs, ce, kind, start, end, launch, frees=None):
    """(target, wake, own duration) per call: a sync call, a free (``frees``: an implicit device
    sync), a copy call whose copy ended inside it, or a launch made while the GPU's launch queue
    was full (``_queue_full``), blocked on the GPU until the op whose end released it (the latest
    op end inside the call) ended; its own time is then what it took beyond that, up to the wake
    cap."""
    m = len(cs)
    order = np.argsort(end, kind="stable")
    k = np.searchsorted(end[order], ce, side="right") - 1
    cand = np.where(k >= 0, order[np.clip(k, 0, None)], -1)
    waited = (cand >= 0) & (end[np.clip(cand, 0, None)] > cs)
    own_copy = np.zeros(m, bool)
    if len(launch):
        lk = launch >= 0
        own_copy[launch[lk]] = end[lk] <= ce[launch[lk]]
    frees = np.zeros(m, bool) if frees is None else frees
    blocking = waited & ((kind == SYNC) | frees | own_copy | ((kind == LAUNCH) & _queue_full(cs, start, end, launch)))
    target = np.where(blocking, cand, -1)
    # kept as measured: a return long after the awaited op's end (the host thread descheduled,
    # a wait the call hid) is real time the step keeps; beyond the wake cap it is reported as
    # unexplained
    wake = np.where(blocking, np.clip(ce - end[np.clip(cand, 0, None)], 0, None), 0)
    dur = np.where(blocking, np.minimum(ce - cs, np.maximum(wake, 1)), ce - cs)
    return target, wake, dur


def _drained(ce, start, end) -> np.ndarray:
    """Per call end: no op of the GPU was running then (every stream had finished its work)."""
    if not len(start):
        return np.zeros(len(ce), bool)
    running = np.searchsorted(np.sort(start), ce, side="left") - np.searchsorted(np.sort(end), ce, side="left")
    return running <= 0


def _queue_full(cs, start, end, launch) -> np.ndarray:
    """Per call: the GPU's queue of launched, unfinished ops was full when it began (pending ops
    at ``QUEUE_FULL_SHARE`` of the window's most, that most at least ``QUEUE_MIN_DEPTH``)."""
    lk = launch >= 0
    if not lk.any():
        return np.zeros(len(cs), bool)
    launched = np.sort(cs[launch[lk]])
    ended = np.sort(end[lk])
    pending = np.searchsorted(launched, cs, side="left") - np.searchsorted(ended, cs, side="right")
    most = int(pending.max())
    return (pending >= QUEUE_FULL_SHARE * most) & (most >= QUEUE_MIN_DEPTH)


def _recomputed_calls(cs, ce, launch, recomputed) -> np.ndarray:
    """Calls inside the stretches of host work that launched the recomputed forward (its
    Python between its launches, same thread)."""
    m = len(cs)
    rl = launch[recomputed & (launch >= 0)] if m else np.zeros(0, np.int64)
    if not len(rl):
        return np.zeros(m, bool)
    runs = _runs(np.sort(rl))
    spans = iv.union(cs[runs[0]], ce[runs[1]])
    k = np.searchsorted(spans[0], cs, side="right") - 1
    return (k >= 0) & (cs < spans[1][np.clip(k, 0, None)])


def _fold(keep, gap, gc, load, own, same):
    """(gap, gc, load, folded calls, kept rows, old row -> kept row) with each dropped call's
    time and the CPU time before it added to the gap before the next kept call of its thread
    (its kernel-load time to that call's load: a kept call loads nothing itself)."""
    m = len(keep)
    if not m or keep.all():
        return gap, gc, np.zeros(m, np.int64), np.zeros(m, np.int64), np.arange(m), np.arange(m)
    kept = np.flatnonzero(keep)
    start = ~same
    start[0] = True
    # the row after which a kept call's folded time begins: the previous kept call of its
    # thread, else the row before the thread's first
    mark = np.where(keep, np.arange(m), np.where(start, np.arange(m) - 1, -2))
    q = np.maximum.accumulate(mark)
    q_before = np.where(kept > 0, q[np.clip(kept - 1, 0, None)], -1)
    q_before = np.where(start[kept], kept - 1, np.maximum(q_before, -1))
    out = []
    for vals, base in ((np.where(keep, 0, gap + own), gap), (np.where(keep, 0, gc), gc),
                       (np.where(keep, 0, load), np.zeros(m, np.int64)),
                       ((~keep).astype(np.int64), np.zeros(m, np.int64))):
        run = np.concatenate([[0], np.cumsum(vals)])  # run[i]: the sum of rows < i
        added = base.copy()
        added[kept] += run[kept] - run[q_before + 1]
        out.append(added)
    remap = np.full(m, -1, np.int64)
    remap[kept] = np.arange(len(kept))
    return out[0], out[1], out[2], out[3], kept, remap


def _thread_waits(cs, ce, tid, gap):
    """Host threads hand work to each other (the main thread's backward() wakes the autograd
    engine's device thread and waits for it): a thread's first call, or a call after an idle
    stretch during which another thread's call ended, waited for that call. The edge keeps the
    measured time from that call's end; the idle stretch is no CPU work of this thread."""
    m = len(cs)
    first = np.ones(m, bool)
    first[1:] = tid[1:] != tid[:-1]
    prev_end = np.where(first, np.iinfo(np.int64).min // 4, np.concatenate([[0], ce[:-1]]))
    cand_dst = np.flatnonzero(first | (gap > THREAD_WAIT_NS))
    src = latest_ended_elsewhere(cs, ce, tid, cand_dst)
    hit = src >= 0
    hit[hit] &= ce[src[hit]] > prev_end[cand_dst[hit]]  # it ended while this thread was idle
    dst, src = cand_dst[hit], src[hit]
    gap = gap.copy()
    gap[dst] = 0
    return gap, dict(h_src=src.astype(np.int64), h_dst=dst.astype(np.int64),
                     h_lag=(cs[dst] - ce[src]).astype(np.int64))


def latest_ended_elsewhere(cs, ce, tid, dst) -> np.ndarray:
    """Per call ``dst``: the call of another thread that ended last at or before its start
    (``ce``: each call's end), -1 where none did among the few latest ends."""
    order = np.argsort(ce, kind="stable")
    k = np.searchsorted(ce[order], cs[dst], side="right") - 1
    src = np.full(len(dst), -1, np.int64)
    for back in range(8):  # the latest ends may be this thread's own: step back a few
        kk = k - back
        c = order[np.clip(kk, 0, None)]
        src = np.where((kk >= 0) & (src < 0) & (tid[c] != tid[dst]), c, src)
    return src


def _runs(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First and last of each run of consecutive call indices (a recomputed stretch of launches
    with no other launches between them)."""
    if len(idx) == 0:
        return idx, idx
    brk = np.flatnonzero(np.diff(idx) > 8) + 1  # a few non-recomputed calls (syncs) inside stay in
    firsts = np.concatenate([[0], brk])
    lasts = np.concatenate([brk - 1, [len(idx) - 1]])
    return idx[firsts], idx[lasts]


def _gc_in_gaps(nvtx: pd.DataFrame, cs, ce, same, lo, hi) -> np.ndarray:
    m = len(cs)
    if nvtx is None or nvtx.empty or m == 0:
        return np.zeros(m, np.int64)
    g = nvtx[contains_per_distinct(nvtx["text"], GC_RANGES)]
    if g.empty:
        return np.zeros(m, np.int64)
    sets = iv.union(g["start"].to_numpy(np.int64), g["end"].to_numpy(np.int64))
    prev_end = np.concatenate([[cs[0] if m else 0], ce[:-1]])
    prev_end = np.where(same, prev_end, cs)
    return (iv.covered_before(sets, cs) - iv.covered_before(sets, np.minimum(prev_end, cs))).astype(np.int64)
