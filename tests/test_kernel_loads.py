"""Kernels a library loads at their first use inside the window (analyzers.host.kernel_load_ns),
the loads that drain the GPU (replay.host_calls), and what static expert shapes save the host
(replay.shapes). Counted against the exports' own rows by SQL, independently of profclass."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import decompress_fixture
from profclass import diagnose
from profclass.analyzers.host import _kernel_loads, kernel_load_ns
from profclass.analyzers.iterations import detect_iterations
from profclass.load import load
from profclass.replay import collectives
from profclass.replay.run import replayer_of
from profclass.replay.scenario import captured
from profclass.replay.shapes import repeat_shapes
from profclass.timeline import build_ops, split_gpus

ROOT = Path(__file__).resolve().parents[1]


def _export(name: str, tmp_path) -> Path:
    return decompress_fixture(next((ROOT / "fixtures" / "profiles").glob(f"{name}.sqlite*")), tmp_path / "p.sqlite")


def test_a_set_up_call_counts_as_a_load_only_after_a_load_and_before_the_next_launch():
    names = pd.Series(["cuKernelSetAttribute", "cudaLaunchKernel", "cuLibraryLoadData", "cuLibraryGetKernel",
                       "cuKernelSetAttribute", "cudaLaunchKernel", "cuKernelSetAttribute",
                       "cuKernelSetAttribute"], dtype="category")
    tid = np.array([1, 1, 1, 1, 1, 1, 1, 2])
    start = np.arange(8) * 100
    end = start + np.array([5, 5, 40, 2, 30, 5, 7, 9])
    launches = names.astype(str).str.startswith("cudaLaunch").to_numpy()
    got = kernel_load_ns(names, tid, start, end, launches)
    # the first set-up call precedes any load; the one after the launch, and another thread's, are
    # a library's per-launch habit
    assert got.tolist() == [0, 0, 40, 2, 30, 0, 0, 0]


def test_the_loads_counted_in_each_window_are_the_exports_own(tmp_path):
    path = _export("mcore_ep4_unbalanced", tmp_path)
    prof = load(str(path))
    con = sqlite3.connect(path)
    seen = 0
    for g in split_gpus(prof, 0, build_ops(prof)):
        detect_iterations(g, None)
        lo, hi = g.window
        n, ns = _kernel_loads(g, lo, hi)
        sql = con.execute(
            "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON s.id = r.nameId "
            "WHERE s.value LIKE 'cuLibraryLoad%' AND r.start >= ? AND r.start < ? "
            "AND (r.globalTid >> 24) & 16777215 = ?", (int(lo), int(hi), int(g.pid))).fetchone()[0]
        assert n == sql, (g.pid, n, sql)
        assert (ns > 0) == (n > 0)
        seen += n
    con.close()
    assert seen >= 10  # learned routing keeps loading GEMM kernels through the run


def test_a_load_that_returned_with_the_gpu_drained_waits_as_a_sync_and_the_replay_still_fits():
    """On the GPU-bound learned-routing job the long cuKernelSetAttribute calls end 0.1-0.2 ms
    after the GPU's last kernel (docs/notes.md, forty-third session): each is a wait."""
    d = diagnose(str(next((ROOT / "fixtures" / "profiles").glob("mcore_gb_ep4_unbalanced.sqlite*"))),
                 keep_replay=True)
    waits = 0
    for t in d.extra.replay_inputs.traces:
        c = t.calls
        w = np.flatnonzero(c.c_load_waits)
        waits += len(w)
        assert (c.c_target[w] >= 0).all()
        # the awaited op is the latest to end before the call returned, on any stream
        ends = t.ops.start + t.ops.dur
        for i in w:
            assert ends[c.c_target[i]] == ends[ends <= ends[c.c_target[i]] + c.c_wake[i]].max()
    assert waits >= 4
    assert abs(d.replay["error_pct"]) < 0.5


@pytest.mark.parametrize("name", ["mcore_ep4_unbalanced", "mcore_ep4_base"])
def test_static_shapes_cut_only_the_expert_phase_gemm_launches_and_never_add(name):
    d = diagnose(str(next((ROOT / "fixtures" / "profiles").glob(f"{name}.sqlite*"))), keep_replay=True)
    r = replayer_of(d.extra.replay_inputs)
    for t, seg, g in zip(r.traces, r.ctx.ep_segments, r.ctx.op_groups):
        w = captured(t)
        after = repeat_shapes(t, w, seg, g, 1.0)
        cut = w.c_gap - after.c_gap
        assert (cut >= 0).all()
        inside = t.ops.gemm & (t.ops.launch >= 0) & collectives.expert_phase(t, seg, g)
        allowed = np.zeros(len(cut), bool)
        allowed[t.ops.launch[inside]] = True
        assert not cut[~allowed].any()


def _cut_ms_per_step(name: str) -> float:
    d = diagnose(str(next((ROOT / "fixtures" / "profiles").glob(f"{name}.sqlite*"))), keep_replay=True)
    r = replayer_of(d.extra.replay_inputs)
    return float(np.mean([(captured(t).c_gap - repeat_shapes(t, captured(t), s, g, 1.0).c_gap).sum() / t.iterations
                          for t, s, g in zip(r.traces, r.ctx.ep_segments, r.ctx.op_groups)])) / 1e6


def test_learned_routing_pays_more_host_time_per_expert_gemm_than_its_force_balanced_twin():
    """The same program, routing learned or force-balanced: the per-shape host work that static
    shapes remove is larger where the shapes change every step."""
    assert _cut_ms_per_step("mcore_ep4_unbalanced") > 1.5 * _cut_ms_per_step("mcore_ep4_base")


def test_the_host_kernel_loads_fix_follows_the_loads_in_the_window(diagnosis):
    loaded, settled = diagnosis("mcore_ep4_unbalanced"), diagnosis("mcore_ep4_base")
    row = next(e for e in loaded.evidence if e["metric"].startswith("kernels a library loaded"))
    assert row["value"] >= 1.0 and "ms/step of host time" in row["note"]
    assert "host_kernel_loads" in [f["id"] for f in loaded.fixes]
    assert "host_kernel_loads" not in [f["id"] for f in settled.fixes]
