"""The one shape every analyzer has: what the facade and the registry call, the same way for all.

Each analyzer module ends with ``ANALYZER = Analyzer(...)`` naming its halves; what it does
not measure is left to the do-nothing defaults (no numbers, facts, evidence rows or missing
notes, no report section, no gain models). ``analyzers/__init__.py`` lists them (the registry);
``profclass.pipeline`` calls every registered one through ``analyzers.job_outputs``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .job import Job


def no_numbers(job: Job) -> dict:
    return {}


def no_facts(job: Job, numbers: dict) -> dict:
    return {}


def no_rows(job: Job, numbers: dict) -> list:
    return []


@dataclass(frozen=True)
class Analyzer:
    """One analysis: its metadata and its halves.

    - ``analyse(gpu, prof, sets) -> result``: the per-GPU half, run per file over the steady
      window (``sets.WindowSets``); its result is the ``GpuAnalysis`` field ``per_gpu_field``.
    - ``numbers(job)``: job quantities (ms per step) the fix gains and pitfall costs are priced from.
    - ``facts(job, numbers)``: the named values ``data/fixes.toml`` and ``data/rules.toml`` test.
    - ``evidence(job, numbers)``: its rows of the Diagnosis ``evidence``.
    - ``missing(job, numbers)``: what it could not see (the Diagnosis ``missing``).
    - ``section``/``report(job, numbers)``: the Diagnosis field it fills, and how.
    - ``gains``: how each fix gain name it owns (``data/fixes.toml`` ``gain``) is priced.
    """

    name: str  # the module's name
    about: str  # one line: what it measures (docs/architecture.md, reports)
    per_gpu_field: str | None = None
    analyse: Callable[[Any, Any, Any], Any] | None = None
    numbers: Callable[[Job], dict] = no_numbers
    facts: Callable[[Job, dict], dict] = no_facts
    evidence: Callable[[Job, dict], list] = no_rows
    missing: Callable[[Job, dict], list] = no_rows
    section: str | None = None
    report: Callable[[Job, dict], Any] | None = None
    gains: Mapping[str, Callable[[dict], Any]] = field(default_factory=dict)
