"""Predicted gains against before/after runs (issue 15): the validated-gains table of
docs/fixes.md recomputed from the committed profiles, and the gain models on known numbers."""
from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest

from conftest import ROOT, profile_path
from profclass.analyzers import GAINS
from profclass.diff import diff, render_text
from profclass.fixes import load_table, predict, predict_by_id

spec = importlib.util.spec_from_file_location("gain_pairs", ROOT / "fixtures" / "gain_pairs.py")
gain_pairs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gain_pairs)
PP_KEYS = ("pp_bubble_ms", "pp_stages", "pp_microbatches")  # the micro-batch count: flags, else issue 31's inference


@pytest.fixture(scope="module")
def rows(diagnosis):
    return gain_pairs.rows(diagnosis)


def test_docs_table_is_the_one_the_profiles_give(rows):
    assert gain_pairs.table(rows) in (ROOT / "docs" / "fixes.md").read_text(), \
        "docs/fixes.md is out of date: python fixtures/gain_pairs.py"


def test_pairs_name_real_fixes_and_profiles():
    c = gain_pairs.corpus()
    names, fixes = {p["name"] for p in c["profile"]}, {f["id"] for f in load_table()}
    assert len(c["gain_pair"]) >= 5
    assert len({p["fix"] for p in c["gain_pair"]}) >= 5, "at least five different fixes"
    for p in c["gain_pair"]:
        assert p["base"] in names and p["fix"] in fixes
        # a candidate is a committed profile, or a timer log of a run beside the base's rerun
        # or a run known only by its untraced reruns
        assert p["candidate"] in names or (p.get("candidate_timer") and p.get("base_timer")) or p.get("untraced")
        for log in (p.get("base_timer"), p.get("candidate_timer")):
            assert log is None or "mean step over iters" in gain_pairs.timer_text(log)
        assert p["realized"] in ("step", "per_microbatch")


# issue 30's pairs whose share-model range does not hold the realized gain (docs/fixes.md says
# why; what was registered for them is the replay's prediction, judged in docs/notes.md)
UNCOVERED = {"fp8_base_1gpu", "grouped_base_1gpu", "gc_base_1gpu", "graphs2_base_1gpu", "fp82_base_1gpu",
             "gc2_base_1gpu",
             # call IA: drop-and-pad's share model prices the kernel loads alone (the replay prices the rest)
             "mcore_moe1_dropless",
             # its 4 -> 16 and 4 -> 32 micro-batch pairs: the share model prices a doubling (the replay takes
             # the pair's factor); its overlapped VPP pairs with more micro-batches: two changes at once
             "mcore_wrapped_dense_tp2_pp2->w_dense_tp2_pp2_m16", "mcore_wrapped_dense_tp2_pp2->w_dense_tp2_pp2_m32",
             "mcore_wrapped_dense_tp2_pp2->w_dense_tp2_pp2_vpp2_ovl_m8",
             "mcore_wrapped_dense_tp2_pp2->w_dense_tp2_pp2_vpp2_ovl_m16",
             # call J: --bias-activation-fusion with TorchDynamo off ran Megatron's fused SwiGLU eagerly (a loss)
             "mcore_gb_pp4s_m8->gb_pp4s_m8_baf", "mcore_dense_tp2sp_pp2->tp2sp_pp2_baf",
             # calls L and M: VPP with overlapped P2P, which syncs nothing; the share model knows no P2P mode
             "mcore_gb_pp4s_m8->gb_pp4s_vpp2_m8_ovl_mgc", "mcore_dense_tp2sp_pp2->tp2sp_pp2_vpp2_ovl",
             "mcore_wrapped_dense_tp2_pp2->w_dense_tp2_pp2_vpp2_ovl",
             # calls P, Q and R: overlapped P2P again, and two schedule changes at once (the share model prices one)
             "mcore_gb_pp4_m4->gb_pp4_vpp2_m4_ovl_mgc", "mcore_dense_tp2sp_pp2->tp2sp_pp2_vpp2_ovl_m16",
             "mcore_gb_pp4s_m8->gb_pp4s_vpp2_m16_ovl_mgc", "mcore_gb_pp4_m8->gb_pp4_vpp2_m16_ovl_mgc",
             # call V: their batched twins, two schedule changes at once again
             "mcore_wrapped_dense_tp2_pp2->w_dense_tp2_pp2_vpp2_m8", "mcore_wrapped_dense_tp2_pp2->w_dense_tp2_pp2_vpp2_m16",
             "mcore_gb_pp4_m8->gb_pp4_vpp2_m16_mgc", "mcore_gb_pp4s_m8->gb_pp4s_vpp2_m16_mgc",
             # call W: the same, from 4 micro-batches
             "mcore_gb_pp4_m4->gb_pp4_vpp2_m8_mgc"}


