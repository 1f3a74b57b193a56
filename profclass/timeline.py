"""Stage 2, timeline: each GPU's activity as one table of ops.

A *GPU* here is one (report, process, device) triple: with ``nsys profile torchrun ...`` one
report holds every rank; with one report per rank each file holds one. For each GPU this
stage joins kernels and copies to the CUDA API call that launched them (correlation id).
Finding iterations and the steady-state window is the first analyzer
(``profclass.analyzers.iterations``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .kernels import classify_kernels, describe_name
from .load import RawProfile

# CUDA API calls that launch GPU work (their start is when the CPU asked for it)
LAUNCH_CALLS = re.compile(r"^(cudaLaunch|cuLaunch|cudaGraphLaunch|cuGraphLaunch|cudaMemcpy|cuMemcpy|"
                          r"cudaMemset|cuMemset)")


@dataclass
class GpuTimeline:
    """One GPU's activity. DataFrames are sorted by start and hold only this GPU's rows.

    ops: kernels, memcpys and memsets with columns start, end, op ('kernel', 'memcpy',
      'memset'), name, full_name, stream, correlation, grid, block, graph_node, bytes, kind
      ('HtoD'...; '' for kernels), pinned, is_comm, library, collective, is_gemm, is_fp8,
      pair, side, launch_start, launch_end, launch_tid (the CPU call and its thread; -1 when
      unknown)
    runtime: this process's CUDA API calls (start, end, tid, correlation, name)
    nvtx: this process's NVTX ranges (start, end, tid, text)
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
    periods: list = field(default_factory=list)  # candidate step periods (ns, names supporting)
    window: tuple[int, int] = (0, 0)
    # start, end, group of each NCCL kernel once the communication analyzer named its group
    # (the picture's lane per group); None before
    comm_groups: pd.DataFrame | None = None

    @property
    def label(self) -> str:
        r = f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"
        return f"{r} / GPU {self.device}"

    @property
    def steady(self) -> pd.DataFrame:
        return self.iterations[self.iterations["steady"]]


def comm_kernels(g: GpuTimeline) -> pd.DataFrame:
    """The communication kernels of one GPU (peer copies are communication but not kernels),
    each with ``in_forward`` (``in_forward``; a summary's ops carry it already)."""
    o = g.ops
    sel = (o["is_comm"] & (o["op"] == "kernel")).to_numpy(bool)
    out = o[sel]
    return out if "in_forward" in o else out.assign(in_forward=in_forward(o, sel))


def in_forward(ops: pd.DataFrame, sel: np.ndarray) -> np.ndarray:
    """Per selected op (``ops`` sorted by start): whether the last forward/backward pair kernel
    (``side``: softmax, norm, activation) that started before it is a forward one, i.e. it was
    issued inside a forward pass. TP collectives run in every layer's forward and backward;
    gradient reductions (DP, expert DP) only in the backward or after it."""
    out = np.zeros(int(sel.sum()), bool)
    if "side" not in ops:
        return out
    side = ops["side"]
    fwd = side.eq("fwd").to_numpy(bool)  # vectorised on the categorical column: no string copy
    marked = np.flatnonzero(fwd | side.eq("bwd").to_numpy(bool))
    if not len(marked):
        return out
    pos = np.searchsorted(marked, np.flatnonzero(sel)) - 1
    ok = pos >= 0
    out[ok] = fwd[marked[pos[ok]]]
    return out


OPS_COLUMNS = ["start", "end", "device", "pid", "stream", "correlation", "op", "name", "full_name",
               "grid", "block", "graph_node", "bytes", "kind", "pinned", "is_comm", "library",
               "collective", "is_gemm", "is_fp8", "pair", "side", "launch_start", "launch_end",
               "launch_tid"]
