"""The call-by-call pipeline schedule (profclass/replay/p2p_calls.py): Megatron-Core's P2P calls
per stage, counted against real captures' PP kernels, a batched call's wait for both
neighbours worked by hand, and the capture's P2P mode read from its kernels."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import profclass
from profclass.analyzers import pp_program as pc
from profclass.replay import pipeline_schedule as ps
from profclass.replay.run import Replayer

PROFILES = Path(__file__).resolve().parent.parent / "fixtures" / "profiles"


def _pp_sendrecv_per_step(name: str) -> tuple[list[float], Replayer]:
    d = profclass.diagnose(str(PROFILES / f"{name}.sqlite.xz"), keep_replay=True)
    r = Replayer(d.extra.replay_inputs)
    return [float(((kd["group"] == "PP") & (kd["collective"] != "all_reduce")).sum()) / t.iterations
            for t, kd in zip(r.traces, r.groups)], r


@pytest.mark.parametrize("name,v", [("mcore_gb_pp4s_m8", 1), ("mcore_gb_pp4s_vpp2_m8", 2)])
def test_calls_are_the_captures_pp_kernels(name, v):
    """PP 4, 8 micro-batches: each batched call is one NCCL kernel, so the program's calls per
    stage are the capture's PP send/recv kernels per step (1F1B: 11, 21, 19, 9; interleaved:
    25, 25, 23, 21), within the window's edges (one kernel a step)."""
    counts, r = _pp_sendrecv_per_step(name)
    stage = [row["stage"] for row in r.inp.pipeline.per_stage]
    want = [pc.kernels_per_step(4, v, 8, s, ps.BATCHED) for s in stage]
    assert np.abs(np.array(counts) - want).max() <= 1, (counts, want)
    assert r.stages.p2p == ps.BATCHED
    # the overlapped mode would launch far more: each posted tensor is a kernel of its own
    if v == 2:
        assert all(pc.kernels_per_step(4, 2, 8, s, ps.OVERLAPPED) > 1.5 * c for s, c in zip(stage, counts))


def test_a_batched_call_waits_for_both_neighbours():
    """p = 2, v = 2, m = 4, no exchange cost: balanced stages give the known interleaved step
    (v m + p - 1 chunk slots) in both modes. With stage 0's backward twice as slow, the
    overlapped schedule takes 41 and the batched one 42: a batched steady call holds a stage
    until both neighbours have posted theirs, even where its next forward's input is there
    (on PP 4 with a slow third stage: 48 against 47)."""
    for mode in (ps.BATCHED, ps.OVERLAPPED):
        s = ps.simulate(2, 2, 4, [1, 1], [2, 2], 0, 0, mode)
        assert float(s.end.max()) == pytest.approx((2 * 4 + 1) * 3)
    slow = dict(f_comp=[1, 1], b_comp=[4, 2], x=0.0)
    assert ps.simulate(2, 2, 4, mode=ps.BATCHED, **slow).end.max() == pytest.approx(42)
    assert ps.simulate(2, 2, 4, mode=ps.OVERLAPPED, **slow).end.max() == pytest.approx(41)
    slow4 = dict(f_comp=[1] * 4, b_comp=[2, 2, 4, 2], x=0.0)
    assert ps.simulate(4, 2, 4, mode=ps.BATCHED, **slow4).end.max() == pytest.approx(48)
    assert ps.simulate(4, 2, 4, mode=ps.OVERLAPPED, **slow4).end.max() == pytest.approx(47)


def test_1f1b_program_is_megatrons():
    """forward_backward_pipelining_without_interleaving on the middle stage of PP 3, m = 2:
    recv_forward, forward, send_forward (warm-up), recv_forward, then forward,
    send_forward_recv_backward, backward, send_backward (the last steady one), recv_backward,
    backward, send_backward (cool-down)."""
    prog = pc.program(3, 1, 2, 1)
    kinds = [it[0] if it[0] == "X" else ("B" if it[1][0] else "F") for it in prog]
    assert kinds == ["X", "F", "X", "X", "F", "X", "B", "X", "X", "B", "X"]
    assert prog[5] == ("X", (("f", 1, 0, 1),), (("b", 2, 0, 0),))  # send_forward_recv_backward


