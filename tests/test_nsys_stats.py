"""profclass's reading of real exports against NVIDIA's own tools on the same files:
``nsys stats -r cuda_gpu_kern_sum`` (kernel time per kernel name) and
``nsys analyze -r gpu_gaps`` (idle stretches per process and device)."""
from __future__ import annotations

import io
import subprocess

import numpy as np
import pandas as pd
import pytest

from conftest import decompress_fixture, profile_path
from profclass import intervals as iv
from profclass.analyzers import analyse_gpu
from profclass.analyzers.iterations import detect_iterations
from profclass.load import load
from profclass.timeline import build_ops, split_gpus

NAMES = ["compute_1gpu", "comm_4gpu"]
GAP_MS = 1  # gpu_gaps' threshold (integer milliseconds; the rule's default is 500)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """The plain SQLite export of a committed fixture (a private copy nsys may read)."""
    made = {}

    def get(name: str) -> str:
        if name not in made:
            out = tmp_path_factory.mktemp(name) / f"{name}.sqlite"
            decompress_fixture(profile_path(name), out)
            made[name] = str(out)
        return made[name]

    return get


def nsys_csv(nsys: str, *args: str) -> pd.DataFrame:
    proc = subprocess.run([nsys, *args, "--format", "csv", "--output", "-"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    # nsys prints a "Processing [...]" line before the CSV header
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "," in line and not line.startswith("Processing"))
    return pd.read_csv(io.StringIO("\n".join(lines[start:])))


@pytest.mark.parametrize("name", NAMES)
def test_kernel_totals_match_nsys_stats(name, nsys, export):
    path = export(name)
    ref = nsys_csv(nsys, "stats", "--report", "cuda_gpu_kern_sum", path)
    ref = ref.set_index("Name")[["Total Time (ns)", "Instances"]].sort_index()
    k = load(path).kernels
    mine = (k.assign(dur=k["end"] - k["start"]).groupby(k["full_name"].astype(str))["dur"]
            .agg(["sum", "size"]).sort_index())
    assert len(ref) > 20
    assert list(mine.index) == list(ref.index)
    assert (mine["sum"].to_numpy() == ref["Total Time (ns)"].to_numpy()).all()
    assert (mine["size"].to_numpy() == ref["Instances"].to_numpy()).all()


def profclass_gaps(path: str, threshold_ns: int) -> pd.DataFrame:
    """Idle stretches per (pid, device) from profclass's ops (kernels, copies, sets), over the
    device's whole span as gpu_gaps defines it."""
    ops = build_ops(load(path))
    rows = []
    for (pid, dev), o in ops.groupby(["pid", "device"]):
        busy = iv.union(o["start"].to_numpy(), o["end"].to_numpy())
        a, b = iv.complement(busy, int(busy[0][0]), int(busy[1][-1]))
        keep = (b - a) >= threshold_ns
        rows += [(int(pid), int(dev), int(s), int(e - s)) for s, e in zip(a[keep], b[keep])]
    return pd.DataFrame(rows, columns=["PID", "Device ID", "Start (ns)", "Duration (ns)"])


@pytest.mark.parametrize("name", NAMES)
def test_gpu_gaps_match_nsys_analyze(name, nsys, export):
    path = export(name)
    ref = nsys_csv(nsys, "analyze", "--rule", f"gpu_gaps:gap={GAP_MS}:rows=-1", path)
    ref = ref[["PID", "Device ID", "Start (ns)", "Duration (ns)"]].sort_values(["PID", "Device ID", "Start (ns)"])
    mine = profclass_gaps(path, GAP_MS * 1_000_000).sort_values(["PID", "Device ID", "Start (ns)"])
    assert len(ref) > 100
    assert ref.to_numpy().tolist() == mine.to_numpy().tolist()


@pytest.mark.parametrize("name", NAMES)
def test_window_idle_covers_nsys_gaps_inside_it(name, nsys, export):
    """Every gpu_gaps gap inside a GPU's steady window is idle time in profclass's features."""
    path = export(name)
    ref = nsys_csv(nsys, "analyze", "--rule", f"gpu_gaps:gap={GAP_MS}:rows=-1", path)
    prof = load(path)
    checked = 0
    for g in split_gpus(prof, 0, build_ops(prof)):
        detect_iterations(g, None)
        f = analyse_gpu(g, prof).idle
        lo, hi = g.window
        mine = ref[(ref["PID"] == g.pid) & (ref["Device ID"] == g.device)]
        s = mine["Start (ns)"].to_numpy(np.int64)
        e = s + mine["Duration (ns)"].to_numpy(np.int64)
        inside = (s >= lo) & (e <= hi)
        assert f.gaps >= inside.sum()
        assert f.idle_ns >= (e - s)[inside].sum()
        checked += int(inside.sum())
    assert checked >= 1  # the comparison is not vacuous
