"""Allocator churn in the replay: a cudaFree waits for the device before it frees (an implicit
device sync), so the replay holds it as a wait on the GPU's work, not as CPU time; the
memory_allocator_churn transform takes the allocator's calls away, waits included
(docs/replay.md, "Allocator churn")."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from profclass import diagnose
from profclass.replay.run import replayer_of
from profclass.replay.scenario import captured
from profclass.replay.trace import ALLOC
from profclass.replay import transforms

ROOT = Path(__file__).resolve().parents[1]


def _diagnosis(name: str):
    return diagnose(str(next((ROOT / "fixtures" / "profiles").glob(f"{name}.sqlite*"))), keep_replay=True)


@pytest.fixture(scope="module")
def churn():
    """moe_train.py's memory preset: torch.cuda.empty_cache() at the end of every step."""
    return _diagnosis("memory_1gpu")


def test_a_free_that_returned_after_the_gpu_drained_waits_for_the_latest_op(churn):
    waits = 0
    for t in churn.extra.replay_inputs.traces:
        c = t.calls
        w = np.flatnonzero((c.c_kind == ALLOC) & (c.c_target >= 0))
        waits += len(w)
        ends = t.ops.start + t.ops.dur
        for i in w:
            # the awaited op is the latest to end inside the call, and the call's own time is what it
            # took after that end, never its whole measured length
            assert t.ops.start[c.c_target[i]] < c.c_start[i] + c.c_dur[i] + c.c_wake[i]
            returned = ends[c.c_target[i]] + c.c_wake[i]
            assert ends[c.c_target[i]] == ends[ends <= returned].max()
            assert c.c_dur[i] <= max(c.c_wake[i], 1)
    # one empty_cache a step: its first free drains the device (5 steps in the window)
    assert waits >= 5
    assert abs(churn.replay["error_pct"]) < 0.5
    assert churn.replay["graph"]["unexplained_ms_per_step"] < 0.05  # the free's work after the drain is its own


def test_dropping_the_allocator_calls_takes_their_waits_too(churn):
    r = replayer_of(churn.extra.replay_inputs)
    ws = [captured(t) for t in r.traces]
    out = transforms.apply({"kind": "drop_allocs"}, "best", r.traces, ws, r.ctx)
    for t, w in zip(r.traces, out):
        alloc = t.calls.c_kind == ALLOC
        assert not w.c_dur[alloc].any() and not w.c_blocks[alloc].any()
        # nothing else moves: the other calls keep their time and their waits
        base = captured(t)
        assert (w.c_dur[~alloc] == base.c_dur[~alloc]).all() and (w.c_blocks[~alloc] == base.c_blocks[~alloc]).all()


def test_an_emptying_every_step_is_a_pitfall_priced_by_the_replay(churn):
    """memory_1gpu empties the cache at the end of every step: its frees are counted a step at least
    once on its GPU, and the pitfall's cost is memory_allocator_churn's replayed price."""
    (dev,) = churn.devices
    assert dev["features"]["free_calls"] >= dev["features"]["iterations"]
    assert dev["features"]["free_calls"] <= dev["features"]["alloc_calls"]
    (p,) = [p for p in churn.pitfalls if p["rule"] == "allocator_churn_every_step"]
    fix = next(f for f in churn.fixes if f["id"] == "memory_allocator_churn")
    assert p["cost_ms_per_step"] == pytest.approx(fix["expected_gain_ms"], abs=0.011)
    assert p["cost_basis"].startswith("replay:drop_allocs")


def test_a_lone_allocation_is_no_churn():
    """mcore_memwall_full allocates once inside its window (a cudaMalloc, no free): allocator idle,
    but no emptying, so no pitfall."""
    d = _diagnosis("mcore_memwall_full")
    assert all(dev["features"]["free_calls"] == 0 for dev in d.devices)
    assert any(dev["features"]["alloc_calls"] > 0 for dev in d.devices)
    assert not [p for p in d.pitfalls if p["rule"] == "allocator_churn_every_step"]


def test_diff_recognises_an_emptying_that_ended(churn):
    """memory_1gpu (an emptying every step) -> memory_offload_1gpu (the same job without it and without
    recompute): diff reads the churn's end off the frees (churn:gone) and prices it on the base;
    the reverse pair starts one, which is no fix."""
    from conftest import profile_path
    from profclass.diff.compare import diff

    r = diff(str(profile_path("memory_1gpu")), str(profile_path("memory_offload_1gpu")))
    (row,) = [g for g in r.fix_gains if g["fix"] == "memory_allocator_churn"]
    assert row["detected_by"] == "churn:gone"
    listed = next(f for f in churn.fixes if f["id"] == "memory_allocator_churn")
    assert row["predicted_gain_ms"] == pytest.approx(listed["expected_gain_ms"], abs=0.011)
    back = diff(str(profile_path("memory_offload_1gpu")), str(profile_path("memory_1gpu")))
    assert not [g for g in back.fix_gains if g["fix"] == "memory_allocator_churn"]


def _expandable_emptying(tmp_path):
    """One GPU, three iterations, each ending as call GD's (PYTORCH_CUDA_ALLOC_CONF=expandable_segments)
    emptying did: the allocator's cudaStreamSynchronize waits for the last kernel, then it unmaps
    and releases two pages; the next iteration maps them again."""
    from tests.nsys_builder import NsysExportBuilder

    b = NsysExportBuilder(tmp_path / "run.sqlite")
    b.add_gpu(0, name="NVIDIA H200", total_memory=140 * 2**30)
    t = 1_000_000
    for it in range(3):
        start = t
        for name in ("cuMemCreate", "cuMemMap", "cuMemSetAccess"):
            b.add_runtime(name, t, t + 30_000)
            t += 40_000
        for _ in range(4):
            b.add_kernel(t + 20_000, t + 2_000_000, "nvjet_gemm", launch=(t, t + 10_000))
            t += 15_000
        t += 4 * 2_000_000
        b.add_runtime("cudaStreamSynchronize_v3020", t - 7_000_000, t + 5_000)  # returns as the queue drains
        t += 10_000
        for name in ("cuMemUnmap", "cuMemRelease", "cuMemUnmap", "cuMemRelease"):
            b.add_runtime(name, t, t + 80_000)
            t += 90_000
        b.add_nvtx(f"iteration {it}", start - 10_000, t)
        t += 20_000
    return b.write()


def test_an_expandable_segments_emptying_is_churn_too(tmp_path):
    """The unmaps count as memory handed back, so the pitfall holds; the allocator's stream sync
    before them waits as an allocator call, and the churn fix takes it with the unmaps."""
    d = diagnose(str(_expandable_emptying(tmp_path)), keep_replay=True)
    (dev,) = d.devices
    assert dev["features"]["free_calls"] == 2 * dev["features"]["iterations"]
    assert [p["rule"] for p in d.pitfalls if p["rule"] == "allocator_churn_every_step"]
    (t,) = d.extra.replay_inputs.traces
    c = t.calls
    waits = np.flatnonzero((c.c_kind == ALLOC) & (c.c_target >= 0))
    assert len(waits) >= 2  # the allocator's syncs, one an emptying in the window
    r = replayer_of(d.extra.replay_inputs)
    (w,) = transforms.apply({"kind": "drop_allocs"}, "best", r.traces, [captured(t)], r.ctx)
    assert not w.c_blocks[waits].any()
