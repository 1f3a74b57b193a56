"""Analyzer: what the host costs beyond idle gaps: launch-bound kernels, CUDA graphs, GC."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from .. import intervals as iv
from ..timeline import GpuTimeline
from .gainmodel import Gain, gain, removed, share_of
from .job import Job, evidence_row, mean_per_step_ms
from .protocol import Analyzer
from .results import HostResult
from .sets import WindowSets, clipped_set, contains_per_distinct, name_matches

GRAPH_LAUNCH = re.compile(r"cudaGraphLaunch|cuGraphLaunch")  # str.startswith, as a match
GC_RANGES = re.compile(r"(?:^|\W)(?:gc|garbage|collect)(?:\W|$)", re.I)
LAUNCH_BOUND_SHARE = 0.2  # this share of kernels shorter than their launch: launch-bound
# a pause: a stretch with no CUDA call on the launching thread this much longer than the thread's
# longest stretches of a step. Above the step-to-step jitter of those stretches (a few ms) and
# below one collection of CPython's oldest generation over a training process's heap (>= 10^6
# tracked objects at tens of ns each: tens to hundreds of ms); docs/fixes.md, the remove_gc row
PAUSE_MIN_NS = 20_000_000
# The host's speed, read from the capture (load.tables.read_host_probe): driver calls that do the
# same small CPU work on every host and never touch the GPU (PyTorch makes them per kernel
# launch). Their median own time moves with the host's pace: the same job's host time on two
# hosts went as theirs (docs/replay.md, "The host's speed"). Below MIN_PROBE_CALLS it is not read.
MIN_PROBE_CALLS = 100
# the corpus's captures (lent H100 and H200 hosts): the 10th, 50th and 90th percentile of their
# probe medians, one per job (tests/test_host_speed.py derives them from the snapshots)
PROBE_NS_CORPUS = (121, 182, 239)
# A library loading a kernel at its first use: cuBLAS(Lt) loads each GEMM kernel it picks from
# its embedded cubins (cuLibraryLoadData, cuLibraryGetKernel) and sets its attributes
# (cuKernelSetAttribute) before launching it the first time, 0.05-14 ms of host time per kernel
# in the corpus. Inside a steady window it means GEMM shapes the job had not run before: uneven
# expert token counts give the experts' GEMMs new shapes every step (docs/fixes.md, `balance`).
KERNEL_LOAD_CALLS = re.compile(r"^(cuLibraryLoad|cuModuleLoad|cuLibraryGetKernel|cuModuleGetFunction|"
                               r"cuLibraryGetModule)")
KERNEL_SETUP_CALLS = re.compile(r"^(cuKernelSetAttribute|cuFuncSetAttribute|cudaFuncSetAttribute|"
                                r"cuKernelSetCacheConfig|cuFuncSetCacheConfig|cudaFuncSetCacheConfig)")
LOADED_KERNEL_CALLS = re.compile(r"^(cuLibraryLoad|cuModuleLoad)")  # one per kernel (module) loaded
# a load a step on average: the job's shapes have not settled (a stray late first use, such as
# the first checkpoint's or the last micro-batch's kernel, is one load in a window, not one a step)
KERNEL_LOADS_PER_STEP = 1.0


def host_pauses(gaps: np.ndarray, iterations: int) -> np.ndarray:
    """Per gap (ns of CPU time between one thread's CUDA calls): the part that is a pause
    outside the steps' rhythm. Every step has its own longest stretches (the optimizer's
    Python, the data); the reference is the median of the thread's ``iterations`` longest gaps
    (one a step, were the steps alike), so a pause in fewer than half of the steps stands out:
    a gap over the reference by more than PAUSE_MIN_NS and more than the reference itself is a
    pause of its excess. Needs 3 steps (with 2 the median is the pause's own half)."""
    n = len(gaps)
    if iterations < 3 or n < iterations:
        return np.zeros(n, np.int64)
    ref = float(np.median(np.partition(gaps, n - iterations)[n - iterations:]))
    excess = gaps - ref
    return np.where(excess > max(PAUSE_MIN_NS, ref), excess, 0).astype(np.int64)


def kernel_load_ns(names: pd.Series, tid: np.ndarray, start: np.ndarray, end: np.ndarray,
                   launches: np.ndarray) -> np.ndarray:
    """Per API call, rows sorted by (tid, start): its own time where it loads a kernel (a load
    call, or a set-up call after one on its thread before the thread's next launch), else 0. A
    set-up call alone is no load: some libraries set an attribute before every launch.
    ``launches``: bool per call, it launched an op."""
    m = len(start)
    load = name_matches(names, KERNEL_LOAD_CALLS) if m else np.zeros(0, bool)
    if not load.any():
        return np.zeros(m, np.int64)
    idx = np.arange(m)
    first = np.ones(m, bool)
    first[1:] = tid[1:] != tid[:-1]
    thread_first = np.maximum.accumulate(np.where(first, idx, 0))
    last_load = np.maximum.accumulate(np.where(load, idx, -1))
    last_launch = np.maximum.accumulate(np.where(launches, idx, -1))
    setup = name_matches(names, KERNEL_SETUP_CALLS) & (last_load >= thread_first) & (last_load > last_launch)
    return np.where(load | setup, end - start, 0).astype(np.int64)


def _kernel_loads(gpu: GpuTimeline, lo: int, hi: int) -> tuple[int, int]:
    """(kernels loaded, ns of host time loading them) inside the window, on the threads that
    loaded one (``kernel_load_ns``); only those threads' rows are sorted."""
    rt = gpu.runtime
    if rt.empty:
        return 0, 0
    start = rt["start"].to_numpy(np.int64)
    keep = (start >= lo) & (start < hi)
    loaded = keep & name_matches(rt["name"], LOADED_KERNEL_CALLS)
    if not loaded.any():
        return 0, 0
    tid = rt["tid"].to_numpy()
    rows = rt[keep & np.isin(tid, np.unique(tid[loaded]))].sort_values(["tid", "start"], kind="stable")
    launches = rows["correlation"].isin(gpu.ops["correlation"]).to_numpy(bool)
    ns = kernel_load_ns(rows["name"], rows["tid"].to_numpy(), rows["start"].to_numpy(np.int64),
                        rows["end"].to_numpy(np.int64), launches)
    return int(loaded.sum()), int(ns.sum())


def _pause_ns(gpu: GpuTimeline, lo: int, hi: int) -> int:
    """Pauses (``host_pauses``) of the threads that launched the window's ops: the most any of
    them shows (a collection holds the interpreter; a thread waiting in a CUDA call hides it).

    Column arrays, one thread's rows at a time, in (start, table order) as a stable sort by
    (tid, start) gives them: no copy of the window's API call rows (on a 4 GB export's process,
    ~4M calls, two such copies were ~400 MiB at its peak RSS; bench/RESULTS.md)."""
    rt = gpu.runtime
    if rt.empty or len(gpu.steady) < 3:
        return 0
    start, tid = rt["start"].to_numpy(np.int64), rt["tid"].to_numpy()
    keep = (start >= lo) & (start < hi)
    launched = pd.Series(rt["correlation"].to_numpy()[keep]).isin(gpu.ops["correlation"]).to_numpy(bool)
    launching = np.unique(tid[keep][launched])
    del launched
    end = rt["end"].to_numpy(np.int64)
    most = 0
    for t in launching:
        mine = keep & (tid == t)
        s, e = start[mine], end[mine]
        if len(s) > 1 and not bool((s[1:] >= s[:-1]).all()):  # (the runtime table is sorted as a rule)
            by_start = np.argsort(s, kind="stable")
            s, e = s[by_start], e[by_start]
        after = np.maximum.accumulate(e)[:-1]
        gaps = np.clip(s[1:] - after, 0, None)
        # a stretch in which another launching thread sits in a CUDA call is a hand-off, not a pause
        # (the main thread waits in backward() while the autograd thread's kernel load drains the GPU)
        others = keep & np.isin(tid, launching[launching != t])
        if others.any():
            busy = iv.union(start[others], end[others])
            gaps = gaps - iv.measure_within(busy, after, np.maximum(s[1:], after))
        most = max(most, int(host_pauses(gaps, len(gpu.steady)).sum()))
    return most


def analyse(gpu: GpuTimeline, prof, sets: WindowSets) -> HostResult:
    kern, lo, hi = sets.kernels, sets.lo, sets.hi
    lb = kern[(kern["launch_start"] >= 0)
              & ((kern["end"] - kern["start"]) < (kern["launch_end"] - kern["launch_start"]))]
    rt = gpu.runtime
    in_w = ((rt["start"] < hi) & (rt["end"] > lo)).to_numpy(bool)
    gcr = gpu.nvtx[contains_per_distinct(gpu.nvtx["text"], GC_RANGES)]
    probe_ns, probes = prof.host_probe or (None, 0)
    read = probes >= MIN_PROBE_CALLS
    loads, load_ns = _kernel_loads(gpu, lo, hi)
    return HostResult(kernel_loads=loads, kernel_load_ns=load_ns,
                      kernels=int(len(kern)), launch_bound_kernels=int(len(lb)),
                      probe_call_ns=probe_ns if read else None, probe_calls=probes if read else 0,
                      launch_bound_kernel_ns=int((lb["end"] - lb["start"]).sum()),
                      graph_kernels=int((kern["graph_node"] != 0).sum()),
                      graph_launches=int((in_w & name_matches(rt["name"], GRAPH_LAUNCH)).sum()),
                      gc_ns=iv.total(clipped_set(gcr, lo, hi)) if not gcr.empty else 0,
                      pause_ns=_pause_ns(gpu, lo, hi) if gcr.empty else 0)


# ---------------------------------------------------------------------------------------------
# job level

# fix gain ceilings (ms per step) from the job numbers; see docs/fixes.md
def _host_spread(n: dict) -> Gain | None:
    """Pinning brings the worst-placed rank's host time to the median rank's. Not priced for a
    lone rank (no spread to see) nor a pipelined job (stages do different work by design)."""
    if n["host_rank_ms"] is None or (n.get("pp_stages") or n["pp_from_flags"]) > 1:
        return None
    ranks = n["host_rank_ms"]
    spread, full = max(ranks) - float(np.median(ranks)), max(ranks) - min(ranks)
    return gain("host_spread", spread, 0.0, full, full,
                f"slowest rank's host time {max(ranks):.1f} minus the median rank's {float(np.median(ranks)):.1f} ms/step")


GAINS = {"gc": lambda n: removed("gc", min(n["gc_ms"], n["host_ms"]), "garbage-collection time" if n["gc_marked"]
                                  else "host pauses outside the steps' rhythm (no GC ranges in the profile)"),
         "host_spread": _host_spread,
         # at most the loads' host time; a load that drained a GPU-bound queue waited out work the
         # step runs anyway, so half, and none at the low end (the replay prices the critical path)
         "kernel_loads": lambda n: share_of("kernel_loads", min(n["kernel_load_ms"], n["host_ms"]), 0.5, 0.0, 1.0,
                                            "host time loading kernels at their first use")}

def job_probe_ns(records) -> float | None:
    """The job's host probe: the median over its GPUs' exports (None where none was read)."""
    probes = [r.analysis.host.probe_call_ns for r in records if r.analysis.host.probe_call_ns is not None]
    return float(np.median(probes)) if probes else None


def numbers(job: Job) -> dict:
    ranks = [walls.get("host", 0) / r.iterations / 1e6 for walls, r in zip(job.walls.gpu_ns, job.records)]
    pp = str(job.flags.get("--pipeline-model-parallel-size", "1"))
    marked = any(r.analysis.host.gc_ns for r in job.records)
    return dict(gc_ms=mean_per_step_ms(job, lambda a: a.host.gc_ns if marked else a.host.pause_ns), gc_marked=marked,
                probe_call_ns=job_probe_ns(job.records),
                kernel_loads=float(np.mean([r.analysis.host.kernel_loads / r.iterations for r in job.records])),
                kernel_load_ms=mean_per_step_ms(job, lambda a: a.host.kernel_load_ns),
                host_ms=job.walls_ns["host"] / 1e6,
                host_rank_ms=ranks if len(ranks) > 1 else None, pp_from_flags=int(pp) if pp.isdigit() else 1)


def facts(job: Job, numbers: dict) -> dict:
    lb = np.mean([r.analysis.host.launch_bound_kernels / max(r.analysis.host.kernels, 1) for r in job.records])
    return dict(launch_bound_kernels=bool(lb >= LAUNCH_BOUND_SHARE),
                kernel_loads=bool(numbers["kernel_loads"] >= KERNEL_LOADS_PER_STEP))


def evidence(job: Job, numbers: dict) -> list[dict]:
    per_step = float(np.mean([r.analysis.host.launch_bound_kernels / r.iterations for r in job.records]))
    rows = [evidence_row("host", "kernels shorter than their launch", per_step, "per step",
                         "launch-bound kernels")]
    if not numbers["gc_marked"] and numbers["gc_ms"] > 0:
        i = int(np.argmax([r.analysis.host.pause_ns for r in job.records]))
        worst = job.records[i]
        rows.append(evidence_row(
            "host", "pauses outside the steps' rhythm (no CUDA call; Python's garbage collector is the usual cause)",
            numbers["gc_ms"], "ms/step",
            f"the launching thread's stretches with no CUDA call over its typical longest one by > "
            f"{PAUSE_MIN_NS / 1e6:.0f} ms; most on rank {getattr(worst.gpu, 'rank', i)}: {worst.analysis.host.pause_ns / 1e6:.1f} ms "
            f"in {worst.iterations} steps, a rate a short window cannot pin down"))
    if numbers["kernel_loads"] > 0:
        rows.append(_loads_row(job, numbers))
    if numbers["probe_call_ns"] is not None:
        rows.append(_speed_row(numbers["probe_call_ns"]))
    return rows


def _loads_row(job: Job, numbers: dict) -> dict:
    i = int(np.argmax([r.analysis.host.kernel_load_ns for r in job.records]))
    worst = job.records[i]
    return evidence_row(
        "host", "kernels a library loaded at their first use inside the window (GEMM shapes not run before)",
        numbers["kernel_loads"], "per step",
        f"{numbers['kernel_load_ms']:.1f} ms/step of host time in the loading calls (cuLibraryLoadData, "
        f"cuKernelSetAttribute; mean over GPUs), most on rank {getattr(worst.gpu, 'rank', i)}: "
        f"{worst.analysis.host.kernel_loads} loads, {worst.analysis.host.kernel_load_ns / 1e6:.1f} ms in "
        f"{worst.iterations} steps. A load that finds the GPU busy waits for it to drain, and the GPU then idles "
        f"until the host launches again. Uneven expert token counts give the experts' GEMMs new shapes every step: "
        f"static shapes (--moe-pad-expert-input-to-capacity) or balanced routing end it (docs/replay.md, Kernel loads)")


def _speed_row(ns: float) -> dict:
    low, mid, high = PROBE_NS_CORPUS
    where = ("slower than 9 in 10 of them" if ns > high else "faster than 9 in 10 of them" if ns < low
             else "inside their usual spread")
    return evidence_row(
        "host", "the host's speed: a fixed-work driver call (cuKernelGetName), median own time", ns, "ns",
        f"the corpus's captures' hosts: {low}-{high} ns (10th-90th percentile, median {mid}); this one is {where}. "
        f"A host-paced step's host time moves with it: its gains and its step without the profiler are priced "
        f"at this host's pace; on a host at the corpus's median the host's time would be x{mid / ns:.2f} "
        f"(docs/replay.md, The host's speed)")


ANALYZER = Analyzer(name="host", about="launch-bound kernels, CUDA graphs, garbage collection",
                    per_gpu_field="host", analyse=analyse, numbers=numbers, facts=facts, evidence=evidence,
                    gains=GAINS)
