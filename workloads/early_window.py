#!/usr/bin/env python3
"""Call LB's measurement: how far a whole-run capture's first iterations sit from the same run's
later ones (docs/notes.md, fifty-fifth session).

    python3 workloads/early_window.py LOG...

Each log holds one untraced run's per-iteration timer as ``STEP_MS it=N ms=X`` lines (80 of
them). E: the mean of the iterations among the first 8 that profclass's own steady-window rule
keeps from a capture of those 8 (``iterations.mark_steady``: leading warm-up, a cut-short or a
teardown last step dropped); L: the mean of the last 30 (iterations 50..79); the ratio E/L.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from profclass.analyzers.iterations import mark_steady

STEP = re.compile(r"^STEP_MS it=(\d+) ms=([0-9.]+)", re.M)
CAPTURED, LATER = 8, 30


def early_and_later(text: str) -> dict | None:
    """{early, later, ratio, kept} of one run's timer; None unless it holds 50 + LATER steps."""
    ms = np.array([float(v) for _, v in sorted(((int(i), v) for i, v in STEP.findall(text)))])
    if len(ms) < 50 + LATER:
        return None
    # the first 8 as a capture's back-to-back steps (ns), through the rule a diagnosis applies
    span = np.round(ms[:CAPTURED] * 1e6).astype(np.int64)
    start = np.r_[0, np.cumsum(span)[:-1]]
    steady = mark_steady(pd.DataFrame({"start": start, "end": start + span}))["steady"].to_numpy(bool)
    early, later = float(ms[:CAPTURED][steady].mean()), float(ms[-LATER:].mean())
    return dict(early=round(early, 2), later=round(later, 2), ratio=round(early / later, 3), kept=int(steady.sum()))


def main(paths: list[str]) -> int:
    print("| run | iterations kept of the first 8 | E: their mean, ms | L: iterations 50..79, ms | E/L |")
    print("|---|---:|---:|---:|---:|")
    for p in paths:
        r = early_and_later(Path(p).read_text())
        if r:
            print(f"| {Path(p).stem} | {r['kept']} | {r['early']:.2f} | {r['later']:.2f} | {r['ratio']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
