"""Stage 3, analyzers: one module per analysis, between the timeline and classify stages.

Every analyzer has one shape (``protocol.Analyzer``), and its module ends with
``ANALYZER = Analyzer(...)``: a per-GPU half, ``analyse(gpu, prof, sets) -> result``, run per
file over the steady window (``profclass.ranks``), and job halves over the frozen ``job.Job``
(numbers, facts, evidence rows, missing notes, a Diagnosis section, gain models), each
defaulting to nothing. ``ANALYZERS`` below is the registry: ``analyse_gpu`` runs every
per-GPU half, ``job_outputs`` every job half, the same way for all.

The cross-rank stages that analyzers read (``layout_stage.job_layout``,
``matching.analyse_ranks``, ``pipeline_bubbles.measure``, ``stragglers.find``) run once over
all GPUs, in the facade, before the job halves. Adding an analysis: write its module (ending
in ``ANALYZER``), add its per-GPU result type to ``results`` (and a ``GpuAnalysis`` field, if it
measures each GPU), list it in ``ANALYZERS``; add its rows to the TOML tables
(docs/architecture.md, "Adding an analysis").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..timeline import GpuTimeline
from . import communication, compute, host, idle, iterations, layout_stage, memory, pipeline_bubbles, profiler
from . import stragglers
from .job import GpuRecord, Job
from .protocol import Analyzer
from .results import GpuAnalysis
from .sets import window_sets

# the registry, in the order of the Diagnosis ``evidence`` rows (and of merging numbers and facts)
ANALYZERS: tuple[Analyzer, ...] = (
    compute.ANALYZER, communication.ANALYZER, pipeline_bubbles.ANALYZER, stragglers.ANALYZER, idle.ANALYZER,
    host.ANALYZER, profiler.ANALYZER, memory.ANALYZER, iterations.ANALYZER, layout_stage.ANALYZER)
# the Diagnosis ``missing`` notes follow the profiles' own, in this (published) order
MISSING_ORDER = ("iterations", "layout", "communication", "profiler")
# per-GPU analyzers, in the order of the ``GpuAnalysis`` fields they fill
PER_GPU: tuple[Analyzer, ...] = tuple(next(a for a in ANALYZERS if a.per_gpu_field == f.name)
                                      for f in fields(GpuAnalysis))
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
# every fix gain name -> how it is priced from the job numbers
GAINS = {name: gain for a in ANALYZERS for name, gain in a.gains.items()}


def analyse_gpu(gpu: GpuTimeline, prof) -> GpuAnalysis:
    """Every per-GPU analyzer on one GPU whose iterations were found
    (``iterations.detect_iterations``)."""
    sets = window_sets(gpu)
    return GpuAnalysis(**{a.per_gpu_field: a.analyse(gpu, prof, sets) for a in PER_GPU})


def feature_record(a: GpuAnalysis) -> dict:
    """All per-GPU results as one flat dict in ``FEATURE_ORDER`` (the JSON ``features``)."""
    flat = {k: v for f in fields(a) for k, v in asdict(getattr(a, f.name)).items()}
    # a new analyzer's fields follow the published ones
    return {**{k: flat.pop(k) for k in FEATURE_ORDER}, **flat}


@dataclass(frozen=True)
class JobOutputs:
    """What every analyzer's job half gave, merged: the analyzers' stage output."""

    numbers: dict  # ms per step and the like, what fix gains and pitfall costs are priced from
    facts: dict  # what data/fixes.toml and data/rules.toml test
    evidence: list[dict]
    missing: list[str]
    sections: dict  # Diagnosis field -> its value, for the analyzers that fill one


def job_outputs(job: Job) -> JobOutputs:
    """Every registered analyzer's job half, called the same way."""
    numbers: dict = {}
    for a in ANALYZERS:
        numbers.update(a.numbers(job))
    facts: dict = {}
    for a in ANALYZERS:
        facts.update(a.facts(job, numbers))
    by_name = {a.name: a for a in ANALYZERS}
    missing = [m for name in MISSING_ORDER for m in by_name[name].missing(job, numbers)]
    missing += [m for a in ANALYZERS if a.name not in MISSING_ORDER for m in a.missing(job, numbers)]
    return JobOutputs(numbers=numbers, facts=facts,
                      evidence=[row for a in ANALYZERS for row in a.evidence(job, numbers)], missing=missing,
                      sections={a.section: a.report(job, numbers) for a in ANALYZERS if a.section})


__all__ = ["ANALYZERS", "GAINS", "Analyzer", "GpuAnalysis", "GpuRecord", "Job", "JobOutputs", "analyse_gpu",
           "feature_record", "job_outputs"]
