"""The replay window's edges and its typical launch latency: what a GPU-bound capture's queue
and a window that opens or closes inside a sync must not turn into fixed time. Each rule is
checked on a small case worked out by hand and on the real capture that showed it
(`mcore_gb_ep4_slowfabric`: 4x H200, EP 4, NCCL over shared memory)."""
from __future__ import annotations

import numpy as np
import pytest

from profclass.replay import transforms
from profclass.replay.latency import latencies
from profclass.replay.run import Replayer
from profclass.replay.trace import SYNC

US = 1_000
SLOW_FABRIC = "mcore_gb_ep4_slowfabric"


def test_a_queued_ops_wait_is_not_its_launch_latency():
    """Stream 0: 38 ops of 100 us queued by calls 1 us apart (each waits for the previous op,
    not for its launch); stream 1: two ops launched onto an idle stream, 6 us after their
    calls. The typical launch latency is those two's 6 us, so no queued op carries the queue's
    milliseconds as a launch latency once a change drains the queue."""
    n_q = 38
    c_start = np.concatenate([np.arange(n_q) * US, [50_000 * US, 60_000 * US]]).astype(np.int64)
    start = np.concatenate([10 * US + np.arange(n_q) * 100 * US, [50_006 * US, 60_006 * US]]).astype(np.int64)
    end = start + 100 * US
    stream = np.array([0] * n_q + [1, 1], np.int64)
    launch = np.arange(n_q + 2, dtype=np.int64)
    none = np.zeros(0, np.int64)
    lag, gap, _, _, _ = latencies(start, end, stream, launch, c_start, none, none, c_end=c_start + 2 * US)
    assert lag[n_q:].tolist() == [6 * US, 6 * US]
    # queued ops (stream-bound) get the typical latency, not their measured milliseconds
    assert lag[1:n_q].max() == 6 * US
    assert gap[1:n_q].max() == 0


@pytest.fixture(scope="module")
def slow_fabric(diagnosis) -> Replayer:
    return Replayer(diagnosis(SLOW_FABRIC).extra.replay_inputs)


def test_a_gpu_bound_captures_launch_latency_is_microseconds(slow_fabric):
    """Its kernels were queued milliseconds ahead of the GPU; the launch latency the replay
    keeps for them is a launch's (the ops launched onto an idle stream: tens of us)."""
    for t in slow_fabric.traces:
        assert np.median(t.ops.launch_lag[t.ops.launch >= 0]) < 100 * US


def test_a_window_that_opens_inside_a_sync_holds_it(slow_fabric):
    """Ranks 1-3's window opens as the DP all-reduce starts, while their host sits in the sync
    that waits for it: that sync is in the window from its start, waiting for a window op."""
    opened = 0
    for t in slow_fabric.traces:
        c = t.calls
        assert c.c_start.min() >= t.lo
        at_lo = (c.c_start == t.lo) & (c.c_kind == SYNC) & (c.c_target >= 0)
        opened += int(at_lo.any())
    assert opened >= 3


def test_no_call_runs_past_the_window_and_the_step_ends_with_it(slow_fabric):
    """The last step's sync returned in the next step; inside the window it ends at the
    window's end, so the replayed window spans its iterations: the measured step. Every GPU
    keeps all of its own (until the whole-period rule, rank 0 also kept a partial first
    iteration its peers' windows did not hold, which ``span`` left out of its replay)."""
    kept = 0
    for t, t0, step in zip(slow_fabric.traces, slow_fabric.inp.traces, slow_fabric.inp.step_ns):
        c = t.calls
        inside = c.c_start < t.hi
        assert (c.c_start[inside] + c.c_dur[inside] <= t.hi).all()
        per = (t.measured_end - t.lo) / t.iterations
        assert abs(per - (t.hi - t.lo) / t.iterations) < 0.01 * per
        if t.iterations == t0.iterations:
            assert abs(per - step) < 0.01 * step
            kept += 1
    assert kept == len(slow_fabric.traces) == 4


def test_scaling_the_transfers_is_not_floored_by_the_capture(slow_fabric):
    """Communication at a ninth of its captured transfer: each rank gains at least three
    quarters of the transfer it no longer waits for (the rest goes to the refill behind syncs
    and the wait for peers); every rank replays the same iterations (``span``)."""
    r = slow_fabric
    spec = {"kind": "scale", "ops": "group:EP,DP,EDP,TP,ETP", "factor": [0.3, 0.111, 0.05]}
    w = transforms.apply(spec, "best", r.traces, r.untraced, r.ctx)
    out = r.replay(w)
    checked = 0
    for gi, t in enumerate(r.traces):
        saved = (r.untraced_out.ends[gi] - out.ends[gi]) / t.iterations
        freed = r.ctx.transfer[gi].sum() * (1 - 0.111) / t.iterations
        assert saved >= 0.75 * freed
        checked += 1
    assert checked == 4
