"""Where the capture began in the run: from its launch (a whole-run capture, whose steady window
is among the run's first steps) or at a capture range, read from each process's first CUDA call
the export holds (a helper of ``iterations``; docs/classification.md, "Where the capture began")."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ..timeline import GpuTimeline

# The process's first CUDA call in the export tells where the capture began: the CUDA runtime's
# start (lazy loading's mode query, made before any GPU work) when nsys traced the process from
# its launch, the profiler API's start with a capture range (cudaProfilerApi). On the corpus the
# reading matches the command of all 87 captures (tests/test_job_window.py; first read in the
# fifty-fourth session, docs/notes.md). The loader keeps these calls (ranks.API_CALLS_USED).
CAPTURE_START_CALLS = re.compile(r"^(cuModuleGetLoadingMode|cuProfilerStart|cudaProfilerStart)$")


def capture_start(gpu: GpuTimeline) -> str:
    """``process``: the export holds this process from its start (its first CUDA call the
    runtime's); ``range``: a capture range began it; ``unknown``: neither call is held (another
    CUDA, or a capture started by a delay or by hand)."""
    rt = gpu.runtime
    rows = np.flatnonzero(capture_start_calls(rt))
    if not rows.size:
        return "unknown"
    first = rows[np.argmin(rt["start"].to_numpy()[rows])]
    return "process" if str(rt["name"].iloc[first]) == "cuModuleGetLoadingMode" else "range"


def capture_start_calls(rt: pd.DataFrame) -> np.ndarray:
    """Per API call: one of ``CAPTURE_START_CALLS`` (kept for ``capture_start`` alone: the
    runtime's and the profiler's start are not the job's work, and the replay leaves them out)."""
    if rt.empty or not hasattr(rt["name"], "cat"):
        return np.zeros(len(rt), bool)
    cats = rt["name"].cat.categories
    wanted = np.flatnonzero([CAPTURE_START_CALLS.match(str(c)) is not None for c in cats])
    return np.isin(rt["name"].cat.codes.to_numpy(), wanted) if wanted.size else np.zeros(len(rt), bool)


def captured_before(gpu) -> int:
    """Iterations found before the steady window's first (warm-up the window dropped, and any
    whole period the capture held before it)."""
    its = gpu.iterations
    if its is None or its.empty or "steady" not in its or not its["steady"].any():
        return 0
    return int(np.argmax(its["steady"].to_numpy(bool)))


def job_capture_start(records) -> dict:
    """The window's place in the run: ``capture_start`` (``process``, ``range`` or ``unknown``,
    the one every GPU's process gives, else ``unknown``) and ``iterations_before`` (the fewest
    iterations any GPU found before its steady window)."""
    starts = {r.gpu.step.get("capture_start", "unknown") for r in records}  # ranks._found read it
    return dict(capture_start=starts.pop() if len(starts) == 1 else "unknown",
                iterations_before=min(captured_before(r.gpu) for r in records))
