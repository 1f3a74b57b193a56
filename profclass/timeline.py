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

from .kernels import classify_kernels, describe_name
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


OPS_COLUMNS = ["start", "end", "device", "pid", "stream", "correlation", "op", "name", "full_name",
               "grid", "block", "graph_node", "bytes", "kind", "pinned", "is_comm", "library",
               "collective", "is_gemm", "is_fp8", "pair", "side", "launch_start", "launch_end"]
_STR_COLUMNS = ("op", "kind", "library", "collective", "pair", "side")
_DESCRIBED = ("is_comm", "library", "collective", "is_gemm", "is_fp8", "pair", "side")


def build_ops(prof: RawProfile) -> pd.DataFrame:
    """Kernels, memcpys and memsets in one frame sorted by (start, end), each joined to the
    API call that launched it (see ``GpuTimeline.ops``).

    Built column-wise from numpy arrays: string columns travel as small per-name tables plus
    integer codes (the kernel taxonomy runs once per distinct name), rows are put in order
    once, and text columns stay categorical (codes into those small tables). The same rows
    as ``build_ops_pandas``, several times faster on million-kernel exports.
    """
    k = prof.kernels
    if k.empty or not isinstance(k["full_name"].dtype, pd.CategoricalDtype) \
            or not isinstance(k["name"].dtype, pd.CategoricalDtype):
        return build_ops_pandas(prof)
    parts = [("kernel", k)] + [(op, df) for df, op in ((prof.memcpy, "memcpy"), (prof.memset, "memset"))
                                if not df.empty]
    num = {c: np.concatenate([df[c].to_numpy(np.int64) for _, df in parts])
           for c in ("start", "end", "device", "pid", "stream", "correlation")}
    n_k = len(k)
    zeros = [np.zeros(len(df), np.int64) for _, df in parts[1:]]
    for c in ("grid", "block", "graph_node"):
        num[c] = np.concatenate([k[c].to_numpy(np.int64)] + zeros)
    num["bytes"] = np.concatenate([np.zeros(n_k, np.int64)] + [df["bytes"].to_numpy(np.int64) for _, df in parts[1:]])
    flags = {"pinned": np.concatenate([np.zeros(n_k, bool)] + [
        (df["pinned"].to_numpy(bool) if op == "memcpy" else np.zeros(len(df), bool)) for op, df in parts[1:]])}

    # strings as (values, codes) per part; a kernel's taxonomy comes from its name's row
    full = k["full_name"].cat
    described = pd.DataFrame([describe_name(str(n)) for n in full.categories])
    kcodes = full.codes.to_numpy()
    strs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {c: [] for c in _STR_COLUMNS}
    strs["op"].append((np.array(["kernel"], object), np.zeros(n_k, np.int64)))
    strs["kind"].append((np.array([""], object), np.zeros(n_k, np.int64)))
    for c in ("library", "collective", "pair", "side"):
        strs[c].append((described[c].to_numpy(object) if len(described) else np.array([""], object), kcodes))
    for c in ("is_comm", "is_gemm", "is_fp8"):
        flags[c] = [described[c].to_numpy(bool)[kcodes] if len(described) else np.zeros(n_k, bool)]
    names = [(k["name"].cat.categories.to_numpy(object), k["name"].cat.codes.to_numpy())]
    full_names = [(full.categories.to_numpy(object), kcodes)]
    for op, df in parts[1:]:
        m = len(df)
        kind_vals, kind_codes = (np.unique(df["kind"].to_numpy(object).astype(str), return_inverse=True)
                                 if op == "memcpy" else (np.array(["memset"], object), np.zeros(m, np.int64)))
        kind_vals = kind_vals.astype(object)
        strs["op"].append((np.array([op], object), np.zeros(m, np.int64)))
        strs["kind"].append((kind_vals, kind_codes))
        op_names = (np.array([f"{op} {v}" for v in kind_vals], object) if op == "memcpy"
                    else np.array([op], object))
        names.append((op_names, kind_codes))
        full_names.append((op_names, kind_codes))
        # peer-to-peer copies move data between GPUs: communication, not local copies
        p2p = (kind_vals == "PtoP")[kind_codes] if op == "memcpy" else np.zeros(m, bool)
        strs["library"].append((np.array(["", "cuda_p2p"], object), p2p.astype(np.int64)))
        strs["collective"].append((np.array(["", "other"], object), p2p.astype(np.int64)))
        strs["pair"].append((np.array([""], object), np.zeros(m, np.int64)))
        strs["side"].append((np.array([""], object), np.zeros(m, np.int64)))
        flags["is_comm"].append(p2p)
        flags["is_gemm"].append(np.zeros(m, bool))
        flags["is_fp8"].append(np.zeros(m, bool))
    for c in ("is_comm", "is_gemm", "is_fp8"):
        flags[c] = np.concatenate(flags[c])

    launch_start, launch_end = _launch_times(prof.runtime, num["pid"], num["correlation"])
    order = np.lexsort((num["end"], num["start"]))  # stable: ties keep kernels, copies, sets order
    cols = {}
    # each column is put in order and its unordered parts dropped before the next one
    for c in OPS_COLUMNS:
        if c in num:
            cols[c] = num.pop(c)[order]
        elif c in flags:
            cols[c] = flags.pop(c)[order]
        elif c in strs:
            cols[c] = _categorical(strs.pop(c), order)
        elif c == "name":
            cols[c] = _categorical(names, order)
        elif c == "full_name":
            cols[c] = _categorical(full_names, order)
        elif c == "launch_start":
            cols[c] = launch_start[order]
        elif c == "launch_end":
            cols[c] = launch_end[order]
    return pd.DataFrame(cols, copy=False)  # fresh arrays: no consolidation copy needed