def test_every_pair_is_within_target_or_its_range_covers_the_realized_gain(rows, diagnosis):
    """Where a model misses the target, docs/fixes.md says why and its range covers the
    realized gain, except on the UNCOVERED pairs, which stay outside it until a model prices
    them; a pair goes unpriced only for want of the layout analyzer's numbers."""
    doc = (ROOT / "docs" / "fixes.md").read_text().split("**Why the misses.**")[1]
    for r in rows:
        p = r["pair"]
        if r["pred"]["expected_gain_ms"] is None:
            if r["pred"]["gain_model"]:  # a fix with no share model (the schedule prices it) is never priced here
                assert not all(diagnosis(p["base"]).numbers.get(k) is not None for k in PP_KEYS), p
            continue
        if not r["ok"]:
            assert f"`{p['base']}`" in doc, f"{p['base']}: the miss is not explained"
            if p["base"] in UNCOVERED or f"{p['base']}->{p['candidate']}" in UNCOVERED:
                assert not r["covered"], f"{p['base']}: now inside its range: drop it from UNCOVERED"
            else:
                assert r["covered"], f"{p['base']}: realized {r['realized']:.1f} outside the predicted range"
    assert UNCOVERED <= ({r["pair"]["base"] for r in rows if not r["ok"]}
                         | {f"{r['pair']['base']}->{r['pair']['candidate']}" for r in rows if not r["ok"]})


def test_priced_pairs_meet_the_target_where_captures_are_consistent(rows):
    """Of the priced pairs, every miss is one docs/fixes.md explains (host-bound under tracing, a
    host that ran faster in one run, step-long pauses); 18 of 24 meet the target today."""
    priced = [r for r in rows if r["pred"]["expected_gain_ms"] is not None]
    assert sum(r["ok"] for r in priced) >= 18


def test_held_out_gpu_bound_pairs_meet_the_target(rows):
    """The gpubound pairs were captured after the models were written (capture_layouts.sh
    gpubound, gpubound_pp; gpubound2 after the host-issue terms), on jobs the GPU paces under
    tracing, and judged on their untraced reruns: 6 of their 8 meet the target (the misses:
    interleaving and DP overlap, whose runs hold a step-long pause). Routing balance counts
    among the 6 only since its moving-imbalance term, written after it missed."""
    held_out = [r for r in rows if r["pair"]["base"].startswith("mcore_gb_") and not r["pair"].get("registered")]
    assert len(held_out) == 8 and all(r["untraced"] for r in held_out)
    assert sum(r["ok"] for r in held_out) >= 6


def test_held_out_dense_pairs(rows):
    """Predicted before they ran (docs/notes.md), judged on their untraced reruns: DP
    overlap on TP x DP, VPP on TP x PP and twice the micro-batches all meet the target (the
    last missed in the traced window, on a host-perturbed base rerun)."""
    dense = {r["pair"]["candidate"]: r for r in rows
             if r["pair"]["base"].startswith("mcore_dense_") and not r["pair"].get("registered")}
    assert set(dense) == {"pair_tp2_dp2_dpoverlap", "pair_tp2sp_pp2_vpp2", "pair_tp2sp_pp2_m16"}
    assert all(r["ok"] for r in dense.values())
    m16 = dense["pair_tp2sp_pp2_m16"]
    assert abs(m16["traced"] - m16["pred"]["expected_gain_ms"]) > 0.3 * m16["traced"]  # the traced miss


