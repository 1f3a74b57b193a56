"""Analyzer: time paid for fitting in memory: recompute, offload copies, the footprint.

Idle around allocator calls and after offload copies is the idle analyzer's split; this
module adds what runs on the GPU for memory's sake and reports all of it as the memory wall.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .. import intervals as iv
from ..timeline import GpuTimeline
from .gainmodel import Gain, gain, removed, share_of
from .idle import copy_roles
from .job import Job, evidence_row, mean_per_step_ms
from .protocol import Analyzer
from .recompute import forward_passes, outside, recomputed_spans
from .results import MemoryResult
from .sets import WindowSets, clipped_set

OFFLOAD_MIN_SHARE = 0.01  # offload copies and their waits above this share of the step
# peak footprint (the process's cudaMalloc'd bytes, caching-allocator pool included) at or
# above this share of the card is "near capacity": the rest is what the caching allocator's
# fragmentation (reserved - allocated, commonly 10-15% of the pool at peak) and the memory
# outside the pool (CUDA context, NCCL and cuBLAS workspaces: 1-3 GiB) take, so keeping the
# activations that recompute drops would run out of memory. docs/classification.md
NEAR_CAPACITY = 0.8
# extra forward passes per backward below this are no recompute: one pair kernel used outside
# the layers (the loss's softmax) in a 20-layer model gives ~0.05
MIN_RECOMPUTE_RATIO = 0.05


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


def analyse(gpu: GpuTimeline, prof, sets: WindowSets) -> MemoryResult:
    comp, lo, hi = sets.compute_ops, sets.lo, sets.hi
    copies = sets.copy_ops
    off, _ = copy_roles(copies)  # offload needs its round trip; one-way input copies are not
    fwd = comp[comp["side"] == "fwd"]
    r = MemoryResult(recompute_ratio=recompute_ratio(comp),
                     pair_fwd_ns=int((fwd["end"].clip(upper=hi) - fwd["start"].clip(lower=lo)).clip(lower=0).sum()),
                     offload_bytes=int(off["bytes"].sum()),
                     offload_exposed_ns=iv.total(iv.subtract(clipped_set(off, lo, hi), sets.compute_or_comm)))
    recomputed = _measure_recompute(r, gpu, sets)
    # forward passes are the forwards that are not recomputed: once the recomputed spans are
    # taken out, every forward-only kernel left must have its backward partner (ratio below
    # the threshold), else recomputed forwards the spans missed would count as passes
    kept = outside(comp, recomputed)
    if recompute_ratio(kept) < MIN_RECOMPUTE_RATIO:
        r.forward_passes, r.warmup_forwards = forward_passes(kept, gpu.steady["start"].to_numpy(np.int64))
    r.total_memory_bytes, r.peak_memory_bytes = _footprint(gpu, prof)
    return r


def _measure_recompute(r: MemoryResult, gpu: GpuTimeline, sets: WindowSets) -> iv.IntervalSet:
    """The recomputed forward's spans inside backward (``recompute``), split by what ran in
    them; without backward-only kernels, the kernel-ratio estimate. Returns the spans (empty
    where none were found)."""
    comp = sets.compute_ops
    if not (comp["side"] == "bwd").any():
        _estimate_recompute(r, sets)
    elif r.recompute_ratio < MIN_RECOMPUTE_RATIO:
        # every forward-only kernel has its backward partner: nothing runs twice (a
        # pipeline's later micro-batch forwards between backwards look like recompute)
        r.recompute_measured_ns = 0
    else:
        spans = recomputed_spans(comp)
        recomputed = iv.clip(spans, sets.lo, sets.hi)
        r.recompute_measured_ns = r.recompute_ns = iv.total(recomputed)
        r.recompute_compute_ns = iv.total(iv.intersect(recomputed, sets.compute))
        r.recompute_comm_ns = iv.total(iv.intersect(iv.subtract(recomputed, sets.compute), sets.comm))
        busy = iv.union_sets(sets.compute_or_comm, sets.copies)
        r.recompute_idle_ns = iv.total(iv.subtract(recomputed, busy))
        return spans
    return iv.EMPTY


def _estimate_recompute(r: MemoryResult, sets: WindowSets) -> None:
    # forward ~ 1/3 of a step's compute (backward ~ 2x forward); recompute adds r forwards
    ratio = r.recompute_ratio
    r.recompute_ns = r.recompute_compute_ns = (int(iv.total(sets.compute) * ratio / (3.0 + ratio))
                                               if ratio >= MIN_RECOMPUTE_RATIO else 0)


def near_capacity(m: MemoryResult) -> bool | None:
    """Whether this GPU's peak footprint is near its card's capacity; None when unknown."""
    if not m.peak_memory_bytes or not m.total_memory_bytes:
        return None
    return m.peak_memory_bytes >= NEAR_CAPACITY * m.total_memory_bytes


def charged_recompute(m: MemoryResult) -> dict[str, int]:
    """The recompute time the memory wall takes from the other walls, by where it sits: all of
    it when the card is near capacity (the job recomputes because it must), none otherwise
    (then recompute is a pitfall, and its time stays compute, communication and launch gaps)."""
    if not near_capacity(m):
        return {"compute": 0, "communication": 0, "host": 0}
    return {"compute": m.recompute_compute_ns, "communication": m.recompute_comm_ns, "host": m.recompute_idle_ns}


def _footprint(gpu, prof) -> tuple[int | None, int | None]:
    """The card's memory and this process's peak on it (CUDA_GPU_MEMORY_USAGE_EVENTS)."""
    g = prof.gpus[prof.gpus["device"] == gpu.device]
    total = int(g["total_memory"].iloc[0]) if len(g) and g["total_memory"].iloc[0] > 0 else None
    me = prof.memory_events
    if me.empty:
        return total, None
    mine = me[(me["pid"] == gpu.pid) & (me["device"] == gpu.device)].sort_values("start")
    if mine.empty:
        return total, None
    return total, int(max(0, np.cumsum(mine["bytes"].to_numpy()).max()))


# ---------------------------------------------------------------------------------------------
# job level

def charged_recompute_ms(job: Job) -> float:
    """Recompute time the memory wall took (ms per step, mean over GPUs)."""
    return mean_per_step_ms(job, lambda a: sum(charged_recompute(a.memory).values()))


# gain models (ms per step) from the job numbers; see docs/fixes.md
def _rerun_forward(model: str, n: dict, keep_ms: float, what: str) -> Gain:
    """What removing recompute (less ``keep_ms``, what selective recompute keeps) saves.

    Measured (the memory analyzer's ``recompute_measured_ms``: the recomputed-forward *spans*
    inside backward, with their launches, dispatch and waits): that time itself, range x
    compute/step to x step/compute. Else the forward/backward-ratio estimate, kernels only: a
    recomputed forward also re-runs their launches, dispatch all-to-alls and waits, so it
    costs what the rest of the step costs per ms of compute (x step/compute); the kernels
    alone are the low end and the range is symmetric about the estimate."""
    scale = n["step_ms"] / n["compute_ms"] if n["compute_ms"] else 1.0
    measured = n.get("recompute_measured_ms")
    if measured is not None:
        span = max(0.0, float(measured) - keep_ms)
        return gain(model, span, span / scale, span * scale, span,
                    f"{what}: measured recomputed-forward spans {span:.1f} ms/step (range x 1/{scale:.2f} to x {scale:.2f})")
    kernels = max(0.0, n["recompute_ms"] - keep_ms)
    est = kernels * scale
    return gain(model, est, kernels, 2 * est - kernels, kernels,
                f"{what}: {kernels:.1f} ms/step of recompute kernels (ratio estimate) x step/compute {scale:.2f}")


GAINS = {
    "recompute_off": lambda n: _rerun_forward("recompute_off", n, 0.0, "recompute"),
    "recompute_minus_selective": lambda n: _rerun_forward("recompute_minus_selective", n, n["selective_keep_ms"],
                                                          "recompute beyond what selective keeps"),
    "offload": lambda n: removed("offload", n["offload_ms"], "exposed offload copies"),
    "memory_all": lambda n: removed("memory_all", n["memory_ms"], "memory wall"),
    # halving the footprint can remove at most about half of what fitting costs
    "memory_half": lambda n: share_of("memory_half", n["memory_ms"], 0.5, 0.0, 1.0, "memory wall"),
    "pp_double_stages": lambda n: _double_stages(n),
}


def _double_stages(n: dict) -> Gain | None:
    """Twice the pipeline stages halve each GPU's share of the model (half the memory wall) but
    lengthen the bubble from (p-1)/(m+p-1) to (2p-1)/(m+2p-1) of the compute; unpriced without
    the pipeline numbers (docs/fixes.md)."""
    p, m = n.get("pp_stages"), n.get("pp_microbatches")
    if not p or not m:
        return None
    added = n["compute_ms"] * ((2 * p - 1) / (m + 2 * p - 1) - (p - 1) / (m + p - 1))
    half = 0.5 * n["memory_ms"]
    return gain("pp_double_stages", half - added, -added, n["memory_ms"] - added, n["memory_ms"],
                f"half the memory wall {half:.1f} minus the longer bubble {added:.1f} ms/step (PP {p}->{2 * p}, {m} micro-batches)")

def peak_share(job: Job) -> float | None:
    """The largest peak footprint over GPUs as a share of its card; None when unknown."""
    peaks = [m.peak_memory_bytes / m.total_memory_bytes for m in (r.analysis.memory for r in job.records)
             if m.peak_memory_bytes and m.total_memory_bytes]
    return max(peaks) if peaks else None


def largest_peak(job: Job) -> tuple[int | None, int | None]:
    """The largest peak footprint over GPUs and its card's memory (bytes; None when unknown)."""
    peaks = [(m.peak_memory_bytes, m.total_memory_bytes) for m in (r.analysis.memory for r in job.records)
             if m.peak_memory_bytes]
    return max(peaks) if peaks else (None, None)


