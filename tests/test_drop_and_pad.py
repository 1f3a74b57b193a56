"""Drop-and-pad (``moe_drop_and_pad``, transform ``static_shapes``) and the experts' phase of a job
with no EP all-to-all (``collectives.varying_stretches``), on committed captures."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conftest import profile_path
from profclass import diagnose
from profclass.replay import collectives, shapes
from profclass.replay.run import replayer_of
from profclass.replay.scenario import captured
from profclass.replay.trace import COMM


def _traces(name: str):
    return replayer_of(diagnose(str(profile_path(name)), keep_replay=True).extra.replay_inputs).traces


def _unique_stretches(t) -> np.ndarray:
    """The same reading by another route: each stream cut at the attention and softmax kernels,
    and the router's top-k, each stretch's GEMMs as a tuple of (kernel, CTAs) in start order, and the
    ops of the stretches whose tuple no other stretch has, less the cuts (no hashing)."""
    df = pd.DataFrame({"stream": t.ops.stream, "start": t.ops.start, "name": t.ops.name, "grid": t.ops.grid,
                       "gemm": t.ops.gemm & (t.ops.kind != COMM),
                       "cut": t.ops_named(lambda n: collectives.DENSE_PART.search(n)
                                          or collectives.MOE_ROUTER.search(n))}).sort_values(["stream", "start"])
    df["stretch"] = (df["cut"] | (df["stream"] != df["stream"].shift())).cumsum()
    g = df[df["gemm"]]
    sig = g.groupby("stretch").apply(lambda x: tuple(zip(x["name"], x["grid"])), include_groups=False)
    once = sig[sig.map(sig.value_counts()) == 1].index
    out = np.zeros(t.n_ops, bool)
    out[df.index[df["stretch"].isin(once) & ~df["cut"]]] = True
    return out


def test_a_one_gpu_moe_jobs_varying_stretches_are_its_unrepeated_gemm_sequences():
    """On a one-GPU MoE capture (every expert local: no all-to-all marks the experts) the experts'
    phase is most of its GEMMs, no attention kernel, and exactly the stretches a plain tuple
    comparison finds unrepeated."""
    t = _traces("compute_1gpu")[0]
    phase = collectives.varying_stretches(t)
    assert (t.ops.gemm & phase).sum() > (t.ops.gemm & ~phase).sum() > 0
    assert not (phase & t.ops_named(collectives.ATTENTION.search)).any()
    assert (phase == _unique_stretches(t)).all()


@pytest.mark.parametrize("name", ["mcore_1gpu_dense_small", "graphs_base_1gpu"])
def test_a_job_with_no_router_has_no_varying_stretch(name):
    """A dense model, or a stack of MLPs with no attention kernel to cut its stream, has no experts:
    nothing is read as their phase (before the router check, the MLP stack read whole)."""
    assert not any(collectives.varying_stretches(t).any() for t in _traces(name))


def test_drop_and_pad_is_offered_on_a_one_gpu_moe_job_and_prices_more_than_its_loads(diagnosis):
    """The fix follows the loads (one GPU, no EP spread to read), and static shapes remove the loads
    and more: its replayed price is above host_kernel_loads' on the same capture."""
    d = diagnosis("compute_1gpu")
    fixes = {f["id"]: f for f in d.fixes}
    assert {"moe_drop_and_pad", "host_kernel_loads"} <= set(fixes)
    pad, loads = fixes["moe_drop_and_pad"]["expected_gain_ms"], fixes["host_kernel_loads"]["expected_gain_ms"]
    assert pad > loads > 0


def test_drop_and_pad_is_not_offered_where_nothing_is_loaded(diagnosis):
    assert "moe_drop_and_pad" not in [f["id"] for f in diagnosis("mcore_ep4_base").fixes]


def test_with_ep_all_to_alls_drop_and_pad_prices_at_least_balance_and_the_unblocked_syncs_together():
    """Where the experts sit between EP all-to-alls, static_shapes is routing balance and the
    dispatcher's unblocked syncs, with every launch of the experts' phase fixed, not its GEMMs'
    alone: at each point at least what the two fixes replay together."""
    path = str(profile_path("mcore_ep4_unbalanced"))
    asked = ("moe_drop_and_pad", "ep_balance_routing+host_moe_token_sync")
    r = diagnose(path, price_fixes=asked).replay["requested"]
    assert r[asked[0]]["best_ms"] > 0
    for k in ("low_ms", "best_ms", "high_ms"):
        assert r[asked[0]][k] >= r[asked[1]][k] - 0.05, k


def test_fixed_shapes_cut_only_launches_inside_the_experts_phase_and_never_add():
    t = _traces("compute_1gpu")[0]
    w = captured(t)
    after = shapes.fixed_shapes(t, w, None, None, 1.0)
    cut = w.c_gap - after.c_gap
    assert (cut >= 0).all() and cut.sum() > 0
    inside = (t.ops.launch >= 0) & collectives.expert_phase(t, None, None)
    allowed = np.zeros(len(cut), bool)
    allowed[t.ops.launch[inside]] = True
    assert not cut[~allowed].any()
    # the GEMM launches' rule cuts a part of it
    assert (w.c_gap - shapes.repeat_shapes(t, w, None, None, 1.0).c_gap).sum() <= cut.sum()
