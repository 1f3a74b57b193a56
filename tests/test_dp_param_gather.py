"""dp_overlap_param_gather (forty-first session): the distributed optimizer's parameter all-gather
under the next forward, offered where the gather's transfer is exposed and the reductions are
overlapped already. Its positive case was captured on 2x H200 (call DB, docs/notes.md; the export
is not committed: fixtures/ is at its limit) and is judged from its timer logs by
tests/test_same_machine_pairs.py; the transform's bucketing is worked by hand in
tests/test_replay_overlap.py. Here: what must not trigger it on the committed captures, and diff's
conditions."""
from __future__ import annotations

import pytest

from profclass.analyzers.communication import DP_EXPOSED_MIN, DP_OVERLAP_SEEN
from profclass.diff.fix_gains import _applied
from profclass.fixes import load_table


@pytest.mark.parametrize("name", ["mcore_ep4_dpoverlap", "mcore_gb_ep4_dpoverlap", "mcore_ep4_base"])
def test_the_moe_dispatchers_token_gathers_are_no_parameter_gather(name, diagnosis):
    """Where EP = DP the alltoall dispatcher's token-count all-gathers fall in the DP group, with
    up to 22 ms a step of waiting on these captures and next to no transfer (0.05-0.1 ms): the
    parameter gather is read by its exposed transfer, so they do not make the fix."""
    d = diagnosis(name)
    gathers = [c for c in d.collectives if c["collective"] == "all_gather" and c["group"] == "DP"]
    assert gathers and all(c["transfer_ms_per_step"] < 0.2 for c in gathers)
    assert d.numbers["exposed_dp_gather_ms"] < DP_EXPOSED_MIN * d.window["step_ms"]["mean"]
    assert "dp_overlap_param_gather" not in {f["id"] for f in d.fixes}


def test_an_overlapped_dp_job_without_the_distributed_optimizer_gathers_nothing(diagnosis):
    d = diagnosis("mcore_gb_dp4_dpoverlap")
    assert d.numbers["exposed_dp_gather_ms"] == 0.0
    assert d.numbers["dp_reductions_beside_compute"] >= DP_OVERLAP_SEEN  # its reductions overlapped


def _signs(dp, gather):
    return dict(dp=dp, dp_gather=gather)


def test_diff_reads_the_gather_moved_beside_the_forward():
    """overlap:dp_gather: the parameter gathers under DP_OVERLAP_SEEN of their time beside compute
    on the base (call DB's base: 0.00), at least that on the candidate (call DB's: 0.50)."""
    (fix,) = [f for f in load_table() if f["id"] == "dp_overlap_param_gather"]
    assert "overlap:dp_gather" in fix["applied_when"]
    assert _applied("overlap:dp_gather", {}, {}, _signs(0.57, 0.0), _signs(0.60, 0.50))[0]
    assert not _applied("overlap:dp_gather", {}, {}, _signs(0.57, 0.3), _signs(0.60, 0.50))[0]
    assert not _applied("overlap:dp_gather", {}, {}, _signs(0.57, None), _signs(0.60, None))[0]
    # the flag, where the launch line has it
    assert _applied("on:--overlap-param-gather", {}, {"--overlap-param-gather": True}, {}, {})[0]


def test_a_subsumed_fix_names_one_whose_transform_makes_its_change():
    """``subsumed_by``: where both apply in one pair, diff credits the fix whose transform makes
    the other's change too. The reductions and the gather overlapped at once:
    dp_overlap_grad_reduce's overlap with the parameter gather bucketed too. Padded to capacity
    (both capacity flags): drop-and-pad's static_shapes, which runs ep_balance_routing's balance
    (replay/transforms.py ``_static_shapes``) and adds static shapes and unblocked syncs."""
    table = {f["id"]: f for f in load_table()}
    subsumed = {i: f["subsumed_by"] for i, f in table.items() if f.get("subsumed_by")}
    assert subsumed == {"dp_overlap_param_gather": "dp_overlap_grad_reduce", "ep_balance_routing": "moe_drop_and_pad"}
    mine, theirs = table["dp_overlap_param_gather"]["transform"], table["dp_overlap_grad_reduce"]["transform"]
    assert theirs["kind"] == mine["kind"] and theirs.get("param_gather") == mine["param_gather"] == 1
    assert mine["reduce"] == 0 and theirs.get("reduce", 1) == 1
    import inspect

    from profclass.replay import transforms
    assert table["ep_balance_routing"]["transform"]["kind"] == "balance"
    assert table["moe_drop_and_pad"]["transform"]["kind"] == "static_shapes"
    assert "_balance(" in inspect.getsource(transforms._static_shapes)
