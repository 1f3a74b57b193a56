"""Analyzer: GPU idle time in the window, split by what the host was doing when the GPU ran dry.

One vectorised pass over the gaps of busy = compute | comm | copies (see ``sets``): allocator calls
(cudaMalloc/cudaFree... overlapping the gap), a large offload copy that just finished, a host
synchronisation that returned at the start of the gap (the CPU waited, then had to refill the
queue), a late launch (the next kernel was launched after the gap began: the CPU was the
bottleneck), or other (the work was queued but waited on another stream or a peer).
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from .. import intervals as iv
from ..timeline import GpuTimeline
from .gainmodel import Gain, gain, removed, share_of
from .job import Job, evidence_row, mean_per_step_ms
from .pipeline_gains import bubble_growth
from .protocol import Analyzer
from .results import IdleResult
from .sets import WindowSets, clipped_set, name_matches

ALLOC_CALLS = re.compile(r"^(cudaMalloc(?!Async)|cudaFree(?!Async)|cudaMallocHost|cudaHostAlloc|"
                         r"cudaFreeHost|cudaMallocManaged|cudaMallocPitch|cuMemAlloc(?!Async)|"
                         r"cuMemFree(?!Async)|cuMemHostAlloc|cuMemFreeHost|cuMemCreate|cuMemRelease|"
                         r"cuMemMap|cuMemUnmap|cuMemAddressReserve|cuMemAddressFree|cuMemSetAccess|"
                         r"cudaHostRegister|cudaHostUnregister|cuMemHostRegister)")
# frees that wait for the device before they return (cudaFree synchronizes implicitly): the
# caching allocator's emptying (torch.cuda.empty_cache()) makes one a cached block
FREE_CALLS = re.compile(r"^(cudaFree(?!Async)|cudaFreeHost|cuMemFree(?!Async)|cuMemFreeHost)")
# with expandable segments the allocator hands pages back by unmapping them (cuMemUnmap, then
# cuMemRelease), after a stream sync of its own (call GD: each emptying's unmaps follow one)
UNMAP_CALLS = re.compile(r"^cuMemUnmap")
SYNC_CALLS = re.compile(r"^(cudaDeviceSynchronize|cudaStreamSynchronize|cudaEventSynchronize|"
                        r"cudaThreadSynchronize|cuCtxSynchronize|cuStreamSynchronize|"
                        r"cuEventSynchronize|cudaMemcpy$|cudaMemcpy2D$|cuMemcpyDtoH|cuMemcpyHtoD$)")
# the host waits for the whole device, not one stream: what Megatron's batch_p2p_sync does after
# every pipeline p2p exchange (a drain of every queue)
DEVICE_SYNC_CALLS = re.compile(r"^(cudaDeviceSynchronize|cudaThreadSynchronize|cuCtxSynchronize)")
SYNC_SLACK_NS = 50_000  # a sync that returned at most this long before the gap began caused it
OFFLOAD_MIN_BYTES = 256 * 1024  # smaller host<->device copies are control traffic, not offload
# offload is a round trip: what goes to the host comes back (activations out in forward, in
# for backward; optimizer offload: gradients out, parameters in, fp32 vs bf16 at most 2x
# apart). Device-to-host and host-to-device volumes within this factor are offload;
# host-to-device copies without their outbound half are input data
OFFLOAD_RETURN_RATIO = 2.0
HOST_SYNC_IDLE_MIN = 0.03  # share of the step idle after host syncs that makes them worth fixing
# a GPU gap this long is the host away (a stall, logging, a checkpoint check, GC): launching
# a kernel takes 5-20 us, so falling behind on launches opens gaps of tens to hundreds of us,
# never 2 ms; in a synchronous job every peer then waits for this rank
STALL_GAP_NS = 2_000_000
# the input pipeline is reported from this share of the step: what a timer resolves over a
# few steps (below, input time is noise next to the 5-10% run-to-run spread)
INPUT_MIN_SHARE = 0.01


def analyse(gpu: GpuTimeline, prof, sets: WindowSets) -> IdleResult:
    compute_or_comm, copies = sets.compute_or_comm, sets.copies
    busy = iv.union_sets(compute_or_comm, copies)
    gaps = iv.complement(busy, sets.lo, sets.hi)
    del busy  # (the window's gaps and the busy set are millions of intervals at 4 GB: one at a time)
    length = gaps[1] - gaps[0]
    r = IdleResult(idle_ns=iv.total(gaps), gaps=int(gaps[0].size),
                   idle_stall_ns=int(length[length >= STALL_GAP_NS].sum()))
    del length
    off, inp = copy_roles(sets.copy_ops)
    r.input_bytes = int(inp["bytes"].sum())
    r.input_pageable_bytes = int(inp.loc[~inp["pinned"].astype(bool), "bytes"].sum())
    r.input_mask_bytes = int(inp.loc[attention_masks(inp["bytes"].to_numpy(np.int64)), "bytes"].sum())
    r.input_exposed_ns = iv.total(iv.subtract(clipped_set(inp, sets.lo, sets.hi), compute_or_comm))
    if gaps[0].size:
        _split(r, gpu, gaps, off, inp)
    return r


def copy_roles(copies: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(offload copies, input copies) among the window's host<->device copies: large copies
    both ways of similar volume are offload; otherwise host-to-device copies are input."""
    hd = copies[copies["kind"].isin(["HtoD", "DtoH"])]
    large = hd[hd["bytes"] >= OFFLOAD_MIN_BYTES]
    out_b = float(large.loc[large["kind"] == "DtoH", "bytes"].sum())
    in_b = float(large.loc[large["kind"] == "HtoD", "bytes"].sum())
    if out_b > 0 and in_b > 0 and max(out_b, in_b) <= OFFLOAD_RETURN_RATIO * min(out_b, in_b):
        return large, hd.iloc[:0]
    return hd.iloc[:0], hd[hd["kind"] == "HtoD"]


