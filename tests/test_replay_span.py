"""One span of steady iterations for a job's GPUs (``replay.span``): a GPU whose window holds an
iteration its peers' do not is cut to the peers' count, on small traces worked out by hand and
on the capture that showed it (``mcore_gb_ep4_slowfabric``: rank 0 kept 4 iterations, its
peers 3)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from profclass.replay import span
from profclass.replay.trace import COMPUTE, LAUNCH, SYNC, Calls, Edges, GpuTrace, Ops

US = 1_000
PERIOD = 100 * US


def _trace(n_its: int, first_start: int = 0, sync_across: bool = False) -> GpuTrace:
    """``n_its`` iterations of PERIOD: each a launch call at its start and a 40 us kernel 5 us
    after it, then a sync call at +50 us waiting for that kernel; a closing call after the
    window. ``sync_across``: the last iteration's sync waits instead for the next one's kernel
    (not in the window: -1 stays -1, only the index moves)."""
    starts = first_start + PERIOD * np.arange(n_its)
    op_start = starts + 5 * US
    calls_start = np.sort(np.concatenate([starts, starts + 50 * US, [first_start + PERIOD * n_its]]))
    m = len(calls_start)
    kind = np.array([LAUNCH, SYNC] * n_its + [LAUNCH], np.int8)
    target = np.full(m, -1, np.int64)
    target[1:-1:2] = np.arange(n_its)
    dur = np.where(kind == SYNC, 1 * US, 2 * US).astype(np.int64)
    return GpuTrace(
        lo=int(starts[0]), hi=int(starts[-1] + PERIOD), iterations=n_its,
        ops=Ops(start=op_start, dur=np.full(n_its, 40 * US), stream=np.zeros(n_its, np.int64),
                kind=np.full(n_its, COMPUTE, np.int8), gemm=np.zeros(n_its, bool), fusion=np.zeros(n_its, np.int8),
                recomputed=np.zeros(n_its, bool), offload=np.zeros(n_its, bool), launch=np.arange(0, 2 * n_its, 2),
                launch_lag=np.full(n_its, 5 * US), stream_gap=np.zeros(n_its, np.int64)),
        calls=Calls(c_start=calls_start, c_dur=dur, c_tid=np.ones(m, np.int64), c_kind=kind,
                    c_gap=np.full(m, 10 * US), c_gc=np.zeros(m, np.int64), c_load=np.zeros(m, np.int64),
                    c_load_waits=np.zeros(m, bool), c_target=target,
                    c_wake=np.where(target >= 0, 3 * US, 0), c_recomputed=np.zeros(m, bool),
                    c_folded=np.zeros(m, np.int64)),
        edges=Edges(e_src=np.zeros(0, np.int64), e_dst=np.zeros(0, np.int64), e_lag=np.zeros(0, np.int64),
                    e_from_start=np.zeros(0, bool), h_src=np.zeros(0, np.int64), h_dst=np.zeros(0, np.int64),
                    h_lag=np.zeros(0, np.int64)),
        edge_source="cuda events", measured_end=int(calls_start[-1]), unexplained_ns=3 * n_its * US,
        iteration_starts=starts)


def test_the_gpu_with_an_extra_iteration_keeps_the_ones_its_peers_hold():
    extra, peer = _trace(3), _trace(2, first_start=PERIOD)
    out = span.common([extra, peer])
    assert out[1] is peer
    t = out[0]
    assert (t.lo, t.hi, t.iterations) == (PERIOD, 3 * PERIOD, 2)
    assert list(t.iteration_starts) == [PERIOD, 2 * PERIOD]
    assert list(t.ops.start) == [PERIOD + 5 * US, 2 * PERIOD + 5 * US]
    # launch, sync, launch, sync, and the closing call; indices point into the cut arrays
    assert list(t.calls.c_start) == [PERIOD, PERIOD + 50 * US, 2 * PERIOD, 2 * PERIOD + 50 * US, 3 * PERIOD]
    assert list(t.ops.launch) == [0, 2]
    assert list(t.calls.c_target) == [-1, 0, -1, 1, -1]
    assert t.unexplained_ns == 2 * US * 3
    assert t.measured_end == 3 * PERIOD


def _host_ahead() -> GpuTrace:
    """Three iterations; one thread launches all three kernels at once (0, 10, 20 us), the first
    running 5-125 us, then blocks in a sync (30 us) until the third ends (245 us, woken 3 us
    later) and launches again 10 us after (258 us, 305 us); another thread syncs on the first
    kernel at 110 us and is woken by the first thread's call at 305 us (a hand-off) to launch at
    310 us."""
    t = _trace(3)
    ops = replace(t.ops, start=np.array([5, 135, 205]) * US, dur=np.array([120, 10, 40]) * US,
                  launch=np.array([0, 1, 2]))
    calls = replace(t.calls, c_start=np.array([0, 10, 20, 30, 258, 305, 110, 310]) * US,
                    c_dur=np.array([2, 2, 2, 3, 2, 2, 3, 2]) * US, c_tid=np.array([1, 1, 1, 1, 1, 1, 2, 2]),
                    c_kind=np.array([LAUNCH, LAUNCH, LAUNCH, SYNC, LAUNCH, LAUNCH, SYNC, LAUNCH], np.int8),
                    c_gap=np.array([10, 10, 10, 10, 10, 10, 10, 0]) * US, c_gc=np.zeros(8, np.int64),
                    c_load=np.zeros(8, np.int64), c_load_waits=np.zeros(8, bool),
                    c_target=np.array([-1, -1, -1, 2, -1, -1, 0, -1]),
                    c_wake=np.array([0, 0, 0, 3, 0, 0, 3, 0]) * US, c_recomputed=np.zeros(8, bool),
                    c_folded=np.zeros(8, np.int64))
    edges = replace(t.edges, h_src=np.array([5]), h_dst=np.array([7]), h_lag=np.array([3 * US]))
    return replace(t, ops=ops, calls=calls, edges=edges)


def test_a_span_that_ends_early_cuts_the_waits_past_its_end_and_moves_the_closing_call_back():
    cut = span.trim(_host_ahead(), 0, 2)
    assert (cut.lo, cut.hi, cut.iterations) == (0, 2 * PERIOD, 2)
    assert list(cut.ops.launch) == [0, 1]
    # calls starting in the span, then each thread's next one closing it (258 us, 310 us)
    assert list(cut.calls.c_start // US) == [0, 10, 20, 30, 258 - 48, 110, 310]
    assert list(cut.calls.c_target) == [-1, -1, -1, -1, -1, 0, -1]
    # the second thread's closing call was woken by a call the cut left out (305 us): it now
    # waits for the first thread's last kept call (ends 212 us) by the measured 98 us
    assert (list(cut.edges.h_src), list(cut.edges.h_dst), list(cut.edges.h_lag)) == ([4], [6], [98 * US])
    # the sync that waited for the third kernel holds the host to the span's end only, and the
    # closing call moves back by what it waited past it (248 - 200 us)
    assert cut.calls.c_dur[3] == 2 * PERIOD - 30 * US
    assert cut.calls.c_wake[3] == 0
    whole = _host_ahead()
    assert span.trim(whole, 0, 3) is whole


def test_a_wait_for_a_kernel_the_span_opens_inside_keeps_its_measured_return():
    cut = span.trim(_host_ahead(), 1, 2)
    assert (cut.lo, cut.hi) == (PERIOD, 3 * PERIOD)
    assert list(cut.ops.start) == [135 * US, 205 * US]
    # the sync at 110 us waited for the first kernel (ended 125 us, woken 3 us later)
    i = int(np.flatnonzero(cut.calls.c_start == 110 * US)[0])
    assert cut.calls.c_target[i] == -1
    assert cut.calls.c_dur[i] == 18 * US
    # the span runs to the trace's end: the hand-off's calls are both in it
    assert (list(cut.edges.h_src), list(cut.edges.h_dst)) == ([1], [3])


def test_equal_counts_are_left_alone():
    a, b = _trace(2), _trace(2, first_start=5 * US)
    assert span.common([a, b]) == [a, b]


PROFILES = Path(__file__).resolve().parent.parent / "fixtures" / "profiles"


@pytest.mark.skipif(not (PROFILES / "mcore_gb_ep4_slowfabric.sqlite.xz").exists(), reason="fixture absent")
def test_every_rank_of_a_job_moves_alike_when_its_collectives_get_faster(monkeypatch):
    """Rank 0 of this capture finds a 580 ms first iteration its peers do not where a head as long
    as a period counts whatever its kernels (before the whole-period rule; it holds 1,912 of a
    step's 2,297: set here to make the ranks' windows differ): replayed with it, its lone
    collectives kept (or, scaled, lost) their waits for peers outside their windows, and a faster
    fabric moved rank 0 by 104.7 ms/step against its peers' 139.6."""
    import profclass
    from profclass.analyzers import iterations
    from profclass.replay import run as R
    from profclass.replay import transforms as T
    monkeypatch.setattr(iterations, "WHOLE_PERIOD_KERNELS", 0.0)
    got = []
    orig = R.Replayer.__init__

    def keep(self, inp):
        orig(self, inp)
        got.append(self)

    R.Replayer.__init__ = keep
    try:
        profclass.diagnose(str(PROFILES / "mcore_gb_ep4_slowfabric.sqlite.xz"))
    finally:
        R.Replayer.__init__ = orig
    r = got[0]
    assert [t.iterations for t in r.inp.traces] == [4, 3, 3, 3]
    assert [t.iterations for t in r.traces] == [3, 3, 3, 3]
    los = [t.lo + t.shift_ns for t in r.traces]
    assert max(los) - min(los) < 1_000_000
    spec = {"kind": "scale", "ops": "group:EP,DP,EDP,TP,ETP", "factor": [0.3, 0.111, 0.05]}
    out = r.replay(T.apply(spec, "best", r.traces, r.untraced, r.ctx))
    gains = [(b - a) / t.iterations / 1e6 for b, a, t in zip(r.untraced_out.ends, out.ends, r.traces)]
    assert max(gains) - min(gains) < 1.0, gains
