"""diff recognises a fix off the timeline where the launch line names no flag (a wrapper, a config
file, a Bridge recipe): committed pairs whose exports have their launch line replaced by a
wrapper's (``train job.yaml``; the timelines untouched) are recognised as the same fix, with the
same price and the same realized gain, as the pairs with their flags."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import profile_path, relaunched
from profclass.diff.compare import diff
from profclass.diff.fix_gains import TIMELINE_CAVEATS
from profclass.analyzers.communication import DP_OVERLAP_SEEN, DP_REDUCTIONS, beside_compute

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"


@pytest.fixture(scope="module")
def flagless(tmp_path_factory):
    """name -> a copy of the committed export whose launch line is ``train job.yaml``."""
    out, made = tmp_path_factory.mktemp("flagless"), {}

    def make(name: str) -> str:
        if name not in made:  # a wrapper's launch line: ``train job.yaml``
            made[name] = relaunched(name, out / f"{name}.sqlite", lambda command, args: ("train", ["job.yaml"]))
        return made[name]

    return make


# (base, candidate, the fix, the condition the flagless pair is recognised by)
PAIRS = [
    ("mcore_gb_dp4_base", "mcore_gb_dp4_dpoverlap", "dp_overlap_grad_reduce", "overlap:dp"),
    ("dpnooverlap_4gpu", "dpoverlap_4gpu", "dp_overlap_grad_reduce", "overlap:dp"),  # moe_train's DDP
    ("mcore_ep2_small_mbs1", "mcore_ep2_small_mbs4", "host_bigger_launches", "up:micro_batch_rows"),
    ("grouped_base_1gpu", "grouped_cand_1gpu", "compute_grouped_gemm", "kernels:grouped"),
    ("gc_base_1gpu", "gc_cand_1gpu", "host_gc", "pauses:gone"),  # manual GC: the marked collections gone
    # a change none of the three conditions is: the micro-batch count, off the layout as before
    ("mcore_gb_pp4_m4", "mcore_gb_pp4_m8", "pp_microbatches", "up:--num-microbatches"),
]


@pytest.mark.parametrize("base, cand, fix, cond", PAIRS, ids=[p[2] + ":" + p[0] for p in PAIRS])
def test_a_flagless_pair_is_recognised_as_its_flagged_twin(base, cand, fix, cond, flagless):
    bare = diff(flagless(base), flagless(cand))
    (row,) = bare.fix_gains  # the one fix, nothing else read into the timeline
    assert (row["fix"], row["detected_by"]) == (fix, cond)
    # what the rows cannot tell from a bigger micro-batch is said; the flags leave nothing to say
    said = [n for n in bare.notes if n.startswith(f"{fix}: ")]
    assert said == ([f"{fix}: {TIMELINE_CAVEATS[cond]}"] if cond in TIMELINE_CAVEATS else [])
    flagged = diff(str(profile_path(base)), str(profile_path(cand)))
    assert not [n for n in flagged.notes if n.startswith(f"{fix}: ")]
    (twin,) = [r for r in flagged.fix_gains if r["fix"] == fix]
    assert twin["detected_by"].startswith(("on:", "up:--"))  # the flagged pair says it by flag
    assert row["predicted_gain_ms"] == pytest.approx(twin["predicted_gain_ms"], abs=0.011)
    assert row["realized_gain_ms"] == pytest.approx(twin["realized_gain_ms"], abs=0.011)
    assert row["realized_per"] == twin["realized_per"]


def _snapshots():
    for f in sorted(SNAPSHOTS.glob("*.json")):
        if not f.name.startswith("diff__"):
            yield f.stem, json.loads(f.read_text())


def _snapshot(name: str):
    """A capture's committed JSON snapshot as the object fix_gains' sign readers take."""
    from types import SimpleNamespace

    return SimpleNamespace(**json.loads((SNAPSHOTS / f"{name}.json").read_text()))


def _snapshotted_pairs() -> list[dict]:
    """Every committed gain pair whose base and candidate are both snapshotted."""
    import tomllib

    corpus = tomllib.loads((Path(__file__).resolve().parents[1] / "fixtures" / "corpus.toml").read_text())
    return [p for p in corpus["gain_pair"] if all((SNAPSHOTS / f"{p[k]}.json").exists() for k in ("base", "candidate"))]


def _flags(d) -> dict:
    return ((d["config"].get("command_line_flags") or {}).get("value")) or {}


def test_norm_rows_are_the_micro_batch_tokens_the_launch_line_gives():
    """On every capture whose launch line gives the sequence and the micro-batch, each GPU's
    normalisation kernels cover seq x micro-batch rows (over TP with sequence parallelism)."""
    seen = 0
    for name, d in _snapshots():
        f = _flags(d)
        if not (isinstance(f, dict) and f.get("--seq-length") and f.get("--micro-batch-size")):
            continue
        tp = int(f.get("--tensor-model-parallel-size") or 1) if f.get("--sequence-parallel") else 1
        rows = int(f["--seq-length"]) * int(f["--micro-batch-size"]) // tp
        assert {dv["features"]["norm_rows"] for dv in d["devices"]} == {rows}, name
        seen += 1
    assert seen >= 38


def test_dp_overlap_seen_parts_the_corpus_by_its_launch_lines():
    """DP_OVERLAP_SEEN against every capture with DP gradient reductions: those launched with
    --overlap-grad-reduce (flag or moe_train's) run at least that share of them beside compute,
    the others less."""
    seen = {True: 0, False: 0}
    for name, d in _snapshots():
        share = beside_compute(d["collectives"], DP_REDUCTIONS)
        if share is None:
            continue
        on = "--overlap-grad-reduce" in _flags(d)
        assert (share >= DP_OVERLAP_SEEN) == on, (name, share)
        seen[on] += 1
    assert seen[True] >= 4 and seen[False] >= 30


def test_a_flagless_job_whose_reductions_overlap_is_not_offered_the_overlap_again(flagless):
    """dpoverlap_4gpu without its launch line: its reductions run beside the backward (0.42 of
    their time), so dp_overlap_grad_reduce is on already (fact dp_reductions_overlapped), as its
    flag said; before, the flagless capture was offered it at -3.8 ms (the overlap moved again).
    Its no-overlap twin, flagless too, still gets it."""
    import profclass

    on = profclass.diagnose(flagless("dpoverlap_4gpu"))
    assert on.numbers["dp_reductions_beside_compute"] >= DP_OVERLAP_SEEN
    assert "dp_overlap_grad_reduce" not in {f["id"] for f in on.fixes}
    off = profclass.diagnose(flagless("dpnooverlap_4gpu"))
    assert off.numbers["dp_reductions_beside_compute"] < DP_OVERLAP_SEEN
    assert "dp_overlap_grad_reduce" in {f["id"] for f in off.fixes}


# the committed routing pairs (force-balanced candidates): base imbalance 1.2-4.5% of the step,
# candidates 0.1-0.2%; mcore_alltoall_4gpu's base has a host-late straggler too, so diagnose does
# not call routing its cause, but the spread still fell
ROUTING_PAIRS = [("mcore_ep4_unbalanced", "mcore_ep4_base"), ("mcore_alltoall_4gpu", "mcore_alltoall_4gpu_balanced"),
                 ("mcore_gb_ep4_unbalanced", "mcore_gb_ep4_base")]


@pytest.mark.parametrize("base, cand", ROUTING_PAIRS, ids=[p[0] for p in ROUTING_PAIRS])
def test_a_flagless_routing_pair_is_recognised_by_its_imbalance(base, cand, flagless):
    """Force balance turned on in a config file: the EP work spread that fell says it (balance:ep),
    at the flagged twin's price and realized gain."""
    bare = diff(flagless(base), flagless(cand))
    (row,) = bare.fix_gains
    assert (row["fix"], row["detected_by"]) == ("ep_balance_routing", "balance:ep")
    assert f"ep_balance_routing: {TIMELINE_CAVEATS['balance:ep']}" in bare.notes  # what the spread cannot tell
    (twin,) = diff(str(profile_path(base)), str(profile_path(cand))).fix_gains
    assert twin["fix"] == "ep_balance_routing" and twin["detected_by"].startswith("on:")
    assert row["predicted_gain_ms"] == pytest.approx(twin["predicted_gain_ms"], abs=0.011)
    assert row["realized_gain_ms"] == pytest.approx(twin["realized_gain_ms"], abs=0.011)


def test_balance_ep_holds_on_the_routing_pairs_alone():
    """Over every committed gain pair whose two sides are snapshotted, balance:ep (the base's
    routing uneven, the candidate's spread fallen by ROUTING_BALANCED_FALL to under the minimum,
    both with EP collectives) holds exactly where the pair balanced routing: no DP overlap, fabric,
    recompute or micro-batch pair reads as one. Two captures of one learned-routing job
    (mcore_alltoall_4gpu, its NVTX twin: 1.19% and 0.52% of the step) read as balanced neither way."""
    from profclass.diff.fix_gains import _routing, balanced_routing

    def routing(name):
        return _routing(_snapshot(name))

    seen, moe = {True: 0, False: 0}, 0
    for pair in _snapshotted_pairs():
        rb, rc = routing(pair["base"]), routing(pair["candidate"])
        balanced = pair["fix"] == "ep_balance_routing"
        assert balanced_routing(rb, rc) == balanced, (pair["base"], pair["candidate"], rb, rc)
        seen[balanced] += 1
        moe += not balanced and rb is not None and rc is not None
    assert seen[True] == 3 and seen[False] >= 20 and moe >= 8  # 8+: EP on both sides, where it could fire
    a, b = routing("mcore_alltoall_4gpu"), routing("mcore_alltoall_4gpu_nvtx")
    assert a[0] and not b[0] and not balanced_routing(a, b) and not balanced_routing(b, a)


def test_pauses_gone_holds_on_the_manual_gc_pair_alone():
    """Over every committed gain pair whose two sides are snapshotted, pauses:gone holds on the
    manual-GC pair only. A weak negative test: on most bases no pause shows at all; the one
    capture with pauses (gb_pp4s_vpp2_m8, 22.4 ms a step unmarked) is a candidate here (the next
    test takes it as a base)."""
    from profclass.diff.fix_gains import _pauses, _pauses_gone

    hits = [(p["base"], p["fix"]) for p in _snapshotted_pairs()
            if _pauses_gone(_pauses(_snapshot(p["base"])), _pauses(_snapshot(p["candidate"])))]
    assert hits == [("gc_base_1gpu", "host_gc")]
    # an unmarked pause cannot be told from the rhythm in under 3 steps: none seen there is not gone
    assert not _pauses_gone((5e6, False, 3), (0.0, False, 2)) and _pauses_gone((5e6, False, 3), (0.0, False, 3))


def test_pauses_gone_beside_a_changed_setting_is_not_manual_gc(flagless):
    """mcore_gb_pp4s_vpp2_m8 -> mcore_gb_pp4s_m8 (interleaving turned off): the base's window holds
    22.4 ms a step of unmarked pauses and the candidate's 3 steps none, so the pauses are gone,
    but VPP changed (off the timeline, with no flag): no manual GC is read into it."""
    from profclass.diff.fix_gains import _pauses, _pauses_gone

    snap = {n: _pauses(_snapshot(n)) for n in ("mcore_gb_pp4s_vpp2_m8", "mcore_gb_pp4s_m8")}
    assert _pauses_gone(snap["mcore_gb_pp4s_vpp2_m8"], snap["mcore_gb_pp4s_m8"])
    bare = diff(flagless("mcore_gb_pp4s_vpp2_m8"), flagless("mcore_gb_pp4s_m8"))
    assert "host_gc" not in {r["fix"] for r in bare.fix_gains}
    import profclass
    from profclass.diff.fix_gains import side_settings

    vpp = "--virtual-pipeline-model-parallel-size"  # read off the timeline: the setting that changed
    sides = [side_settings(profclass.diagnose(flagless(n))) for n in ("mcore_gb_pp4s_vpp2_m8", "mcore_gb_pp4s_m8")]
    assert [s.get(vpp) for s in sides] == [2, None]


def _capacity_flags(command, args):
    """The padded twin's launch line as Megatron-LM's flags would say it (the timeline untouched)."""
    return command, args + ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]