MASK_MIN_SEQ = 64  # shortest sequence whose [s, s] mask is told from a token tensor by its size
MASK_MAX_BATCH = 64  # largest micro-batch the size arithmetic tries


def attention_masks(nbytes: np.ndarray) -> np.ndarray:
    """Per input copy (its bytes): whether it is a boolean attention mask, [b', 1, s, s] (b' = 1
    or the micro-batch b), beside a token tensor of the same batch, int64 [b, s] or [b, s + 1]
    (tokens, labels, position ids: a loader's --create-attention-mask-in-dataloader batch). Only
    the largest size is tried: s^2 bytes outweigh 8 b s wherever s > 8 b, and a smaller square
    size (a float [b, s] loss mask of 256^2 bytes) would find a token-sized partner by chance."""
    sizes = np.unique(nbytes)
    if not len(sizes) or sizes[-1] < MASK_MIN_SEQ ** 2:
        return np.zeros(len(nbytes), bool)
    n, b = int(sizes[-1]), np.arange(1, MASK_MAX_BATCH + 1)
    for b_mask in b[n % b == 0]:
        s = int(round(np.sqrt(n // b_mask)))
        if s < MASK_MIN_SEQ or b_mask * s * s != n:
            continue
        b_tok = b if b_mask == 1 else np.array([b_mask])  # [1, 1, s, s] is broadcast over the batch
        if np.isin(8 * np.r_[b_tok * s, b_tok * (s + 1)], sizes[:-1]).any():
            return nbytes == n
    return np.zeros(len(nbytes), bool)


def _host_calls(r: IdleResult, gpu: GpuTimeline):
    """Allocator calls and the ends of host syncs near the window; counts those inside it."""
    lo, hi = gpu.window
    rt = gpu.runtime
    near = ((rt["end"] > lo - 10_000_000) & (rt["start"] < hi)).to_numpy(bool)
    # the few calls wanted, picked from all at once (no copy of every call near the window)
    alloc = rt[near & name_matches(rt["name"], ALLOC_CALLS)]
    sync = rt[near & name_matches(rt["name"], SYNC_CALLS)]
    in_w = (alloc["start"] < hi) & (alloc["end"] > lo)
    r.alloc_calls = int(in_w.sum())
    r.alloc_call_ns = int((alloc["end"] - alloc["start"])[in_w].sum())
    handed_back = name_matches(alloc["name"], FREE_CALLS) | name_matches(alloc["name"], UNMAP_CALLS)
    r.free_calls = int((in_w & handed_back).sum())
    d2h = _blocking_copies(gpu.ops)
    sync_end = np.sort(np.r_[sync["end"].to_numpy(), d2h["launch_end"].to_numpy()])
    sw = (sync["start"] < hi) & (sync["end"] > lo)
    r.sync_calls = int(sw.sum()) + int(((d2h["start"] >= lo) & (d2h["start"] < hi)).sum())
    r.sync_call_ns = int((sync["end"] - sync["start"])[sw].sum())
    r.device_syncs = int((sw & name_matches(sync["name"], DEVICE_SYNC_CALLS)).sum())
    return alloc, sync_end


def _blocking_copies(ops: pd.DataFrame) -> pd.DataFrame:
    """Device-to-host copies to pageable memory with their launch call: the call returns only
    when the GPU drained (a host sync)."""
    return ops[(ops["kind"] == "DtoH") & ~ops["pinned"] & (ops["launch_end"] >= 0)]


def host_waits(gpu: GpuTimeline) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends), by end, of the spans the host sat blocked waiting for this GPU inside its
    window: host syncs, and blocking device-to-host copies to pageable memory (their launch call
    returns when the GPU drained). A faster GPU can bring the host's next work forward by at
    most these (``communication``'s fabric gain: what the host lets a GPU saving bank)."""
    lo, hi = gpu.window
    rt = gpu.runtime
    sync = rt[name_matches(rt["name"], SYNC_CALLS) & (rt["end"] > lo).to_numpy(bool)
              & (rt["start"] < hi).to_numpy(bool)]
    d2h = _blocking_copies(gpu.ops)
    d2h = d2h[(d2h["launch_end"] > lo) & (d2h["launch_start"] < hi)]
    start = np.r_[sync["start"].to_numpy(np.int64), d2h["launch_start"].to_numpy(np.int64)]
    end = np.r_[sync["end"].to_numpy(np.int64), d2h["launch_end"].to_numpy(np.int64)]
    order = np.argsort(end, kind="stable")
    return start[order], end[order]


def _split(r: IdleResult, gpu: GpuTimeline, gaps: iv.IntervalSet, off: pd.DataFrame, inp: pd.DataFrame) -> None:
    a, b = gaps
    alloc, sync_end = _host_calls(r, gpu)
    ops = gpu.ops
    # allocator-bound: an allocator call ran inside the gap or returned just before it.
    # cudaFree (and cudaMalloc on a full caching allocator) synchronise the device, so the
    # whole gap, not only the call's overlap, is time paid for memory.
    alloc_calls = iv.union(alloc["start"].to_numpy(), alloc["end"].to_numpy())
    alloc_end = np.sort(alloc["end"].to_numpy())
    overlap = iv.measure_within(alloc_calls, a, b) if alloc_calls[0].size else np.zeros(a.size, np.int64)
    alloc_bound = (overlap > 0) | _ended_within(alloc_end, a - SYNC_SLACK_NS, b)
    del overlap  # (one int64 per gap: 24 MiB at 4 GB, as each of j and launch below)
    # offload-bound: the gap opens right after an offload copy finished (the host waited
    # for it, then refilled the queue)
    offload_bound = _ended_within(np.sort(off["end"].to_numpy()), a - SYNC_SLACK_NS, a) & ~alloc_bound
    # input-bound: an input copy closes the gap (the host was building the batch) or just
    # ended before it (a blocking pageable copy held the host)
    taken = alloc_bound | offload_bound
    input_bound = (_ended_within(np.sort(inp["start"].to_numpy()), b, b)
                   | _ended_within(np.sort(inp["end"].to_numpy()), a - SYNC_SLACK_NS, a)) & ~taken
    taken |= input_bound
    # sync-bound: a sync call returned between (gap start - slack) and the gap end
    sync_bound = _ended_within(sync_end, a - SYNC_SLACK_NS, b) & ~taken
    taken |= sync_bound
    # launch-bound: the op that ends the gap was launched after the gap began
    starts = ops["start"].to_numpy()
    j = np.minimum(np.searchsorted(starts, b, side="left"), len(starts) - 1)
    launch = ops["launch_start"].to_numpy()[j]
    late = (launch >= 0) & (launch > a) & ~taken
    del j, launch
    length = b - a
    r.idle_alloc_ns = int(length[alloc_bound].sum())
    r.idle_offload_ns = int(length[offload_bound].sum())
    r.idle_input_ns = int(length[input_bound].sum())
    r.idle_sync_ns = int(length[sync_bound].sum())
    r.idle_launch_ns = int(length[late].sum())
    r.idle_other_ns = int(length[~taken & ~late].sum())


def _ended_within(sorted_ends: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For each [lo, hi], whether some value of ``sorted_ends`` falls inside it."""
    if not sorted_ends.size:  # often: no allocator call, offload or input copy in the window
        return np.zeros(np.shape(hi), bool)
    return np.searchsorted(sorted_ends, hi, side="right") > np.searchsorted(sorted_ends, lo, side="left")


# ---------------------------------------------------------------------------------------------
# job level

# gain models (ms per step) from the job numbers; see docs/fixes.md
def _bigger_microbatch(n: dict) -> Gain:
    """k times the micro-batch at the same work per step (k = 2 unless the change says, e.g. a
    ``diff`` that saw 1 -> 4): the host issues 1/k of the launches, so its issue time H (the
    step less the time its thread sat in syncs waiting for the GPU) shrinks by H (1 - 1/k).
    That saves GPU time only where the GPU waited for the host: the launch-late idle and, in a
    launch-bound job, the waits inside collectives for a late peer (its launch overhead, which
    shrinks alike: a peer is late by at most its own launch-late idle, so the waits count up to
    that). Kernels whose grids left SMs unfilled fill them: (1 - 1/k) of that time.
    On a pipeline the same work in m/k micro-batches lengthens the fill/drain slots: the
    schedule bubble grows (``bubble_growth``), taken off the estimate and the low end.
    Low end: only the launch-late idle shrinks; high end: all of it and the waits."""
    k = max(float(n.get("microbatch_factor") or 2.0), 1.0)
    launch, low_sm = n["idle_launch_ms"], n["compute_ms"] * max(0.0, 1.0 - n["sm_busy"])
    wait = min(n.get("comm_wait_ms") or 0.0, launch)
    issue = n.get("host_issue_ms")
    issue = n["step_ms"] if issue is None else issue
    host_saved, sm_saved = issue * (1.0 - 1.0 / k), low_sm * (1.0 - 1.0 / k)
    grow, grow_basis = bubble_growth(n, k)
    return gain("bigger_microbatch", min(host_saved, launch + wait) + sm_saved - grow,
                min(host_saved, launch) + sm_saved - grow,
                min(issue, launch + wait) + low_sm, launch + low_sm + wait,
                f"{k:g}x micro-batch: host issue time {issue:.1f} ms/step falls by {host_saved:.1f}, of which the "
                f"GPU gains what it waited for the host (launch-late idle {launch:.1f} + waits for peers "
                f"{wait:.1f}), plus {sm_saved:.1f} of unfilled-SM compute {low_sm:.1f} ms/step{grow_basis}")


GAINS = {
    "input": lambda n: removed("input", n["input_ms"], "GPU idle waiting for input batches"),
    "idle_sync": lambda n: removed("idle_sync", n["idle_sync_ms"], "idle after host syncs"),
    # graphs launch a captured scope at once; dropless MoE captures only partial scopes (low half)
    "launch_idle": lambda n: share_of("launch_idle", n["idle_launch_ms"], 1.0, 0.5, 1.0, "launch-late idle"),
    "idle_alloc": lambda n: removed("idle_alloc", n["idle_alloc_ms"], "idle around allocator calls"),
    "bigger_microbatch": _bigger_microbatch,
}

def numbers(job: Job) -> dict:
    per_step = [(r.analysis.idle.sync_call_ns / r.iterations / 1e6, r.analysis.idle.sync_calls / r.iterations,
                 r.analysis.idle.device_syncs / r.iterations) for r in job.records]
    return dict(idle_sync_ms=mean_per_step_ms(job, lambda a: a.idle.idle_sync_ns),
                idle_launch_ms=mean_per_step_ms(job, lambda a: a.idle.idle_launch_ns),
                idle_alloc_ms=mean_per_step_ms(job, lambda a: a.idle.idle_alloc_ns),
                # the input pipeline: idle waiting on input copies and the copies nothing hides
                input_ms=mean_per_step_ms(job, lambda a: a.idle.idle_input_ns + a.idle.input_exposed_ns),
                # the host's issue time: the step less its wait in syncs; the job runs at its slowest host
                host_issue_ms=max(job.step_ms - wait for wait, _, _ in per_step),
                host_syncs_per_step=float(np.mean([n for _, n, _ in per_step])),
                device_syncs_per_step=float(np.mean([d for _, _, d in per_step])))


def facts(job: Job, numbers: dict) -> dict:
    pageable = any(r.analysis.idle.input_pageable_bytes for r in job.records)
    masks = any(r.analysis.idle.input_mask_bytes for r in job.records)
    pipeline = numbers["input_ms"] >= INPUT_MIN_SHARE * job.step_ms
    # input_mask: the batches carry an attention mask the GPU could build (host_input_on_gpu has
    # nothing to move without one)
    return dict(host_sync_idle=numbers["idle_sync_ms"] >= HOST_SYNC_IDLE_MIN * job.step_ms,
                input_pipeline=pipeline, input_pageable=pageable and pipeline, input_mask=masks and pipeline)


def evidence(job: Job, numbers: dict) -> list[dict]:
    mib, pageable, masks = (np.mean([getattr(r.analysis.idle, key) / r.iterations for r in job.records]) / 2**20
                            for key in ("input_bytes", "input_pageable_bytes", "input_mask_bytes"))
    return [evidence_row("host", "input pipeline (waits on input copies, exposed copies)", numbers["input_ms"],
                         "ms/step", f"{mib:.1f} MiB host-to-device input per step, {pageable:.1f} MiB from "
                         f"pageable memory, {masks:.1f} MiB attention masks; no device-to-host return, so not offload"),
            evidence_row("host", "idle after host syncs", numbers["idle_sync_ms"], "ms/step",
                         "GPU idle that began when a host synchronisation returned"),
            evidence_row("host", "idle, launch-late", numbers["idle_launch_ms"], "ms/step",
                         "the next kernel was launched after the GPU ran dry"),
            evidence_row("host", "idle, other", mean_per_step_ms(job, lambda a: a.idle.idle_other_ns),
                         "ms/step", "queued work waited on another stream or peer")]


ANALYZER = Analyzer(name="idle", about="GPU idle in the window, split by what the host was doing",
                    per_gpu_field="idle", analyse=analyse, numbers=numbers, facts=facts, evidence=evidence,
                    gains=GAINS)