def test_untraced_reruns_are_whole_and_paired():
    """Each untraced pair names one log per replicate for both jobs; every log holds the
    steady steps of a whole run (11 of 14 iterations; megatron_moe: 37 of 40, counted from 1;
    moe_train: 27 of 40; fix_pairs: 57 of 60, 27 of 30, 17 of 20 or 11 of 14, by case), and a
    job's replicates ran the same configuration."""
    for p in gain_pairs.corpus()["gain_pair"]:
        u = p.get("untraced")
        if not u:
            continue
        assert len(u["base"]) == len(u["candidate"]) >= 2, p["base"]
        for logs in (u["base"], u["candidate"]):
            heads = {re.search(r"^(world=.*|scenario .*|case=.*) (?:mean_steady|local_params|device=)",
                               gain_pairs.timer_text(log), re.M).group(1) for log in logs}
            assert len(heads) == 1, logs
            for log in logs:
                assert len(gain_pairs.untraced_steps(log)) in (11, 37, 27, 57, 17), log
        assert u["base"] != u["candidate"]


@pytest.mark.xfail(strict=True, reason="issue 15's target (80% of pairs) is not met by the share models: 42 of "
                   "84, all judged without the profiler; the misses explained in docs/fixes.md (replicates that "
                   "disagree by more than the error, collector pauses, gains priced on the traced host)")
def test_issue_target_80_percent_of_pairs(rows):
    assert sum(r["ok"] for r in rows) >= 0.8 * len(rows)


@pytest.mark.xfail(strict=True, reason="issue 30's target (80% of the replayed pairs within max(15%, 3% of the "
                   "step)) is not met: 59 of 83 untraced, 11 of 31 traced; docs/fixes.md 'Replayed gains' and "
                   "the issue-30 note give each miss's cause")
def test_replay_target_80_percent_of_pairs(replay_rows):
    for judged in ("ok_untraced", "ok_traced"):
        rows = [r for r in replay_rows if r[judged] is not None]
        assert sum(r[judged] for r in rows) >= 0.8 * len(rows), judged


def _numbers(**over) -> dict:
    base = dict(step_ms=100.0, compute_ms=60.0, gemm_ms=30.0, sm_busy=1.0, fusible_ms=10.0, comm_wait_ms=0.0,
                exposed_ep_ms=0.0, exposed_dp_ms=0.0, exposed_dp_transfer_ms=0.0, dp_reductions_per_step=0.0,
                slow_fabric=False, num_layers=None, straggler_wait_ms=0.0, gpus=4, straggler_reason=None,
                idle_sync_ms=0.0, idle_launch_ms=0.0, idle_alloc_ms=0.0, gc_ms=0.0, host_ms=0.0,
                host_rank_ms=None, pp_from_flags=1, recompute_ms=0.0, selective_keep_ms=0.0, offload_ms=0.0, memory_ms=0.0)
    return {**base, **over}


