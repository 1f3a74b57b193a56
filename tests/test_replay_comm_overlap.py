"""The tp_overlap (Megatron's --tp-comm-overlap) and ep_overlap (--overlap-moe-expert-parallel-comm)
transforms worked out by hand, and priced on real captures."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from profclass.replay import transforms
from profclass.replay.scenario import captured
from profclass.replay.trace import COMM, COMPUTE
from test_replay_engine import _trace

MS = 1_000_000
SPEC = {"kind": "tp_overlap", "slowdown": [1.12, 1.06, 1.0]}


def _layer():
    """One stream, back to back: a TP all-gather (4 ms), a bias kernel (1), a GEMM (10), a GEMM
    (6), a TP reduce-scatter (8), a norm kernel (1), a TP all-reduce (6), a GEMM (2), a DP
    all-reduce (5)."""
    durs = [4, 1, 10, 6, 8, 1, 6, 2, 5]
    kinds = [COMM, COMPUTE, COMPUTE, COMPUTE, COMM, COMPUTE, COMM, COMPUTE, COMM]
    starts = np.cumsum([0] + durs[:-1])
    t = _trace([(s * MS, d * MS, 0, k, -1, 0, 0) for s, d, k in zip(starts, durs, kinds)], [])
    gemm = np.array([False, False, True, True, False, False, False, True, False])
    t = replace(t, ops=replace(t.ops, gemm=gemm))
    groups = np.array(["TP", "", "", "", "TP", "", "TP", "", "DP"], object)
    colls = np.array(["all_gather", "", "", "", "reduce_scatter", "", "all_reduce", "", "all_reduce"], object)
    transfer = np.where(np.array(kinds) == COMM, np.array(durs) * MS, 0).astype(np.int64)
    ctx = transforms.Context(op_groups=(groups,), ep_segments=(np.full(9, -1),), op_colls=(colls,),
                             transfer=(transfer,), members=({"TP": [0, 1]},))
    return t, ctx


def test_each_tp_collective_hides_behind_its_gemm_by_the_ring_exchange_formula():
    t, ctx = _layer()
    w = transforms.apply(SPEC, "high", [t], [captured(t)], ctx)[0]  # no slowdown
    left = w.transfer_scale * ctx.transfer[0] / MS
    # TP 2: each exchange hides behind half the GEMM, min(c, g (n - 1) / n)
    assert left[0] == pytest.approx(0.0)  # all-gather 4 before the 10 ms GEMM: min(4, 5)
    assert left[4] == pytest.approx(5.0)  # reduce-scatter 8 after the 6 ms GEMM: 8 - min(8, 3)
    # the all-reduce (sequence parallelism turned on with the overlap): a reduce-scatter half
    # and an all-gather half; the GEMM before it is behind another collective, so only the
    # all-gather half hides, behind the 2 ms GEMM after it: 6 - min(3, 1)
    assert left[6] == pytest.approx(5.0)
    assert left[8] == pytest.approx(5.0)  # the DP all-reduce is not the transform's
    assert (w.op_dur == t.ops.dur).all()


def test_the_gemms_it_pipelines_with_slow_down_and_nothing_else():
    t, ctx = _layer()
    w = transforms.apply(SPEC, "low", [t], [captured(t)], ctx)[0]
    slowed = np.flatnonzero(w.op_dur != t.ops.dur)
    assert list(slowed) == [2, 3, 7]
    assert (w.op_dur[slowed] == (t.ops.dur[slowed] * 1.12).astype(np.int64)).all()


def test_without_a_tp_group_of_two_there_is_nothing_to_price():
    t, ctx = _layer()
    one = replace(ctx, members=({"TP": [0]},))
    assert transforms.apply(SPEC, "best", [t], [captured(t)], one) is None


@pytest.mark.parametrize("name", ["mcore_dense_tp2sp_pp2", "mcore_dense_tp2_dp2"])
def test_tp_overlap_priced_on_a_capture_within_its_tp_transfers(name):
    """The price is a critical-path replay, never more than the step's matched TP transfers
    (what the overlap can hide), and its range runs from the slowed to the unslowed GEMMs."""
    import profclass
    from conftest import profile_path

    d = profclass.diagnose(str(profile_path(name)), price_fixes=("tp_comm_overlap",), keep_replay=True)
    p = d.replay["requested"]["tp_comm_overlap"]
    assert p["basis"].startswith("replay:tp_overlap")
    assert 0 < p["low_ms"] < p["best_ms"] < p["high_ms"]
    inp = d.extra.replay_inputs
    from profclass.replay.run import Replayer
    r = Replayer(inp)
    tp = [((g == "TP") & (x > 0)) for g, x in zip(r.ctx.op_groups, r.ctx.transfer)]
    per_gpu = [x[s].sum() / t.iterations / 1e6 for x, s, t in zip(r.ctx.transfer, tp, r.traces)]
    assert p["high_ms"] <= max(per_gpu)


EP_SPEC = {"kind": "ep_overlap", "slowdown": [1.32, 1.22, 1.0]}


def _ep_layer(microbatches):
    """One stream: a 10 ms expert GEMM, a 4 ms EP all-to-all, a 10 ms GEMM, a 4 ms EP all-to-all,
    a 2 ms TP all-reduce: 20 ms of compute beside 8 ms of EP transfers."""
    durs, kinds = [10, 4, 10, 4, 2], [COMPUTE, COMM, COMPUTE, COMM, COMM]
    starts = np.cumsum([0] + durs[:-1])
    t = _trace([(s * MS, d * MS, 0, k, -1, 0, 0) for s, d, k in zip(starts, durs, kinds)], [])
    groups = np.array(["", "EP", "", "EP", "TP"], object)
    transfer = np.where(np.array(kinds) == COMM, np.array(durs) * MS, 0).astype(np.int64)
    ctx = transforms.Context(op_groups=(groups,), ep_segments=(np.full(5, -1),), op_colls=(groups,),
                             transfer=(transfer,), microbatches=microbatches)
    return t, ctx


@pytest.mark.parametrize("m, point, left", [
    (2, "high", 0.5),  # half the passes paired, all of it hidden (20 ms of compute > 8): 1 - 1/2
    (4, "high", 0.25),  # 3 of 4 pairs: 1 - 3/4
    (4, "best", 1 - 0.75 * (2 - 1.22)),  # the hidden part pays 22% back in slower compute
])
def test_ep_all_to_alls_hide_in_the_paired_passes(m, point, left):
    t, ctx = _ep_layer(m)
    w = transforms.apply(EP_SPEC, point, [t], [captured(t)], ctx)[0]
    assert w.transfer_scale[[1, 3]] == pytest.approx([left, left])
    assert w.transfer_scale[4] == 1.0 and (w.op_dur == t.ops.dur).all()


def test_ep_overlap_hides_no_more_than_the_compute_beside_it():
    t, ctx = _ep_layer(2)
    t = replace(t, ops=replace(t.ops, dur=np.array([2, 4, 2, 4, 2]) * MS))  # 4 ms of compute, 8 of EP
    w = transforms.apply(EP_SPEC, "high", [t], [captured(t)], ctx)[0]
    assert w.transfer_scale[1] == pytest.approx(1 - 0.5 * 4 / 8)


@pytest.mark.parametrize("m", [None, 1])
def test_ep_overlap_needs_two_micro_batches_to_pair(m):
    t, ctx = _ep_layer(m)
    assert transforms.apply(EP_SPEC, "best", [t], [captured(t)], ctx) is None
