"""Analyzer: iterations and the steady-state window every other analyzer measures over.

Iterations come from, in order of preference:
1. ``nvtx``: NVTX ranges named like an iteration (``iteration 12``, ``ProfilerStep#3``,
   ``train_step 5``..., and megatron.core's ``nvtx_decorator`` range on the step function,
   named by its module path with no number: ``megatron.training.training.train_step``,
   ``__main__.train_step``; ``--iteration-range REGEX`` overrides). A range's GPU extent is
   the span of the GPU work launched while it was open. megatron.core's module ranges and
   ``emit_nvtx`` op ranges (tens of thousands per step) match neither form.
2. ``periodicity``: the kernel sequence repeats once per step (Megatron-LM's ``--profile``
   captures a few steady iterations with no iteration ranges). Kernels that occur in equal
   bursts at a regular spacing mark the step; the longest such period with support from
   several kernel names is the step.
3. ``whole``: the whole capture, one "iteration".

Ranks of one synchronous job share one step, so the step is then agreed across GPUs
(``consensus``): a GPU that did not find the job's step on its own takes it, phase-aligned
(``job`` source). Warm-up iterations are dropped; the steady ones fix the window W.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ..timeline import GpuTimeline
from .job import GpuRecord, Job, evidence_row
from .capture_start import job_capture_start
from .protocol import Analyzer
from .results import WindowResult
from .sets import WindowSets

DEFAULT_ITERATION_REGEX = (r"^\s*(iteration|iter|step|train_step|training_step|ProfilerStep#|"
                           r"train_batch|global_step)[\s_#:=-]*(\d+)\s*$"
                           # megatron.core nvtx_decorator: f"{module}.{qualname}" of the step function
                           r"|^[\w.<>]*\.(train_step|training_step)$")
WARMUP_FACTOR = 1.25  # a leading iteration slower than this x the steady median is warm-up
SOURCE_PREFERENCE = ["nvtx", "periodicity", "job", "whole"]
PERIOD_CV = 0.15  # bursts of one kernel name this regular (std/mean of spacing) mark a period
PERIOD_TOL = 0.05  # two periods within this fraction are the same step (run-to-run jitter)
MIN_STEADY = 3  # fewer steady steps than this: the window is weak (no spread, warm-up unsure)
# a step repeats one program, so every whole period between two marks launches the same kernels
# (the corpus's: equal counts); a head or tail period with fewer than this x the fewest of a whole
# one lost the rest to the capture's start or end, however long it looks (PyTorch skips a kernel
# on an empty tensor: the 1% is room for an expert with no tokens)
WHOLE_PERIOD_KERNELS = 0.99


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
    ops = gpu.ops.loc[(gpu.ops["launch_start"] >= 0).to_numpy(), ["start", "end", "launch_start"]]
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


def period_candidates(gpu: GpuTimeline, min_bursts: int = 3) -> list[tuple[float, np.ndarray, str]]:
    """(period ns, burst starts, kernel name) of every kernel name that occurs in equal bursts
    at a regular spacing. One pass per distinct name over its sorted starts."""
    k = gpu.ops.loc[(gpu.ops["op"] == "kernel").to_numpy(), ["start", "full_name"]]
    if len(k) < 20:
        return []
    names = k["full_name"].cat.categories
    codes = k["full_name"].cat.codes.to_numpy()
    order = np.argsort(codes, kind="stable")
    sc, st = codes[order], k["start"].to_numpy()[order]
    bounds = np.flatnonzero(np.r_[True, sc[1:] != sc[:-1], True])
    cands = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = b - a
        if n < min_bursts or n > 5000:
            continue
        t = st[a:b]
        gaps = np.diff(t)
        first = np.r_[0, np.flatnonzero(gaps > 0.5 * gaps.max()) + 1]
        if first.size < min_bursts:
            continue
        per_burst = np.diff(np.r_[first, n])
        if (per_burst != per_burst[0]).any():
            continue
        periods = np.diff(t[first])
        if periods.mean() <= 0 or periods.std() / periods.mean() > PERIOD_CV:
            continue
        cands.append((float(periods.mean()), t[first], str(names[sc[a]])))
    return cands


def choose_period(periods: np.ndarray, support: np.ndarray) -> float:
    """The step among candidate periods: the longest one that several kernel names agree on
    (a shorter period with wide support is a repeated part of the step, e.g. a layer)."""
    strong = support >= min(3, support.max())
    return float(periods[strong].max())


def _agreeing(periods: np.ndarray, p: float) -> np.ndarray:
    return np.abs(periods - p) <= PERIOD_TOL * p


def periodic_iterations(gpu: GpuTimeline, period: float | None = None) -> pd.DataFrame:
    """Iterations from the periodicity of the kernel sequence (no NVTX needed).

    ``period``: the job's step (``consensus``): only a kernel name with that period may mark
    it here. Among the names that mark the step, the first in name order is the marker: every
    rank runs the same program, so every rank picks the same kernel and its iterations start
    at the same point of the step, without the ranks having to talk (they may be analysed on
    different workers). The chosen name is kept in ``gpu.marker``; the candidate periods in
    ``gpu.periods`` (ns, with how many names support each) for the job's consensus."""
    cands = period_candidates(gpu)
    if not cands:
        gpu.periods = []
        return pd.DataFrame()
    periods = np.array([c[0] for c in cands])
    support = np.array([_agreeing(periods, p).sum() for p in periods])
    gpu.periods = sorted({(round(float(p)), int(n)) for p, n in zip(periods, support)})
    top = choose_period(periods, support) if period is None else period
    group = np.flatnonzero(_agreeing(periods, top))
    if group.size == 0:
        return pd.DataFrame()
    i = min(group, key=lambda i: cands[i][2])
    gpu.marker = cands[i][2]
    return _steps_from_marks(gpu, cands[i][0], cands[i][1])