def test_pipeline_models_price_only_with_the_layout_numbers():
    assert GAINS["pp_interleave"](_numbers()) is None
    # not pipelined (the layout analyzer reports a 0 bubble and one stage): no price either
    assert GAINS["pp_interleave"](_numbers(pp_bubble_ms=0.0, pp_stages=1, pp_microbatches=4)) is None
    # p=4, m=4, v=1, step 100: theory bubble 3/7 -> 42.9 ms of the measured 60; imbalance 10;
    # the p2p part 7.1. VPP 2 takes the schedule part to 3/11 of the step (saves 15.6) and
    # doubles the p2p part: 15.6 - 7.1
    n = _numbers(pp_bubble_ms=60.0, pp_stages=4, pp_virtual_stages=1, pp_microbatches=4, stage_imbalance_ms=10.0)
    g = GAINS["pp_interleave"](n)
    schedule, p2p = 300 / 7, 60 - 300 / 7 - 10
    saved = schedule * (1 - (3 / 11) / (3 / 7))
    assert g.estimate_ms == pytest.approx(saved - p2p)
    # low: nothing saved, the doubled p2p part paid (or the launch-late idle again, if lower)
    assert g.low_ms == pytest.approx(min(saved - 2 * p2p, -p2p)) and g.high_ms == pytest.approx(saved)
    assert g.ceiling_ms == 60.0
    assert GAINS["pp_interleave"]({**n, "idle_launch_ms": 20.0}).low_ms == pytest.approx(saved - 2 * p2p - 20)
    # Megatron's batch_p2p_sync: 8.5 device syncs per step, one per exchange of 1F1B (m + (p-1)/2
    # = 5.5 of them: share 1); VPP 2 has m v + (p-1) + (v-1) p = 15: 9.5 more, each costing the
    # host refill (launch-late + after-sync idle over all host syncs: 20 / 10 = 2 ms)
    synced = {**n, "idle_launch_ms": 15.0, "idle_sync_ms": 5.0, "host_syncs_per_step": 10.0,
              "device_syncs_per_step": 8.5}
    assert GAINS["pp_interleave"](synced).estimate_ms == pytest.approx(saved - p2p - 9.5 * 2.0)
    # no device syncs after the exchanges: no such cost
    assert GAINS["pp_interleave"]({**synced, "device_syncs_per_step": 0.0}).estimate_ms == pytest.approx(saved - p2p)
    # a large p2p part outweighs what interleaving saves: it predicts a loss
    assert GAINS["pp_interleave"]({**n, "pp_bubble_ms": 90.0, "stage_imbalance_ms": 0.0}).estimate_ms < 0
    assert GAINS["pp_more_microbatches"](n).estimate_ms == pytest.approx(schedule / 2)
    # the once-per-step DP reduction is shared by twice the work too
    assert GAINS["pp_more_microbatches"]({**n, "exposed_dp_ms": 8.0}).estimate_ms == pytest.approx((schedule + 8) / 2)


def test_bigger_microbatch_gains_what_the_gpu_waited_for_the_host():
    # host issue time 90 of a 100 ms step; the GPU waited 40 for launches and 20 for late peers;
    # compute 20 with SMs half busy (10 unfilled)
    n = _numbers(idle_launch_ms=40.0, comm_wait_ms=20.0, compute_ms=20.0, sm_busy=0.5, host_issue_ms=90.0)
    g = GAINS["bigger_microbatch"](n)
    assert g.estimate_ms == pytest.approx(45.0 + 5.0)  # 2x: the host saves 45 <= 60 waited; half the unfilled SMs
    assert GAINS["bigger_microbatch"]({**n, "microbatch_factor": 4.0}).estimate_ms == pytest.approx(60.0 + 7.5)
    # a GPU-bound job (the GPU waited little for its host) gains little, whatever the factor
    gpu_bound = {**n, "idle_launch_ms": 2.0, "comm_wait_ms": 0.0, "sm_busy": 1.0, "microbatch_factor": 8.0}
    assert GAINS["bigger_microbatch"](gpu_bound).estimate_ms == pytest.approx(2.0)


def test_dp_overlap_pipelines_reductions_behind_backward():
    # T = 30 ms of exposed reduction, backward 40 ms, 4 layers: starts after 10 ms of backward,
    # the last layer's 7.5 ms runs after it: exposed max(30 - 30, 7.5) = 7.5, gain 22.5
    n = _numbers(compute_ms=60.0, exposed_dp_transfer_ms=30.0, exposed_dp_ms=32.0, num_layers=4,
                 dp_reductions_per_step=2.0)
    g = GAINS["dp_overlap"](n)
    assert g.estimate_ms == pytest.approx(22.5 - 2 * 0.02)
    assert g.low_ms < 0  # overlap can cost: NCCL's SMs come from the backward
    # more reduction than backward to hide it under: bounded by the backward after the first layer
    assert GAINS["dp_overlap"]({**n, "exposed_dp_transfer_ms": 80.0}).estimate_ms == pytest.approx(30 - 0.04)


