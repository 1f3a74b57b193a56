"""`diff`'s replayed split of a step change into its causes (profclass/diff/split.py), on the
corpus's gain pairs: one-change twins whose construction (fixtures/corpus.toml `[[gain_pair]]`,
`change`) says which cost moved, independently of profclass."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import profile_path

from profclass.diff import diff, render_markdown, render_text

# (base, candidate, what construction says moved, the classes that stand for it)
PAIRS = [
    # NCCL through host memory -> NVLink: the collectives' transfers
    ("mcore_ep4_slowfabric", "mcore_ep4_base", "communication", {"TP", "EP", "DP", "EDP", "ETP", "CP", "PP"}),
    # micro-batch 1 -> 4 at the same tokens per step, launch-bound job: the host's work per step
    ("mcore_ep2_small_mbs1", "mcore_ep2_small_mbs4", "host", {"host"}),
    # full activation recompute -> none: the recognised change, replayed with its transform
    ("mcore_rc_full_ample", "mcore_rc_none_ample", "recompute", {"recompute_off"}),
    # aux-loss routing -> force-balanced routing, GPU-bound job: each rank's expert compute
    ("mcore_gb_ep4_unbalanced", "mcore_gb_ep4_base", "compute", {"compute"}),
    # gradient all-reduce after backward -> overlapped with it: the DP collectives
    ("dpnooverlap_4gpu", "dpoverlap_4gpu", "communication", {"DP"}),
    # the corpus's regression pairs ([[pair]]): twice the all-to-all volume; a host sync after
    # every layer
    ("comm_4gpu", "comm_4gpu_2xdispatch", "communication", {"EP"}),
    ("compute_4gpu", "compute_4gpu_syncs", "host", {"host"}),
]


@pytest.mark.parametrize("base,cand,what,classes", PAIRS, ids=[f"{b}->{c}" for b, c, _, _ in PAIRS])
def test_split_sums_to_the_change_and_names_the_constructed_cause(base, cand, what, classes, diagnosis):
    r = diff(diagnosis(base), diagnosis(cand))
    sp = r.step["split"]
    assert sp["missing"] == [] and sp["parts"], sp["missing"]
    # the parts plus what is not explained are the measured change, exactly (the step means')
    measured = r.step["candidate_ms"] - r.step["base_ms"]
    assert sp["measured_delta_ms"] == pytest.approx(measured, abs=2e-3)
    total = sum(p["delta_ms"] for p in sp["parts"]) + sp["not_explained_ms"]
    assert total == pytest.approx(sp["measured_delta_ms"], abs=1e-9)
    assert sp["replayed_delta_ms"] == pytest.approx(sum(p["delta_ms"] for p in sp["parts"]), abs=1e-9)
    # the largest part is the one change the twin made, in the step's direction
    top = max(sp["parts"], key=lambda p: abs(p["delta_ms"]))
    assert top["cls"] in classes, (what, sp["summary"])
    assert top["delta_ms"] * measured > 0
    assert sp["summary"].startswith(f"step change {measured:+.1f} ms:")
    assert "Replayed causes: step change" in render_text(r) and "Replayed causes: step change" in render_markdown(r)


def test_self_diff_splits_into_nothing(diagnosis):
    """The candidate's costs are the base's: every replay is the base's, every part zero."""
    d = diagnosis("mcore_ep4_base")
    sp = diff(d, d).step["split"]
    assert sp["parts"] and all(p["delta_ms"] == 0 and p["alone_ms"] == 0 for p in sp["parts"])
    assert sp["not_explained_ms"] == 0
    assert sp["evidence"]["only_in_candidate"]["names"] == 0


def test_no_split_says_why(tmp_path, diagnosis):
    """A stored diagnosis has no graph to replay; different GPU counts cannot take each other's
    costs GPU by GPU: missing[] says so, and the reports say there is no split."""
    stored = tmp_path / "base.json"
    stored.write_text(diagnosis("mcore_ep4_base").to_json())
    r = diff(str(stored), diagnosis("mcore_ep4_slowfabric"))
    sp = r.step["split"]
    assert sp["parts"] == [] and sp["summary"] is None and "base has no replay inputs" in sp["missing"][0]
    assert "No replayed split of the step change" in render_text(r)
    sp = diff(diagnosis("compute_1gpu"), diagnosis("compute_4gpu")).step["split"]
    assert sp["parts"] == [] and "different GPU counts (1 vs 4)" in sp["missing"][0]


