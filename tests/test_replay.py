"""The replay on the real corpus: its fidelity table (docs/replay.md) recomputed from the JSON
snapshots (which tests/test_json_snapshots.py recomputes from the profiles) and held to the
issue's target, and the plan's and fixes' invariants on every snapshot."""
from __future__ import annotations

import importlib.util
import json
import re
import statistics

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("replay_fidelity", ROOT / "fixtures" / "replay_fidelity.py")
fidelity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fidelity)
SNAPSHOTS = sorted((ROOT / "tests" / "snapshots").glob("*.json"))
DIAGNOSES = [p for p in SNAPSHOTS if not p.name.startswith("diff__")]


def test_docs_tables_are_the_ones_the_snapshots_give():
    doc = (ROOT / "docs" / "replay.md").read_text()
    assert fidelity.table(fidelity.rows()) in doc, "docs/replay.md is out of date: python fixtures/replay_fidelity.py"
    assert fidelity.untraced_table(fidelity.untraced_rows()) in doc, \
        "docs/replay.md is out of date: python fixtures/replay_fidelity.py"


def test_replayed_step_within_target_of_the_measured_one():
    rows = [r for r in fidelity.rows() if r["judged"]]
    assert len(rows) >= 40
    errors = [abs(r["error"]) for r in rows]
    assert max(errors) <= fidelity.MAX_ERR_PCT, [(r["name"], r["error"]) for r in rows
                                                 if abs(r["error"]) > fidelity.MAX_ERR_PCT]
    assert statistics.median(errors) <= fidelity.MAX_MEDIAN_PCT


@pytest.mark.parametrize("snap", DIAGNOSES, ids=lambda p: p.stem)
def test_plan_and_gains_never_claim_more_than_the_step(snap):
    d = json.loads(snap.read_text())
    r, plan = d["replay"], d["plan"]
    if not r:
        return
    step = r["measured_step_ms"]
    # the plan starts from the step without the profiler, never longer than the traced one
    assert r["untraced_step_ms"] <= step + 1e-6
    assert sum(p["gain_ms"] for p in plan) <= r["untraced_step_ms"] + 1e-6
    # each plan step shortens the step, and the step after it is what the gains leave
    left = r["untraced_step_ms"]
    for p in plan:
        assert p["gain_ms"] > 0 and p["wall_after"] in ("compute", "communication", "host", "memory")
        left -= p["gain_ms"]
        assert abs(p["step_ms_after"] - left) <= 0.05 * len(plan)
    for w, v in r["without_wall_ms"].items():
        assert 0 <= v <= step * 1.05, (w, v)
    for f in d["fixes"]:
        if (f.get("gain_basis") or "").startswith("replay:"):
            assert f["gain_low_ms"] <= f["expected_gain_ms"] + 0.01 <= f["gain_high_ms"] + 0.02
            assert f["expected_gain_ms"] <= step


@pytest.mark.parametrize("snap", DIAGNOSES, ids=lambda p: p.stem)
def test_the_plan_starts_with_the_largest_replayed_gain(snap):
    """Best fix first: a schedule change (a PP fix, priced by the simulation) competes with the
    graph's fixes at every step, so on a pipelined job the first step is the largest price,
    whichever kind it is (a schedule change taken after the graph's fixes failed this on 7
    pipelined captures). A fix of another wall that undoes a pitfall the profile shows (recompute
    off where memory has room) competes too: where it leads, its gain is the pitfall's replayed
    cost. The plan's pool at its start is the verdict's, the runner-up's, the pitfalls' and the
    largest removal's fixes; a fix it took later from a wall a step exposed may price more alone."""
    from profclass.pitfalls import load_rules

    d = json.loads(snap.read_text())
    seeded = d["replay"].get("largest_removal") if d["replay"] else None
    priced = [f for f in d["fixes"] if (f.get("gain_basis") or "").startswith("replay:") and f["expected_gain_ms"] > 0
              and (f["for"] != "plan" or f["wall"] == seeded)]
    if not d["plan"] or not priced:
        return
    best = max(priced, key=lambda f: f["expected_gain_ms"])
    first = d["plan"][0]
    assert first["gain_ms"] == pytest.approx(best["expected_gain_ms"], abs=0.011), (best["id"], first)
    led = next(f for f in d["fixes"] if f["id"] == first["id"])
    if led["for"] == "pitfall":
        by_rule = {r["id"]: r.get("priced_by") for r in load_rules()}
        (cost,) = {p["cost_ms_per_step"] for p in d["pitfalls"] if by_rule.get(p["rule"]) == first["id"]}
        assert first["gain_ms"] == pytest.approx(cost, abs=0.011)