def test_straggler_models_spread_or_remove_the_lateness():
    n = _numbers(straggler_wait_ms=90.0, gpus=4, straggler_reason="imbalance")
    assert GAINS["straggler_balance"](n).estimate_ms == pytest.approx(22.5)  # 3 x 30 waited, spread over 4
    assert GAINS["straggler_host"](n).estimate_ms == pytest.approx(30.0)
    assert GAINS["straggler_balance"]({**n, "straggler_reason": "host"}).low_ms == 0.0


def test_routing_balance_without_a_straggler_prices_the_ep_work_spread():
    # no rank late step after step: the busiest EP rank's work over the mean between EP syncs
    n = _numbers(ep_work_imbalance_ms=24.0, ep_wait_ms=27.5)
    g = GAINS["straggler_balance"](n)
    assert (g.estimate_ms, g.low_ms, g.high_ms) == pytest.approx((24.0, 12.0, 27.5))
    # the waiting bounds it from above only where it exceeds the spread
    assert GAINS["straggler_balance"]({**n, "ep_wait_ms": 5.0}).high_ms == pytest.approx(24.0)
    # a straggler: its model, not the spread
    s = GAINS["straggler_balance"]({**n, "straggler_wait_ms": 90.0, "straggler_reason": "imbalance"})
    assert s.estimate_ms == pytest.approx(22.5)


def test_recompute_scales_with_what_a_forward_costs_the_step():
    n = _numbers(recompute_ms=20.0, compute_ms=50.0, step_ms=100.0)
    assert GAINS["recompute_off"](n).estimate_ms == pytest.approx(40.0)
    # the memory analyzer's measured recompute spans already hold their launches and dispatch:
    # taken as they are, not scaled again
    g = GAINS["recompute_off"]({**n, "recompute_measured_ms": 30.0})
    assert (g.estimate_ms, g.low_ms, g.high_ms) == pytest.approx((30.0, 15.0, 60.0))


def test_unpriced_fix_is_null_never_zero():
    fix = next(f for f in load_table() if f["id"] == "host_cpu_affinity")
    out = predict(fix, _numbers(), 100.0)
    assert out["expected_gain_ms"] is None and out["gain_high_ms"] is None and "not priced" in out["gain_basis"]
    ranked = predict(fix, _numbers(host_rank_ms=[10.0, 12.0, 11.0, 20.0]), 100.0)
    assert ranked["expected_gain_ms"] == pytest.approx(20.0 - 11.5) and ranked["gain_high_ms"] == 10.0
    # pipeline stages do different host work by design: their spread is not misplacement
    assert predict(fix, _numbers(host_rank_ms=[10.0, 20.0], pp_from_flags=4), 100.0)["expected_gain_ms"] is None


def test_every_model_in_the_tables_exists():
    for f in load_table():
        if f.get("gain"):
            assert f["gain"] in GAINS, f["id"]


# the CPU-affinity change is the workload's own flag (--rank-cpus): no launch-line flag names it
AFFINITY_UNREAD = pytest.mark.xfail(strict=True, reason="diff does not read a CPU-affinity change")


@pytest.mark.parametrize("pair", [pytest.param(p, marks=AFFINITY_UNREAD) if p["fix"] == "host_cpu_affinity" else p
                                  for p in gain_pairs.corpus()["gain_pair"]  # both runs profiled
                                  if p["candidate"] in {q["name"] for q in gain_pairs.corpus()["profile"]}],
                         ids=lambda p: f"{p['base']}->{p['candidate']}")
