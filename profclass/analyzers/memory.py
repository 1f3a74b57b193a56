"""Analyzer: time paid for fitting in memory: recompute, offload copies, the footprint.

Idle around allocator calls and after offload copies is the idle analyzer's split; this
module adds what runs on the GPU for memory's sake and reports all of it as the memory wall.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .. import intervals as iv
from ..timeline import GpuTimeline
from .gainmodel import Gain, gain, removed, share_of
from .idle import OFFLOAD_MIN_BYTES
from .job import Job, evidence_row, mean_per_step_ms
from .sets import WindowSets, clipped_set

OFFLOAD_MIN_SHARE = 0.01  # offload copies and their waits above this share of the step


@dataclass
class MemoryResult:
    recompute_ratio: float = 0.0  # extra forward passes per backward pass
    pair_fwd_ns: int = 0  # forward kernels that have a backward partner
    recompute_ns: int = 0  # estimate
    offload_bytes: int = 0
    offload_exposed_ns: int = 0  # offload copies nothing hides
    peak_memory_bytes: int | None = None
    total_memory_bytes: int | None = None


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
    off = copies[copies["kind"].isin(["HtoD", "DtoH"]) & (copies["bytes"] >= OFFLOAD_MIN_BYTES)]
    fwd = comp[comp["side"] == "fwd"]
    r = MemoryResult(recompute_ratio=recompute_ratio(comp),
                     pair_fwd_ns=int((fwd["end"].clip(upper=hi) - fwd["start"].clip(lower=lo)).clip(lower=0).sum()),
                     offload_bytes=int(off["bytes"].sum()),
                     offload_exposed_ns=iv.total(iv.subtract(clipped_set(off, lo, hi), sets.compute_or_comm)))
    # forward ~ 1/3 of a step's compute (backward ~ 2x forward); recompute adds r forwards
    ratio = r.recompute_ratio
    r.recompute_ns = int(iv.total(sets.compute) * ratio / (3.0 + ratio)) if ratio >= 0.05 else 0
    r.total_memory_bytes, r.peak_memory_bytes = _footprint(gpu, prof)
    return r


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


def headroom_note(share: float) -> str:
    return f"peak GPU memory {100 * share:.0f}% of capacity (CUDA_GPU_MEMORY_USAGE_EVENTS)"


def numbers(job: Job) -> dict:
    # full recompute reruns r of the forward passes the selective kind would keep
    pair_keep = float(np.mean([r.analysis.memory.pair_fwd_ns * r.analysis.memory.recompute_ratio
                               / (1 + r.analysis.memory.recompute_ratio) / r.iterations
                               for r in job.records])) / 1e6
    return dict(recompute_ms=mean_per_step_ms(job, lambda a: a.memory.recompute_ns), selective_keep_ms=pair_keep,
                offload_ms=(mean_per_step_ms(job, lambda a: a.memory.offload_exposed_ns)
                            + mean_per_step_ms(job, lambda a: a.idle.idle_offload_ns)),
                memory_ms=job.walls_ns["memory"] / 1e6)


def facts(job: Job, numbers: dict) -> dict:
    return dict(alloc_in_steady=numbers["idle_alloc_ms"] > 0,
                offload=numbers["offload_ms"] > OFFLOAD_MIN_SHARE * job.step_ms)


def evidence(job: Job, numbers: dict) -> list[dict]:
    recs = job.records
    ratio = np.mean([r.analysis.memory.recompute_ratio for r in recs])
    alloc_calls = np.mean([r.analysis.idle.alloc_calls / r.iterations for r in recs])
    offload_mib = np.mean([r.analysis.memory.offload_bytes / r.iterations for r in recs]) / 2**20
    ev = [evidence_row("memory", "recompute (estimate)", numbers["recompute_ms"], "ms/step",
                       f"forward/backward kernel ratio {ratio:.2f}"),
          evidence_row("memory", "idle around allocator calls", numbers["idle_alloc_ms"], "ms/step",
                       f"{alloc_calls:.1f} cudaMalloc/cudaFree-type calls per step"),
          evidence_row("memory", "offload copies (exposed) and their waits", numbers["offload_ms"], "ms/step",
                       f"{offload_mib:.1f} MiB host<->device per step")]
    peaks = [(m.peak_memory_bytes, m.total_memory_bytes) for m in (r.analysis.memory for r in recs)
             if m.peak_memory_bytes]
    if peaks:
        peak, total = max(peaks)
        ev.append(evidence_row("memory", "peak GPU memory", peak / 2**30, "GiB",
                               f"of {total / 2**30:.0f} GiB ({100 * peak / total:.0f}%)" if total else "capacity unknown"))
    return ev