def headroom_note(share: float) -> str:
    return f"peak GPU memory {100 * share:.0f}% of capacity (CUDA_GPU_MEMORY_USAGE_EVENTS)"


def numbers(job: Job) -> dict:
    # full recompute reruns r of the forward passes the selective kind would keep
    pair_keep = float(np.mean([r.analysis.memory.pair_fwd_ns * r.analysis.memory.recompute_ratio
                               / (1 + r.analysis.memory.recompute_ratio) / r.iterations
                               for r in job.records])) / 1e6
    measured = [r.analysis.memory.recompute_measured_ns / r.iterations for r in job.records
                if r.analysis.memory.recompute_measured_ns is not None]
    return dict(recompute_ms=mean_per_step_ms(job, lambda a: a.memory.recompute_ns), selective_keep_ms=pair_keep,
                # the recomputed forward timed in the profile (None: no backward kernels to find it by)
                recompute_measured_ms=float(np.mean(measured)) / 1e6 if measured else None,
                offload_ms=(mean_per_step_ms(job, lambda a: a.memory.offload_exposed_ns)
                            + mean_per_step_ms(job, lambda a: a.idle.idle_offload_ns)),
                memory_ms=job.walls_ns["memory"] / 1e6)


OFFLOAD_FLAGS = ("--cpu-offloading", "--optimizer-cpu-offload", "--cpu-offloading-num-layers",
                 "--offload-optimizer", "--fine-grained-activation-offloading")


