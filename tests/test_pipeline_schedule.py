"""The pipeline-schedule replay (profclass/replay/pipeline_schedule.py): Megatron-Core's op
order, hand-worked schedules, fidelity on the PP captures, and a PP fix priced by it."""
from __future__ import annotations

import importlib.util
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from profclass.analyzers.pp_program import order
from profclass.replay import pipeline_schedule as ps

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("replay_fidelity", ROOT / "fixtures" / "replay_fidelity.py")
fidelity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fidelity)


def test_1f1b_order_is_megatrons():
    """forward_backward_pipelining_without_interleaving: min(p - r - 1, m) warm-up forwards,
    then one forward and one backward a step, then the remaining backwards."""
    F, B = (lambda i: (False, 0, i)), (lambda i: (True, 0, i))
    assert order(2, 1, 2, 0) == [F(0), F(1), B(0), B(1)]
    assert order(2, 1, 2, 1) == [F(0), B(0), F(1), B(1)]
    assert order(4, 1, 2, 0) == [F(0), F(1), B(0), B(1)]  # warm-up capped at m
    assert order(4, 1, 8, 1)[:4] == [F(0), F(1), F(2), B(0)]


def test_interleaved_order_is_megatrons():
    """forward_backward_pipelining_with_interleaving (p=2, v=2, m=4, rank 0): warm-up
    (p - r - 1) * 2 + (v - 1) * p = 4 chunk-forwards in get_schedule_table's order (groups of p
    micro-batches, chunk by chunk), backwards in the same order with the chunk reversed."""
    F, B = (lambda c, i: (False, c, i)), (lambda c, i: (True, c, i))
    assert order(2, 2, 4, 0) == [F(0, 0), F(0, 1), F(1, 0), F(1, 1),
                                    F(0, 2), B(1, 0), F(0, 3), B(1, 1), F(1, 2), B(0, 0), F(1, 3), B(0, 1),
                                    B(1, 2), B(1, 3), B(0, 2), B(0, 3)]
    assert len(order(4, 2, 4, 3)) == 2 * 2 * 4
    assert order(4, 2, 4, 0)[:8] == [F(c, i) for c in (0, 1) for i in range(4)]  # all warm-up: min(10, 8)


def test_p2_m2_by_hand():
    """Forward 1, backward 2, no exchange cost. Stage 0: F0 [0,1], F1 [1,2], B0 after stage 1's
    B0 [2,4]: [4,6], B1 after stage 1's B1: stage 1 runs F0 [1,2], B0 [2,4], F1 [4,5], B1 [5,7],
    so stage 0's B1 is [7,9]."""
    s = ps.simulate(2, 1, 2, [1, 1], [2, 2], 0)
    assert list(s.start) == [0, 1] and list(s.end) == [9, 7] and list(s.busy) == [6, 6]


@pytest.mark.parametrize("p,v,m,f,b", [(4, 1, 8, 1, 2), (4, 2, 4, 1, 1), (4, 2, 8, 1, 2), (2, 2, 4, 1, 2), (8, 1, 16, 1, 2)])
def test_balanced_stages_give_the_known_bubble(p, v, m, f, b):
    """Balanced stages, no exchange cost: the step is (v m + p - 1) chunk slots, the bubble
    (p - 1) / (v m + p - 1) of it (Narayanan et al. 2021)."""
    s = ps.simulate(p, v, m, [f] * p, [b] * p, 0)
    step = float(s.end.max())
    assert step == pytest.approx((v * m + p - 1) * (f + b))
    assert 1 - s.busy[0] / step == pytest.approx((p - 1) / (v * m + p - 1))


def test_exchange_cost_and_a_slow_stage_lengthen_the_step():
    base = ps.simulate(4, 1, 8, [1] * 4, [2] * 4, 0).end.max()
    assert ps.simulate(4, 1, 8, [1] * 4, [2] * 4, 0.1).end.max() > base
    slow = ps.simulate(4, 1, 8, [1, 1, 1.5, 1], [2, 2, 3, 2], 0).end.max()
    assert slow >= 8 * 4.5  # the slow stage's m slots bound the step


def test_schedule_fidelity_on_the_pp_captures():
    """Every pipelined capture's schedule, simulated at its captured (p, v, m) from its measured
    inputs, against its measured step (the snapshots; docs/replay.md's table is this one)."""
    rows = fidelity.schedule_rows()
    assert len(rows) >= 15
    assert statistics.median(abs(r["error_pct"]) for _, r in rows) <= fidelity.SCHEDULE_TOL_PCT, rows
    assert fidelity.schedule_table(rows) in (ROOT / "docs" / "replay.md").read_text(), \
        "docs/replay.md is out of date: python fixtures/replay_fidelity.py"


@pytest.mark.xfail(strict=True, reason="12 of 17 pipelined captures within 5%: the host-bound PP 4 jobs (-5.2% to "
                   "-5.6%), the recipe's PP 2 x VPP 2 job (-5.0%) and mcore_gb_pp4_vpp2_m8 (-5.8%, two steady "
                   "steps of the whole-period window) are 5-6% from the simulation")
