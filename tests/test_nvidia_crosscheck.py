"""profclass against NVIDIA's recipes on the same real exports (each recipe's own mapper, run by
the recipe venv's Python through tests/nvidia/recipe_mapper.py): communication/compute overlap
against ``nccl_gpu_overlap_trace``, GPU gaps against ``gpu_gaps``.

The two measure the overlap differently, and the test says by how much:
- NVIDIA: per NCCL kernel, the sum over compute kernels of its overlap with each (``Compute
  Sum``); compute kernels that overlap each other count once each, and NCCL kernels that
  overlap each other each count the compute under them.
- profclass: |M & C|, the union of communication kernels against the union of compute kernels
  (``analyzers.communication.CommResult.overlapped_comm_ns``): time, counted once.
So NVIDIA's sum >= profclass's, equal where neither kind overlaps itself under the other. On
every committed fixture with communication under compute (7 of them, measured with the same
two formulas) the difference is 0 ns: compute runs on one stream at a time there, and no NCCL
kernel overlaps another with compute beneath. The test asserts that agreement to the
nanosecond, and that NVIDIA's own number is its formula on profclass's kernels. Kernel totals per
name (``nsys stats -r cuda_gpu_kern_sum``) and GPU gaps (``nsys analyze -r gpu_gaps``) are
checked in tests/test_nsys_stats.py (exact agreement); the ``gpu_gaps`` recipe runs the rule
``nsys analyze`` runs, and agrees as exactly (below). The ``cuda_gpu_kern_sum`` recipe needs
nsys's ``median`` SQLite function, which this install lacks: ``nsys stats`` checks kernel sums.
"""
from __future__ import annotations

import subprocess

import numpy as np
import pandas as pd
import pytest

from conftest import ROOT, decompress_fixture, profile_path
from profclass import intervals as iv
from profclass.load import load
from profclass.timeline import build_ops
from test_recipe import recipe_bin  # noqa: F401 (the recipe venv fixture)

DRIVER = ROOT / "tests" / "nvidia" / "recipe_mapper.py"
# real captures with communication under compute: DP all-reduce overlapped with the backward,
# Megatron TP=2 with sequence parallelism and PP=2, and Megatron EP=4 with its DP overlap on
NAMES = ["dpoverlap_4gpu", "mcore_dense_tp2sp_pp2", "mcore_ep4_dpoverlap"]


