"""Analyzer: GPU idle time in the window, split by what the host was doing when the GPU ran dry.

One vectorised pass over the gaps of busy = C | M | X (see ``sets``): allocator calls
(cudaMalloc/cudaFree... overlapping the gap), a large offload copy that just finished, a host
synchronisation that returned at the start of the gap (the CPU waited, then had to refill the
queue), a late launch (the next kernel was launched after the gap began: the CPU was the
bottleneck), or other (the work was queued but waited on another stream or a peer).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .. import intervals as iv
from ..timeline import GpuTimeline
from .gainmodel import Gain, gain, removed, share_of
from .job import Job, evidence_row, mean_per_step_ms
from .sets import WindowSets, name_matches

ALLOC_CALLS = re.compile(r"^(cudaMalloc(?!Async)|cudaFree(?!Async)|cudaMallocHost|cudaHostAlloc|"
                         r"cudaFreeHost|cudaMallocManaged|cudaMallocPitch|cuMemAlloc(?!Async)|"
                         r"cuMemFree(?!Async)|cuMemHostAlloc|cuMemFreeHost|cuMemCreate|cuMemRelease|"
                         r"cuMemMap|cuMemUnmap|cuMemAddressReserve|cuMemAddressFree|cuMemSetAccess|"
                         r"cudaHostRegister|cudaHostUnregister|cuMemHostRegister)")
SYNC_CALLS = re.compile(r"^(cudaDeviceSynchronize|cudaStreamSynchronize|cudaEventSynchronize|"
                        r"cudaThreadSynchronize|cuCtxSynchronize|cuStreamSynchronize|"
                        r"cuEventSynchronize|cudaMemcpy$|cudaMemcpy2D$|cuMemcpyDtoH|cuMemcpyHtoD$)")
SYNC_SLACK_NS = 50_000  # a sync that returned at most this long before the gap began caused it
OFFLOAD_MIN_BYTES = 256 * 1024  # smaller host<->device copies are control traffic, not offload
HOST_SYNC_IDLE_MIN = 0.03  # share of the step idle after host syncs that makes them worth fixing


@dataclass
class IdleResult:
    idle_ns: int = 0
    gaps: int = 0
    idle_alloc_ns: int = 0
    idle_offload_ns: int = 0
    idle_sync_ns: int = 0
    idle_launch_ns: int = 0
    idle_other_ns: int = 0
    alloc_calls: int = 0  # allocator calls in the window
    alloc_call_ns: int = 0
    sync_calls: int = 0  # host syncs (and blocking pageable device-to-host copies) in the window
    sync_call_ns: int = 0


def analyse(gpu: GpuTimeline, prof, sets: WindowSets) -> IdleResult:
    CM, X = sets.compute_or_comm, sets.copies
    busy = iv.union(np.r_[CM[0], X[0]], np.r_[CM[1], X[1]])
    gaps = iv.complement(busy, sets.lo, sets.hi)
    r = IdleResult(idle_ns=iv.total(gaps), gaps=int(gaps[0].size))
    if gaps[0].size:
        _split(r, gpu, gaps)
    return r


def _host_calls(r: IdleResult, gpu: GpuTimeline):
    """Allocator calls and the ends of host syncs near the window; counts those inside it."""
    lo, hi = gpu.window
    rt = gpu.runtime
    rt = rt[(rt["end"] > lo - 10_000_000) & (rt["start"] < hi)]
    alloc = rt[name_matches(rt["name"], ALLOC_CALLS)]
    sync = rt[name_matches(rt["name"], SYNC_CALLS)]
    in_w = (alloc["start"] < hi) & (alloc["end"] > lo)
    r.alloc_calls = int(in_w.sum())
    r.alloc_call_ns = int((alloc["end"] - alloc["start"])[in_w].sum())
    # blocking device-to-host copies to pageable memory return only when the GPU drained
    ops = gpu.ops
    d2h = ops[(ops["kind"] == "DtoH") & ~ops["pinned"] & (ops["launch_end"] >= 0)]
    sync_end = np.sort(np.r_[sync["end"].to_numpy(), d2h["launch_end"].to_numpy()])
    sw = (sync["start"] < hi) & (sync["end"] > lo)
    r.sync_calls = int(sw.sum()) + int(((d2h["start"] >= lo) & (d2h["start"] < hi)).sum())
    r.sync_call_ns = int((sync["end"] - sync["start"])[sw].sum())
    return alloc, sync_end


def _split(r: IdleResult, gpu: GpuTimeline, gaps: iv.IntervalSet) -> None:
    a, b = gaps
    alloc, sync_end = _host_calls(r, gpu)
    ops = gpu.ops
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
    r.idle_alloc_ns = int(length[alloc_bound].sum())
    r.idle_offload_ns = int(length[offload_bound].sum())
    r.idle_sync_ns = int(length[sync_bound].sum())
    r.idle_launch_ns = int(length[late].sum())
    r.idle_other_ns = int(length[~alloc_bound & ~offload_bound & ~sync_bound & ~late].sum())


def _ended_within(sorted_ends: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For each [lo, hi], whether some value of ``sorted_ends`` falls inside it."""
    return np.searchsorted(sorted_ends, hi, side="right") > np.searchsorted(sorted_ends, lo, side="left")


# ---------------------------------------------------------------------------------------------
# job level

# gain models (ms per step) from the job numbers; see docs/fixes.md
def _bigger_microbatch(n: dict) -> Gain:
    """Twice the micro-batch: half the launches per sample (half the launch-late idle per unit
    of work) and kernels whose grids left SMs unfilled fill them; per the base step's work."""
    launch, low_sm = n["idle_launch_ms"], n["compute_ms"] * max(0.0, 1.0 - n["sm_busy"])
    return gain("bigger_microbatch", 0.5 * (launch + low_sm), 0.5 * launch, launch + low_sm, launch + low_sm,
                f"half of launch-late idle {launch:.1f} + unfilled-SM compute {low_sm:.1f} ms/step")


GAINS = {
    "idle_sync": lambda n: removed("idle_sync", n["idle_sync_ms"], "idle after host syncs"),
    # graphs launch a captured scope at once; dropless MoE captures only partial scopes (low half)
    "launch_idle": lambda n: share_of("launch_idle", n["idle_launch_ms"], 1.0, 0.5, 1.0, "launch-late idle"),
    "idle_alloc": lambda n: removed("idle_alloc", n["idle_alloc_ms"], "idle around allocator calls"),
    "bigger_microbatch": _bigger_microbatch,
}

def numbers(job: Job) -> dict:
    return dict(idle_sync_ms=mean_per_step_ms(job, lambda a: a.idle.idle_sync_ns),
                idle_launch_ms=mean_per_step_ms(job, lambda a: a.idle.idle_launch_ns),
                idle_alloc_ms=mean_per_step_ms(job, lambda a: a.idle.idle_alloc_ns))


def facts(job: Job, numbers: dict) -> dict:
    return dict(host_sync_idle=numbers["idle_sync_ms"] >= HOST_SYNC_IDLE_MIN * job.step_ms)


def evidence(job: Job, numbers: dict) -> list[dict]:
    return [evidence_row("host", "idle after host syncs", numbers["idle_sync_ms"], "ms/step",
                         "GPU idle that began when a host synchronisation returned"),
            evidence_row("host", "idle, launch-late", numbers["idle_launch_ms"], "ms/step",
                         "the next kernel was launched after the GPU ran dry"),
            evidence_row("host", "idle, other", mean_per_step_ms(job, lambda a: a.idle.idle_other_ns),
                         "ms/step", "queued work waited on another stream or peer")]