def test_diff_states_the_predicted_gain_of_the_fix_the_pair_applies(pair, diagnosis):
    b, c = diagnosis(pair["base"]), diagnosis(pair["candidate"])
    r = diff(b, c)
    row = next((f for f in r.fix_gains if f["fix"] == pair["fix"]), None)
    assert row is not None, f"diff did not recognise {pair['fix']} in {[f['fix'] for f in r.fix_gains]}"
    fix = next(f for f in load_table() if f["id"] == pair["fix"])
    listed = next((f for f in b.fixes if f["id"] == pair["fix"]), None)
    if row["gain_basis"] and row["gain_basis"].startswith("replay:"):
        # the replay's price, as diagnose prices the fixes it lists: the same number where the
        # base lists this fix and the pair made the transform's own change
        assert fix.get("transform") and row["gain_low_ms"] <= row["predicted_gain_ms"] <= row["gain_high_ms"]
        if listed is not None and not pair.get("change_inputs"):
            assert row["predicted_gain_ms"] == listed["expected_gain_ms"]
    else:
        # no replay price: the share model, with the change the pair made as diff reads it off
        # the flags (e.g. micro-batch 1 -> 4)
        want = predict(fix, {**b.numbers, **pair.get("change_inputs", {})}, b.window["step_ms"]["mean"])
        assert row["predicted_gain_ms"] == want["expected_gain_ms"]
    scale = 2.0 if pair["realized"] == "per_microbatch" else 1.0
    assert row["realized_gain_ms"] == pytest.approx(r.step["base_ms"] - r.step["candidate_ms"] / scale, abs=0.01)
    assert (row["realized_per"] == "base work") == (scale != 1.0)
    assert f"Known fix: {row['title']}" in render_text(r, width=400)


def test_diff_of_a_run_against_itself_names_no_fix(diagnosis):
    d = diagnosis("mcore_ep4_base")
    assert diff(d, d).fix_gains == []


def test_diff_reads_the_prediction_of_a_saved_base(diagnosis, tmp_path):
    b, c = diagnosis("mcore_ep4_unbalanced"), diagnosis("mcore_ep4_base")
    saved = tmp_path / "base.json"
    saved.write_text(b.to_json())
    row = next(f for f in diff(str(saved), c).fix_gains if f["fix"] == "ep_balance_routing")
    stored = next((f for f in b.fixes if f["id"] == "ep_balance_routing"), None)
    # a stored diagnosis carries only the fixes it listed: their prediction, else unknown (null)
    assert row["predicted_gain_ms"] == (stored["expected_gain_ms"] if stored else None)


def test_a_plain_number_is_a_ceiling_claimed_as_such():
    from profclass.analyzers.gainmodel import as_gain

    g = as_gain("some_time", 12.0)
    assert (g.estimate_ms, g.low_ms, g.high_ms, g.ceiling_ms) == (12.0, 0.0, 12.0, 12.0)
    assert g.basis.startswith("some_time: ceiling only") and as_gain("x", None) is None


def test_gain_text_without_a_step_share():
    from profclass.fixes import gain_text

    f = dict(expected_gain_ms=3.0, expected_gain_pct=None, gain_low_ms=1.0, gain_high_ms=4.0)
    assert gain_text(f) == "~3.0 ms/step, range 1.0 to 4.0"
    assert gain_text({**f, "expected_gain_ms": None}) == "gain not priced"


def test_moving_imbalance_held_out_pair(rows):
    """Predicted before it ran (docs/notes.md): force-balanced routing on moe_train's
    learned-router job realizes what the EP work spread predicts."""
    (r,) = [r for r in rows if r["pair"]["candidate"] == "compute_4gpu_forcebalance"]
    assert r["ok"] and r["untraced"] and r["traced"] is None
    assert r["pred"]["gain_low_ms"] <= r["realized"] <= r["pred"]["gain_high_ms"]


def test_moving_routing_imbalance_on_real_captures(diagnosis):
    """Learned routing on the GPU-bound EP 4 job: no straggler, but the busiest EP rank's work
    between all-to-alls is 4.5% of the step over the mean, and routing balance is offered; the
    same job force-balanced measures 0.2% and is not offered the fix."""
    learned, balanced = diagnosis("mcore_gb_ep4_unbalanced"), diagnosis("mcore_gb_ep4_base")
    for d in (learned, balanced):
        assert d.stragglers == []
    step = learned.window["step_ms"]["mean"]
    assert learned.numbers["ep_work_imbalance_ms"] >= 0.03 * step
    assert balanced.numbers["ep_work_imbalance_ms"] <= 0.002 * balanced.window["step_ms"]["mean"]
    fix = next(f for f in learned.fixes if f["id"] == "ep_balance_routing")
    # the share model prices the spread; the JSON's gain is the replay's (each phase evened)
    share = predict_by_id("ep_balance_routing", learned.numbers, step)
    assert share["expected_gain_ms"] == pytest.approx(learned.numbers["ep_work_imbalance_ms"], abs=0.01)
    assert fix["gain_model"] == "replay:balance" and 0 < fix["expected_gain_ms"] < step
    assert "ep_balance_routing" not in [f["id"] for f in balanced.fixes]


