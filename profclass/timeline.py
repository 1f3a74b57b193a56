"""Stage 2, timeline: per-GPU activity, iterations and the steady-state window.

A *GPU* here is one (report, process, device) triple: with ``nsys profile torchrun ...`` one
report holds every rank; with one report per rank each file holds one. For each GPU this
stage joins kernels and copies to the CUDA API call that launched them (correlation id),
finds iterations, drops warm-up, and fixes the steady-state window W that every feature is
measured over.

Iterations come from, in order of preference:
1. ``nvtx``: NVTX ranges named like an iteration (``iteration 12``, ``ProfilerStep#3``,
   ``train_step 5``...; ``--iteration-range REGEX`` overrides). A range's GPU extent is the
   span of the GPU work launched while it was open.
2. ``periodicity``: the kernel sequence repeats once per step (Megatron-LM's ``--profile``
   captures a few steady iterations with no iteration ranges). Kernels that occur in equal
   bursts at a regular spacing mark the step; the longest such period with support from
   several kernel names is the step.
3. ``whole``: the whole capture, one "iteration".
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .kernels import classify_kernels
from .load import RawProfile

DEFAULT_ITERATION_REGEX = (r"^\s*(iteration|iter|step|train_step|training_step|ProfilerStep#|"
                           r"train_batch|global_step)[\s_#:=-]*(\d+)\s*$")
WARMUP_FACTOR = 1.25  # a leading iteration slower than this x the steady median is warm-up

# CUDA API calls that launch GPU work (their start is when the CPU asked for it)
LAUNCH_CALLS = re.compile(r"^(cudaLaunch|cuLaunch|cudaGraphLaunch|cuGraphLaunch|cudaMemcpy|cuMemcpy|"
                          r"cudaMemset|cuMemset)")


@dataclass
class GpuTimeline:
    """One GPU's activity. DataFrames are sorted by start and hold only this GPU's rows.

    ops: kernels, memcpys and memsets with columns start, end, op ('kernel', 'memcpy',
      'memset'), name, full_name, stream, correlation, grid, block, graph_node, bytes, kind
      ('HtoD'...; '' for kernels), pinned, is_comm, library, collective, is_gemm, is_fp8,
      pair, side, launch_start, launch_end (the CPU call; -1 when unknown)
    runtime: this process's CUDA API calls (start, end, tid, correlation, name)
    nvtx: this process's NVTX ranges (start, end, tid, text, domain)
    iterations: index, start, end of each detected iteration on the GPU clock, and steady
      (bool: inside the steady-state window)
    """

    source: int
    path: str
    pid: int
    device: int
    rank: int | None
    ops: pd.DataFrame
    runtime: pd.DataFrame
    nvtx: pd.DataFrame
    iterations: pd.DataFrame = field(default_factory=pd.DataFrame)
    window_source: str = "whole"
    marker: str | None = None  # the kernel name that marks the step (periodicity only)
    window: tuple[int, int] = (0, 0)

    @property
    def label(self) -> str:
        r = f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"
        return f"{r} / GPU {self.device}"

    @property
    def steady(self) -> pd.DataFrame:
        return self.iterations[self.iterations["steady"]]


def build_ops(prof: RawProfile) -> pd.DataFrame:
    k = classify_kernels(prof.kernels)
    k["op"] = "kernel"
    k["bytes"] = 0
    k["kind"] = ""
    k["pinned"] = False
    parts = [k]
    for df, op in ((prof.memcpy, "memcpy"), (prof.memset, "memset")):
        if df.empty:
            continue
        d = df.copy()
        d["op"] = op
        d["name"] = (op + " " + d["kind"]) if "kind" in d else op
        d["full_name"] = d["name"]
        if "kind" not in d:
            d["kind"] = "memset"
            d["pinned"] = False
        for col, val in (("grid", 0), ("block", 0), ("graph_node", 0), ("is_comm", False),
                         ("library", ""), ("collective", ""), ("is_gemm", False),
                         ("is_fp8", False), ("pair", ""), ("side", "")):
            d[col] = val
        # peer-to-peer copies move data between GPUs: communication, not local copies
        if op == "memcpy":
            p2p = d["kind"] == "PtoP"
            d.loc[p2p, "is_comm"] = True
            d.loc[p2p, "library"] = "cuda_p2p"
            d.loc[p2p, "collective"] = "other"
        parts.append(d)
    cols = ["start", "end", "device", "pid", "stream", "correlation", "op", "name", "full_name",
            "grid", "block", "graph_node", "bytes", "kind", "pinned", "is_comm", "library",
            "collective", "is_gemm", "is_fp8", "pair", "side"]
    ops = pd.concat([p[cols].astype({"name": object, "full_name": object}) for p in parts],
                    ignore_index=True)
    # join each op to the API call that launched it (correlation ids are per process)
    rt = prof.runtime
    if not rt.empty:
        launches = rt[rt["name"].astype(str).str.match(LAUNCH_CALLS)][["pid", "correlation", "start", "end"]]
        launches = launches.drop_duplicates(["pid", "correlation"]).rename(
            columns={"start": "launch_start", "end": "launch_end"})
        ops = ops.merge(launches, on=["pid", "correlation"], how="left")
    else:
        ops["launch_start"] = np.nan
        ops["launch_end"] = np.nan
    ops["launch_start"] = ops["launch_start"].fillna(-1).astype(np.int64)
    ops["launch_end"] = ops["launch_end"].fillna(-1).astype(np.int64)
    ops["name"] = ops["name"].astype("category")
    ops["full_name"] = ops["full_name"].astype("category")
    return ops.sort_values(["start", "end"], kind="stable").reset_index(drop=True)


def split_gpus(prof: RawProfile, source: int, ops: pd.DataFrame) -> list[GpuTimeline]:
    gpus = []
    for (pid, device), g in ops.groupby(["pid", "device"], sort=True):
        if not (g["op"] == "kernel").any():
            continue  # a process that only copied to this device (e.g. a peer) is not a rank
        gpus.append(GpuTimeline(
            source=source, path=prof.path, pid=int(pid), device=int(device), rank=None,
            ops=g.drop(columns=["pid", "device"]).reset_index(drop=True),
            runtime=prof.runtime[prof.runtime["pid"] == pid].sort_values("start").reset_index(drop=True),
            nvtx=prof.nvtx[prof.nvtx["pid"] == pid].sort_values("start").reset_index(drop=True)))
    return gpus


# ---------------------------------------------------------------------------------------------
# iterations

def nvtx_iterations(gpu: GpuTimeline, regex: str) -> pd.DataFrame:
    """Iterations from NVTX ranges, projected onto the GPU through launch times."""
    nv = gpu.nvtx
    if nv.empty:
        return pd.DataFrame()
    pat = re.compile(regex, re.I)
    texts = nv["text"].astype(str)
    uniq = texts.unique()
    matches = {t: pat.search(t) for t in uniq}
    hit = texts.map(lambda t: matches[t] is not None)
    ranges = nv[hit.to_numpy()]
    if len(ranges) < 1:
        return pd.DataFrame()
    # one thread drives the training loop: keep the thread with the most iteration ranges
    tid = ranges["tid"].value_counts().idxmax()
    ranges = ranges[ranges["tid"] == tid].sort_values("start")
    # nested or duplicate ranges (an outer "step" around an inner one): keep the outermost
    outer = ranges["start"].to_numpy() >= np.maximum.accumulate(
        np.r_[-1, ranges["end"].to_numpy()[:-1]])
    ranges = ranges[outer]
    ops = gpu.ops[gpu.ops["launch_start"] >= 0]
    if ranges.empty or ops.empty:
        return pd.DataFrame()
    rs, re_ = ranges["start"].to_numpy(), ranges["end"].to_numpy()
    ls = ops["launch_start"].to_numpy()
    i = np.searchsorted(rs, ls, side="right") - 1
    inside = (i >= 0) & (ls < re_[np.maximum(i, 0)])
    g = pd.DataFrame({"it": i[inside], "start": ops["start"].to_numpy()[inside],
                      "end": ops["end"].to_numpy()[inside]}).groupby("it").agg(
        start=("start", "min"), end=("end", "max"))
    if g.empty:
        return pd.DataFrame()
    labels = ranges["text"].astype(str).to_numpy()
    g["label"] = labels[g.index.to_numpy()]
    return g.reset_index(drop=True)


def periodic_iterations(gpu: GpuTimeline, min_bursts: int = 3) -> pd.DataFrame:
    """Iterations from the periodicity of the kernel sequence (no NVTX needed).

    Among the names that mark the step, the first in name order is the marker: every rank
    runs the same program, so every rank picks the same kernel and its iterations start at
    the same point of the step, without the ranks having to talk (they may be analysed on
    different workers). The chosen name is kept in ``gpu.marker``."""
    k = gpu.ops[gpu.ops["op"] == "kernel"]
    if len(k) < 20:
        return pd.DataFrame()
    names = k["full_name"].cat.categories
    codes = k["full_name"].cat.codes.to_numpy()
    starts = k["start"].to_numpy()
    order = np.argsort(codes, kind="stable")
    sc, st = codes[order], starts[order]
    bounds = np.flatnonzero(np.r_[True, sc[1:] != sc[:-1], True])
    cands = []  # (period, n_bursts, burst_starts)
    for a, b in zip(bounds[:-1], bounds[1:]):  # one pass per distinct kernel name
        n = b - a
        if n < min_bursts or n > 5000:
            continue
        t = st[a:b]
        gaps = np.diff(t)
        big = gaps > 0.5 * gaps.max()
        first = np.r_[0, np.flatnonzero(big) + 1]
        if first.size < min_bursts:
            continue
        per_burst = np.diff(np.r_[first, n])
        if (per_burst != per_burst[0]).any():
            continue
        bursts = t[first]
        periods = np.diff(bursts)
        if periods.mean() <= 0 or periods.std() / periods.mean() > 0.15:
            continue
        cands.append((float(periods.mean()), bursts, str(names[sc[a]])))
    if not cands:
        return pd.DataFrame()
    periods = np.array([c[0] for c in cands])
    # support: how many kernel names agree on (within 5% of) each period
    support = (np.abs(periods[:, None] - periods[None, :]) <= 0.05 * periods[:, None]).sum(1)
    strong = support >= min(3, support.max())
    top = periods[strong].max()
    group = [i for i in range(len(cands)) if abs(periods[i] - top) <= 0.05 * top]
    period, bursts, gpu.marker = cands[min(group, key=lambda i: cands[i][2])]
    it_start = bursts
    it_end = np.r_[bursts[1:], bursts[-1] + period]
    last_end = k["end"].max()
    # the tail after the last marker is a whole iteration only if it is about one period long
    tail = last_end - bursts[-1]
    if not (0.85 * period <= tail <= 1.15 * period):
        it_start, it_end = it_start[:-1], it_end[:-1]
    # a capture that starts at an iteration boundary (cudaProfilerStart) holds one more
    head = bursts[0] - k["start"].min()
    if 0.85 * period <= head <= 1.15 * period:
        it_start = np.r_[k["start"].min(), it_start]
        it_end = np.r_[bursts[0], it_end]
    it_end = np.minimum(it_end, last_end)
    return pd.DataFrame({"start": it_start.astype(np.int64), "end": it_end.astype(np.int64),
                         "label": [f"period {i}" for i in range(len(it_start))]})


def mark_steady(its: pd.DataFrame, open_end: bool = False) -> pd.DataFrame:
    """Step spans (start of one to start of the next) and warm-up removal.

    ``open_end``: the last iteration's end is only where its GPU work stopped (NVTX), so its
    span lacks the trailing idle a start-to-start span has; it is then used only when fewer
    than two whole steps exist.
    """
    its = its.sort_values("start").reset_index(drop=True)
    nxt = its["start"].shift(-1)
    # the span of a step runs to the start of the next one, so host gaps between steps count
    its["step_end"] = np.where(nxt.notna(), nxt.fillna(0), its["end"]).astype(np.int64)
    dur = (its["step_end"] - its["start"]).to_numpy().astype(float)
    steady = np.ones(len(its), dtype=bool)
    if len(its) >= 2:
        whole = dur[:-1] if open_end and len(its) >= 3 else dur
        med = np.median(whole)
        # an iteration cut short by the end of the capture (cudaProfilerStop, --duration), or
        # an open-ended last one when whole steps exist
        if dur[-1] < 0.5 * med or (open_end and len(its) >= 3):
            steady[-1] = False
        kept = dur[steady]
        ref = np.median(kept[len(kept) // 2:]) if kept.size else med  # the settled second half
        for i in range(len(its)):  # leading warm-up iterations only
            if steady[i] and dur[i] > WARMUP_FACTOR * ref and steady.sum() > 1:
                steady[i] = False
            else:
                break
        # the last iteration often ends with a sync/teardown tail: judge it alone
        if steady[-1] and dur[-1] > WARMUP_FACTOR * ref and steady.sum() > 2:
            steady[-1] = False
    its["steady"] = steady
    its["index"] = np.arange(len(its))
    return its


def detect_iterations(gpu: GpuTimeline, regex: str | None) -> None:
    its, source = pd.DataFrame(), "whole"
    its_nvtx = nvtx_iterations(gpu, regex or DEFAULT_ITERATION_REGEX)
    if len(its_nvtx) >= 1:
        its, source = its_nvtx, "nvtx"
    else:
        its_per = periodic_iterations(gpu)
        if len(its_per) >= 2:
            its, source = its_per, "periodicity"
    if its.empty:
        lo, hi = int(gpu.ops["start"].min()), int(gpu.ops["end"].max())
        its = pd.DataFrame({"start": [lo], "end": [hi], "label": ["whole capture"]})
        source = "whole"
    its = mark_steady(its, open_end=(source == "nvtx"))
    gpu.iterations = its
    gpu.window_source = source
    st = its[its["steady"]]
    gpu.window = (int(st["start"].min()), int(st["step_end"].max()))
