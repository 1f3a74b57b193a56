"""Pauses outside the steps' rhythm (host.host_pauses): worked out by hand, then checked against
what a workload logged of its own garbage collector, which profclass does not read."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from conftest import decompress_fixture
from profclass.analyzers.host import PAUSE_MIN_NS, _pause_ns, host_pauses
from profclass.analyzers.iterations import detect_iterations
from profclass.load import load
from profclass.timeline import build_ops, split_gpus

MS = 1_000_000
ROOT = Path(__file__).resolve().parents[1]


def test_a_pause_is_its_excess_over_the_steps_own_longest_stretch():
    # 4 steps, each with a 10 ms stretch (the optimizer's Python) among 1 ms ones; step 3's is 150
    gaps = np.array([1, 10, 1, 1, 10, 1, 1, 150, 1, 1, 10, 1]) * MS
    got = host_pauses(gaps, 4)
    assert got.tolist() == [0] * 7 + [140 * MS] + [0] * 4


def test_no_pause_where_every_step_has_it_with_two_steps_or_below_the_floor():
    every = np.array([1, 150, 1, 150, 1, 150]) * MS  # each step's long stretch is its rhythm
    assert not host_pauses(every, 3).any()
    assert not host_pauses(np.array([1, 10, 1, 150]) * MS, 2).any()  # 2 steps: no median to trust
    small = np.array([1, 10, 1, 10, 1, 10 + PAUSE_MIN_NS / MS - 1]) * MS
    assert not host_pauses(small, 3).any()


def _gpu(name: str, tmp_path):
    path = decompress_fixture(next((ROOT / "fixtures" / "profiles").glob(f"{name}.sqlite*")), tmp_path / "p.sqlite")
    prof = load(str(path))
    (g,) = split_gpus(prof, 0, build_ops(prof))[:1]
    detect_iterations(g, None)
    return g


def test_the_unmarked_pauses_of_a_collecting_job_are_its_collectors_own_ranges(tmp_path):
    """gc_base_1gpu marks each collection with an NVTX range from gc.callbacks (the workload's
    own, docs/notes.md): read without those ranges, the pauses found are that time."""
    g = _gpu("gc_base_1gpu", tmp_path)
    lo, hi = g.window
    gc = g.nvtx[g.nvtx["text"].astype(str).str.contains(re.compile(r"\bgc\b"))]
    marked = (np.minimum(gc["end"], hi) - np.maximum(gc["start"], lo)).clip(lower=0).sum()
    found = _pause_ns(g, lo, hi)
    assert marked > 100 * MS
    assert abs(found - marked) <= 0.15 * marked, (found / MS, marked / MS)