def test_a_flagless_drop_and_pad_pair_is_recognised_by_its_syncs(tmp_path):
    """mcore_moe1_dropless -> mcore_moe1_padded (call IA: capacity padding set in the wrapper's YAML,
    no flag on either launch line): the dispatcher's token-count syncs gone (3 host syncs a step ->
    1, the loss's) say drop-and-pad (syncs:gone), priced by the replay as the registered price was,
    and the candidate relaunched with the capacity flags is the same fix by flag, at the same price
    and realized gain."""
    from profclass.diff.fix_gains import _syncs

    # (MoE, host syncs a step, micro-batches a step, rows a micro-batch)
    assert _syncs(_snapshot("mcore_moe1_dropless")) == (True, 3.0, 2, 4096.0)
    assert _syncs(_snapshot("mcore_moe1_padded")) == (True, 1.0, 2, 4096.0)
    base, cand = str(profile_path("mcore_moe1_dropless")), str(profile_path("mcore_moe1_padded"))
    bare = diff(base, cand)
    (row,) = bare.fix_gains
    assert (row["fix"], row["detected_by"]) == ("moe_drop_and_pad", "syncs:gone")
    assert f"moe_drop_and_pad: {TIMELINE_CAVEATS['syncs:gone']}" in bare.notes
    assert row["gain_basis"].startswith("replay:static_shapes")
    flagged = diff(base, relaunched("mcore_moe1_padded", tmp_path / "c.sqlite", _capacity_flags))
    (twin,) = flagged.fix_gains
    assert (twin["fix"], twin["detected_by"]) == ("moe_drop_and_pad", "on:--moe-pad-expert-input-to-capacity")
    assert row["predicted_gain_ms"] == pytest.approx(twin["predicted_gain_ms"], abs=0.011)
    assert row["realized_gain_ms"] == pytest.approx(twin["realized_gain_ms"], abs=0.011)
    # reversed (padding taken off) the syncs come back: nothing is read as drop-and-pad
    assert not [r for r in diff(cand, base).fix_gains if r["fix"] == "moe_drop_and_pad"]