@pytest.mark.parametrize("snap", DIAGNOSES, ids=lambda p: p.stem)
def test_no_memory_wall_to_remove_where_the_analyzer_found_none(snap):
    """Where no GPU recomputes (every forward-only kernel has its backward partner) and the
    memory wall is empty, removing it leaves the step and the critical path holds none of it:
    a pipeline's later micro-batch forwards between backwards are not a recomputed forward
    (before the replay shared the analyzer's gate, 19 captures lost 6-39% of their step)."""
    from profclass.analyzers.memory import MIN_RECOMPUTE_RATIO

    d = json.loads(snap.read_text())
    r = d["replay"]
    if not r or d["walls"]["memory"]["ms_per_step"] > 0.01:
        return
    if max(dev["features"].get("recompute_ratio", 0.0) for dev in d["devices"]) >= MIN_RECOMPUTE_RATIO:
        return
    step = r["measured_step_ms"]
    assert r["without_wall_ms"]["memory"] == pytest.approx(step, rel=0.01)
    assert r["critical_path_ms"].get("memory", 0.0) <= 0.01 * step


@pytest.mark.parametrize("snap", DIAGNOSES, ids=lambda p: p.stem)
def test_a_host_paced_report_says_its_untraced_step_is_likely_high(snap):
    """The untraced step removes CUDA tracing's per-call cost only; where that took
    ``UNTRACED_CAVEAT_SHARE`` or more off the traced step, jobs run again on their capture's
    machine mostly ran faster still (docs/replay.md, "On the capture's own machine"): such a
    report, uncalibrated, says so in missing[], with the share it did remove; other reports do
    not."""
    from profclass.replay.constants import UNTRACED_CAVEAT_SHARE
    d = json.loads(snap.read_text())
    if not d["replay"]:
        return
    r = d["replay"]
    said = [m for m in d["missing"] if m.startswith("replay: untraced_step_ms takes only")]
    moved = r["untraced_step_ms"] <= (1 - UNTRACED_CAVEAT_SHARE) * r["measured_step_ms"]
    assert len(said) == int(moved and not r.get("host_calibration"))
    # the JSON says it in its own field (schema 2.31.0), which the reports' replay line reads
    calibrated = (r.get("host_calibration") or {}).get("reached")
    # and (schema 2.33.0) an upper bound too where the window is the run's first steps
    early = d["window"]["capture_start"] == "process"
    assert r["untraced_step_bound"] == ("calibrated" if calibrated else "upper" if said or early else "estimate")
    if said:
        assert f"({100 * (1 - r['untraced_step_ms'] / r['measured_step_ms']):.0f}%)" in said[0]


def test_every_fix_transform_in_the_table_is_one_the_replay_knows():
    """data/fixes.toml's transforms are data: each names a kind the replay implements, and each
    uncertain parameter is a [low-gain end, best, high-gain end] triple."""
    from profclass.fixes import load_table
    from profclass.replay.transforms import KINDS
    specs = [f["transform"] for f in load_table() if "transform" in f]
    assert len(specs) >= 15
    for spec in specs:
        assert spec["kind"] in KINDS, spec
        for key, value in spec.items():
            if isinstance(value, list):
                assert len(value) == 3, (spec, key)


def test_a_requested_fix_is_also_priced_with_the_profiler_kept():
    """The gain pairs' traced windows are judged against the fix replayed on the captured step:
    on a launch-bound 1-GPU capture, CUDA graphs save the traced calls' CUPTI cost too, so the
    traced run gains more than the untraced one."""
    import profclass
    from conftest import profile_path

    d = profclass.diagnose(str(profile_path("graphs_base_1gpu")), price_fixes=("cuda_graphs",))
    price = d.replay["requested"]["cuda_graphs"]
    traced = price["traced"]
    assert traced["basis"].endswith("with the profiler kept")
    assert "without the profiler's cost" in price["basis"]
    assert "the host that banks the gain is not the captured one" in price["basis"]
    assert traced["low_ms"] <= traced["best_ms"] <= traced["high_ms"]
    assert traced["best_ms"] > price["best_ms"] > 0


