"""Issue 14 items 3-6 on real captures: the memory wall per the seeds (measured recompute),
offload vs input, the profiler's own overhead. The reference is the realized difference of
the workloads' own step timers between two captures that differ in one setting (run-to-run
noise ~5-10% of the step, so tolerances are at least that wide)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conftest import PROFILES, ROOT
from profclass import intervals as iv
from profclass.analyzers.recompute import K_GRAM, recomputed_spans


def timer_delta(candidate: str, base: str) -> float:
    return PROFILES[candidate]["workload_step_ms"] - PROFILES[base]["workload_step_ms"]


def pitfall(d, pid: str) -> dict | None:
    return next((p for p in d.pitfalls if p["id"] == pid), None)


# ----------------------------------------------------------------------------- memory wall

@pytest.mark.parametrize("full, none", [("mcore_rc_full_ample", "mcore_rc_none_ample"),
                                        ("mcore_recompute_4gpu", "mcore_alltoall_4gpu_balanced")])
def test_measured_recompute_matches_the_realized_cost(full, none, diagnosis):
    """Turning full recompute off saves what the recomputed forward costs: the measured
    recompute is the timers' difference within the noise (and within the captures' own
    step difference); the run without recompute measures none."""
    realized = timer_delta(full, none)
    d, base = diagnosis(full), diagnosis(none)
    measured = d.memory["recompute_ms_per_step"]
    captured = d.window["step_ms"]["mean"] - base.window["step_ms"]["mean"]
    assert measured == pytest.approx(realized, rel=0.25), (measured, realized, captured)
    assert min(realized, captured) * 0.8 <= measured <= max(realized, captured) * 1.2
    assert base.memory["recompute_ms_per_step"] == 0.0
    assert d.memory["recompute_mode"] == "full" and base.memory["recompute_mode"] == "none"


def test_full_recompute_with_headroom_is_a_pitfall_priced_by_the_replay(diagnosis):
    """Its cost is what turning recompute off would save (the replay of recompute_off, its
    priced_by), not the recompute's measured span: within issue 30's target of what the change
    realized by the workload's own timer on untraced reruns of both configurations."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gain_pairs", ROOT / "fixtures" / "gain_pairs.py")
    gain_pairs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gain_pairs)
    d = diagnosis("mcore_rc_full_ample")
    pf = pitfall(d, "full_recompute_with_headroom")
    assert pf is not None and pf["rule"] == pf["id"]
    assert pf["cost_basis"].startswith("replay:drop_recomputed")
    assert pf["cost_ms_per_step"] != pytest.approx(d.memory["recompute_ms_per_step"], abs=0.5)
    pair = next(p for p in gain_pairs.corpus()["gain_pair"]
                if p["base"] == "mcore_rc_full_ample" and p["fix"] == "recompute_off")
    reruns = gain_pairs.untraced(pair, *gain_pairs.pair_runs(pair, PROFILES))
    assert gain_pairs.replay_within(pf["cost_ms_per_step"], reruns["realized"], reruns["base_step"]), reruns
    # ample headroom: recompute is not memory's; it stays in the walls it runs in
    assert d.memory["near_capacity"] is False and d.memory["recompute_charged_ms_per_step"] == 0.0
    assert d.verdict["wall"] != "memory" and d.walls["memory"]["ms_per_step"] < 1.0


def test_memory_wall_full_recompute_near_capacity(diagnosis):
    """107 GiB ballast: the job fits only with full recompute (without it, it runs out of
    memory). Near capacity, the recompute is what memory costs, and memory is the verdict."""
    d = diagnosis("mcore_memwall_full")
    m = d.memory
    assert d.verdict["wall"] == "memory"
    assert m["near_capacity"] is True and m["memory_bound"] is True
    assert m["peak_gib"] / m["capacity_gib"] >= 0.8
    assert m["recompute_charged_ms_per_step"] == pytest.approx(m["recompute_ms_per_step"], rel=0.05)
    # the same recompute as the ample run (same model): the realized cost of recompute
    realized = timer_delta("mcore_rc_full_ample", "mcore_rc_none_ample")
    assert m["recompute_ms_per_step"] == pytest.approx(realized, rel=0.25)
    assert d.walls["memory"]["ms_per_step"] >= m["recompute_charged_ms_per_step"] - 0.5
    assert pitfall(d, "full_recompute_with_headroom") is None
    assert any(f["id"] == "recompute_selective" for f in d.fixes)


def test_pipeline_forwards_between_backwards_are_not_recompute(diagnosis):
    """1F1B interleaves micro-batch forwards with backwards: without doubled forward kernels
    they are not recompute."""
    d = diagnosis("mcore_bridge_pp2_ep2")
    assert d.memory["recompute_mode"] == "none" and d.memory["recompute_ms_per_step"] == 0.0


