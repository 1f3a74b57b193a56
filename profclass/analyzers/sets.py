"""What several analyzers measure against: one GPU's ops inside the steady-state window W and
their interval sets (see ``profclass.intervals``), built once per GPU.

``compute`` = compute kernels, ``comm`` = communication kernels (NCCL, DeepEP, HybridEP,
NVSHMEM, peer copies), ``copies`` = other copies and memsets, all clipped to the window W;
busy = compute | comm | copies and idle = W - busy, so

    |W| = |compute| + |comm - compute| + |copies - compute - comm| + idle
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .. import intervals as iv
from ..timeline import GpuTimeline


@dataclass
class WindowSets:
    lo: int
    hi: int
    kernels: pd.DataFrame  # kernels overlapping W (KERNEL_COLUMNS)
    compute_ops: pd.DataFrame  # COMPUTE_COLUMNS
    comm_ops: pd.DataFrame  # COMM_COLUMNS
    copy_ops: pd.DataFrame  # copies and memsets that are not communication (COPY_COLUMNS)
    compute: iv.IntervalSet  # compute kernels, clipped to W
    comm: iv.IntervalSet  # communication kernels
    copies: iv.IntervalSet  # other copies and memsets
    compute_or_comm: iv.IntervalSet  # compute | comm


def clipped_set(df: pd.DataFrame, lo: int, hi: int) -> iv.IntervalSet:
    """The union of the rows' [start, end) clipped to [lo, hi]."""
    return iv.clip(iv.union(df["start"].to_numpy(), df["end"].to_numpy()), lo, hi)


# the columns the analyzers read of each window frame: a frame holds only these, so the
# window's frames are a few narrow copies, not four copies of every ops column (4 GB export:
# ~1 GiB less per GPU)
KERNEL_COLUMNS = ["start", "end", "launch_start", "launch_end", "graph_node", "is_fp8"]
COMPUTE_COLUMNS = ["start", "end", "name", "full_name", "grid", "is_gemm", "pair", "side", "launch_tid"]
COMM_COLUMNS = ["start", "end", "collective", "library"]
COPY_COLUMNS = ["start", "end", "kind", "bytes", "pinned"]


def window_sets(gpu: GpuTimeline) -> WindowSets:
    lo, hi = gpu.window
    o = gpu.ops
    in_w = ((o["end"] > lo) & (o["start"] < hi)).to_numpy(bool)
    is_kernel = (o["op"] == "kernel").to_numpy(bool)
    is_comm = o["is_comm"].to_numpy(bool)
    kern_rows = in_w & is_kernel
    kern = o.loc[kern_rows, KERNEL_COLUMNS]
    comp = o.loc[kern_rows & ~is_comm, COMPUTE_COLUMNS]
    comm = o.loc[in_w & is_comm, COMM_COLUMNS]
    copies = o.loc[in_w & ~is_kernel & ~is_comm, COPY_COLUMNS]
    compute, comm_set = clipped_set(comp, lo, hi), clipped_set(comm, lo, hi)
    return WindowSets(lo=lo, hi=hi, kernels=kern, compute_ops=comp, comm_ops=comm, copy_ops=copies,
                      compute=compute, comm=comm_set, copies=clipped_set(copies, lo, hi),
                      compute_or_comm=iv.union_sets(compute, comm_set))


def _per_distinct(values: pd.Series, test) -> np.ndarray:
    """``test`` (str -> bool) of each value, as a bool array, run once per distinct value (API
    call names and NVTX texts repeat every step), not once per row; a missing value is tested
    as the text "nan" (what ``astype(str)`` wrote for it before pandas 3)."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        # the codes are the factorisation already (API call names: no hash of millions of
        # rows); the test of "nan" goes last, where a missing value's code -1 picks it
        cats = values.cat.categories
        hit = np.fromiter((bool(test(str(u))) for u in [*cats, "nan"]), bool, len(cats) + 1)
        return hit[values.cat.codes.to_numpy()]
    codes, uniq = pd.factorize(values, use_na_sentinel=False)
    hit = np.fromiter((bool(test(str(u))) for u in uniq), bool, len(uniq))
    return hit[codes]


def name_matches(names: pd.Series, pattern: re.Pattern) -> np.ndarray:
    """``names.astype(str).str.match(pattern)`` as a bool array."""
    return _per_distinct(names, pattern.match)


def contains_per_distinct(text: pd.Series, pattern: re.Pattern) -> np.ndarray:
    """``text.astype(str).str.contains(pattern)`` as a bool array."""
    return _per_distinct(text, pattern.search)
