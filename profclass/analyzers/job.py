"""What the job-level half of every analyzer reads: one record per GPU and the job context.

The facade (``profclass.pipeline``) fills ``Job`` stage by stage: the records after the
per-GPU analyzers, ``comm`` and ``stragglers`` after the cross-rank ones, ``walls_ns`` and
``step_ns`` after classify, ``cfg`` after the configuration is derived.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from . import GpuAnalysis
    from .communication import CommAnalysis, RankComm


@dataclass
class GpuRecord:
    """One GPU: its timeline (or per-rank summary) and what the analyzers found on it."""

    gpu: Any  # GpuTimeline, or the per-rank GpuSummary standing in for it
    analysis: GpuAnalysis
    iterations: int  # steady iterations, at least 1 (every per-step figure divides by it)
    comm: RankComm | None = None  # wait/transfer against its peers (communication analyzer)
    walls_ns: dict[str, int] = field(default_factory=dict)  # classify: ns of the window per wall


@dataclass
class Job:
    records: list[GpuRecord]
    comm: CommAnalysis | None = None
    stragglers: list[dict] = field(default_factory=list)
    walls_ns: dict[str, float] = field(default_factory=dict)  # job ns per step per wall
    step_ns: float = 0.0  # mean steady step over GPUs
    cfg: dict = field(default_factory=dict)
    layout: Any = None  # layout.Layout: sizes and group membership (before the cross-rank analyzers)
    members: list = field(default_factory=list)  # per GPU: group -> member ranks (comm_groups)
    comm_kernels: list = field(default_factory=list)  # per GPU: its NCCL kernels with their group
    pipeline: Any = None  # pipeline_bubbles.PipelineResult
    # the verdict without the estimated waiting for ranks outside the profile, where it differs
    unseen_reading: str | None = None

    @property
    def step_ms(self) -> float:
        return self.step_ns / 1e6


def mean_per_step_ms(job: Job, value: Callable[[GpuAnalysis], float]) -> float:
    """Mean over GPUs of ``value`` per steady iteration, in ms."""
    return float(np.mean([value(r.analysis) / r.iterations for r in job.records])) / 1e6


def evidence_row(wall: str, metric: str, value, unit: str, note: str) -> dict:
    return dict(wall=wall, metric=metric, value=round(float(value), 3), unit=unit, note=note)