def test_interleaved_steady_call_moves_four_tensors():
    """The batched interleaved steady call sends the forward's output and the backward's
    gradient and receives the next forward's input and the next backward's gradient."""
    steady = [it for it in pc.program(4, 2, 8, 1) if it[0] == "X" and len(it[1]) == 2 and len(it[2]) == 2]
    assert steady, "no send_forward_backward_recv_forward_backward on a middle stage"


def test_captured_mode_is_the_closest_kernel_count():
    p, v, m, stage = 4, 2, 8, [0, 1, 2, 3]
    batched = [pc.kernels_per_step(p, v, m, s, ps.BATCHED) for s in stage]
    overlapped = [pc.kernels_per_step(p, v, m, s, ps.OVERLAPPED) for s in stage]
    assert pc.captured_p2p(p, v, m, stage, batched) == ps.BATCHED
    assert pc.captured_p2p(p, v, m, stage, overlapped) == ps.OVERLAPPED
    assert pc.captured_p2p(p, 1, m, stage, overlapped) == ps.BATCHED  # 1F1B's calls are batched


def test_a_requested_mode_moves_the_price():
    """The mode is a parameter of the fix: asked for, it is used at every point; unasked on a
    1F1B base, the low point is batched and the best overlapped."""
    st = ps.Stages(p=4, v=1, m=8, work=np.array([3e6, 3e6, 4.5e6, 3e6]), rest=np.zeros(4), floor=1e5,
                   gaps=np.full(8, 2e5), measured_step=0.0, gpu_stage=(0, 1, 2, 3), meet=False)
    asked = {m: ps.gains_ms({"kind": "pp_schedule", "vpp": 2, "p2p": m}, st) for m in (ps.BATCHED, ps.OVERLAPPED)}
    assert asked[ps.BATCHED]["best"] != asked[ps.OVERLAPPED]["best"]
    default = ps.gains_ms({"kind": "pp_schedule", "vpp": 2, "p2p": "default"}, st)
    assert default["best"] == pytest.approx(asked[ps.OVERLAPPED]["best"])
    assert default["low"] == pytest.approx(asked[ps.BATCHED]["low"])


def test_the_sync_idle_is_measured_within_the_stages_idle():
    """On a captured 1F1B job (every P2P call ends in a device sync) the GPU idle after those
    syncs that a host ahead would not leave is positive on every stage and no more than the
    stage's idle per step (the pipeline analyzer's)."""
    _, r = _pp_sendrecv_per_step("mcore_gb_pp4s_m8")
    idle = {row["stage"]: row["idle_ms"] for row in r.inp.pipeline.per_stage}
    got = r.stages.sync_idle / 1e6
    assert (got > 0).all()
    assert all(got[s] <= idle[s] + 1e-6 for s in range(4)), (got, idle)


def test_overlapped_p2p_takes_the_sync_idle_away_and_batched_pays_it_per_call():
    """Uniform stages with 4 ms of sync idle a step each and no host gap after an exchange: an
    overlapped interleaved schedule runs that much faster than from stages with none, scaled by
    the schedule (every chunk slot is shorter, the bubble's too: (v m + p - 1) / (v m) = 19 / 16);
    the batched one's price falls: each call it adds pays the refill its device sync leaves (the
    idle per call, less the gap the exchange's cost already holds)."""
    base = ps.Stages(p=4, v=1, m=8, work=np.full(4, 3e6), rest=np.zeros(4), floor=1e5, gaps=np.zeros(8),
                     measured_step=0.0, gpu_stage=(0, 1, 2, 3), meet=False, sync_idle=np.zeros(4))
    idle = replace(base, sync_idle=np.full(4, 4e6))
    spec = {m: {"kind": "pp_schedule", "vpp": 2, "p2p": m} for m in (ps.BATCHED, ps.OVERLAPPED)}
    assert ps.gains_ms(spec[ps.BATCHED], idle)["best"] < ps.gains_ms(spec[ps.BATCHED], base)["best"] - 1.0
    x = ps.exchange_cost(base, 0.5)
    faster = ps.step_ns(base, 2, 8, x, p2p=ps.OVERLAPPED) - ps.step_ns(idle, 2, 8, x, p2p=ps.OVERLAPPED)
    assert faster / 1e6 == pytest.approx(4.0 * 19 / 16)