def test_syncs_gone_holds_on_the_drop_and_pad_pair_alone():
    """Over every committed gain pair whose two sides are snapshotted (27, 22 of them MoE on both
    sides), syncs:gone holds on the drop-and-pad pair only: a bigger micro-batch (fewer syncs a
    step, but the rows a micro-batch grown) does not, nor recompute off (the recomputed forward's
    syncs gone, 18.5 -> 10.5 a step on mcore_rc_full_ample: not to half; where it were, the pair's
    change:recompute is recognised, beside which the sign names nothing, ALONE_ONLY)."""
    from profclass.diff.fix_gains import ALONE_ONLY, _syncs, _syncs_gone

    pairs = _snapshotted_pairs()
    hits = [(p["base"], p["fix"]) for p in pairs if _syncs_gone(_syncs(_snapshot(p["base"])), _syncs(_snapshot(p["candidate"])))]
    assert hits == [("mcore_moe1_dropless", "moe_drop_and_pad")] and "syncs:gone" in ALONE_ONLY
    assert len(pairs) >= 27
    # the work split differently is no sync gone: four rows a micro-batch for one
    assert not _syncs_gone((True, 9.0, 4, 1024.0), (True, 3.0, 1, 4096.0))
    assert not _syncs_gone((False, 9.0, 4, 1024.0), (False, 1.0, 4, 1024.0))  # no MoE either side