def test_fabric_saving_banks_only_what_the_host_waited_for():
    """Per segment between host waits, a transfer saving counts up to that wait; after the last
    wait it counts whole; GPUs add up."""
    from types import SimpleNamespace

    from profclass.analyzers.communication import fabric_bankable
    ms = 1_000_000
    # GPU 0: the host waited 2 ms (ending at 10) and 20 ms (ending at 50). Collectives ending at
    # 5 and 8 (saving 3 + 3 in the first segment: 2 banked), at 30 (10: all banked) and at 60,
    # after the last wait (4: banked whole)
    gpu0 = SimpleNamespace(host_waits=(np.array([8, 30]) * ms, np.array([10, 50]) * ms))
    fabric0 = (np.array([5, 8, 30, 60]) * ms, np.array([3, 3, 10, 4]) * ms)
    # GPU 1: no host waits at all: nothing shows the host pacing it, every saving counts
    gpu1 = SimpleNamespace(host_waits=(np.zeros(0, np.int64), np.zeros(0, np.int64)))
    fabric1 = (np.array([5]) * ms, np.array([10]) * ms)
    job = SimpleNamespace(records=[SimpleNamespace(gpu=gpu0), SimpleNamespace(gpu=gpu1)],
                          comm=SimpleNamespace(fabric_transfers=[fabric0, fabric1]))
    assert fabric_bankable(job) == pytest.approx((2 + 10 + 4 + 10) / (20 + 10))
    # and the fabric model scales its bandwidth saving by it
    n = _numbers(slow_fabric=True, exposed_ep_ms=40.0, exposed_dp_transfer_ms=10.0, fabric_bankable=0.5)
    assert GAINS["fabric_ratio"](n).estimate_ms == pytest.approx(50 * (1 - 50 / 450) * 0.5)
    assert GAINS["fabric_ratio"](n).high_ms == pytest.approx(50.0)


@pytest.fixture(scope="module")
def replay_rows():
    return gain_pairs.replay_rows(gain_pairs.replay_price)


def test_docs_replay_table_is_the_one_the_profiles_give(replay_rows):
    assert gain_pairs.replay_table(replay_rows) in (ROOT / "docs" / "fixes.md").read_text(), \
        "docs/fixes.md is out of date: python fixtures/gain_pairs.py --replay"


def test_recompute_off_is_priced_with_the_whole_recomputed_forward(replay_rows):
    """Issue 31: dropping full recompute saves the recomputed forward's kernels, collectives and
    launches: the replay's saving within 15% of the realized one on every recompute pair."""
    pairs = [r for r in replay_rows if r["pair"]["fix"] == "recompute_off"]
    assert pairs
    for r in pairs:
        assert abs(r["price"]["best_ms"] - r["untraced"]) <= 0.15 * r["untraced"], r["pair"]["base"]


def _rows_with_fix(section: str) -> list[str]:
    """A registration table's rows, a fix cell that reads "the same" given the row above's."""
    rows, fix = [], ""
    for line in section.splitlines():
        if not line.startswith("| "):
            continue
        cells = line.split("|")
        if len(cells) > 2 and cells[2].strip() == "the same":
            line = "|".join(cells[:2] + [f" {fix} "] + cells[3:])
        elif len(cells) > 2:
            fix = cells[2].strip()
        rows.append(line)
    return rows