def _steps_from_marks(gpu: GpuTimeline, period: float, bursts: np.ndarray) -> pd.DataFrame:
    """Iterations starting at each mark; the stretch before the first mark (head) or after the
    last (tail) counts only if it is a whole one: about one period long and with a whole
    period's kernels (``WHOLE_PERIOD_KERNELS``; a capture cut at an iteration boundary)."""
    k = gpu.ops.loc[(gpu.ops["op"] == "kernel").to_numpy(), ["start", "end"]]
    starts = k["start"].to_numpy()  # sorted: a GpuTimeline's ops are
    at_mark = np.searchsorted(starts, bursts)
    per_period = np.diff(at_mark)  # kernels of each whole period between two marks
    whole = WHOLE_PERIOD_KERNELS * per_period.min() if per_period.size else 0.0
    it_start = bursts
    it_end = np.r_[bursts[1:], bursts[-1] + period]
    last_end = k["end"].max()
    tail = last_end - bursts[-1]
    if not (0.85 * period <= tail <= 1.15 * period) or len(starts) - at_mark[-1] < whole:
        it_start, it_end = it_start[:-1], it_end[:-1]
    head = bursts[0] - starts[0]
    if 0.85 * period <= head <= 1.15 * period and at_mark[0] >= whole:
        it_start = np.r_[starts[0], it_start]
        it_end = np.r_[bursts[0], it_end]
    it_end = np.minimum(it_end, last_end)
    # the last whole period before a cut tail still holds part of the step cudaProfilerStop
    # ran in (mcore_gb_ep4_dpoverlap: 713 ms against 507-519), so ``mark_steady`` judges it as
    # the capture's last step
    return pd.DataFrame({"start": it_start.astype(np.int64), "end": it_end.astype(np.int64),
                         "label": [f"period {i}" for i in range(len(it_start))]})


def mark_steady(its: pd.DataFrame, open_end: bool = False) -> pd.DataFrame:
    """Step spans (start of one to start of the next) and warm-up removal.

    ``open_end``: the last iteration's end is only where its GPU work stopped (NVTX), so its
    span lacks the trailing idle a start-to-start span has; it is then used only when fewer
    than two whole steps exist.
    """
    its = its.sort_values("start").reset_index(drop=True)
    # the span of a step runs to the start of the next one, so host gaps between steps count;
    # in integers: a shift through float64 loses nanoseconds past 2**53 and overflows near 2**63
    step_end = its["end"].to_numpy(np.int64, copy=True)
    step_end[:-1] = its["start"].to_numpy(np.int64)[1:]
    its["step_end"] = step_end
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
        # the last iteration often ends with a sync/teardown tail (cudaProfilerStop's flush):
        # judge it alone, against the other steady steps (a reference that held it would let
        # a 1.33x last step through)
        if steady[-1] and steady.sum() > 2 and dur[-1] > WARMUP_FACTOR * np.median(dur[steady][:-1]):
            steady[-1] = False
    its["steady"] = steady
    its["index"] = np.arange(len(its))
    return its


def detect_iterations(gpu: GpuTimeline, regex: str | None) -> None:
    """This GPU's own iterations (NVTX, else periodicity, else the whole capture)."""
    gpu.periods = []
    its, source = nvtx_iterations(gpu, regex or DEFAULT_ITERATION_REGEX), "nvtx"
    if its.empty:
        its, source = periodic_iterations(gpu), "periodicity"
        if len(its) < 2:
            its = pd.DataFrame()
    _set_window(gpu, its, source)


