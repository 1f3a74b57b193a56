"""Analyzer: iterations and the steady-state window every other analyzer measures over.

Iterations come from, in order of preference:
1. ``nvtx``: NVTX ranges named like an iteration (``iteration 12``, ``ProfilerStep#3``,
   ``train_step 5``...; ``--iteration-range REGEX`` overrides). A range's GPU extent is the
   span of the GPU work launched while it was open.
2. ``periodicity``: the kernel sequence repeats once per step (Megatron-LM's ``--profile``
   captures a few steady iterations with no iteration ranges). Kernels that occur in equal
   bursts at a regular spacing mark the step; the longest such period with support from
   several kernel names is the step.
3. ``whole``: the whole capture, one "iteration".

Warm-up iterations are dropped; the steady ones fix the window W.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..timeline import GpuTimeline
from .job import Job, evidence_row
from .sets import WindowSets

DEFAULT_ITERATION_REGEX = (r"^\s*(iteration|iter|step|train_step|training_step|ProfilerStep#|"
                           r"train_batch|global_step)[\s_#:=-]*(\d+)\s*$")
WARMUP_FACTOR = 1.25  # a leading iteration slower than this x the steady median is warm-up
SOURCE_PREFERENCE = ["nvtx", "periodicity", "whole"]


@dataclass
class WindowResult:
    window_ns: int = 0
    iterations: int = 0  # steady iterations (0 only for an empty window)
    step_ns: list[int] = field(default_factory=list)  # each steady step, start to next start


def analyse(gpu: GpuTimeline, prof, sets: WindowSets) -> WindowResult:
    """The window found by ``detect_iterations`` (run first, per file), as numbers."""
    steady = gpu.steady
    return WindowResult(window_ns=sets.hi - sets.lo, iterations=int(len(steady)),
                        step_ns=(steady["step_end"] - steady["start"]).astype(int).tolist())



def nvtx_iterations(gpu: GpuTimeline, regex: str) -> pd.DataFrame:
    """Iterations from NVTX ranges, projected onto the GPU through launch times."""
    nv = gpu.nvtx
    if nv.empty:
        return pd.DataFrame()
    pat = re.compile(regex, re.I)
    # the regex runs once per distinct text, not once per range
    codes, uniq = pd.factorize(nv["text"].astype(str))
    hit_text = np.array([pat.search(t) is not None for t in uniq], bool)
    ranges = nv[hit_text[codes] if len(uniq) else np.zeros(len(nv), bool)]
    if len(ranges) < 1:
        return pd.DataFrame()
    # one thread drives the training loop: keep the thread with the most iteration ranges
    tid = ranges["tid"].value_counts().idxmax()
    ranges = ranges[ranges["tid"] == tid].sort_values("start")
    # nested or duplicate ranges (an outer "step" around an inner one): keep the outermost
    outer = ranges["start"].to_numpy() >= np.maximum.accumulate(
        np.r_[-1, ranges["end"].to_numpy()[:-1]])
    ranges = ranges[outer]
    ops = gpu.ops[gpu.ops["launch_start"] >= 0]
    if ranges.empty or ops.empty:
        return pd.DataFrame()
    rs, re_ = ranges["start"].to_numpy(), ranges["end"].to_numpy()
    ls = ops["launch_start"].to_numpy()
    i = np.searchsorted(rs, ls, side="right") - 1
    inside = (i >= 0) & (ls < re_[np.maximum(i, 0)])
    g = pd.DataFrame({"it": i[inside], "start": ops["start"].to_numpy()[inside],
                      "end": ops["end"].to_numpy()[inside]}).groupby("it").agg(
        start=("start", "min"), end=("end", "max"))
    if g.empty:
        return pd.DataFrame()
    labels = ranges["text"].astype(str).to_numpy()
    g["label"] = labels[g.index.to_numpy()]
    return g.reset_index(drop=True)


def periodic_iterations(gpu: GpuTimeline, min_bursts: int = 3) -> pd.DataFrame:
    """Iterations from the periodicity of the kernel sequence (no NVTX needed).

    Among the names that mark the step, the first in name order is the marker: every rank
    runs the same program, so every rank picks the same kernel and its iterations start at
    the same point of the step, without the ranks having to talk (they may be analysed on
    different workers). The chosen name is kept in ``gpu.marker``."""
    k = gpu.ops[gpu.ops["op"] == "kernel"]
    if len(k) < 20:
        return pd.DataFrame()
    names = k["full_name"].cat.categories
    codes = k["full_name"].cat.codes.to_numpy()
    starts = k["start"].to_numpy()
    order = np.argsort(codes, kind="stable")
    sc, st = codes[order], starts[order]
    bounds = np.flatnonzero(np.r_[True, sc[1:] != sc[:-1], True])
    cands = []  # (period, n_bursts, burst_starts)
    for a, b in zip(bounds[:-1], bounds[1:]):  # one pass per distinct kernel name
        n = b - a
        if n < min_bursts or n > 5000:
            continue
        t = st[a:b]
        gaps = np.diff(t)
        big = gaps > 0.5 * gaps.max()
        first = np.r_[0, np.flatnonzero(big) + 1]
        if first.size < min_bursts:
            continue
        per_burst = np.diff(np.r_[first, n])
        if (per_burst != per_burst[0]).any():
            continue
        bursts = t[first]
        periods = np.diff(bursts)
        if periods.mean() <= 0 or periods.std() / periods.mean() > 0.15:
            continue
        cands.append((float(periods.mean()), bursts, str(names[sc[a]])))
    if not cands:
        return pd.DataFrame()
    periods = np.array([c[0] for c in cands])
    # support: how many kernel names agree on (within 5% of) each period
    support = (np.abs(periods[:, None] - periods[None, :]) <= 0.05 * periods[:, None]).sum(1)
    strong = support >= min(3, support.max())
    top = periods[strong].max()
    group = [i for i in range(len(cands)) if abs(periods[i] - top) <= 0.05 * top]
    period, bursts, gpu.marker = cands[min(group, key=lambda i: cands[i][2])]
    it_start = bursts
    it_end = np.r_[bursts[1:], bursts[-1] + period]
    last_end = k["end"].max()
    # the tail after the last marker is a whole iteration only if it is about one period long
    tail = last_end - bursts[-1]
    if not (0.85 * period <= tail <= 1.15 * period):
        it_start, it_end = it_start[:-1], it_end[:-1]
    # a capture that starts at an iteration boundary (cudaProfilerStart) holds one more
    head = bursts[0] - k["start"].min()
    if 0.85 * period <= head <= 1.15 * period:
        it_start = np.r_[k["start"].min(), it_start]
        it_end = np.r_[bursts[0], it_end]
    it_end = np.minimum(it_end, last_end)
    return pd.DataFrame({"start": it_start.astype(np.int64), "end": it_end.astype(np.int64),
                         "label": [f"period {i}" for i in range(len(it_start))]})


def mark_steady(its: pd.DataFrame, open_end: bool = False) -> pd.DataFrame:
    """Step spans (start of one to start of the next) and warm-up removal.

    ``open_end``: the last iteration's end is only where its GPU work stopped (NVTX), so its
    span lacks the trailing idle a start-to-start span has; it is then used only when fewer
    than two whole steps exist.
    """
    its = its.sort_values("start").reset_index(drop=True)
    nxt = its["start"].shift(-1)
    # the span of a step runs to the start of the next one, so host gaps between steps count
    its["step_end"] = np.where(nxt.notna(), nxt.fillna(0), its["end"]).astype(np.int64)
    dur = (its["step_end"] - its["start"]).to_numpy().astype(float)
    steady = np.ones(len(its), dtype=bool)
    if len(its) >= 2:
        whole = dur[:-1] if open_end and len(its) >= 3 else dur
        med = np.median(whole)
        # an iteration cut short by the end of the capture (cudaProfilerStop, --duration), or
        # an open-ended last one when whole steps exist
        if dur[-1] < 0.5 * med or (open_end and len(its) >= 3):
            steady[-1] = False
        kept = dur[steady]
        ref = np.median(kept[len(kept) // 2:]) if kept.size else med  # the settled second half
        for i in range(len(its)):  # leading warm-up iterations only
            if steady[i] and dur[i] > WARMUP_FACTOR * ref and steady.sum() > 1:
                steady[i] = False
            else:
                break
        # the last iteration often ends with a sync/teardown tail: judge it alone
        if steady[-1] and dur[-1] > WARMUP_FACTOR * ref and steady.sum() > 2:
            steady[-1] = False
    its["steady"] = steady
    its["index"] = np.arange(len(its))
    return its


def detect_iterations(gpu: GpuTimeline, regex: str | None) -> None:
    its, source = pd.DataFrame(), "whole"
    its_nvtx = nvtx_iterations(gpu, regex or DEFAULT_ITERATION_REGEX)
    if len(its_nvtx) >= 1:
        its, source = its_nvtx, "nvtx"
    else:
        its_per = periodic_iterations(gpu)
        if len(its_per) >= 2:
            its, source = its_per, "periodicity"
    if its.empty:
        lo, hi = int(gpu.ops["start"].min()), int(gpu.ops["end"].max())
        its = pd.DataFrame({"start": [lo], "end": [hi], "label": ["whole capture"]})
        source = "whole"
    its = mark_steady(its, open_end=(source == "nvtx"))
    gpu.iterations = its
    gpu.window_source = source
    st = its[its["steady"]]
    gpu.window = (int(st["start"].min()), int(st["step_end"].max()))


# ---------------------------------------------------------------------------------------------
# job level

GAINS: dict = {}

def window_section(job: Job) -> dict:
    """The Diagnosis ``window``: where iterations came from and the job's step statistics."""
    per_it = [np.asarray(r.analysis.window.step_ns, float) / 1e6 for r in job.records]
    if len({len(p) for p in per_it}) == 1:  # the same iterations on every GPU
        job_steps = np.mean(np.stack(per_it), axis=0)
    else:
        job_steps = max(per_it, key=len)
    gpus = [r.gpu for r in job.records]
    return dict(source=_window_source(job), sources={g.label: g.window_source for g in gpus},
                iterations=int(np.median([r.iterations for r in job.records])),
                # mean: the step every share and ms/step refers to (mean over GPUs of their
                # steady windows); the spread comes from the per-iteration steps
                step_ms=dict(mean=round(job.step_ms, 3), median=round(float(np.median(job_steps)), 3),
                             std=round(float(job_steps.std(ddof=1)) if len(job_steps) > 1 else 0.0, 3),
                             min=round(float(job_steps.min()), 3), max=round(float(job_steps.max()), 3),
                             per_iteration=[round(float(x), 3) for x in job_steps]))


def _window_source(job: Job) -> str:
    """The weakest source any GPU's window came from."""
    return sorted({r.gpu.window_source for r in job.records}, key=SOURCE_PREFERENCE.index)[0]


def missing(job: Job) -> list[str]:
    if _window_source(job) != "whole":
        return []
    return ["iterations (no NVTX iteration ranges and no periodic kernel pattern: the whole "
            "capture was diagnosed as one window; a capture shorter than one iteration looks "
            "like this)"]


def numbers(job: Job) -> dict:
    return {}


def facts(job: Job, numbers: dict) -> dict:
    return {}


def evidence(job: Job, numbers: dict) -> list[dict]:
    return [evidence_row("all", "step time", job.step_ms, "ms", "mean steady-state step")]
