"""Launches that waited on a full launch queue (``host_calls._queue_full``)."""
from __future__ import annotations

import numpy as np

from profclass.replay import host_calls
from profclass.replay.constants import QUEUE_MIN_DEPTH
from profclass.replay.trace import LAUNCH


def _one_stream(n_ops: int, depth: int, op_ns: int = 100_000, call_ns: int = 5_000):
    """A GPU-bound stream as CUDA runs it: the host launches an op every ``call_ns`` until
    ``depth`` are pending, then each launch returns 2 us after the oldest pending op ends."""
    cs, ce, start, end = [], [], [], []
    t = 0
    for i in range(n_ops):
        s = t
        t += call_ns
        if i >= depth:  # the queue is full until op i - depth ends
            t = max(t, end[i - depth] + 2_000)
        cs.append(s)
        ce.append(t)
        st = max(s + 3_000, end[-1] if end else 0)
        start.append(st)
        end.append(st + op_ns)
    return (np.array(cs, np.int64), np.array(ce, np.int64), np.array(start, np.int64),
            np.array(end, np.int64), np.arange(n_ops, dtype=np.int64))


def test_a_launch_made_while_the_queue_is_full_waits_for_the_op_that_frees_a_slot():
    cs, ce, start, end, launch = _one_stream(3_000, 1_000)
    kind = np.full(len(cs), LAUNCH, np.int8)
    target, wake, dur = host_calls._blocking(cs, ce, kind, start, end, launch)
    waited = ce - cs > 5_000
    assert waited.sum() > 1_500
    # every launch that waited is held by the op that ended just before it returned
    hit = target >= 0
    assert (hit[waited]).mean() > 0.99
    assert np.all(end[target[hit]] <= ce[hit]) and np.all(wake[hit] <= 2_000)
    assert np.all(dur[hit] <= 2_000)  # its own time is what it took after the release
    assert not hit[:900].any()  # the queue filling up: launches that waited for nothing


def test_a_queue_never_half_full_blocks_no_launch():
    """Long launch calls with an op ending inside them, on a GPU that never held
    ``QUEUE_MIN_DEPTH`` pending ops (a host-paced job, a descheduled thread): host time."""
    cs, ce, start, end, launch = _one_stream(400, QUEUE_MIN_DEPTH // 2)
    assert not host_calls._queue_full(cs, start, end, launch).any()
    kind = np.full(len(cs), LAUNCH, np.int8)
    target, _, dur = host_calls._blocking(cs, ce, kind, start, end, launch)
    assert (target < 0).all() and np.array_equal(dur, ce - cs)


def test_on_a_capture_that_filled_its_queue_the_waiting_launches_began_at_its_depth(diagnosis):
    """``affinity_cand_2gpu``'s second GPU filled its launch queue (1,018 ops pending at most):
    the replay holds launches that waited on it, each on an op that ended while it was inside."""
    inp = diagnosis("affinity_cand_2gpu").extra.replay_inputs
    blocked = 0
    for t in inp.traces:
        c = t.calls
        waits = (c.c_kind == LAUNCH) & (c.c_target >= 0)
        blocked += int(waits.sum())
        assert np.all(t.ops.start[c.c_target[waits]] + t.ops.dur[c.c_target[waits]] >= c.c_start[waits])
    assert blocked > 0
