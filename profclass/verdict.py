"""Classify's output types, in a module that imports nothing of profclass: the analyzers'
job context (``analyzers.job.Job``) holds them, and ``classify`` reads the analyzers' results,
so neither may import the other for them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Verdict:
    wall: str
    runner_up: str
    confidence: float
    scores: dict[str, float]
    straggler_blame_share: float | None = None
    confidence_basis: dict = field(default_factory=dict)
    rule: str = "scores"  # what decided: "scores", "straggler" or "memory-bound"
    rule_note: str = ""  # what the rule counted where, or why one that found its evidence did not decide


@dataclass(frozen=True)
class JobWalls:
    """The classify stage (``classify.classify_job``): the walls per GPU and for the job, and the verdict."""

    gpu_ns: tuple[dict[str, int], ...]  # per GPU: ns of its window per wall
    job_ns: dict[str, float]  # job: ns per step per wall (stragglers' waits moved to their wall)
    step_ns: float  # mean steady step over GPUs
    shares: dict[str, float]  # job_ns over step_ns
    verdict: Verdict
    late_walls: tuple[tuple[str, float], ...]  # per blamed rank: its wall and excess ns per step
    # recompute charged to memory is at least MEMORY_BOUND_MIN_SHARE of the step (the memory
    # section's memory_bound; the verdict takes it only without a straggler)
    memory_bound: bool = False
    # the verdict without the estimated waiting for ranks outside the profile, where it differs
    unseen_reading: str | None = None