def test_the_gap_after_an_exchange_leaves_once():
    """The sync idle holds the host's gap after each exchange, which the exchange's cost ``x``
    also holds: stages whose sync idle is exactly those gaps (0.2 ms after each of a stage's
    calls) price an overlapped schedule as stages with none do (the gaps go once, with ``x``),
    not 0.2 ms a call faster."""
    gap = 2e5
    base = ps.Stages(p=4, v=1, m=8, work=np.full(4, 3e6), rest=np.zeros(4), floor=1e5, gaps=np.full(8, gap),
                     measured_step=0.0, gpu_stage=(0, 1, 2, 3), meet=False, sync_idle=np.zeros(4))
    calls = np.array([pc.calls_per_microbatch(4, 1, 8, s) for s in range(4)])
    gaps_only = replace(base, sync_idle=calls * 8 * gap)
    x = ps.exchange_cost(base, 0.5)
    assert ps.step_ns(gaps_only, 2, 8, x, p2p=ps.OVERLAPPED) == pytest.approx(ps.step_ns(base, 2, 8, x, p2p=ps.OVERLAPPED))


def test_the_overlap_fix_is_priced_where_the_capture_batches(diagnosis):
    """pp_overlap_p2p lists on an interleaved capture whose P2P ran batched, priced by the
    schedule alone (no share model) at less than the step; a 1F1B capture does not list it."""
    d = diagnosis("mcore_gb_pp4s_vpp2_m8")
    fixes = {f["id"]: f for f in d.fixes}
    assert "pp_overlap_p2p" in fixes
    fix = fixes["pp_overlap_p2p"]
    assert fix["gain_model"] == "replay:pp_schedule"
    assert 0 < fix["gain_low_ms"] <= fix["expected_gain_ms"] <= fix["gain_high_ms"] < d.window["step_ms"]["mean"]
    assert "pp_overlap_p2p" not in {f["id"] for f in diagnosis("mcore_gb_pp4s_m8").fixes}
    # its basis says what the overlapped price assumes; interleaving more, batched as captured, does not
    assert "sync idle leaves once" in fix["gain_basis"] and "the busiest stage by -0.5%" in fix["gain_basis"]
    assert "sync idle leaves once" not in fixes["pp_interleave"]["gain_basis"]


def test_the_report_states_the_schedule_its_p2p_mode_and_sync_idle(diagnosis):
    """replay.pipeline_schedule carries the captured P2P mode and each stage's idle after the
    P2P syncs (schema 2.7.0), and the report says them in words; a job with no pipeline has
    neither."""
    from profclass import formatting

    d = diagnosis("mcore_gb_pp4s_vpp2_m8")
    sched = d.replay["pipeline_schedule"]
    assert sched["p2p"] == ps.BATCHED and len(sched["sync_idle_ms"]) == 4
    assert all(x >= 0 for x in sched["sync_idle_ms"]) and max(sched["sync_idle_ms"]) > 0
    line = next(x for x in formatting.replay_lines(d) if x.startswith("Pipeline schedule"))
    assert "interleaved (2 chunks a stage, P2P batched)" in line, line
    assert f"{sched['sync_idle_ms'][3]:.1f}" in line and f"{sched['simulated_step_ms']:.1f} ms" in line
    flat = diagnosis("mcore_ep4_base")
    assert "pipeline_schedule" not in flat.replay
    assert not any(x.startswith("Pipeline schedule") for x in formatting.replay_lines(flat))


def test_the_pipeline_analyzer_reads_the_mode_and_the_overlap_fix_needs_batched(diagnosis):
    """pipeline.p2p and per_stage[].sendrecv_per_step (schema 2.8.0) on the batched interleaved
    capture: the program's kernels per stage within the window's edges; pp_overlap_p2p applies
    where the mode is batched and not where it is overlapped (a capture that already overlaps)."""
    from profclass import fixes

    d = diagnosis("mcore_gb_pp4s_vpp2_m8")
    assert d.pipeline["p2p"] == pc.BATCHED
    for row in d.pipeline["per_stage"]:
        assert abs(row["sendrecv_per_step"] - pc.kernels_per_step(4, 2, 8, row["stage"], pc.BATCHED)) <= 1, row
    fix = next(f for f in fixes.load_table() if f["id"] == "pp_overlap_p2p")
    ctx = {"pp_interleaved": True, "pp_p2p_batched": True, "scope": "training"}
    assert fixes._applies(fix, ctx, {})
    assert not fixes._applies(fix, {**ctx, "pp_p2p_batched": False}, {})