def _kernels(names: list[str], sides: list[str]) -> pd.DataFrame:
    start = np.arange(len(names), dtype=np.int64) * 1000
    return pd.DataFrame({"start": start, "end": start + 900, "full_name": names, "side": sides})


def test_recompute_spans_on_a_synthetic_sequence():
    """forward (4 layers) | backward of layers 4..1, each after its recomputed forward | next
    forward: four spans, each one layer long."""
    layer = [f"k{i}" for i in range(K_GRAM + 2)] + ["ln_fwd"]
    side_l = [""] * (K_GRAM + 2) + ["fwd"]
    back = ["ln_bwd", "g1", "g2"]
    side_b = ["bwd", "", ""]
    names = layer * 4 + (back + layer) * 4 + back + ["optimizer"] + layer * 4
    sides = side_l * 4 + (side_b + side_l) * 4 + side_b + [""] + side_l * 4
    spans = recomputed_spans(_kernels(names, sides))
    assert spans[0].size == 4
    assert iv.total(spans) == 4 * ((len(layer) - 1) * 1000 + 900)
    # no doubled forward: a backward region holding only backward kernels has no spans
    plain = recomputed_spans(_kernels(layer * 4 + back * 5 + layer * 4, side_l * 4 + side_b * 5 + side_l * 4))
    assert plain[0].size == 0


# ----------------------------------------------------------------------------- offload vs input

def test_pageable_input_copies_are_the_input_pipeline_not_offload(diagnosis):
    d, base = diagnosis("mcore_ep4_input_pageable"), diagnosis("mcore_ep4_base")
    assert d.memory["offload_ms_per_step"] == 0.0
    assert all(dv["features"]["offload_bytes"] == 0 for dv in d.devices)
    feats = [dv["features"] for dv in d.devices]
    per_step_mib = np.mean([f["input_bytes"] / dv["iterations"] for f, dv in zip(feats, d.devices)]) / 2**20
    # each micro-batch: tokens and labels (2 x 32 KiB) + a 4 MiB [1,1,s,s] mask, 2 micro-batches
    assert per_step_mib == pytest.approx(2 * (4 + 2 * 32 / 1024), rel=0.05)
    assert all(f["input_pageable_bytes"] == f["input_bytes"] for f in feats)
    row = next(e for e in d.evidence if e["metric"].startswith("input pipeline"))
    realized = timer_delta("mcore_ep4_input_pageable", "mcore_ep4_base")
    # a small effect (7 ms on 257): within the 5-10% run-to-run noise of the step
    assert abs(row["value"] - realized) <= 0.1 * PROFILES["mcore_ep4_base"]["workload_step_ms"]
    assert row["wall"] == "host" and row["value"] > 1.0
    ids = [f["id"] for f in d.fixes]
    assert {"host_input_pinned", "host_input_workers", "host_input_on_gpu"} <= set(ids)
    assert not any(f["id"].startswith("offload") for f in d.fixes)
    assert next(e for e in base.evidence if e["metric"].startswith("input pipeline"))["value"] == 0.0


def test_real_offload_is_still_offload(diagnosis):
    d = diagnosis("memory_offload_1gpu")
    assert d.verdict["wall"] == "memory"
    assert d.memory["offload_ms_per_step"] > 0.5 * d.window["step_ms"]["mean"]
    assert d.devices[0]["features"]["input_bytes"] == 0
    assert any(f["id"].startswith("offload") for f in d.fixes)


# ----------------------------------------------------------------------------- profiler overhead

def test_emit_nvtx_overhead_is_a_pitfall_with_the_realized_inflation(diagnosis):
    d = diagnosis("mcore_bridge_pp2_ep2_emitnvtx")
    pf = pitfall(d, "profiler_overhead_emit_nvtx")
    assert pf is not None
    realized = timer_delta("mcore_bridge_pp2_ep2_emitnvtx", "mcore_bridge_pp2_ep2")
    assert pf["cost_ms_per_step"] == pytest.approx(realized, rel=0.35), (pf["cost_ms_per_step"], realized)
    feats = d.devices[0]["features"]
    assert feats["op_ranges"] > 10_000 and 200 <= feats["op_range_cost_ns"] <= 10_000
    # the host wall is partly the instrument's: no CUDA graphs for it, and it says so
    assert d.verdict["wall"] == "host"
    assert not any(f["id"] in ("cuda_graphs", "host_bigger_launches") for f in d.fixes)
    assert any("the capture itself inflates host time" in m for m in d.missing)