FABRIC_PAIRS = [("mcore_ep4_slowfabric", "mcore_ep4_base"), ("mcore_ep2_wide_slowfabric", "mcore_ep2_wide_nvlink"),
                ("mcore_gb_ep4_slowfabric", "mcore_gb_ep4_base")]


def _p2p_unseen(name: str, dst: Path) -> str:
    """``name`` launched by a wrapper (``train job.yaml``) that sets NCCL's environment inside the
    process: the export records no NCCL_P2P_DISABLE (the timelines untouched)."""
    import sqlite3

    relaunched(name, dst, lambda command, args: ("train", ["job.yaml"]))
    con = sqlite3.connect(dst)
    gone = con.execute("DELETE FROM META_DATA_CAPTURE WHERE value LIKE 'NCCL_P2P_DISABLE=%'").rowcount
    con.commit()
    con.close()
    assert gone or "slowfabric" not in name, name
    return str(dst)


@pytest.mark.parametrize("base, cand", FABRIC_PAIRS, ids=[p[0] for p in FABRIC_PAIRS])
def test_a_fabric_pair_whose_environment_is_unseen_is_recognised_by_its_transfers(base, cand, tmp_path):
    """NCCL through host memory on the base, NVLink on the candidate, set where the export cannot
    see it: the same collectives moving their data 8-14x faster say it (transfer:faster), at the
    price and realized gain the environment variable's twin gets."""
    bare = diff(_p2p_unseen(base, tmp_path / "b.sqlite"), _p2p_unseen(cand, tmp_path / "c.sqlite"))
    (row,) = bare.fix_gains
    assert (row["fix"], row["detected_by"]) == ("comm_nvlink_domain", "transfer:faster")
    assert f"comm_nvlink_domain: {TIMELINE_CAVEATS['transfer:faster']}" in bare.notes
    (twin,) = diff(str(profile_path(base)), str(profile_path(cand))).fix_gains
    assert (twin["fix"], twin["detected_by"]) == ("comm_nvlink_domain", "off:NCCL_P2P_DISABLE")
    assert row["predicted_gain_ms"] == pytest.approx(twin["predicted_gain_ms"], abs=0.011)
    assert row["realized_gain_ms"] == pytest.approx(twin["realized_gain_ms"], abs=0.011)


