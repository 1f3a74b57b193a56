"""Drop-and-pad (``ep_drop_and_pad``, transform ``static_shapes``) and the experts' phase of a job
with no EP all-to-all (``collectives.varying_stretches``), on committed captures."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import profile_path
from profclass import diagnose
from profclass.replay import collectives
from profclass.replay.run import replayer_of


def _traces(name: str):
    return replayer_of(diagnose(str(profile_path(name)), keep_replay=True).extra.replay_inputs).traces


def _per_step_repeats(t, ops: np.ndarray) -> float:
    """The median, over ``ops``, of how often a step runs a GEMM of the op's kernel and CTAs."""
    key = t.ops.name[ops].astype(np.int64) * (1 << 32) + t.ops.grid[ops].astype(np.int64)
    _, at, counts = np.unique(key, return_inverse=True, return_counts=True)
    return float(np.median(counts[at])) / t.iterations


def test_a_one_gpu_moe_jobs_varying_stretches_hold_gemms_whose_shapes_do_not_recur():
    """On a one-GPU MoE capture (every expert local: no all-to-all marks the experts) the stretches
    read as the experts' phase hold GEMMs whose kernel and grid recur less often a step than the
    other GEMMs', and no attention kernel."""
    t = _traces("compute_1gpu")[0]
    phase = collectives.varying_stretches(t)
    inside, outside = t.ops.gemm & phase, t.ops.gemm & ~phase
    assert inside.sum() > outside.sum() > 0
    assert _per_step_repeats(t, inside) < _per_step_repeats(t, outside)
    assert not (phase & t.ops_named(collectives.ATTENTION.search)).any()


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
    assert {"ep_drop_and_pad", "host_kernel_loads"} <= set(fixes)
    pad, loads = fixes["ep_drop_and_pad"]["expected_gain_ms"], fixes["host_kernel_loads"]["expected_gain_ms"]
    assert pad > loads > 0


def test_drop_and_pad_is_not_offered_where_nothing_is_loaded(diagnosis):
    assert "ep_drop_and_pad" not in [f["id"] for f in diagnosis("mcore_ep4_base").fixes]


def test_with_ep_all_to_alls_drop_and_pad_prices_balance_and_the_unblocked_syncs_together():
    """Where the experts sit between EP all-to-alls, static_shapes is routing balance (with its
    static shapes) and the dispatcher's unblocked syncs replayed together."""
    path = str(profile_path("mcore_ep4_unbalanced"))
    asked = ("ep_drop_and_pad", "ep_balance_routing+host_moe_token_sync")
    r = diagnose(path, price_fixes=asked).replay["requested"]
    assert r[asked[0]]["best_ms"] > 0
    assert [r[asked[0]][k] for k in ("low_ms", "best_ms", "high_ms")] == \
        [r[asked[1]][k] for k in ("low_ms", "best_ms", "high_ms")]
