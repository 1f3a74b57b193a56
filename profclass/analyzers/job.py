"""What the job-level half of every analyzer reads: the job's stage outputs, frozen.

The facade (``profclass.pipeline``) runs the stages in order, each on the outputs of the
ones before it, and builds one ``Job`` from all of them; only then are the analyzers' job
halves (numbers, facts, evidence, missing notes, report sections) called on it:

    records (per GPU, from the per-file stage) -> layout -> comm -> pipeline
        -> walls (classify) -> stragglers -> cfg (configuration)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..config import run_flags
from ..verdict import JobWalls
from .layout import Layout
from .results import CommAnalysis, GpuAnalysis, PipelineResult


@dataclass(frozen=True)
class GpuRecord:
    """One GPU: its timeline (or per-rank summary) and what the per-GPU analyzers found on it."""

    gpu: Any  # GpuTimeline, or the per-rank GpuSummary standing in for it
    analysis: GpuAnalysis
    iterations: int  # steady iterations, at least 1 (every per-step figure divides by it)


@dataclass(frozen=True)
class Job:
    """Every job-level stage's output: what the analyzers' job halves take as their argument."""

    records: tuple[GpuRecord, ...]
    layout: Layout  # sizes and group membership (layout stage)
    comm: CommAnalysis  # collectives matched across ranks (communication stage)
    pipeline: PipelineResult  # PP bubble and stage imbalance (pipeline stage)
    walls: JobWalls  # ns per wall per GPU and for the job, the verdict (classify)
    stragglers: list[dict]  # the Diagnosis ``stragglers`` rows (stragglers.straggler_rows)
    cfg: dict  # the Diagnosis ``config`` section (config.derive)

    @property
    def step_ns(self) -> float:
        return self.walls.step_ns  # mean steady step over GPUs

    @property
    def step_ms(self) -> float:
        return self.step_ns / 1e6

    @property
    def walls_ns(self) -> dict[str, float]:
        return self.walls.job_ns  # job ns per step per wall

    @property
    def flags(self) -> dict:
        return run_flags(self.cfg)

def mean_per_step_ms(job: Job, value: Callable[[GpuAnalysis], float]) -> float:
    """Mean over GPUs of ``value`` per steady iteration, in ms."""
    return float(np.mean([value(r.analysis) / r.iterations for r in job.records])) / 1e6


def evidence_row(wall: str, metric: str, value, unit: str, note: str) -> dict:
    return dict(wall=wall, metric=metric, value=round(float(value), 3), unit=unit, note=note)