def test_no_profiler_pitfall_without_op_ranges(diagnosis):
    d = diagnosis("mcore_bridge_pp2_ep2")
    assert pitfall(d, "profiler_overhead_emit_nvtx") is None
    assert d.devices[0]["features"]["op_ranges"] == 0
    assert not any("inflates host time" in m for m in d.missing)
    assert any(f["id"] == "cuda_graphs" for f in d.fixes)


# ----------------------------------------------------------------------------- diff blames causes

def test_diff_charges_waiting_to_the_straggler_host(diagnosis):
    """rank 1 does 6 ms of Python per layer: its host grows, the others wait for it. The
    waiting is charged to rank 1's host, transfer did not move, and host is the verdict."""
    from profclass.diff import diff

    b, cand = diagnosis("compute_4gpu"), diagnosis("hoststraggler_4gpu")
    r = diff(b, cand)
    c = r.causes
    assert [w["rank"] for w in c["waited_for"]] == [1] and c["waited_for"][0]["wall"] == "host"
    assert abs(c["transfer_delta_ms"]) < 0.5 and c["wait_delta_ms"] > 10.0
    assert c["charged"]["wall"] == "host" and c["charged"]["ms_per_step"] > 10.0
    assert c["walls_delta_ms"]["communication"] < 0.25 * c["wait_delta_ms"]
    assert r.regression and r.verdict["wall"] == "host"
    # moving the waiting keeps the sum of the ranks' wall changes
    per_rank = [sum(dc["walls"][w]["ms_per_step"] - db["walls"][w]["ms_per_step"] for w in db["walls"])
                for db, dc in zip(b.devices, cand.devices)]
    assert sum(c["walls_delta_ms"].values()) == pytest.approx(float(np.mean(per_rank)), abs=0.01)


def test_diff_finds_the_stalled_rank_despite_run_to_run_noise(diagnosis):
    """ep4_hoststall: 15 ms host stall per step on rank 1 only. The timers say the candidate
    was faster (noise, 257 vs 238 ms), and per-rank host walls drift by tens of ms between
    runs of this host-bound job; the stall is still found on rank 1 and the waiting it causes
    is charged to its host, not read off the step delta."""
    from profclass.diff import diff

    b, cand = diagnosis("mcore_ep4_base"), diagnosis("mcore_ep4_hoststall")
    r = diff(b, cand)
    c = r.causes
    # rank 1 leads; another rank's stall idle may also rise by a few % of the step between two
    # runs of this host-bound job (rank 2: +7 ms here; identical runs stay under 1%)
    lead = c["waited_for"][0]
    assert lead["rank"] == 1 and lead["found_by"] == "stall" and lead["wall"] == "host"
    assert all(w["stall_delta_ms"] < 0.6 * lead["stall_delta_ms"] for w in c["waited_for"][1:])
    # the stall the workload adds (15 ms, partly hidden by the GPU's queued work)
    assert 8.0 <= lead["stall_delta_ms"] <= 15.5
    assert c["charged"]["wall"] == "host" and 1 in c["charged"]["ranks"]
    assert c["charged"]["ms_per_step"] >= lead["stall_delta_ms"] * 3 / 4 - abs(c["wait_delta_ms"])
    assert abs(c["transfer_delta_ms"]) < 1.0
    assert not r.significant  # the step delta is noise here, and the attribution does not use it


def test_a_pitfall_keeps_its_measured_cost_where_the_replay_does_not_price_its_fix():
    """pitfalls.priced swaps a cost for the replay's price of the rule's priced_by fix, only
    where that fix was priced; rules without priced_by are never touched."""
    from profclass import pitfalls

    found = pitfalls.check({"full_recompute": True, "memory_measured": False}, {"recompute_ms": 40.0}, 200.0)
    (pf,) = [p for p in found if p["id"] == "full_recompute_memory_unknown"]
    assert pf["cost_ms_per_step"] == 40.0 and pf["cost_basis"].startswith("recompute_ms")
    assert pitfalls.undoing_fixes(found) == ("recompute_off",)
    assert pitfalls.priced(found, {}, 200.0) == found
    (got,) = [p for p in pitfalls.priced(found, {"recompute_off": (61.0, "replay:drop_recomputed: x")}, 200.0)
              if p["id"] == pf["id"]]
    assert (got["cost_ms_per_step"], got["cost_pct"], got["cost_basis"]) == (61.0, 30.5, "replay:drop_recomputed: x")
    assert pitfalls.priced(found, {"cuda_graphs": (5.0, "replay:cuda_graphs")}, 200.0) == found
