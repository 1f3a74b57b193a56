"""Stage 3, analyzers: one module per analysis, between the timeline and classify stages.

Each analyzer module has a per-GPU half and a job-level half:

- ``analyse(gpu, prof, sets) -> Result``: a small dataclass measured on one GPU's steady
  window (``sets``: that window's ops and interval sets, built once per GPU). Runs per file,
  in whatever process read the export (``profclass.ranks``).
- ``numbers(job) -> dict``: job-level quantities (ms per step) that fix gains and pitfall
  costs are computed from (``GAINS``).
- ``facts(job, numbers) -> dict``: the named booleans/values ``data/fixes.toml`` tests.
- ``evidence(job, numbers) -> list[dict]``: its rows of the Diagnosis ``evidence``.
- ``GAINS``: how each fix gain name it owns (``data/fixes.toml`` ``gain``) is priced from
  the numbers.

Cross-rank analyzers (``communication.analyse_ranks``, ``stragglers.find``) run once over
all GPUs, in the facade. Adding an analysis: write its module, register it below (a field
of ``GpuAnalysis`` and an entry of ``PER_GPU`` if it measures each GPU, an entry of
``JOB_LEVEL``), add its rows to the TOML tables and its section to the report.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..timeline import GpuTimeline
from . import communication, compute, host, idle, iterations, memory, pipeline_bubbles, profiler, stragglers
from .job import GpuRecord, Job
from .sets import window_sets

# per-GPU analyzers: (GpuAnalysis field, module)
PER_GPU = (("window", iterations), ("compute", compute), ("communication", communication),
           ("idle", idle), ("host", host), ("memory", memory), ("profiler", profiler))
# job-level halves, in the order their evidence rows are reported
JOB_LEVEL = (compute, communication, pipeline_bubbles, stragglers, idle, host, profiler, memory, iterations)
# the per-GPU ``features`` of the JSON: every result field, in this (published) order
FEATURE_ORDER = (
    "window_ns", "iterations", "step_ns", "compute_ns", "gemm_ns", "comm_ns", "exposed_comm_ns",
    "overlapped_comm_ns", "comm_by_type_ns", "exposed_comm_by_type_ns", "comm_libraries",
    "exposed_copy_ns", "offload_exposed_ns", "offload_bytes", "idle_ns", "idle_alloc_ns",
    "idle_offload_ns", "idle_sync_ns", "idle_launch_ns", "idle_other_ns", "gc_ns", "gaps",
    "alloc_calls", "alloc_call_ns", "sync_calls", "sync_call_ns", "kernels", "launch_bound_kernels",
    "launch_bound_kernel_ns", "recompute_ratio", "pair_fwd_ns", "recompute_ns", "sm_active",
    "sm_active_estimate", "sm_active_source", "tensor_active", "peak_memory_bytes",
    "total_memory_bytes", "fp8_kernels", "graph_kernels", "graph_launches")


@dataclass
class GpuAnalysis:
    """One GPU's analyzer results."""

    window: iterations.WindowResult
    compute: compute.ComputeResult
    communication: communication.CommResult
    idle: idle.IdleResult
    host: host.HostResult
    memory: memory.MemoryResult
    profiler: profiler.ProfilerResult


def analyse_gpu(gpu: GpuTimeline, prof) -> GpuAnalysis:
    """Every per-GPU analyzer on one GPU whose iterations were found
    (``iterations.detect_iterations``)."""
    sets = window_sets(gpu)
    return GpuAnalysis(**{name: module.analyse(gpu, prof, sets) for name, module in PER_GPU})


def feature_record(a: GpuAnalysis) -> dict:
    """All per-GPU results as one flat dict in ``FEATURE_ORDER`` (the JSON ``features``)."""
    flat = {k: v for name, _ in PER_GPU for k, v in asdict(getattr(a, name)).items()}
    # a new analyzer's fields follow the published ones
    return {**{k: flat.pop(k) for k in FEATURE_ORDER}, **flat}


# every fix gain name -> how it is priced from the job numbers
GAINS = {name: gain for module in JOB_LEVEL for name, gain in module.GAINS.items()}


def job_numbers(job: Job) -> dict:
    out: dict = {}
    for module in JOB_LEVEL:
        out.update(module.numbers(job))
    return out


def job_facts(job: Job, numbers: dict) -> dict:
    out: dict = {}
    for module in JOB_LEVEL:
        out.update(module.facts(job, numbers))
    return out


def job_evidence(job: Job, numbers: dict) -> list[dict]:
    return [row for module in JOB_LEVEL for row in module.evidence(job, numbers)]


__all__ = ["GAINS", "GpuAnalysis", "GpuRecord", "Job", "analyse_gpu", "feature_record", "job_evidence",
           "job_facts", "job_numbers"]