def test_cuda_graphs_leave_a_dropless_moe_jobs_experts_eager(diagnosis):
    """The fix's flags name per-layer graphs of attention, router and preprocess for dropless
    MoE: the experts' phase (EP all-to-alls and what runs between dispatch and combine, with no
    attention or softmax kernel) stays eager at the low and best points, graphed only at the
    high point (full-iteration graphs, static shapes). On the host-bound TP 2 + SP x EP 2 job the
    scoped price is well under the full one; with no EP (the 1-GPU graphs base) nothing is
    scoped out, so the points differ only by the node gap (the transform's own points: the
    reported range also holds the host's speed, ``HOST_SPEED``)."""
    from profclass.fixes import load_table
    from profclass.replay import run as R

    moe = next(f for f in diagnosis("mcore_wrapped_tp2sp_ep2").fixes if f["id"] == "cuda_graphs")
    assert 0 < moe["gain_low_ms"] <= moe["expected_gain_ms"] < 0.75 * moe["gain_high_ms"]
    spec = next(f["transform"] for f in load_table() if f["id"] == "cuda_graphs")
    r = R.Replayer(diagnosis("graphs_base_1gpu").extra.replay_inputs)
    best, high = (R._graph_gain(r, [spec], p, r.untraced, r.untraced_out, r.untraced_stages) for p in ("best", "high"))
    assert 0 < best <= high and best > 0.9 * high


def test_the_expert_phase_is_the_ops_between_dispatch_and_combine():
    """collectives.expert_phase on a hand-made trace: phases between EP all-to-alls holding a
    softmax or attention kernel are dense, the others (and the EP all-to-alls) are the experts'."""
    import numpy as np

    from profclass.replay import collectives
    from profclass.replay.trace import COMM, COMPUTE, GpuTrace

    class T:  # the fields expert_phase reads, and GpuTrace's own per-op name test
        ops_named = classmethod(GpuTrace.ops_named)
        n_ops = 7
        names = ("attn_fwd_flash", "gemm", "ncclSendRecv", "softmax_warp_forward")
        ops = type("O", (), dict(name=np.array([0, 1, 2, 1, 2, 3, 1]),
                                 kind=np.array([COMPUTE, COMPUTE, COMM, COMPUTE, COMM, COMPUTE, COMPUTE])))()
    seg = np.array([-1, -1, 0, 0, 1, 1, 1])  # attention, gemm | dispatch, experts | combine, router, gemm
    groups = np.array(["", "", "EP", "", "EP", "", ""])
    assert collectives.expert_phase(T, seg, groups).tolist() == [False, False, True, True, True, False, False]


@pytest.mark.parametrize("snap", DIAGNOSES, ids=lambda p: p.stem)
def test_a_plan_step_comes_from_the_listed_fixes_a_pitfall_or_the_wall_a_step_exposed(snap):
    """The plan classifies again: its pool is the verdict's and runner-up's fixes, a fix that
    undoes a pitfall the profile shows, the fixes of the wall whose removal shortens the replayed
    step most, and those of each wall a step leaves the largest (``replay.plan.fix_plan``). No
    other fix enters, one of an exposed wall enters only after the step that exposed it, and
    every step's fix is listed in fixes[] with its price alone and where it came from (``for``;
    before schema 2.32.0 the last kinds were not listed, and `mcore_rc_full_ample`'s plan began
    with a fix fixes[] did not hold)."""
    from profclass.fixes import load_table
    from profclass.pitfalls import load_rules

    d = json.loads(snap.read_text())
    wall_of = {f["id"]: f["wall"] for f in load_table()}
    listed = {f["id"]: f for f in d["fixes"]}
    by_rule = {r["id"]: r.get("priced_by") for r in load_rules()}
    undoing = {by_rule.get(p["rule"]) for p in d["pitfalls"]}
    exposed = {d["replay"]["largest_removal"]} if d["plan"] else set()  # in the pool from the start
    for step in d["plan"]:
        f = listed.get(step["id"])
        assert f is not None and f["expected_gain_ms"] is not None, (step, sorted(listed))
        assert f["for"] != "pitfall" or step["id"] in undoing
        assert f["for"] != "plan" or wall_of[step["id"]] in exposed, (step, exposed)
        exposed.add(step["wall_after"])
    for f in d["fixes"]:  # a listed fix of neither wall is a pitfall's or a plan step's
        assert f["for"] in ("verdict", "runner_up") or f["id"] in undoing | {s["id"] for s in d["plan"]}, f["id"]