def test_overlapped_kernels_slow_the_compute_beside_them_by_hand():
    """Balanced stages (busy 2 ms of a 3 ms micro-batch), no exchange cost: an overlapped
    interleaved schedule from a batched capture lengthens every chunk slot by the slowdown's
    share of its busy time, so the step grows by (v m + p - 1) / v x slowdown x busy; a batched
    one, or a capture that already overlapped (its busy time has it), does not move."""
    st = ps.Stages(p=4, v=1, m=8, work=np.full(4, 3e6), rest=np.zeros(4), floor=0.0, gaps=np.zeros(8),
                   measured_step=0.0, gpu_stage=(0, 1, 2, 3), meet=False, sync_idle=np.zeros(4),
                   busy=np.full(4, 2e6))
    s = ps.OVERLAP_SLOWDOWN[1]
    grow = ps.step_ns(st, 2, 8, 0.0, p2p=ps.OVERLAPPED, slowdown=s) - ps.step_ns(st, 2, 8, 0.0, p2p=ps.OVERLAPPED)
    assert grow == pytest.approx((2 * 8 + 4 - 1) / 2 * s * 2e6)
    assert ps.step_ns(st, 2, 8, 0.0, p2p=ps.BATCHED, slowdown=s) == ps.step_ns(st, 2, 8, 0.0, p2p=ps.BATCHED)
    ovl = replace(st, v=2, p2p=ps.OVERLAPPED)
    assert ps.step_ns(ovl, 2, 8, 0.0, slowdown=s) == ps.step_ns(ovl, 2, 8, 0.0)


def test_the_busiest_stage_is_not_slowed_by_its_posted_kernels():
    """A posted send/recv kernel takes SMs while it waits for its peer: the stages that wait for
    another slow (``OVERLAP_SLOWDOWN``), the busiest, which the others wait for, does not
    (``OVERLAP_SLOWDOWN_BUSIEST``). On the batched gpubound2 capture whose overlapped twin
    measured +3.2, +0.9, +2.8 and -0.2% on its four GPUs, the busiest stage by work is the fourth."""
    st = ps.Stages(p=3, v=1, m=4, work=np.array([2e6, 3e6, 2.5e6]), rest=np.zeros(3), floor=0.0,
                   gaps=np.zeros(4), measured_step=0.0)
    for i, point in enumerate(ps.POINTS):
        assert list(ps.overlap_slowdown(st, point)) == [ps.OVERLAP_SLOWDOWN[i], ps.OVERLAP_SLOWDOWN_BUSIEST[i],
                                                        ps.OVERLAP_SLOWDOWN[i]]
    _, r = _pp_sendrecv_per_step("mcore_gb_pp4s_vpp2_m8")
    assert int(np.argmax(r.stages.work)) == 3


def test_the_refill_is_the_idle_the_host_leaves_not_a_queued_ops_wait():
    """After a device sync on a PP send/recv (op 0, ends at 100 ns; the sync returns at 110;
    op 1, queued before, runs to 120) the GPU idles twice: until 200, for op 2, which the host
    launched at 150 (the refill: counted), and from 300 to 800 before op 3, which was launched at
    160, before the GPU ran dry (the GPU waited for something else, a wait the sync does not
    cause: not counted)."""
    from test_replay_engine import _trace  # the engine tests' hand-built traces

    from profclass.replay import schedule_inputs as si
    from profclass.replay.trace import COMM, COMPUTE, LAUNCH, SYNC

    def trace(op3_launch):  # ops: (start, dur, stream, kind, launch call, lag, gap); calls: (start, dur, tid, kind, gap, target, wake)
        return _trace([(0, 100, 0, COMM, -1, 0, 0), (100, 20, 0, COMPUTE, 0, 0, 0), (200, 100, 0, COMPUTE, 2, 0, 0),
                       (800, 100, 0, COMPUTE, 3, 0, 0)],
                      [(10, 5, 1, LAUNCH, 0, -1, 0), (50, 5, 1, SYNC, 0, 0, 10), (140, 10, 1, LAUNCH, 0, -1, 0),
                       (op3_launch, 5, 1, LAUNCH, 0, -1, 0)])

    assert si._idle_after_syncs(trace(155), np.array([0])) == pytest.approx(80)
    assert si._idle_after_syncs(trace(700), np.array([0])) == pytest.approx(580)  # launched at 705: both count