def test_every_schedule_within_target():
    assert all(abs(r["error_pct"]) <= fidelity.SCHEDULE_TOL_PCT for _, r in fidelity.schedule_rows())


def test_a_pp_fix_is_priced_by_the_schedule(diagnosis):
    """mcore_gb_pp4_m4: more micro-batches priced by the schedule simulation (per the base's
    samples), inside its range and below the step; the plan applies it as a step delta."""
    d = diagnosis("mcore_gb_pp4_m4")
    fix = next(f for f in d.fixes if f["id"] == "pp_microbatches")
    assert fix["gain_model"] == "replay:pp_schedule"
    step = d.window["step_ms"]["mean"]
    assert 0 < fix["gain_low_ms"] <= fix["expected_gain_ms"] <= fix["gain_high_ms"] < step
    rows = [p for p in d.plan if p["id"] == "pp_microbatches"]
    assert rows and rows[0]["applied_as"].startswith("step delta")
    assert sum(p["gain_ms"] for p in d.plan) <= step


def _uniform(p: int, m: int, u: float, rest: float = 0.0) -> ps.Stages:
    import numpy as np
    return ps.Stages(p=p, v=1, m=m, work=np.full(p, u), rest=np.full(p, rest), floor=0.0,
                     gaps=np.zeros(1), measured_step=0.0, gpu_stage=tuple(range(p)))


@pytest.mark.parametrize("p,m,k", [(4, 8, 2), (2, 8, 2), (4, 16, 4)])
def test_a_larger_microbatch_with_no_host_saving_loses_the_bubble_it_adds(p, m, k):
    """k times larger micro-batches, m / k of them, the same work per step and no host time
    saved: the step grows by the bubble, (p - 1) x the new micro-batch's work minus the old's."""
    import numpy as np
    u = 3e6  # ns of work per captured micro-batch
    loss = ps.bigger_microbatch_ms(_uniform(p, m, u), k, np.zeros(p))
    assert loss == pytest.approx(-(p - 1) * (k - 1) * u / 1e6)


def test_a_larger_microbatch_banks_its_host_saving_less_the_bubble():
    """With a host saving of s per step on every stage (no rest), the new micro-batch's work is
    k (u - s / m): the step falls by s and grows by the bubble of the new work."""
    import numpy as np
    p, m, k, u, s = 4, 8, 2, 3e6, 8e6
    gain = ps.bigger_microbatch_ms(_uniform(p, m, u), k, np.full(p, s))
    new_u = k * (u - s / m)
    assert gain == pytest.approx(((m + p - 1) * u - (m / k + p - 1) * new_u) / 1e6)
    assert ps.bigger_microbatch_ms(_uniform(p, 3, u), 2, np.zeros(p)) is None  # 3 / 2 micro-batches


def test_back_to_back_steps_by_hand():
    """p = 2, m = 2, forward 1, backward 2 (test_p2_m2_by_hand's step: stage 0 ends at 9, stage 1
    at 7), and a rest of 3 on the last stage only. Without a meeting point the last stage's rest
    runs beside the first stage's last backward: step 2 starts at 9 on stage 0 and 10 on stage 1,
    and every step after is 9 long. With the stages meeting before the rest (the PP all-reduce),
    the rest waits for stage 0's last backward: step 2 starts at 9 on stage 0 and 12 on stage 1,
    its last backward on stage 0 ends at 20, and the step is 11."""
    f, b = [1, 1], [2, 2]
    assert ps.periodic_step(2, 1, 2, f, b, 0, [0, 0], [0, 3], meet=False) == pytest.approx(9)
    assert ps.periodic_step(2, 1, 2, f, b, 0, [0, 0], [0, 3], meet=True) == pytest.approx(11)
    # a rest before the meeting point runs beside the other stage's last backward (7 + 3 = 10
    # against 9) and then delays the meeting for every stage: the step is 10
    assert ps.periodic_step(2, 1, 2, f, b, 0, [0, 3], [0, 0], meet=True) == pytest.approx(10)
    # no rest at all: back-to-back steps overlap only as far as the dependencies let them
    assert ps.periodic_step(2, 1, 2, f, b, 0, [0, 0], [0, 0], meet=True) == pytest.approx(9)


def test_the_rest_is_the_optimizers_stretch_not_the_longest(diagnosis):
    """The last stage of mcore_wrapped_dense_tp2_pp2: a micro-batch's forward and backward
    (37 ms, no exchange between them) outlast the optimizer's stretch (33 ms); the rest is the
    latter, found by its multi_tensor_apply kernels."""
    d = diagnosis("mcore_wrapped_dense_tp2_pp2")
    sched = d.replay["pipeline_schedule"]
    assert 30 < sched["rest_ms"][1] < 35 < sched["work_ms_per_microbatch"][1]