def _set_window(gpu: GpuTimeline, its: pd.DataFrame, source: str) -> None:
    if its.empty:
        lo, hi = int(gpu.ops["start"].min()), int(gpu.ops["end"].max())
        its = pd.DataFrame({"start": [lo], "end": [hi], "label": ["whole capture"]})
        source = "whole"
    its = mark_steady(its, open_end=(source == "nvtx"))
    gpu.iterations = its
    gpu.window_source = source
    st = its[its["steady"]]
    gpu.window = (int(st["start"].min()), int(st["step_end"].max()))


def boundary_gaps(gpu: GpuTimeline) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the GEMM-free stretch before each steady step boundary (the window's
    end included): from the end of the last GEMM kernel started before the boundary, to the
    boundary. Every forward and backward of every micro-batch runs GEMMs, so what runs here is
    after the last backward: the gradient reduction Megatron issues once per step and the
    optimizer step (comm_groups: the per-step groups on one rank). The stretch after the
    boundary is left out: the next forward's embedding and first TP collectives run there,
    before its first GEMM."""
    o = gpu.ops
    gemm = o[(o["op"] == "kernel") & o["is_gemm"].to_numpy(bool)]
    if gemm.empty:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    bounds = np.r_[gpu.steady["start"].to_numpy(np.int64), np.int64(gpu.window[1])]
    starts = gemm["start"].to_numpy(np.int64)  # ops are sorted by start (GpuTimeline)
    # the latest end among the GEMMs started before each boundary (ends are not sorted like starts)
    ends_max = np.maximum.accumulate(gemm["end"].to_numpy(np.int64))
    before = np.searchsorted(starts, bounds)  # GEMMs started before each boundary
    has = before > 0
    last = ends_max[before[has] - 1]
    keep = last < bounds[has]  # a GEMM running across the boundary: no stretch
    return last[keep], bounds[has][keep]


def step_info(gpu) -> dict:
    """What the job's consensus needs of one GPU (compact: it travels from the workers)."""
    st = gpu.steady
    step = float(np.median(st["step_end"] - st["start"])) if gpu.window_source != "whole" else None
    return dict(source=gpu.window_source, step_ns=step, periods=list(getattr(gpu, "periods", [])),
                steady=int(len(st)))


def consensus(infos: list[dict]) -> dict | None:
    """The step of the job (ranks of one synchronous job share it): NVTX where any GPU has
    it, else the step a GPU found that most GPUs have among their candidate periods.
    None when no GPU found iterations."""
    nv = [i["step_ns"] for i in infos if i["source"] == "nvtx"]
    if nv:
        return dict(source="nvtx", period_ns=float(np.median(nv)))
    own = np.array([i["step_ns"] for i in infos if i["source"] == "periodicity"], float)
    per_gpu = [np.array([p for p, _ in i["periods"]], float) for i in infos if i["periods"]]
    if not own.size:
        return None
    # each GPU's own step is a vote; it counts the GPUs that found it among their candidate
    # periods (a rank's sub-period of the step gathers fewer); ties: the longest, as per GPU
    agree = np.array([sum(_agreeing(g, p).any() for g in per_gpu) for p in own])
    top = own[agree == agree.max()].max()
    return dict(source="periodicity", period_ns=float(np.median(own[_agreeing(own, top)])))


def takes_job_step(info: dict, job: dict | None) -> bool:
    """Whether a GPU must take the job's step: it found none, or another one (a sub-period,
    a multiple), or only periodicity where other ranks mark iterations with NVTX."""
    if job is None or info["source"] == "nvtx":
        return False
    if info["source"] == "whole" or (job["source"] == "nvtx" and info["source"] == "periodicity"):
        return True
    return abs(info["step_ns"] - job["period_ns"]) > PERIOD_TOL * job["period_ns"]


def reference_starts(gpus: list, job: dict) -> np.ndarray | None:
    """Step boundaries of the GPU that found the job's step with the most steady iterations
    (its iteration starts and last step end, on the shared clock)."""
    ok = [g for g in gpus if g.window_source == job["source"] and not takes_job_step(step_info(g), job)]
    if not ok:
        return None
    ref = max(ok, key=lambda g: len(g.steady))
    its = ref.iterations
    return np.r_[its["start"].to_numpy(), its["step_end"].to_numpy()[-1]].astype(np.int64)


def adopt_job_step(gpu: GpuTimeline, job: dict, starts: np.ndarray | None) -> None:
    """Give a GPU the job's step, phase-aligned: the reference GPU's boundaries (same clock)
    over this GPU's capture, else its own kernel that repeats at the job's period."""
    its = pd.DataFrame()
    k = gpu.ops.loc[(gpu.ops["op"] == "kernel").to_numpy(), ["start", "end"]]
    if starts is not None and len(k):
        lo, hi = int(k["start"].min()), int(k["end"].max())
        b = starts[(starts >= lo - 0.05 * job["period_ns"]) & (starts <= hi)]
        if b.size >= 2:
            its = pd.DataFrame({"start": b[:-1], "end": b[1:], "label": [f"job step {i}" for i in range(b.size - 1)]})
    if its.empty and job["source"] == "periodicity":
        its = periodic_iterations(gpu, period=job["period_ns"])
    if its.empty and gpu.window_source != "whole":
        return  # nothing to align to: it keeps its own step (missing[] names the spread)
    _set_window(gpu, its, "job")


