"""Fixes asked for together (``fixes.requested``'s "a+b"): each transform applied to the weights
the one before it left, the fix plan's arithmetic."""
from __future__ import annotations

import pytest
from conftest import profile_path


@pytest.mark.parametrize("name", ["memory_recompute_1gpu"])
def test_fixes_asked_for_together_are_applied_in_turn_in_either_order(name, diagnosis):
    """"recompute_off+host_bigger_launches" prices the step with both transforms applied, the
    second to the weights the first left (the plan's arithmetic): the same in either order, and
    not the sum of the two alone where both shorten the same critical path."""
    import profclass

    both, back = "recompute_off+host_bigger_launches:microbatch_factor=2", \
        "host_bigger_launches:microbatch_factor=2+recompute_off"
    req = profclass.diagnose(str(profile_path(name)),
                             price_fixes=("recompute_off", "host_bigger_launches:microbatch_factor=2", both, back,
                                          "recompute_off+no_such_fix")).replay["requested"]
    one, two = req["recompute_off"]["best_ms"], req["host_bigger_launches:microbatch_factor=2"]["best_ms"]
    assert req[both]["best_ms"] == pytest.approx(req[back]["best_ms"], abs=0.05)
    assert max(one, two) - 0.05 <= req[both]["best_ms"] <= one + two + 0.05
    assert req[both]["low_ms"] <= req[both]["best_ms"] <= req[both]["high_ms"]
    assert req[both]["basis"].startswith("together,")
    assert "recompute_off+no_such_fix" not in req  # a fix without a transform: nothing priced


def test_the_plans_steps_are_the_price_of_its_fixes_together(diagnosis):
    """``memory_offload_1gpu``'s plan (offload, a larger micro-batch, CUDA graphs: graph fixes on
    a job without a pipeline) banks, step by step, what asking for its fixes together prices."""
    import profclass

    plan = diagnosis("memory_offload_1gpu").plan
    assert len(plan) >= 3
    asks = ["+".join(p["id"] for p in plan[:k]) for k in (2, 3)]
    req = profclass.diagnose(str(profile_path("memory_offload_1gpu")), price_fixes=tuple(asks)).replay["requested"]
    for k, ask in zip((2, 3), asks):
        assert req[ask]["best_ms"] == pytest.approx(sum(p["gain_ms"] for p in plan[:k]), abs=0.05)


def test_a_graph_fix_and_a_schedule_change_together_on_a_pipeline_share_its_bubble(diagnosis):
    """On a pipelined job (``mcore_wrapped_pp2_rc_m2``: PP 2, full recompute, 2 micro-batches,
    no Megatron flag), recompute off and twice the micro-batches together: the schedule change is
    simulated on the stages the recompute saving left, so the pair saves less than the two apart
    (the bubble the more micro-batches remove is the leaner stages'), more than either, the same
    in either order. Fixes whose transforms resize the schedule (a larger micro-batch) or are
    priced on the graph alone there (the collectors' pauses) are not priced with a schedule change."""
    import profclass

    both, back = "recompute_off+pp_microbatches", "pp_microbatches+recompute_off"
    refused = ("host_bigger_launches:microbatch_factor=2+pp_interleave", "host_gc+pp_microbatches")
    d = profclass.diagnose(str(profile_path("mcore_wrapped_pp2_rc_m2")),
                           price_fixes=("recompute_off", "pp_microbatches", both, back) + refused)
    req = d.replay["requested"]
    one, two = req["recompute_off"]["best_ms"], req["pp_microbatches"]["best_ms"]
    assert req[both]["best_ms"] == pytest.approx(req[back]["best_ms"], abs=0.05)
    assert max(one, two) + 1.0 < req[both]["best_ms"] < one + two - 1.0
    assert req[both]["low_ms"] <= req[both]["best_ms"] <= req[both]["high_ms"]
    assert req[both]["basis"].startswith("together on this pipelined job")
    for ask in refused:
        assert ask not in req and any(m.startswith(f"what-if {ask}: not priced") for m in d.missing)


@pytest.mark.parametrize("name", ["mcore_wrapped_pp2_rc_m2", "mcore_dense_tp2sp_pp2"])
def test_a_pipelined_plan_banks_what_its_fixes_together_price(name, diagnosis):
    """A pipelined job's plan (graph fixes and schedule changes mixed) banks, step by step, what
    asking for its fixes together prices: each schedule change simulated on the stages the graph
    fixes before it left, each graph fix on the schedule the changes before it made."""
    import profclass

    plan = diagnosis(name).plan
    kinds = {p.get("applied_as", "graph")[:10] for p in plan}
    assert len(plan) >= 3 and len(kinds) == 2, plan  # both kinds of step
    asks = ["+".join(p["id"] for p in plan[:k]) for k in range(2, len(plan) + 1)]
    req = profclass.diagnose(str(profile_path(name)), price_fixes=tuple(asks)).replay["requested"]
    for k, ask in zip(range(2, len(plan) + 1), asks):
        assert req[ask]["best_ms"] == pytest.approx(sum(p["gain_ms"] for p in plan[:k]), abs=0.05), ask