def pairwise_overlap_ns(a: np.ndarray, b: np.ndarray, s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """For each interval [a, b): the sum over intervals [s, e) of their overlap with it, i.e. the
    integral of how many [s, e) are open, F(b) - F(a) with F(t) = sum(clip(t - s, 0, e - s))."""
    s, e = np.sort(s), np.sort(e)
    cs, ce = np.concatenate([[0], np.cumsum(s)]), np.concatenate([[0], np.cumsum(e)])

    def F(t):
        ns, ne = np.searchsorted(s, t), np.searchsorted(e, t)
        return (ns * t - cs[ns]) - (ne * t - ce[ne])
    return F(b) - F(a)


@pytest.fixture(scope="module")
def nvidia_recipe(recipe_bin, nsys, tmp_path_factory):  # noqa: F811
    """``nvidia_recipe(recipe, fixture, *args)`` -> (the export's path, the mapper's table)."""
    exports = {}

    def run(recipe: str, name: str, *args: str):
        if name not in exports:
            d = tmp_path_factory.mktemp(name)
            rep = d / f"{name}.nsys-rep"
            rep.write_bytes(b"")  # stands for the report: the export beside it is newer, so it is read
            exports[name] = (rep, decompress_fixture(profile_path(name), d / f"{name}.sqlite"))
        rep, sqlite = exports[name]
        out = rep.parent / f"{recipe}.parquet"
        proc = subprocess.run([str(recipe_bin / "python"), str(DRIVER), recipe, str(rep), str(out), *args],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return str(sqlite), pd.read_parquet(out)
    return run


@pytest.fixture
def nvidia_overlap(nvidia_recipe):
    return lambda name: nvidia_recipe("nccl_gpu_overlap_trace", name)


@pytest.mark.parametrize("name", NAMES)
def test_nccl_compute_overlap_against_nccl_gpu_overlap_trace(name, nvidia_overlap):
    path, theirs = nvidia_overlap(name)
    ops = build_ops(load(path))
    k = ops[ops["op"] == "kernel"]
    rows = []
    for (pid, dev), g in k.groupby(["pid", "device"]):
        t = theirs[(theirs["PID"] == pid) & (theirs["DeviceID"] == dev)]
        assert len(t) == len(g)  # the same kernels on this GPU
        comm, comp = g[g["is_comm"].astype(bool)], g[~g["is_comm"].astype(bool)]
        nccl = t[t["is_nccl"]]
        # the same kernels are communication: profclass by name, NVIDIA by NCCL's NVTX ranges
        assert sorted(zip(comm["start"], comm["end"])) == sorted(zip(nccl["Start"], nccl["End"]))
        a, b = comm["start"].to_numpy(np.int64), comm["end"].to_numpy(np.int64)
        s, e = comp["start"].to_numpy(np.int64), comp["end"].to_numpy(np.int64)
        # NVIDIA's definition on profclass's kernels: their number to the nanosecond
        nvidia_ns = int(nccl["Compute Sum"].sum())
        assert int(pairwise_overlap_ns(a, b, s, e).sum()) == nvidia_ns
        union_ns = iv.total(iv.intersect(iv.union(a, b), iv.union(s, e)))
        # NVIDIA's compute-compute sum on compute rows: zero means no compute kernel overlaps another
        compute_self = int(t.loc[~t["is_nccl"], "Compute Sum"].sum())
        rows.append((pid, dev, nvidia_ns, union_ns, compute_self))
    df = pd.DataFrame(rows, columns=["pid", "device", "nvidia_ns", "profclass_ns", "compute_self_ns"])
    print(df.to_string())
    assert df["nvidia_ns"].sum() > 1_000_000  # ms of overlap: not a vacuous check
    assert (df["nvidia_ns"] >= df["profclass_ns"]).all()  # a union never exceeds the sum of its parts
    # compute kernels never overlap each other here (NVIDIA's compute-compute sum is 0), so the
    # two definitions meet: the same overlap to the nanosecond
    assert (df["compute_self_ns"] == 0).all()
    assert (df["nvidia_ns"] == df["profclass_ns"]).all()


@pytest.mark.parametrize("name", NAMES)
def test_reported_window_overlap_within_nvidia_bounds(name, nvidia_overlap):
    """The number profclass reports (``overlapped_comm_ns`` of each GPU's steady window, the
    "overlapped communication" evidence): at least NVIDIA's overlap of the NCCL kernels wholly
    inside the window, at most that plus the kernels that cross its edges (clipped there)."""
    from profclass.analyzers import analyse_gpu
    from profclass.analyzers.iterations import detect_iterations
    from profclass.timeline import split_gpus
    path, theirs = nvidia_overlap(name)
    prof = load(path)
    for g in split_gpus(prof, 0, build_ops(prof)):
        detect_iterations(g, None)
        mine = analyse_gpu(g, prof).communication.overlapped_comm_ns
        lo, hi = g.window
        t = theirs[(theirs["PID"] == g.pid) & (theirs["DeviceID"] == g.device) & theirs["is_nccl"]]
        inside = (t["Start"] >= lo) & (t["End"] <= hi)
        edge = ~inside & (t["End"] > lo) & (t["Start"] < hi)
        floor = int(t.loc[inside, "Compute Sum"].sum())
        slack = int((t.loc[edge, "End"].clip(upper=hi) - t.loc[edge, "Start"].clip(lower=lo)).sum())
        assert floor <= mine <= floor + slack, (g.pid, floor, mine, slack)
        assert floor > 0


@pytest.mark.parametrize("name", ["compute_1gpu", "dpoverlap_4gpu"])
def test_gpu_gaps_match_the_gpu_gaps_recipe(name, nvidia_recipe):
    """Idle stretches of at least 1 ms per (process, device) over its whole span: the recipe's
    rows, gap for gap, are profclass's (the recipe's default threshold is 500 ms)."""
    from test_nsys_stats import GAP_MS, profclass_gaps
    path, theirs = nvidia_recipe("gpu_gaps", name, "--gap", str(GAP_MS), "--rows", "-1")
    cols = ["PID", "Device ID", "Start (ns)", "Duration (ns)"]
    theirs = (theirs.rename(columns={"Start:ts_ns": "Start (ns)", "Duration:dur_ns": "Duration (ns)"})[cols]
              .sort_values(cols[:3]))
    mine = profclass_gaps(path, GAP_MS * 1_000_000).sort_values(cols[:3])
    assert len(theirs) > 100
    assert theirs.to_numpy().tolist() == mine.to_numpy().tolist()
