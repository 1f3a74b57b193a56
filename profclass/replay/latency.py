"""Each op's latencies, measured: what its binding predecessor (launch call, stream
predecessor, event source) left it waiting, up to a cap; and, for ops that waited longer than
any traced edge explains, the op of another stream that ended just before (an inferred edge).
"""
from __future__ import annotations

import numpy as np

from .constants import LATENCY_CAPS, TYPICAL_QUANTILE


TYPICAL_MAX_NS = 2 ** 61  # far past any capture; keeps sums with int64 timestamps in range


def _typical(x: np.ndarray) -> int:
    """The low quantile of the measured latencies (float64 quantile of int64 ns: held below
    int64's edge, where rounding would overflow a damaged export's timestamps)."""
    x = x[x >= 0]
    return int(min(np.quantile(x, TYPICAL_QUANTILE), TYPICAL_MAX_NS)) if len(x) else 0


def _free_at_launch(has_launch, launch, c_start, prev, end, ev_last) -> np.ndarray:
    """Ops nothing but their launch held: the stream's previous op and every event source had
    ended (``ev_last``: the latest) when the launch call began. Only their start - call start is
    a launch latency; a queued op's (a GPU-bound job's: milliseconds) is the queue's depth. All
    launched ops where none was free."""
    call_t = np.where(has_launch, c_start[np.clip(launch, 0, None)] if len(c_start) else 0, 0)
    free = has_launch & ((prev < 0) | (end[np.clip(prev, 0, None)] <= call_t)) & (ev_last <= call_t)
    return free if free.any() else has_launch


def latencies(start, end, stream, launch, c_start, e_src, e_dst, e_from_start=None, c_end=None):
    """Per op: the launch latency and stream gap the replay uses; per cross-stream edge its lag
    (from the source's end, or its start where ``e_from_start``); and the waiting no edge
    explains. The binding edge keeps its measured latency up to its cap."""
    n = len(start)
    c_start = c_start.to_numpy(np.int64) if hasattr(c_start, "to_numpy") else c_start
    has_launch = launch >= 0
    meas_launch = np.where(has_launch, start - c_start[np.clip(launch, 0, None)] if len(c_start) else 0, -1)
    order = np.lexsort((start, stream))
    prev = np.full(n, -1, np.int64)
    same = np.zeros(n, bool)
    same[1:] = stream[order][1:] == stream[order][:-1]
    prev[order[1:][same[1:]]] = order[:-1][same[1:]]
    meas_gap = np.where(prev >= 0, start - end[np.clip(prev, 0, None)], -1)
    src_time = (np.where(e_from_start, start[e_src], end[e_src]) if e_from_start is not None
                else end[e_src]) if len(e_dst) else np.zeros(0, np.int64)
    ev_last = np.full(n, np.iinfo(np.int64).min, np.int64)  # per op: its latest event source's time
    if len(e_dst):
        np.maximum.at(ev_last, e_dst, src_time)
    L = _typical(meas_launch[_free_at_launch(has_launch, launch, c_start, prev, end, ev_last)])
    G = _typical(meas_gap[prev >= 0])
    ev_ready = np.where(ev_last > np.iinfo(np.int64).min, ev_last + G, ev_last)
    a_launch = np.where(has_launch, start - meas_launch + L, np.iinfo(np.int64).min)
    a_stream = np.where(prev >= 0, start - meas_gap + G, np.iinfo(np.int64).min)
    bound = np.maximum(np.maximum(a_launch, a_stream), ev_ready)
    resid = np.where(bound > np.iinfo(np.int64).min // 2, start - bound, 0)
    resid = np.clip(resid, 0, None)
    binding_launch = has_launch & (a_launch >= np.maximum(a_stream, ev_ready))
    binding_stream = ~binding_launch & (prev >= 0) & (a_stream >= ev_ready)
    binding_event = ~binding_launch & ~binding_stream & (ev_ready > np.iinfo(np.int64).min // 2)
    cap_g, cap_e = LATENCY_CAPS["stream"], LATENCY_CAPS["event"]
    # the launch is submitted somewhere inside its call: a call the host was slow in (a
    # descheduled thread) can hold its kernel up to its own end
    cap_l = LATENCY_CAPS["launch"] + (np.where(has_launch, (c_end - c_start)[np.clip(launch, 0, None)], 0)
                                      if c_end is not None and len(c_start) else 0)
    # the binding edge keeps its measured latency up to the typical one plus its cap; the
    # others the typical one, or less where this op was measured faster (the replay then never
    # places an op later than it ran)
    launch_lag = np.where(binding_launch, np.minimum(meas_launch, L + cap_l), np.minimum(L, np.maximum(meas_launch, 0)))
    stream_gap = np.where(binding_stream, np.minimum(meas_gap, G + cap_g), np.minimum(G, np.maximum(meas_gap, 0)))
    ev_meas = start[e_dst] - src_time if len(e_dst) else np.zeros(0, np.int64)
    ev_bind = binding_event[e_dst] if len(e_dst) else np.zeros(0, bool)
    e_lag = np.where(ev_bind, np.minimum(ev_meas, G + cap_e), np.minimum(G, np.maximum(ev_meas, 0))) \
        if len(e_dst) else np.zeros(0, np.int64)
    cap = np.where(binding_launch, cap_l, np.where(binding_stream, cap_g, np.where(binding_event, cap_e, 0)))
    # ops bound by nothing in the window (the first of each stream, launched before it) are
    # placed as measured, so their waiting is no blind spot
    over = np.clip(resid - cap, 0, None) * (binding_launch | binding_stream | binding_event)
    return (launch_lag.astype(np.int64), stream_gap.astype(np.int64), np.asarray(e_lag, np.int64),
            int(over.sum()), over > 0)


def inferred_edges(start, end, stream, dst):
    """For each op in ``dst``: the op of another stream whose end (else, whose start) came last
    before its start, at most the event cap before: an untraced event wait ends with its
    source; an op queued behind another stream's op in a shared hardware queue
    (CUDA_DEVICE_MAX_CONNECTIONS=1, Megatron's setting) starts right after that one starts.
    (src, dst, from_start); a wait neither explains stays unexplained."""
    s1, d1 = _latest_before(end, start, stream, dst)
    rest = np.setdiff1d(dst, d1)
    s2, d2 = _latest_before(start, start, stream, rest)
    return (np.concatenate([s1, s2]), np.concatenate([d1, d2]),
            np.concatenate([np.zeros(len(s1), bool), np.ones(len(s2), bool)]))


def _latest_before(times, start, stream, dst):
    """The op of another stream whose ``times`` value came last before each ``dst`` op's start,
    within the event cap."""
    order = np.argsort(times, kind="stable")
    ends = times[order]
    k = np.searchsorted(ends, start[dst], side="right") - 1
    src = np.full(len(dst), -1, np.int64)
    for back in range(8):  # the latest ends may be the op's own stream: step back a few
        kk = k - back
        ok = (kk >= 0) & (src < 0)
        cand = order[np.clip(kk, 0, None)]
        ok &= (stream[cand] != stream[dst]) & (cand != dst)
        src = np.where(ok, cand, src)
    hit = (src >= 0)
    hit[hit] &= start[dst[hit]] - times[src[hit]] <= LATENCY_CAPS["event"]
    return src[hit].astype(np.int64), dst[hit].astype(np.int64)