def test_mismatched_inputs_keep_exit_code_2(tmp_path):
    """Bad input stays one line and exit code 2 with the split in place."""
    bad = tmp_path / "bad.sqlite"
    bad.write_text("not a database")
    p = subprocess.run([sys.executable, "-c", "from profclass.cli import main; main()", "diff",
                        str(profile_path("mcore_ep4_base")), str(bad)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and str(bad) in p.stderr


def test_host_part_stays_within_the_hosts_change_of_cpu_work(diagnosis):
    """The host class scales the base's CPU work by the candidate's rate; it cannot move the
    step by more than the largest change of any GPU's CPU work per step. The DP-overlap twin's
    autograd thread opens its two-step window with a 402 ms hand-off from the main thread (a
    wait, not CPU work): counted as host time, it made the host part +137 ms of a -5 ms change."""
    from profclass.replay.trace import ALLOC

    b, c = diagnosis("mcore_gb_ep4_base"), diagnosis("mcore_gb_ep4_dpoverlap")

    def cpu_ms(d):
        return [float(t.calls.c_gap.sum() + t.calls.c_dur[t.calls.c_kind != ALLOC].sum()) / 1e6 / max(t.iterations, 1)
                for t in d.extra.replay_inputs.traces]

    bound = max(abs(x - y) for x, y in zip(cpu_ms(b), cpu_ms(c)))
    host = next(p for p in diff(b, c).step["split"]["parts"] if p["cls"] == "host")
    assert abs(host["alone_ms"]) <= bound + 1.0, (host, bound)
    assert abs(host["delta_ms"]) <= bound + 1.0, (host, bound)


def test_collector_pauses_are_their_own_cause(diagnosis):
    """Automatic GC -> manual GC (`gc_base_1gpu`: the workload marks every collection with an
    NVTX range of its own, 183-227 ms generation-2 collections every 2-3 steps): the base's
    collections are one part, taken out of both sides before the cost classes, and they explain
    the step change; a side whose window is too short to show pauses says so."""
    sp = diff(diagnosis("gc_base_1gpu"), diagnosis("gc_cand_1gpu")).step["split"]
    pauses = [p for p in sp["parts"] if p["kind"] == "pauses"]
    assert len(pauses) == 1 and pauses[0]["cls"] == "pauses", sp["summary"]
    p = pauses[0]
    assert p["delta_ms"] < 0 and abs(p["delta_ms"]) >= 0.9 * abs(sp["measured_delta_ms"]), sp["summary"]
    assert max(abs(q["delta_ms"]) for q in sp["parts"] if q is not p) < 0.1 * abs(p["delta_ms"])
    assert "candidate not seen in a 2-step window" in p["cause"]
    assert "collector pauses taken out first" in sp["method"]


def test_no_pauses_no_pauses_part(diagnosis):
    """Neither side of the DP-overlap twins pauses: no part, and the method does not say so."""
    sp = diff(diagnosis("dpnooverlap_4gpu"), diagnosis("dpoverlap_4gpu")).step["split"]
    assert not [p for p in sp["parts"] if p["kind"] == "pauses"]
    assert "pauses" not in sp["method"]


def test_known_fix_gain_without_the_collectors_pauses(diagnosis):
    """VPP 2 on the GPU-bound PP 4 stage: the candidate's window holds a host pause its base's
    does not; the realized gain is also given with the pauses the split took out. Until the
    forty-third session this test used DP overlap on the GPU-bound EP 4 job, whose 90 ms "pause"
    on rank 2 was its main thread waiting for the autograd thread inside a cuBLAS kernel load that
    drained the GPU (87.5 ms, docs/replay.md "Kernel loads and new shapes"): no pause now. Manual
    GC's own gain is its pauses: no such figure there."""
    r = diff(diagnosis("mcore_gb_pp4s_m8"), diagnosis("mcore_gb_pp4s_vpp2_m8"))
    part = next(p for p in r.step["split"]["parts"] if p["kind"] == "pauses")
    assert part["candidate_ms"] > 10 and part["base_ms"] == 0
    row = next(f for f in r.fix_gains if f["fix"] == "pp_interleave")
    assert row["realized_without_pauses_ms"] == pytest.approx(
        row["realized_gain_ms"] - part["base_ms"] + part["candidate_ms"], abs=2e-3)
    assert "without the collector's pauses" in " ".join(render_text(r).split())
    loads = diff(diagnosis("mcore_gb_ep4_base"), diagnosis("mcore_gb_ep4_dpoverlap"))
    assert not [p for p in loads.step["split"]["parts"] if p["kind"] == "pauses"]
    gc = diff(diagnosis("gc_base_1gpu"), diagnosis("gc_cand_1gpu")).fix_gains
    assert [f["realized_without_pauses_ms"] for f in gc if f["fix"] == "host_gc"] == [None]