def test_the_wall_a_fix_exposes_brings_its_own_fixes_into_the_plan():
    """comm_4gpu (communication-bound MoE, 4 GPUs): a faster fabric leaves the host the largest
    wall, and the next step is a host fix (larger micro-batches), though host is neither the
    verdict nor the runner-up; before the pool grew with the walls the plan went on with two
    communication fixes worth 6.7 and 1.8 ms/step."""
    d = json.loads((ROOT / "tests" / "snapshots" / "comm_4gpu.json").read_text())
    plan = d["plan"]
    assert plan[0]["id"] == "comm_nvlink_domain" and plan[0]["wall_after"] == "host"
    assert {f["for"] for f in d["fixes"] if f["wall"] == "host"} == {"plan"}
    # the exposed host wall's fix is the largest step after the fabric's (the plan's later steps
    # are worth less); since the forty-third session the fabric gains more, its kernel loads read
    # as the drains they are rather than as host time (docs/replay.md, "Kernel loads")
    assert plan[1]["id"] == "host_bigger_launches" and plan[1]["gain_ms"] > max(p["gain_ms"] for p in plan[2:])


@pytest.mark.parametrize("name, was", [("compute_4gpu_syncs", "ep_deepep"), ("mcore_ep4_hoststall", "comm_even_out_ranks")])
def test_the_plan_starts_from_the_wall_whose_removal_gains_most(name, was):
    """Where the replay finds removing a wall neither the verdict's nor the runner-up's shortens
    the step most (host, on both), that wall's fixes are in the plan's pool from its start: the
    plan opens with that wall's largest fix alone, where it began with a smaller fix of the
    verdict's walls (``was``) and took the larger one second, before the fifty-fourth session."""
    d = json.loads((ROOT / "tests" / "snapshots" / f"{name}.json").read_text())
    assert d["replay"]["largest_removal"] == "host" not in (d["verdict"]["wall"], d["verdict"]["runner_up"])
    alone = {f["id"]: f["expected_gain_ms"] for f in d["fixes"] if f["expected_gain_ms"] is not None}
    host = {f["id"] for f in d["fixes"] if f["wall"] == "host" and f["id"] in alone}
    first = d["plan"][0]["id"]
    assert first in host and alone[first] == max(alone[i] for i in host) and alone[first] > alone[was]
    assert d["plan"][0]["gain_ms"] == pytest.approx(alone[first], abs=0.011)


def test_the_reports_say_why_a_fix_of_another_wall_is_listed(diagnosis):
    """A fix listed for a pitfall (recompute off on `mcore_rc_full_ample`, the plan's first step)
    or for the plan (larger micro-batches on `comm_4gpu`, once the fabric is faster) says so in
    the text, Markdown and HTML reports; a verdict's fix does not."""
    from profclass.fixes import ORIGIN
    from profclass.html import render_html
    from profclass.report import render_markdown, render_text

    for name, fix_id, origin in (("mcore_rc_full_ample", "recompute_off", "pitfall"),
                                 ("comm_4gpu", "host_bigger_launches", "plan")):
        d = diagnosis(name)
        f = next(f for f in d.fixes if f["id"] == fix_id)
        assert f["for"] == origin and f["expected_gain_ms"] is not None
        lead = next(x for x in d.fixes if x["for"] == "verdict")
        for text in (render_text(d, width=400), render_markdown(d), render_html(d)):
            lines = re.split(r"\n|<li>", text)  # the HTML's list items share a line
            line = next(ln for ln in lines if f["title"] in ln and "ms/step" in ln)
            assert ORIGIN[origin] in line, (name, line)
            line = next(ln for ln in lines if lead["title"] in ln and "ms/step" in ln)
            assert not any(o in line for o in ORIGIN.values()), (name, line)