def test_registered_predictions_are_the_ones_committed_before_their_run():
    """Each pair's registered_prediction is the row of the docs/notes.md section its
    ``registered`` names ("docs/notes.md: Call 2 predictions"), committed before the pair's
    candidate ran: best [low, high], as printed there. A base is named there as the capture was
    before its import ("graphs2_base" for graphs2_base_1gpu; the name its corpus command ends
    with, "w_pp2_rc_m2" for mcore_wrapped_pp2_rc_m2)."""
    notes = (ROOT / "docs" / "notes.md").read_text()
    registered = [p for p in gain_pairs.corpus()["gain_pair"] if p.get("registered_prediction")]
    assert len(registered) >= 11
    commands = {q["name"]: q["command"] for q in gain_pairs.corpus()["profile"]}
    for p in registered:
        heading = p["registered"].split(": ", 1)[1]
        section = notes.split(f"### {heading}")[1].split("\n### ")[0]
        # the capture's own name where its command ends with it: "... layout22 (w_pp2_rc_m2)"
        captured = re.search(r"\((\w+)\)\s*$", commands[p["base"]])
        names = (f"`{p['base']}`", f"`{p['base'].removesuffix('_1gpu')}`") + ((f"`{captured.group(1)}`",) if captured else ())
        # pairs of a call are told apart by their key where they have one ("L2: ..." in the
        # pair's change, "| L2 `base` ..." in the row; a row may then state the change, not the
        # fix: call P's two-change pairs), else by the fix
        key = re.match(r"([A-Z]\d+): ", p.get("change", ""))
        row = next(line for line in _rows_with_fix(section)
                   if any(n in line.split("|")[1] for n in names)
                   and (line.split("|")[1].strip().startswith(key.group(1) + " ") if key
                        else re.search(rf"`{p['fix']}[`:]", line)))
        lo, best, hi = p["registered_prediction"]
        assert f"| {best:.2f} [{lo:.2f}, {hi:.2f}] |" in row, (p["base"], row)


def test_diff_prices_the_applied_fix_by_the_replay_as_diagnose_does(diagnosis):
    """rc_full_ample -> rc_none_ample turns recompute off: diff's predicted gain is the replay's
    price of recompute_off on the base (the fix asked for by id through ``diagnose``, another
    path through the replay stage), not the share model's, and says so in its basis."""
    import profclass

    b, c = diagnosis("mcore_rc_full_ample"), diagnosis("mcore_rc_none_ample")
    row = next(f for f in diff(b, c).fix_gains if f["fix"] == "recompute_off")
    asked = profclass.diagnose(str(profile_path("mcore_rc_full_ample")), price_fixes=("recompute_off",))
    want = asked.replay["requested"]["recompute_off"]
    assert (row["predicted_gain_ms"], row["gain_low_ms"], row["gain_high_ms"]) == \
        (want["best_ms"], want["low_ms"], want["high_ms"])
    assert row["gain_basis"].startswith("replay:drop_recomputed")
    share = predict_by_id("recompute_off", b.numbers, b.window["step_ms"]["mean"])
    assert share["expected_gain_ms"] != row["predicted_gain_ms"]


wa_spec = importlib.util.spec_from_file_location("wall_after", ROOT / "workloads" / "wall_after.py")
wall_after = importlib.util.module_from_spec(wa_spec)
wa_spec.loader.exec_module(wall_after)


@pytest.fixture(scope="module")
def wall_after_rows(replay_rows, diagnosis):
    return wall_after.rows(replay_rows, diagnosis)


def test_docs_wall_after_table_is_the_one_the_profiles_give(wall_after_rows):
    assert wall_after.table(wall_after_rows) in (ROOT / "docs" / "replay.md").read_text(), \
        "docs/replay.md is out of date: python workloads/wall_after.py"


def test_more_microbatches_leave_the_host_wall_on_the_host_paced_pipeline(wall_after_rows):
    """mcore_pp4_m4 -> m8: the bubble (communication on the path) was the largest wall; the
    schedule's gain taken off it leaves the host's, as the m8 capture's own path reads. Before
    the delta the prediction was the base's wall, communication."""
    row = next(r for r in wall_after_rows if r["pair"]["base"] == "mcore_pp4_m4" and r["pair"]["candidate"] == "mcore_pp4_m8")
    assert row["base"] == "communication" and row["predicted"] == row["candidate"] == "host"
