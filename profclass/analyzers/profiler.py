"""Analyzer: host time the capture itself adds (per-op NVTX ranges of emit_nvtx / record_shapes).

``torch.autograd.profiler.emit_nvtx()`` (Megatron-Bridge's ``ProfilingConfig``,
``--profile`` setups that turn it on) wraps every ATen operator and autograd node in an NVTX
range named ``aten::mm, seq = 1234, op_id = 56`` (``sizes = [[...]]`` with record_shapes).
Each range costs the host: the record-function callback formats a new name string, Nsight
Systems' NVTX injection copies and timestamps the push and the pop. Tens of thousands per
step slow a host-bound step by tens of ms, and the profile then shows host time the job
does not have without the profiler.

Per-range cost, measured on the capture: on each thread, the gaps between one op range's end
and the next op range's start; their lower quartile is the fastest op-to-op transition
(pop, format the next name, push, with almost no work between), a conservative per-range
cost (the callback's work inside the range is not in it). Inflation = ranges x that cost,
per thread, summed.
"""
from __future__ import annotations

import re

import numpy as np

from ..timeline import GpuTimeline
from .job import Job, evidence_row, mean_per_step_ms
from .protocol import Analyzer
from .results import ProfilerResult
from .sets import WindowSets, contains_per_distinct

# emit_nvtx / record_function op ranges: ATen ops, autograd nodes, their seq/sizes payloads
OP_RANGES = re.compile(r"^(?:aten|autograd|c10d|prim)::|, seq = \d+|, sizes = \[")
OP_GAP_QUANTILE = 25  # percentile of op-to-op gaps: the fastest transitions, little work between
MIN_RANGES_PER_THREAD = 100  # fewer transitions give no stable quantile
# inflation at or above this share of the step is reported: below the 1% a timer can resolve
# over a few steps, the capture's own cost is noise
PROFILER_MIN_SHARE = 0.01


def analyse(gpu: GpuTimeline, prof, sets: WindowSets) -> ProfilerResult:
    nv = gpu.nvtx
    if nv.empty:
        return ProfilerResult()
    nv = nv[(nv["start"] >= sets.lo) & (nv["start"] < sets.hi)]
    ops = nv[contains_per_distinct(nv["text"], OP_RANGES)]  # once per distinct text
    r = ProfilerResult(op_ranges=int(len(ops)), nvtx_ranges=int(len(nv)))
    costs, counts = [], []
    for _, th in ops.sort_values("start").groupby("tid", sort=False):  # a few threads
        if len(th) < MIN_RANGES_PER_THREAD:
            continue
        gap = th["start"].to_numpy()[1:] - th["end"].to_numpy()[:-1]
        gap = gap[gap > 0]  # back-to-back siblings; nested ranges overlap
        if gap.size >= MIN_RANGES_PER_THREAD:
            costs.append(float(np.percentile(gap, OP_GAP_QUANTILE)))
            counts.append(len(th))
    if costs:
        r.op_range_cost_ns = int(np.average(costs, weights=counts))
        r.profiler_inflation_ns = int(sum(c * n for c, n in zip(costs, counts)))
    return r


# ---------------------------------------------------------------------------------------------
# job level

GAINS = {"profiler_inflation": lambda n: n["profiler_inflation_ms"]}


def numbers(job: Job) -> dict:
    return dict(profiler_inflation_ms=mean_per_step_ms(job, lambda a: a.profiler.profiler_inflation_ns),
                profiler_op_ranges_per_step=float(np.mean([r.analysis.profiler.op_ranges / r.iterations
                                                           for r in job.records])))


def facts(job: Job, numbers: dict) -> dict:
    return dict(profiler_overhead=bool(job.step_ns)
                and numbers["profiler_inflation_ms"] >= PROFILER_MIN_SHARE * job.step_ms)


def evidence(job: Job, numbers: dict) -> list[dict]:
    costs = [r.analysis.profiler.op_range_cost_ns for r in job.records if r.analysis.profiler.op_range_cost_ns]
    note = (f"{numbers['profiler_op_ranges_per_step']:.0f} emit_nvtx op ranges per step x "
            f"{np.mean(costs) / 1e3:.2f} us measured per range" if costs else "no per-op NVTX ranges")
    return [evidence_row("host", "host time added by the profiler's op ranges", numbers["profiler_inflation_ms"],
                         "ms/step", note)]


def missing(job: Job, numbers: dict) -> list[str]:
    if not facts(job, numbers)["profiler_overhead"]:
        return []
    return [f"the capture itself inflates host time: emit_nvtx/record_function op ranges "
            f"({numbers['profiler_op_ranges_per_step']:.0f} per step) add about "
            f"{numbers['profiler_inflation_ms']:.0f} ms/step of host work the job does not have "
            f"without them; capture again without emit_nvtx to see the real host wall"]


ANALYZER = Analyzer(name="profiler", about="host time the capture's own per-op NVTX ranges add",
                    per_gpu_field="profiler", analyse=analyse, numbers=numbers, facts=facts, evidence=evidence,
                    missing=missing, gains=GAINS)