def facts(job: Job, numbers: dict) -> dict:
    flags = job.flags
    frees = np.mean([r.analysis.idle.free_calls / max(r.iterations, 1) for r in job.records]) if job.records else 0.0
    # an emptying a step at least: the allocator's blocks go back to the driver and come again
    return dict(alloc_in_steady=numbers["idle_alloc_ms"] > 0, frees_every_step=bool(frees >= 1),
                offload=(numbers["offload_ms"] > OFFLOAD_MIN_SHARE * job.step_ms
                         or (numbers["offload_ms"] > 0 and any(f in flags for f in OFFLOAD_FLAGS))))


def evidence(job: Job, numbers: dict) -> list[dict]:
    recs = job.records
    ratio = np.mean([r.analysis.memory.recompute_ratio for r in recs])
    alloc_calls = np.mean([r.analysis.idle.alloc_calls / r.iterations for r in recs])
    offload_mib = np.mean([r.analysis.memory.offload_bytes / r.iterations for r in recs]) / 2**20
    how = ("recomputed forward measured inside backward" if numbers["recompute_measured_ms"] is not None
           else "estimate")
    ev = [evidence_row("memory", f"recompute ({how})", numbers["recompute_ms"], "ms/step",
                       f"forward/backward kernel ratio {ratio:.2f}; charged to memory "
                       f"{charged_recompute_ms(job):.1f} ms/step (only near capacity)"),
          evidence_row("memory", "idle around allocator calls", numbers["idle_alloc_ms"], "ms/step",
                       f"{alloc_calls:.1f} cudaMalloc/cudaFree-type calls per step"),
          evidence_row("memory", "offload copies (exposed) and their waits", numbers["offload_ms"], "ms/step",
                       f"{offload_mib:.1f} MiB host<->device per step")]
    peak, total = largest_peak(job)
    if peak is not None:
        ev.append(evidence_row("memory", "peak GPU memory", peak / 2**30, "GiB",
                               f"of {total / 2**30:.0f} GiB ({100 * peak / total:.0f}%)" if total else "capacity unknown"))
    return ev


def section(job: Job, numbers: dict) -> dict:
    """The Diagnosis ``memory`` object: recompute mode and cost, footprint, offload, allocator."""
    recs = [r.analysis.memory for r in job.records]
    peak, total = largest_peak(job)
    if total is None:
        totals = [m.total_memory_bytes for m in recs if m.total_memory_bytes]
        total = max(totals) if totals else None
    near = [x for x in (near_capacity(m) for m in recs) if x is not None]
    measured = numbers.get("recompute_measured_ms")
    return dict(
        recompute_mode=job.cfg.get("recompute", {}).get("value"),
        recompute_ms_per_step=None if measured is None else round(measured, 3),
        recompute_charged_ms_per_step=round(charged_recompute_ms(job), 3),
        peak_gib=None if peak is None else round(peak / 2**30, 2),
        capacity_gib=None if total is None else round(total / 2**30, 2),
        near_capacity=any(near) if near else None,
        memory_bound=job.walls.memory_bound,
        offload_ms_per_step=round(numbers["offload_ms"], 3),
        allocator_idle_ms_per_step=round(numbers["idle_alloc_ms"], 3))


ANALYZER = Analyzer(name="memory", about="time paid to fit in memory: recompute, offload, the footprint",
                    per_gpu_field="memory", analyse=analyse, numbers=numbers, facts=facts, evidence=evidence,
                    section="memory", report=section, gains=GAINS)