_STR_COLUMNS = ("op", "kind", "library", "collective", "pair", "side")


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
    def stacked(c: str, kernels: bool = True, copies: bool = True):
        """One int64 column over the parts: the kernels' and/or the copies' values, else 0."""
        return lambda: np.concatenate([df[c].to_numpy(np.int64) if (kernels if op == "kernel" else copies)
                                       else np.zeros(len(df), np.int64) for op, df in parts])
    # the columns the order and the launch join need now; the others are stacked one at a
    # time as they are put in order (a 4 GB export's process: ~200 MB less at once)
    num = {c: stacked(c)() for c in ("start", "end", "pid", "correlation")}
    later = {"device": stacked("device"), "stream": stacked("stream"), "grid": stacked("grid", copies=False),
             "block": stacked("block", copies=False), "graph_node": stacked("graph_node", copies=False),
             "bytes": stacked("bytes", kernels=False)}
    n_k = len(k)
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
        _add_copy_part(op, df, strs, flags, names, full_names)
    for c in ("is_comm", "is_gemm", "is_fp8"):
        flags[c] = np.concatenate(flags[c])

    launch_start, launch_end, launch_tid = _launch_times(prof.runtime, num["pid"], num["correlation"])
    order = np.lexsort((num["end"], num["start"]))  # stable: ties keep kernels, copies, sets order
    num["launch_start"], num["launch_end"], num["launch_tid"] = launch_start, launch_end, launch_tid
    strs["name"], strs["full_name"] = names, full_names
    return _in_order(order, num, later, flags, strs)


def _in_order(order: np.ndarray, num: dict, later: dict, flags: dict, strs: dict) -> pd.DataFrame:
    """The ops frame of ``OPS_COLUMNS``, rows in ``order``: ``num`` and ``flags`` hold arrays,
    ``later`` functions that stack one, ``strs`` (values, codes) parts (``_categorical``).
    Each column is put in order and its unordered parts dropped before the next one."""
    cols = {}
    for c in OPS_COLUMNS:
        if c in num:
            cols[c] = num.pop(c)[order]
        elif c in later:
            cols[c] = later.pop(c)()[order]
        elif c in flags:
            cols[c] = flags.pop(c)[order]
        elif c in strs:
            cols[c] = _categorical(strs.pop(c), order)
    return pd.DataFrame(cols, copy=False)  # fresh arrays: no consolidation copy needed


def _add_copy_part(op: str, df: pd.DataFrame, strs: dict, flags: dict, names: list, full_names: list) -> None:
    """Append one copy/memset table's string and flag columns (as ``build_ops`` lays them out)."""
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


def _categorical(parts: list[tuple[np.ndarray, np.ndarray]], order: np.ndarray) -> pd.Categorical:
    """A text column from (values, codes) parts, put in ``order``, as a categorical: row
    filters then copy int codes, not strings. Its categories are the distinct values that
    occur, sorted, as pandas would infer them. Each part's codes are mapped to the final ones
    through its small value table: the rows are gathered twice (remap, order), not five times."""
    values = np.concatenate([v for v, _ in parts]).astype(object)
    uniq, inv = np.unique(values.astype(str), return_inverse=True)
    inv = inv.reshape(-1)
    present = np.zeros(len(uniq), bool)
    offsets = np.cumsum([0] + [len(v) for v, _ in parts])
    for (v, c), at in zip(parts, offsets):
        present[inv[at:at + len(v)][np.bincount(c, minlength=len(v)) > 0]] = True
    n = int(present.sum())  # codes in the width pandas keeps them in: no conversion pass
    code_of = (np.cumsum(present) - 1)[inv].astype(np.int8 if n < 127 else np.int16 if n < 32767 else np.int32)
    codes = np.concatenate([code_of[at:at + len(v)][c] for (v, c), at in zip(parts, offsets)])[order]
    return pd.Categorical.from_codes(codes, categories=pd.Index(uniq[present].astype(object), dtype="str"))


