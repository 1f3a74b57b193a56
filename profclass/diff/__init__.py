"""Regression triage: compare the profile of a known-good run (base) with a new one (candidate).

``diff(base, candidate)`` diagnoses both sides (each a file, a list of rank files, a directory,
an already computed ``Diagnosis``, or a stored diagnosis JSON) and reports:

- the steady-state step time of each side with its per-iteration spread, the ratio, and
  whether the change is significant given that spread (Welch's t-test on the per-iteration
  step times plus a minimum effect size; see ``step_test`` and docs/diff.md);
- the change of every wall in ms per step, and of the quantities inside each wall (GEMM vs
  other compute, exposed time per collective type, idle after syncs / late launches, recompute,
  allocator and offload time);
- the kernels whose time per step changed most, matched by normalised name, and the kernels
  that appeared or vanished;
- changes in the communication pattern (collective mix, dispatcher, libraries, overlap) and in
  the configuration visible in the profiles (CUDA graphs, FP8, recompute, command-line flags);
- a one-sentence verdict naming the wall that explains most of the change; a pair that changed
  the work a step (the batch) is judged per the base's work (``work``).

The package: ``saved`` (each side as a Diagnosis), ``stats`` (the step test), ``work`` (the work
a step does), ``compare`` (the analysis and ``DiffResult``), ``render`` (one line, text, Markdown).
"""
from __future__ import annotations

from .compare import DiffResult, diff
from .render import one_line, render_markdown, render_text
from .stats import ALPHA, MIN_EFFECT, UNTESTED_MIN_EFFECT, step_test

__all__ = ["ALPHA", "MIN_EFFECT", "UNTESTED_MIN_EFFECT", "DiffResult", "diff", "one_line", "render_markdown",
           "render_text", "step_test"]
