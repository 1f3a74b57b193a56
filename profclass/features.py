"""Stage 3, features: what each GPU did during its steady-state window, as numbers.

Interval sets over the window W (see ``intervals``): C = compute kernels, M = communication
kernels (NCCL, DeepEP, HybridEP, NVSHMEM, peer copies), X = other copies and memsets.
busy = C | M | X and idle = W - busy, so

    |W| = |C| + |M - C| + |X - C - M| + idle

Idle is split by what the host was doing when the GPU ran dry (one vectorised pass over
the gaps): allocator calls (cudaMalloc/cudaFree... overlapping the gap), a host
synchronisation that returned at the start of the gap (the CPU waited, then had to refill
the queue), a late launch (the next kernel was launched after the gap began: the CPU was the
bottleneck), or other (the work was queued but waited on another stream or a peer).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from . import intervals as iv
from .kernels import COLLECTIVE_TYPES
from .load import RawProfile
from .timeline import GpuTimeline

ALLOC_CALLS = re.compile(r"^(cudaMalloc(?!Async)|cudaFree(?!Async)|cudaMallocHost|cudaHostAlloc|"
                         r"cudaFreeHost|cudaMallocManaged|cudaMallocPitch|cuMemAlloc(?!Async)|"
                         r"cuMemFree(?!Async)|cuMemHostAlloc|cuMemFreeHost|cuMemCreate|cuMemRelease|"
                         r"cuMemMap|cuMemUnmap|cuMemAddressReserve|cuMemAddressFree|cuMemSetAccess|"
                         r"cudaHostRegister|cudaHostUnregister|cuMemHostRegister)")
SYNC_CALLS = re.compile(r"^(cudaDeviceSynchronize|cudaStreamSynchronize|cudaEventSynchronize|"
                        r"cudaThreadSynchronize|cuCtxSynchronize|cuStreamSynchronize|"
                        r"cuEventSynchronize|cudaMemcpy$|cudaMemcpy2D$|cuMemcpyDtoH|cuMemcpyHtoD$)")
GRAPH_LAUNCH = re.compile(r"cudaGraphLaunch|cuGraphLaunch")  # str.startswith, as a match
GC_RANGES = re.compile(r"(?:^|\W)(?:gc|garbage|collect)(?:\W|$)", re.I)
SYNC_SLACK_NS = 50_000  # a sync that returned at most this long before the gap began caused it
OFFLOAD_MIN_BYTES = 256 * 1024  # smaller host<->device copies are control traffic, not offload


@dataclass
class GpuFeatures:
    """Per-GPU features over the steady-state window. Times are ns over the whole window."""

    window_ns: int = 0
    iterations: int = 0
    step_ns: list[int] = field(default_factory=list)
    compute_ns: int = 0
    gemm_ns: int = 0
    comm_ns: int = 0
    exposed_comm_ns: int = 0
    overlapped_comm_ns: int = 0
    comm_by_type_ns: dict[str, int] = field(default_factory=dict)
    exposed_comm_by_type_ns: dict[str, int] = field(default_factory=dict)
    comm_libraries: dict[str, int] = field(default_factory=dict)
    exposed_copy_ns: int = 0
    offload_exposed_ns: int = 0
    offload_bytes: int = 0
    idle_ns: int = 0
    idle_alloc_ns: int = 0
    idle_offload_ns: int = 0
    idle_sync_ns: int = 0
    idle_launch_ns: int = 0
    idle_other_ns: int = 0
    gc_ns: int = 0
    gaps: int = 0
    alloc_calls: int = 0
    alloc_call_ns: int = 0
    sync_calls: int = 0
    sync_call_ns: int = 0
    kernels: int = 0
    launch_bound_kernels: int = 0
    launch_bound_kernel_ns: int = 0
    recompute_ratio: float = 0.0
    pair_fwd_ns: int = 0
    recompute_ns: int = 0
    sm_active: float | None = None
    sm_active_estimate: float | None = None
    sm_active_source: str = ""
    tensor_active: float | None = None
    peak_memory_bytes: int | None = None
    total_memory_bytes: int | None = None
    fp8_kernels: int = 0
    graph_kernels: int = 0
    graph_launches: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _ivset(df: pd.DataFrame, lo: int, hi: int) -> iv.IntervalSet:
    return iv.clip(iv.union(df["start"].to_numpy(), df["end"].to_numpy()), lo, hi)


def recompute_ratio(ops: pd.DataFrame) -> float:
    """Extra forward passes per backward pass, from forward/backward kernel pairs.

    Without recompute each forward-type kernel (attention fprop, layer-norm forward, GELU...)
    runs once per backward partner; full activation recompute runs it twice. The median over
    pairs is robust to kernels used outside the layers (the loss's softmax).
    """
    p = ops[ops["pair"] != ""]
    if p.empty:
        return 0.0
    counts = p.groupby(["pair", "side"], observed=True).size().unstack(fill_value=0)
    if "fwd" not in counts or "bwd" not in counts:
        return 0.0
    counts = counts[(counts["bwd"] > 0) & (counts["fwd"] > 0)]
    if counts.empty:
        return 0.0
    ratios = np.clip(counts["fwd"] / counts["bwd"] - 1.0, 0.0, 1.0)
    return float(np.median(ratios))


def compute_features(gpu: GpuTimeline, prof: RawProfile) -> GpuFeatures:
    lo, hi = gpu.window
    f = GpuFeatures(window_ns=hi - lo)
    steady = gpu.steady
    f.iterations = int(len(steady))
    f.step_ns = (steady["step_end"] - steady["start"]).astype(int).tolist()
    ops = gpu.ops[(gpu.ops["end"] > lo) & (gpu.ops["start"] < hi)]
    kern = ops[ops["op"] == "kernel"]
    comp = kern[~kern["is_comm"]]
    comm = ops[ops["is_comm"]]
    copies = ops[(ops["op"] != "kernel") & ~ops["is_comm"]]

    C = _ivset(comp, lo, hi)
    M = _ivset(comm, lo, hi)
    X = _ivset(copies, lo, hi)
    f.compute_ns = iv.total(C)
    f.gemm_ns = iv.total(_ivset(comp[comp["is_gemm"]], lo, hi))
    f.comm_ns = iv.total(M)
    f.overlapped_comm_ns = iv.total(iv.intersect(M, C))
    f.exposed_comm_ns = f.comm_ns - f.overlapped_comm_ns
    for ctype in COLLECTIVE_TYPES:
        sub = comm[comm["collective"] == ctype]
        if sub.empty:
            continue
        Mt = _ivset(sub, lo, hi)
        f.comm_by_type_ns[ctype] = iv.total(Mt)
        f.exposed_comm_by_type_ns[ctype] = iv.total(iv.subtract(Mt, C))
    f.comm_libraries = {str(k): int(v) for k, v in comm.groupby("library", observed=True).size().items()}
    CM = iv.union(np.r_[C[0], M[0]], np.r_[C[1], M[1]])
    f.exposed_copy_ns = iv.total(iv.subtract(X, CM))
    off = copies[copies["kind"].isin(["HtoD", "DtoH"]) & (copies["bytes"] >= OFFLOAD_MIN_BYTES)]
    f.offload_bytes = int(off["bytes"].sum())
    f.offload_exposed_ns = iv.total(iv.subtract(_ivset(off, lo, hi), CM))

    busy = iv.union(np.r_[CM[0], X[0]], np.r_[CM[1], X[1]])
    gaps = iv.complement(busy, lo, hi)
    f.gaps = int(gaps[0].size)
    f.idle_ns = iv.total(gaps)
    _split_idle(f, gpu, gaps)

    f.kernels = int(len(kern))
    lb = kern[(kern["launch_start"] >= 0)
              & ((kern["end"] - kern["start"]) < (kern["launch_end"] - kern["launch_start"]))]
    f.launch_bound_kernels = int(len(lb))
    f.launch_bound_kernel_ns = int((lb["end"] - lb["start"]).sum())
    f.recompute_ratio = recompute_ratio(comp)
    fwd = comp[comp["side"] == "fwd"]
    f.pair_fwd_ns = int((fwd["end"].clip(upper=hi) - fwd["start"].clip(lower=lo)).clip(lower=0).sum())
    # forward ~ 1/3 of a step's compute (backward ~ 2x forward); recompute adds r forwards
    r = f.recompute_ratio
    f.recompute_ns = int(f.compute_ns * r / (3.0 + r)) if r >= 0.05 else 0
    f.fp8_kernels = int(kern["is_fp8"].sum())
    f.graph_kernels = int((kern["graph_node"] != 0).sum())
    rt = gpu.runtime
    in_w = rt[(rt["start"] < hi) & (rt["end"] > lo)]
    f.graph_launches = int(_name_matches(in_w["name"], GRAPH_LAUNCH).sum())
    gcr = gpu.nvtx[gpu.nvtx["text"].astype(str).str.contains(GC_RANGES)]
    f.gc_ns = iv.total(_ivset(gcr, lo, hi)) if not gcr.empty else 0
    _utilisation(f, gpu, prof, comp, C, lo, hi)
    _memory(f, gpu, prof)
    return f


def _name_matches(names: pd.Series, pattern: re.Pattern) -> np.ndarray:
    """``names.str.match(pattern)`` as a bool array; for a categorical, once per category."""
    if isinstance(names.dtype, pd.CategoricalDtype):
        hit = np.array([bool(pattern.match(str(c))) for c in names.cat.categories] + [False], bool)
        return hit[names.cat.codes.to_numpy()]  # code -1 (missing) takes the trailing False
    return np.asarray(names.astype(str).str.match(pattern), bool)


def _split_idle(f: GpuFeatures, gpu: GpuTimeline, gaps: iv.IntervalSet) -> None:
    a, b = gaps
    if a.size == 0:
        return
    lo, hi = gpu.window
    rt = gpu.runtime
    rt = rt[(rt["end"] > lo - 10_000_000) & (rt["start"] < hi)]
    alloc = rt[_name_matches(rt["name"], ALLOC_CALLS)]
    sync = rt[_name_matches(rt["name"], SYNC_CALLS)]
    in_w = (alloc["start"] < hi) & (alloc["end"] > lo)
    f.alloc_calls = int(in_w.sum())
    f.alloc_call_ns = int((alloc["end"] - alloc["start"])[in_w].sum())
    # blocking device-to-host copies to pageable memory return only when the GPU drained
    ops = gpu.ops
    d2h = ops[(ops["kind"] == "DtoH") & ~ops["pinned"] & (ops["launch_end"] >= 0)]
    sync_end = np.sort(np.r_[sync["end"].to_numpy(), d2h["launch_end"].to_numpy()])
    sw = (sync["start"] < hi) & (sync["end"] > lo)
    f.sync_calls = int(sw.sum()) + int(((d2h["start"] >= lo) & (d2h["start"] < hi)).sum())
    f.sync_call_ns = int((sync["end"] - sync["start"])[sw].sum())

    # allocator-bound: an allocator call ran inside the gap or returned just before it.
    # cudaFree (and cudaMalloc on a full caching allocator) synchronise the device, so the
    # whole gap, not only the call's overlap, is time paid for memory.
    A = iv.union(alloc["start"].to_numpy(), alloc["end"].to_numpy())
    alloc_end = np.sort(alloc["end"].to_numpy())
    overlap = iv.measure_within(A, a, b) if A[0].size else np.zeros(a.size, np.int64)
    alloc_bound = (overlap > 0) | _ended_within(alloc_end, a - SYNC_SLACK_NS, b)
    # offload-bound: the gap opens right after a large host<->device copy finished (the
    # host waited for the offload copy, then refilled the queue)
    off = ops[ops["kind"].isin(["HtoD", "DtoH"]) & (ops["bytes"] >= OFFLOAD_MIN_BYTES)]
    off_end = np.sort(off["end"].to_numpy())
    offload_bound = _ended_within(off_end, a - SYNC_SLACK_NS, a) & ~alloc_bound
    # sync-bound: a sync call returned between (gap start - slack) and the gap end
    sync_bound = _ended_within(sync_end, a - SYNC_SLACK_NS, b) & ~alloc_bound & ~offload_bound
    # launch-bound: the op that ends the gap was launched after the gap began
    starts = ops["start"].to_numpy()
    j = np.minimum(np.searchsorted(starts, b, side="left"), len(starts) - 1)
    launch = ops["launch_start"].to_numpy()[j]
    late = (launch >= 0) & (launch > a) & ~alloc_bound & ~offload_bound & ~sync_bound
    length = b - a
    f.idle_alloc_ns = int(length[alloc_bound].sum())
    f.idle_offload_ns = int(length[offload_bound].sum())
    f.idle_sync_ns = int(length[sync_bound].sum())
    f.idle_launch_ns = int(length[late].sum())
    f.idle_other_ns = int(length[~alloc_bound & ~offload_bound & ~sync_bound & ~late].sum())


def _ended_within(sorted_ends: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For each [lo, hi], whether some value of ``sorted_ends`` falls inside it."""
    return np.searchsorted(sorted_ends, hi, side="right") > np.searchsorted(sorted_ends, lo, side="left")


def _utilisation(f, gpu, prof, comp, C, lo, hi) -> None:
    sm_count = _sm_count(gpu, prof)
    busy = iv.total(C)
    if sm_count and busy and not comp.empty:
        # occupancy proxy: share of SMs a kernel's grid can cover, weighted by kernel time,
        # over the window (idle and exposed communication count as 0)
        dur = (np.minimum(comp["end"], hi) - np.maximum(comp["start"], lo)).clip(lower=0).to_numpy()
        cover = np.minimum(1.0, comp["grid"].to_numpy() / sm_count)
        f.sm_active_estimate = float((dur * cover).sum() / max(dur.sum(), 1)) * busy / max(f.window_ns, 1)
        f.sm_active = f.sm_active_estimate
        f.sm_active_source = "estimate: grid size vs SM count, weighted by kernel time"
    gm = prof.gpu_metrics
    if not gm.empty:
        dev = gm[(gm["device"] == _metric_device(gpu, prof)) & (gm["timestamp"] >= lo) & (gm["timestamp"] < hi)]
        sm = dev[dev["metric"] == "sm_active"]["value"]
        if len(sm):
            f.sm_active = float(sm.mean()) / 100.0
            f.sm_active_source = "GPU_METRICS SMs Active (mean over the window)"
            ta = dev[dev["metric"] == "tensor_active"]["value"]
            f.tensor_active = float(ta.mean()) / 100.0 if len(ta) else None


def _sm_count(gpu, prof) -> int:
    g = prof.gpus[prof.gpus["device"] == gpu.device]
    return int(g["sm_count"].iloc[0]) if len(g) and g["sm_count"].iloc[0] > 0 else 0


def _metric_device(gpu, prof) -> int:
    # GPU metrics number sources 0..n-1; with one GPU in the report that is this GPU
    devs = sorted(prof.kernels["device"].unique())
    return devs.index(gpu.device) if gpu.device in devs else 0


def _memory(f, gpu, prof) -> None:
    g = prof.gpus[prof.gpus["device"] == gpu.device]
    if len(g) and g["total_memory"].iloc[0] > 0:
        f.total_memory_bytes = int(g["total_memory"].iloc[0])
    me = prof.memory_events
    if me.empty:
        return
    mine = me[(me["pid"] == gpu.pid) & (me["device"] == gpu.device)].sort_values("start")
    if mine.empty:
        return
    f.peak_memory_bytes = int(max(0, np.cumsum(mine["bytes"].to_numpy()).max()))