def _launch_times(rt: pd.DataFrame, pid: np.ndarray, corr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start, end and thread of the first launch call with each op's (pid, correlation); -1 if
    none."""
    n = len(pid)
    # a thread id is 24 bits (load's globalTid split): int32, one column of 4 bytes an op
    start, end, tid = np.full(n, -1, np.int64), np.full(n, -1, np.int64), np.full(n, -1, np.int32)
    if rt.empty:
        return start, end, tid
    names = rt["name"]
    if isinstance(names.dtype, pd.CategoricalDtype):
        hit_cat = np.asarray(names.cat.categories.astype(str).str.match(LAUNCH_CALLS), bool)
        codes = names.cat.codes.to_numpy()
        is_launch = np.where(codes >= 0, hit_cat[np.maximum(codes, 0)], False)
    else:
        is_launch = names.astype(str).str.match(LAUNCH_CALLS).to_numpy(bool)
    # the launch calls' rows of the few columns read here, not a row filter of the whole frame
    rows = np.flatnonzero(is_launch)
    lpid, lcorr = rt["pid"].to_numpy(np.int64)[rows], rt["correlation"].to_numpy(np.int64)[rows]
    if (len(lpid) and lpid.min() >= 0 and lpid.max() < 2**23 and lcorr.min() >= 0 and lcorr.max() < 2**40
            and pid.min() >= 0 and pid.max() < 2**23 and corr.min() >= 0 and corr.max() < 2**40):
        # (pid, correlation) packed into one int64: a sorted-array join, no hashing of pairs
        lkey, key = (lpid << 40) | lcorr, (pid << 40) | corr
        if len(lkey) > 1 and bool((lkey[1:] > lkey[:-1]).all()):  # one process's calls in table order, as usual
            uniq, first = lkey, np.arange(len(lkey))  # what np.unique gives here, without the sort
        else:
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
    start[found] = rt["start"].to_numpy(np.int64)[rows[at]]
    end[found] = rt["end"].to_numpy(np.int64)[rows[at]]
    tid[found] = rt["tid"].to_numpy(np.int64)[rows[at]]
    return start, end, tid


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
        launches = rt[rt["name"].astype(str).str.match(LAUNCH_CALLS)][["pid", "correlation", "start", "end", "tid"]]
        launches = launches.drop_duplicates(["pid", "correlation"]).rename(
            columns={"start": "launch_start", "end": "launch_end", "tid": "launch_tid"})
        ops = ops.merge(launches, on=["pid", "correlation"], how="left")
    else:
        ops["launch_start"] = ops["launch_end"] = ops["launch_tid"] = np.nan
    for c, t in (("launch_start", np.int64), ("launch_end", np.int64), ("launch_tid", np.int32)):
        ops[c] = ops[c].fillna(-1).astype(t)
    ops["name"] = ops["name"].astype("category")
    ops["full_name"] = ops["full_name"].astype("category")
    return ops.sort_values(["start", "end"], kind="stable").reset_index(drop=True)


def split_gpus(prof: RawProfile, source: int, ops: pd.DataFrame) -> list[GpuTimeline]:
    return list(iter_gpus(prof, source, ops))


def iter_gpus(prof: RawProfile, source: int, ops: pd.DataFrame, reuse: dict | None = None):
    """The GPUs of one export, one at a time in (pid, device) order: a caller that reduces
    each to numbers holds one GPU's copy of the rows at a time, not all of them.

    ``reuse``: where the table holds one GPU (a per-process pass), its process's sorted API
    calls and NVTX ranges are left here by a first pass and taken from here by a second
    (pass the same dict twice), so they are filtered and sorted once; then the caller may
    drop ``prof.runtime`` and ``prof.nvtx`` in between (nothing here reads them again)."""
    # (pid, device) packed into one int64 (pids < 2^24, devices < 2^16): factorising plain
    # integers is far cheaper than a MultiIndex of pairs
    pid, dev = ops["pid"].to_numpy(np.int64), ops["device"].to_numpy(np.int64)
    if len(pid) and pid.min() == pid.max() and dev.min() == dev.max():
        # one GPU (a per-process pass, as usual): every row is that GPU's, in order already
        # (no index array of every row: one held through both loops was 30 MiB at 4 GB)
        keys, order, bounds = [(int(pid[0]), int(dev[0]))], None, np.array([0, len(pid)])
    else:
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
        rows = slice(bounds[j], bounds[j + 1]) if order is None else order[bounds[j]:bounds[j + 1]]
        if not is_kernel[rows].any():
            continue  # a process that only copied to this device (e.g. a peer) is not a rank
        # one GPU in the table (a per-process pass): its rows are all rows, in order already
        mine = rest if len(keys) == 1 else rest.take(rows).reset_index(drop=True)
        if reuse is not None and (pid, device) in reuse:
            runtime, nvtx = reuse.pop((pid, device))
        else:
            runtime, nvtx = _process_rows(prof.runtime, pid), _process_rows(prof.nvtx, pid)
            if reuse is not None and len(keys) == 1:
                reuse[(pid, device)] = (runtime, nvtx)
        yield GpuTimeline(source=source, path=prof.path, pid=int(pid), device=int(device), rank=None, ops=mine,
                          runtime=runtime, nvtx=nvtx)


def _process_rows(df: pd.DataFrame, pid: int) -> pd.DataFrame:
    """One process's rows sorted by start (a per-process pass holds only its own: no filter copy).
    A stable sort: rows that start together keep the export's order, so ties never depend on
    the sort's pivot choice."""
    mine = df["pid"].to_numpy() == pid
    return (df if mine.all() else df[mine]).sort_values("start", kind="stable").reset_index(drop=True)