def test_host_time_comes_off_work_and_rest_by_their_time():
    """less_host: 8 ms a step saved on a stage whose step is 4 micro-batches of 3 ms and a rest
    of 12 ms: half of it (12 of 24 ms) comes off the micro-batches (1 ms each), half off the rest."""
    import numpy as np
    st = _uniform(2, 4, 3e6, rest=12e6)
    lean = ps.less_host(st, np.full(2, 8e6))
    assert lean.work == pytest.approx(np.full(2, 2e6))
    assert lean.rest == pytest.approx(np.full(2, 8e6))
    assert ps.less_host(st, np.zeros(2)).work == pytest.approx(st.work)


def test_stage_balance_moves_whole_layers():
    """PP 4, two layers a stage of 10 ms each, the last stage also running a 25 ms loss: the best
    split Megatron-Core allows (first and last stage any count, the middle ones even) puts 35 ms
    on the busiest stage, not the continuous mean (26.5); with a 5 ms loss no split beats 25."""
    import numpy as np
    st = replace(_uniform(4, 8, 0.0), work=np.array([21.0, 20.0, 20.0, 45.0]),
                 busy=np.array([21.0, 20.0, 20.0, 45.0]), layers=np.array([2, 2, 2, 2]))
    w = ps.balanced_work(st)
    assert w.max() == pytest.approx(35.0) and w.sum() == pytest.approx(st.work.sum())
    assert "-> " in ps.balance_note(st)
    small = replace(st, work=np.array([21.0, 20.0, 20.0, 25.0]), busy=np.array([21.0, 20.0, 20.0, 25.0]))
    assert np.array_equal(ps.balanced_work(small), small.work)
    assert "no split in whole layers" in ps.balance_note(small)
    unknown = replace(st, layers=None)
    assert np.allclose(ps.balanced_work(unknown), 26.5)


def test_two_layers_a_stage_cannot_be_balanced_by_moving_one(diagnosis):
    """The dense TP 2 + SP x PP 2 job: its last stage's loss is less than a layer, so moving one of
    its two layers overshoots (the continuous mean had priced 13.4 ms/step)."""
    d = diagnosis("mcore_dense_tp2sp_pp2")
    fix = next(f for f in d.fixes if f["id"] == "pp_stage_balance")
    assert fix["expected_gain_ms"] == 0.0 and "no split in whole layers" in fix["gain_basis"]


def _vpp_gain(st: ps.Stages, sync_idle: float | None) -> float:
    """pp_interleave (VPP 2, batched) at the best point on ``st`` with each stage's idle after its
    P2P syncs set to ``sync_idle`` ns per step (None: none measured)."""
    import numpy as np
    st = replace(st, sync_idle=None if sync_idle is None else np.full(st.p, sync_idle))
    spec = {"kind": ps.KIND, "vpp": 2, "p2p": "batched", "exchange_quantile": 0.5}
    return ps.gains_ms(spec, st)["best"]


def test_batched_interleaving_pays_a_refill_per_added_sync():
    """Megatron-Core syncs the device after every batched P2P call: VPP 2 doubles a stage's
    calls, each added one pays the idle the host's refill leaves, and the base's own refill
    comes out of its work with its calls."""
    import numpy as np
    st = _uniform(4, 8, 30e6)
    none = _vpp_gain(st, None)
    assert _vpp_gain(st, 0.0) == pytest.approx(none)
    assert _vpp_gain(st, 32e6) < _vpp_gain(st, 16e6) < none
    # VPP 2 adds (calls at v = 2) - (calls at v = 1) per micro-batch on each stage, each paying the
    # refill per call; the busiest path takes at least the first stage's extra
    from profclass.analyzers.pp_program import calls_per_microbatch
    c1, c2 = (calls_per_microbatch(4, v, 8, 0) for v in (1, 2))
    per_call = 16e6 / (c1 * 8)
    assert none - _vpp_gain(st, 16e6) >= 0.5 * (c2 - c1) * 8 * per_call / 1e6
    # the captured schedule is simulated about the same whatever its refill: it is its own calls'
    base = ps.step_ns(st, 1, 8, 0.0)
    assert ps.step_ns(replace(st, sync_idle=np.full(4, 16e6)), 1, 8, 0.0) == pytest.approx(base, rel=0.02)


@pytest.mark.parametrize("m2", [2, 4])
def test_collector_pauses_stall_the_step_in_proportion_to_its_microbatches(m2):
    """Every GPU's pause, added, lengthens the simulated step (each stalls the coupled stages at
    its own moment); a collector runs per allocations, so m' micro-batches carry m' / m of the
    captured pauses, and a micro-batch change compared per sample leaves them out."""
    p, m, u, pause = 4, 8, 3e6, 5e6
    clean = _uniform(p, m, u)
    paused = replace(clean, pause=pause)
    assert ps.step_ns(paused, 1, m, 0.0) - ps.step_ns(clean, 1, m, 0.0) == pytest.approx(pause)
    assert ps.step_ns(paused, 1, m * m2, 0.0) - ps.step_ns(clean, 1, m * m2, 0.0) == pytest.approx(m2 * pause)
    spec = {"kind": ps.KIND, "microbatches": m2}
    with_pause, without = ps.gains_ms(spec, paused), ps.gains_ms(spec, clean)
    assert with_pause["best"] == pytest.approx(without["best"]) and without["best"] > 0