def test_transfer_faster_holds_on_the_fabric_pairs_alone():
    """Over every committed gain pair whose two sides are snapshotted, transfer:faster holds on the
    three fabric pairs only (their transfers a step fall 43.0 -> 5.0, 120.8 -> 10.6, 181.3 -> 16.3
    ms), in neither direction elsewhere: routing balance moves the same collectives' transfers by
    0.87-1.06, a DP overlap, recompute or micro-batch change by less or changes the calls."""
    from profclass.diff.fix_gains import FABRIC_FASTER, _fabric_faster, _transfers

    import tomllib

    fixes = tomllib.loads((Path(__file__).resolve().parents[1] / "profclass" / "data" / "fixes.toml").read_text())
    (fabric,) = [f for f in fixes["fix"] if f["id"] == "comm_nvlink_domain"]
    assert FABRIC_FASTER == fabric["transform"]["factor"][0]  # the bound is the fix's own low end
    pairs = _snapshotted_pairs()
    hits = [(p["base"], p["candidate"]) for p in pairs
            if _fabric_faster(_transfers(_snapshot(p["base"])), _transfers(_snapshot(p["candidate"])))]
    assert sorted(hits) == sorted(FABRIC_PAIRS) and len(pairs) >= 27
    assert not [p for p in pairs if _fabric_faster(_transfers(_snapshot(p["candidate"])), _transfers(_snapshot(p["base"])))]
    for b, c in FABRIC_PAIRS:
        tb, tc = (sum(t for _, t in _transfers(_snapshot(n))[0].values()) for n in (b, c))
        assert tc < FABRIC_FASTER * tb / 2  # well past the bound: 8-14x, not 3.3x
    # the same collectives: one call a step more in ten is another job, not a fabric
    assert not _fabric_faster(({("all_to_all", "EP"): (10.0, 30.0)}, 100.0), ({("all_to_all", "EP"): (12.0, 3.0)}, 70.0))
    # a transfer too small to read (under FABRIC_SEEN of the step)
    assert not _fabric_faster(({("all_to_all", "EP"): (10.0, 0.5)}, 100.0), ({("all_to_all", "EP"): (10.0, 0.1)}, 99.0))