def _stack_codes(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate (values, codes) parts into one table of distinct values and codes into it."""
    values = np.concatenate([v for v, _ in parts]).astype(object)
    offsets = np.cumsum([0] + [len(v) for v, _ in parts[:-1]])
    codes = np.concatenate([c + o for (_, c), o in zip(parts, offsets)])
    uniq, inv = np.unique(values.astype(str), return_inverse=True)
    return uniq.astype(object), inv[codes]


def _categorical(parts, order) -> pd.Categorical:
    """A text column as a categorical: row filters then copy int codes, not strings."""
    uniq, codes = _stack_codes(parts)
    codes = codes[order]
    present = np.zeros(len(uniq), bool)
    present[codes] = True  # categories are the names that occur, as pandas would infer them
    remap = np.cumsum(present) - 1
    return pd.Categorical.from_codes(remap[codes], categories=pd.Index(uniq[present], dtype="str"))


def _launch_times(rt: pd.DataFrame, pid: np.ndarray, corr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of the first launch call with each op's (pid, correlation); -1 if none."""
    n = len(pid)
    start, end = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    if rt.empty:
        return start, end
    names = rt["name"]
    if isinstance(names.dtype, pd.CategoricalDtype):
        hit_cat = np.asarray(names.cat.categories.astype(str).str.match(LAUNCH_CALLS), bool)
        codes = names.cat.codes.to_numpy()
        is_launch = np.where(codes >= 0, hit_cat[np.maximum(codes, 0)], False)
    else:
        is_launch = names.astype(str).str.match(LAUNCH_CALLS).to_numpy(bool)
    launches = rt[is_launch]
    lpid, lcorr = launches["pid"].to_numpy(np.int64), launches["correlation"].to_numpy(np.int64)
    if (len(lpid) and lpid.min() >= 0 and lpid.max() < 2**23 and lcorr.min() >= 0 and lcorr.max() < 2**40
            and pid.min() >= 0 and pid.max() < 2**23 and corr.min() >= 0 and corr.max() < 2**40):
        # (pid, correlation) packed into one int64: a sorted-array join, no hashing of pairs
        lkey, key = (lpid << 40) | lcorr, (pid << 40) | corr
        uniq, first = np.unique(lkey, return_index=True)  # the first call of each key
        pos = np.minimum(np.searchsorted(uniq, key), max(len(uniq) - 1, 0))
        found = (uniq[pos] == key) if len(uniq) else np.zeros(n, bool)
        at = first[pos[found]]
    else:
        lk = pd.MultiIndex.from_arrays([lpid, lcorr])
        keep = ~lk.duplicated(keep="first")  # as drop_duplicates: the first call of a (pid, correlation)
        at_all = lk[keep].get_indexer(pd.MultiIndex.from_arrays([pid, corr]))
        found = at_all >= 0
        at = np.flatnonzero(keep)[at_all[found]]
    start[found] = launches["start"].to_numpy(np.int64)[at]
    end[found] = launches["end"].to_numpy(np.int64)[at]
    return start, end


def build_ops_pandas(prof: RawProfile) -> pd.DataFrame:
    """``build_ops`` with pandas merge/concat (used where the kernels lack categorical names)."""
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
    return list(iter_gpus(prof, source, ops))


def iter_gpus(prof: RawProfile, source: int, ops: pd.DataFrame):
    """The GPUs of one export, one at a time in (pid, device) order: a caller that reduces
    each to numbers holds one GPU's copy of the rows at a time, not all of them."""
    # (pid, device) packed into one int64 (pids < 2^24, devices < 2^16): factorising plain
    # integers is far cheaper than a MultiIndex of pairs
    pid, dev = ops["pid"].to_numpy(np.int64), ops["device"].to_numpy(np.int64)
    if len(pid) and pid.min() >= 0 and pid.max() < 2**40 and dev.min() >= 0 and dev.max() < 2**16:
        codes, uniq = pd.factorize((pid << 16) | dev, sort=True)
        keys = [(int(k >> 16), int(k & 0xFFFF)) for k in uniq]
    else:  # out-of-range ids (damaged exports): pairs
        codes, keys = pd.factorize(pd.MultiIndex.from_arrays([pid, dev]), sort=True)
    order = np.argsort(codes, kind="stable")  # rows of each GPU, in their (start, end) order
    bounds = np.searchsorted(codes[order], np.arange(len(keys) + 1))
    is_kernel = (ops["op"] == "kernel").to_numpy()
    rest = ops.drop(columns=["pid", "device"])
    for j, (pid, device) in enumerate(keys):
        rows = order[bounds[j]:bounds[j + 1]]
        if not is_kernel[rows].any():
            continue  # a process that only copied to this device (e.g. a peer) is not a rank
        yield GpuTimeline(
            source=source, path=prof.path, pid=int(pid), device=int(device), rank=None,
            ops=rest.take(rows).reset_index(drop=True),
            runtime=prof.runtime[prof.runtime["pid"] == pid].sort_values("start").reset_index(drop=True),
            nvtx=prof.nvtx[prof.nvtx["pid"] == pid].sort_values("start").reset_index(drop=True))


# ---------------------------------------------------------------------------------------------
# iterations

def nvtx_iterations(gpu: GpuTimeline, regex: str) -> pd.DataFrame:
    """Iterations from NVTX ranges, projected onto the GPU through launch times."""
    nv = gpu.nvtx
    if nv.empty:
        return pd.DataFrame()
    pat = re.compile(regex, re.I)
    # the regex runs once per distinct text, not once per range
    codes, uniq = pd.factorize(nv["text"].astype(str))
    hit_text = np.array([pat.search(t) is not None for t in uniq], bool)
    ranges = nv[hit_text[codes] if len(uniq) else np.zeros(len(nv), bool)]
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