def test_a_host_paced_fixs_range_holds_a_slower_and_a_faster_host(diagnosis):
    """On a host-paced job (`mcore_ep4_base`) a larger micro-batch gains more where the host is
    slower and less where it is faster: the range holds both of ``host_factors`` (the corpus's
    hosts at the probe's 10th and 90th percentile against this capture's, at least
    ``HOST_SPEED``) beside the transform's own parameters; on a GPU-paced job
    (`mcore_gb_ep4_rc_full`, recompute off: no parameter) the host's speed moves it by little,
    and the range stays near the point."""
    from profclass.replay import run as R

    r = R.Replayer(diagnosis("mcore_ep4_base").extra.replay_inputs)
    assert r.host_factors == R.host_range(r.inp.host_probe_ns) and r.inp.host_probe_ns is not None
    table = {"host_bigger_launches": {"transform": {"kind": "fewer_launches", "microbatch_factor": 2,
                                                     "recovered": [0.75, 1.0, 1.0]}}}
    (price,) = R.price_requests(r, ("host_bigger_launches",), table).values()
    at = {f: R._graph_gain(r, [table["host_bigger_launches"]["transform"]], "best", w, o, st)
          for f, w, o, st in r.host_variants}
    slow, fast = r.host_factors
    assert sorted(at) == sorted(r.host_factors)
    assert at[slow] > price.best_ms > at[fast]
    assert price.high_ms >= at[slow] - 0.01 and price.low_ms <= at[fast] + 0.01
    g = R.Replayer(diagnosis("mcore_gb_ep4_rc_full").extra.replay_inputs)
    (gpu,) = R.price_requests(g, ("recompute_off",), {"recompute_off": {"transform": {"kind": "drop_recomputed"}}}).values()
    assert gpu.high_ms - gpu.low_ms < 0.05 * gpu.best_ms


def test_the_hosts_range_is_the_corpus_spread_against_the_captures_probe():
    """``host_range``: no probe, one machine's drift (``HOST_SPEED``); a probe, the corpus's
    hosts at the 10th and 90th percentile of the probe against it (a host at the corpus's median
    may bank the gain on one 1.31x slower or 0.66x as slow), never narrower than HOST_SPEED; a
    capture on a slow host reaches far to the faster side and a fast one to the slower."""
    from profclass.analyzers.host import PROBE_NS_CORPUS
    from profclass.replay.constants import HOST_SPEED
    from profclass.replay.run import host_range

    fast, mid, slow = PROBE_NS_CORPUS
    assert host_range(None) == HOST_SPEED
    assert host_range(mid) == (round(slow / mid, 2), round(fast / mid, 2))
    assert host_range(slow * 1.2) == (HOST_SPEED[0], round(fast / (slow * 1.2), 2))
    assert host_range(fast / 1.2) == (round(slow * 1.2 / fast, 2), HOST_SPEED[1])
    assert host_range(slow / HOST_SPEED[0] * 1.01)[0] == HOST_SPEED[0]


def test_a_step_delta_comes_off_the_wall_it_shortens():
    from profclass.replay import critical_path

    cp = {"compute": 13.2, "communication": 111.9, "host": 95.1, "memory": 0.0}
    after = critical_path.after_delta(cp, 42.4, "pp_schedule")
    assert after["communication"] == pytest.approx(69.5) and after["host"] == 95.1
    assert critical_path.largest(cp) == "communication" and critical_path.largest(after) == "host"
    assert critical_path.after_delta(cp, 500.0, "pp_schedule")["communication"] == 0.0  # never below none
    assert critical_path.after_delta(cp, 20.0, "fewer_launches")["host"] == pytest.approx(75.1)


def test_every_replayed_fix_says_which_wall_comes_next(diagnosis):
    """fixes[].wall_after: each replayed fix's own next wall; a plan step's first fix agrees
    with it, the plan making that fix alone first."""
    import json

    d = json.loads(diagnosis("mcore_gb_pp4s_m8").to_json())
    replayed = [f for f in d["fixes"] if f.get("gain_basis", "").startswith("replay")]
    assert replayed and all(f["wall_after"] in ("compute", "communication", "host", "memory") for f in replayed)
    first = next(f for f in d["fixes"] if f["id"] == d["plan"][0]["id"])
    assert first["wall_after"] == d["plan"][0]["wall_after"]


def test_the_plans_pool_takes_chosen_then_pitfall_fixes_then_the_largest_removals_once():
    """``plan.plan_pool``: the chosen fixes first, a fix of any wall that undoes a pitfall, the
    largest removal's wall's fixes where the chosen ones do not cover it; no fix twice."""
    from profclass.replay.plan import plan_pool
    fix = lambda i, w: {"id": i, "wall": w}  # noqa: E731
    walls = {"compute": [fix("fp8", "compute")], "memory": [fix("recompute_off", "memory")],
             "host": [fix("graphs", "host"), fix("mbs", "host")]}
    chosen = [fix("fp8", "compute")]
    pool = plan_pool(chosen, walls, ("recompute_off",), "host")
    assert [f["id"] for f in pool] == ["fp8", "recompute_off", "graphs", "mbs"]
    assert [f["id"] for f in plan_pool(chosen, walls, (), None)] == ["fp8"]
    assert [f["id"] for f in plan_pool(chosen, walls, ("fp8",), "compute")] == ["fp8"]
