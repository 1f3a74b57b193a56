"""The overlap transform (Megatron's --overlap-grad-reduce) on a graph worked out by hand, and
priced on a real capture."""
from __future__ import annotations

import math

import numpy as np
import pytest

from profclass.replay import engine, scenario, transforms
from profclass.replay.trace import COMM, COMPUTE
from test_replay_engine import _trace

MS = 1_000_000
SPEC = {"kind": "overlap", "ops": "group:DP"}


def _backward_then_reduce():
    """One stream: four 10 ms backward kernels (0-40 ms), a 40 ms DP all-reduce (40-80), a
    10 ms optimizer kernel (80-90); nothing launched from the window's host."""
    ops = [(i * 10 * MS, 10 * MS, 0, COMPUTE, -1, 0, 0) for i in range(4)]
    ops += [(40 * MS, 40 * MS, 0, COMM, -1, 0, 0), (80 * MS, 10 * MS, 0, COMPUTE, -1, 0, 0)]
    t = _trace(ops, [])
    groups = np.array(["", "", "", "", "DP", ""], object)
    colls = np.array(["", "", "", "", "all_reduce", ""], object)
    det = transforms.detachable(t, groups, colls)
    g = engine.build_graph([t], [], [det])
    w = [scenario.captured(t)]
    ctx = transforms.Context(op_groups=(groups,), ep_segments=(np.full(6, -1),), op_colls=(colls,),
                             detachable=(det,), transfer=(np.zeros(6, np.int64),), microbatches=1,
                             graph=g, replay=lambda ws: scenario.run(g, ws))
    return t, g, w, ctx


def test_the_detachable_reduction_replays_as_captured():
    t, g, w, _ = _backward_then_reduce()
    out = scenario.run(g, w)
    assert int(out.t[g.op_node[0][4]]) == 40 * MS and out.ends[0] == 90 * MS


def test_a_reduction_after_the_backward_overlaps_it_from_its_first_bucket():
    t, g, w, ctx = _backward_then_reduce()
    # 2 buckets; the backward window is 2/3 of the 50 ms of compute (33.3 ms), so the first
    # bucket is ready once 16.7 ms of it ran after 6.7 ms: at the end of the kernel that
    # crosses 23.3 ms of compute (kernel 2, ends at 30 ms). The reduction (40 ms + 0.02 ms for
    # the second bucket's collective) starts at max(30, 40 - 20.01) = 30 ms, ends 70.02 ms; the
    # optimizer follows: the step ends at 80.02 instead of 90 ms.
    ws = transforms.apply({**SPEC, "buckets": 2, "slowdown": 1.0}, "best", [t], w, ctx)
    out = scenario.run(g, ws)
    assert int(out.t[g.op_node[0][4]]) == 30 * MS
    assert out.ends[0] == 80 * MS + 20_000
    # one bucket: nothing is ready before the backward ends; the reduction starts at 40 ms
    one = scenario.run(g, transforms.apply({**SPEC, "buckets": 1, "slowdown": 1.0}, "best", [t], w, ctx))
    assert int(one.t[g.op_node[0][4]]) == 40 * MS and one.ends[0] == 90 * MS


def test_compute_under_the_moved_reduction_slows_by_the_factor():
    t, g, w, ctx = _backward_then_reduce()
    ws = transforms.apply({**SPEC, "buckets": 2, "slowdown": 1.5}, "best", [t], w, ctx)
    # kernel 3 (30-40 ms) ran under the reduction (30-70 ms) for all of its 10 ms: 15 ms now;
    # kernels 0-2 ended before it started, the optimizer runs after it
    assert list(ws[0].op_dur[[0, 1, 2, 3, 5]]) == [10 * MS, 10 * MS, 10 * MS, 15 * MS, 10 * MS]
    out = scenario.run(g, ws)
    # the reduction still starts at 30 ms (its second bound: kernel 3's end 45 - 20.01) and
    # the step ends at 80.02 ms: the slower kernel is hidden under it
    assert int(out.t[g.op_node[0][4]]) == 30 * MS and out.ends[0] == 80 * MS + 20_000


def test_an_added_edge_against_the_graph_order_is_refused():
    t, g, w, _ = _backward_then_reduce()
    bad = scenario.Weights(**{**vars(w[0]), "ready_src": np.array([5]), "ready_dst": np.array([0]),
                              "ready_lag": np.array([0])})
    with pytest.raises(ValueError):
        scenario.run(g, [bad])


def test_dp_overlap_priced_on_a_capture():
    import profclass
    from conftest import profile_path

    d = profclass.diagnose(str(profile_path("dpnooverlap_4gpu")), price_fixes=("dp_overlap_grad_reduce",))
    price = d.replay["requested"]["dp_overlap_grad_reduce"]
    assert price["basis"].startswith("replay:overlap")
    lo, best, hi = price["low_ms"], price["best_ms"], price["high_ms"]
    assert all(math.isfinite(v) for v in (lo, best, hi))
    assert 0 < lo <= best <= hi < d.window["step_ms"]["mean"]