# ---------------------------------------------------------------------------------------------
# job level

def window_section(job: Job, numbers: dict) -> dict:
    """The Diagnosis ``window``: where iterations came from and the job's step statistics."""
    per_it = [np.asarray(r.analysis.window.step_ns, float) / 1e6 for r in job.records]
    if len({len(p) for p in per_it}) == 1:  # the same iterations on every GPU
        job_steps = np.mean(np.stack(per_it), axis=0)
    else:
        job_steps = max(per_it, key=len)
    gpus = [r.gpu for r in job.records]
    return dict(source=window_source(job.records), sources={g.label: g.window_source for g in gpus},
                iterations=int(np.median([r.iterations for r in job.records])),
                # mean: the step every share and ms/step refers to (mean over GPUs of their
                # steady windows); the spread comes from the per-iteration steps
                step_ms=dict(mean=round(job.step_ms, 3), median=round(float(np.median(job_steps)), 3),
                             std=round(float(job_steps.std(ddof=1)) if len(job_steps) > 1 else 0.0, 3),
                             min=round(float(job_steps.min()), 3), max=round(float(job_steps.max()), 3),
                             per_iteration=[round(float(x), 3) for x in job_steps]),
                **job_capture_start(job.records))


def window_source(records: list[GpuRecord]) -> str:
    """Where the job's step came from: the weakest source a GPU found it by on its own
    (GPUs that took the job's step, ``job``, add none); ``whole`` if any GPU has no step."""
    own = {r.gpu.window_source for r in records} - {"job"}
    return sorted(own or {"whole"}, key=SOURCE_PREFERENCE.index)[-1]


def missing(job: Job, numbers: dict) -> list[str]:
    """When the window is weak: no step, a step some GPUs did not find, few steps, or ranks
    whose steps disagree."""
    recs = job.records
    if window_source(recs) == "whole":
        return ["iterations (no NVTX iteration ranges and no periodic kernel pattern: the whole "
                "capture was diagnosed as one window; a capture shorter than one iteration looks "
                "like this)"]
    out = []
    took = [r.gpu.label for r in recs if r.gpu.window_source == "job"]
    if took:
        out.append(f"iterations on {', '.join(took)} (not found on that GPU alone: it uses the step "
                   f"the other GPUs of the job found, at the same times)")
    n = min(r.analysis.window.iterations for r in recs)
    start = job_capture_start(recs)
    if start["capture_start"] == "process":
        k = start["iterations_before"]
        ahead = "begins at the first iteration found" if k == 0 else (
            f"follows the {'first iteration' if k == 1 else f'{k} iterations'} found before it")
        out.append(f"the run's later steps (the capture began with the process, its first CUDA call the "
                   f"runtime's start, and the steady window {ahead}: a run that goes on may settle at "
                   f"another pace, and every per-step number and price here carries its start-up. On 8 "
                   f"one-GPU runs (moe_train.py's scenarios, three Megatron configs) the iterations a "
                   f"capture of the first 8 keeps ran 0.95-1.54x (median 1.30x) their pace at iterations "
                   f"50-79, and allocator churn priced from memory_1gpu's first iterations at 12.4 ms/step "
                   f"realized 5.5 (from iterations 55-60: 7.5, realized 9.2): docs/notes.md, calls KB, LA "
                   f"and LB. Capture later steps: nsys --capture-range=cudaProfilerApi around "
                   f"torch.cuda.profiler.start()/stop(), Megatron-LM's --profile --profile-step-start N)")
    if n < MIN_STEADY:
        out.append(f"steady iterations: only {n} (per-step numbers rest on few steps; capture more)")
    steps = np.array([r.analysis.window.window_ns / max(r.iterations, 1) for r in recs], float)
    if steps.min() > 0 and steps.max() / steps.min() - 1 > PERIOD_TOL:
        out.append(f"one step for the job (GPUs' steps range {steps.min() / 1e6:.1f}-"
                   f"{steps.max() / 1e6:.1f} ms: ranks of one synchronous job should agree)")
    return out


def evidence(job: Job, numbers: dict) -> list[dict]:
    return [evidence_row("all", "step time", job.step_ms, "ms", "mean steady-state step")]


ANALYZER = Analyzer(name="iterations", about="iterations and the steady window every other analyzer measures over",
                    per_gpu_field="window", analyse=analyse, evidence=evidence, missing=missing,
                    section="window", report=window_section)
