"""Analyzer: what the host costs beyond idle gaps: launch-bound kernels, CUDA graphs, GC."""
from __future__ import annotations

import re

import numpy as np

from .. import intervals as iv
from ..timeline import GpuTimeline
from .gainmodel import Gain, gain, removed
from .job import Job, evidence_row, mean_per_step_ms
from .protocol import Analyzer
from .results import HostResult
from .sets import WindowSets, clipped_set, contains_per_distinct, name_matches

GRAPH_LAUNCH = re.compile(r"cudaGraphLaunch|cuGraphLaunch")  # str.startswith, as a match
GC_RANGES = re.compile(r"(?:^|\W)(?:gc|garbage|collect)(?:\W|$)", re.I)
LAUNCH_BOUND_SHARE = 0.2  # this share of kernels shorter than their launch: launch-bound


def analyse(gpu: GpuTimeline, prof, sets: WindowSets) -> HostResult:
    kern, lo, hi = sets.kernels, sets.lo, sets.hi
    lb = kern[(kern["launch_start"] >= 0)
              & ((kern["end"] - kern["start"]) < (kern["launch_end"] - kern["launch_start"]))]
    rt = gpu.runtime
    in_w = ((rt["start"] < hi) & (rt["end"] > lo)).to_numpy(bool)
    gcr = gpu.nvtx[contains_per_distinct(gpu.nvtx["text"], GC_RANGES)]
    return HostResult(kernels=int(len(kern)), launch_bound_kernels=int(len(lb)),
                      launch_bound_kernel_ns=int((lb["end"] - lb["start"]).sum()),
                      graph_kernels=int((kern["graph_node"] != 0).sum()),
                      graph_launches=int((in_w & name_matches(rt["name"], GRAPH_LAUNCH)).sum()),
                      gc_ns=iv.total(clipped_set(gcr, lo, hi)) if not gcr.empty else 0)


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


GAINS = {"gc": lambda n: removed("gc", min(n["gc_ms"], n["host_ms"]), "garbage-collection time"),
         "host_spread": _host_spread}

def numbers(job: Job) -> dict:
    ranks = [walls.get("host", 0) / r.iterations / 1e6 for walls, r in zip(job.walls.gpu_ns, job.records)]
    pp = str(job.flags.get("--pipeline-model-parallel-size", "1"))
    return dict(gc_ms=mean_per_step_ms(job, lambda a: a.host.gc_ns), host_ms=job.walls_ns["host"] / 1e6,
                host_rank_ms=ranks if len(ranks) > 1 else None, pp_from_flags=int(pp) if pp.isdigit() else 1)


def facts(job: Job, numbers: dict) -> dict:
    lb = np.mean([r.analysis.host.launch_bound_kernels / max(r.analysis.host.kernels, 1) for r in job.records])
    return dict(launch_bound_kernels=bool(lb >= LAUNCH_BOUND_SHARE))


def evidence(job: Job, numbers: dict) -> list[dict]:
    per_step = float(np.mean([r.analysis.host.launch_bound_kernels / r.iterations for r in job.records]))
    return [evidence_row("host", "kernels shorter than their launch", per_step, "per step",
                         "launch-bound kernels")]


ANALYZER = Analyzer(name="host", about="launch-bound kernels, CUDA graphs, garbage collection",
                    per_gpu_field="host", analyse=analyse, numbers=numbers, facts=facts, evidence=evidence,
                    gains=GAINS)
