"""Per-file work and the compact per-rank summaries the cross-rank steps need.

Everything up to the per-GPU analyzers (load -> timeline -> iterations -> analyzers)
depends on one file alone, so it runs per file (where: ``profclass.workers``). It returns a
``FileSummary``, never the DataFrames it read: per GPU the analyzer results, the steady window and
iterations, the communication kernels (start, end, collective: for clock alignment and
collective matching), the compute interval set (for exposed waiting) and the per-kernel
table rows; per file the metadata the job-level checks read. That is kilobytes to a few MB
per rank where the export is gigabytes.

Per-file work runs on the file's own clock. Clock alignment later shifts a summary's times
(``GpuSummary.on_shift``); iterations and analyzer results do not depend on the clock origin.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from . import intervals as iv
from .analyzers import GpuAnalysis, analyse_gpu
from .analyzers import idle
from .analyzers.idle import ALLOC_CALLS, SYNC_CALLS
from .analyzers.host import KERNEL_LOAD_CALLS, KERNEL_SETUP_CALLS
from .analyzers.compute import sm_count_of
from .analyzers.memory import MIN_RECOMPUTE_RATIO
from .analyzers import iterations as it
from .analyzers.capture_start import CAPTURE_START_CALLS, capture_start
from .clocks import shift_timeline
from .errors import ProfileError
from .analyzers.nccl_ranges import nccl_alltoall_peers
from .kernel_table import gpu_kernel_agg
from .load import load_by_process
from .replay.trace import GpuTrace
from .replay.trace import build as replay_trace
from .timeline import LAUNCH_CALLS, GpuTimeline, build_ops, in_forward, iter_gpus

# the CUDA API calls any later stage reads (launches for the launch join, allocator and sync
# calls for the idle split, graph launches, a library's kernel loads for the host analyzer and
# the replay): the loader keeps only these (filtered in SQLite)
API_CALLS_USED = re.compile("|".join(f"(?:{p.pattern})" for p in (LAUNCH_CALLS, ALLOC_CALLS, SYNC_CALLS,
                                                                KERNEL_LOAD_CALLS, KERNEL_SETUP_CALLS,
                                                                CAPTURE_START_CALLS)))
# the columns of all ops that the job-level configuration reads (distinct rows suffice)
CONFIG_COLUMNS = ["is_comm", "library", "collective", "is_fp8"]
# the columns of the CUDA event rows that replay.trace._event_edges reads (not their times
# or device: a 4 GB export's process holds 2M such rows)
SYNC_EDGE_COLUMNS = ["kind", "pid", "stream", "event", "correlation"]
# processes of one export analysed at once where the loader read them all in one pass
ANALYSIS_THREADS = 2
# name, grid and block: NCCL's kernel (protocol, type) and channel count, its size class
# (matching._lone_waits)
COMM_COLUMNS = ["start", "end", "op", "is_comm", "collective", "stream", "launch_start", "launch_end",
                "name", "grid", "block"]


@dataclass
class ProfileMeta:
    """What the job-level steps read of a file (``RawProfile`` without its tables)."""

    path: str
    command: list[str]
    env: dict[str, str]
    nsys_version: str
    session_start_ns: int | None
    missing: list[str]
    gpus: pd.DataFrame  # device, name, sm_count, total_memory


@dataclass
class GpuSummary:
    """One GPU after the per-file stages; stands in for a ``GpuTimeline`` in the cross-rank steps.

    ``ops`` holds only the communication kernels; no API calls or NVTX ranges are kept.
    """

    source: int
    path: str
    pid: int
    device: int
    rank: int | None
    window: tuple[int, int]
    window_source: str
    iterations: pd.DataFrame
    analysis: GpuAnalysis
    ops: pd.DataFrame
    compute: iv.IntervalSet  # compute kernels over the whole capture
    kernel_agg: pd.DataFrame  # per (full_name, op) in the window: count, ns (see kernel_table)
    kernels_total: int = 0  # kernels in the whole capture (layout_infer: one program or two)
    alltoall_peers: int | None = None  # torch's all-to-all group size from NCCL's NVTX (layout_infer)
    # (starts, ends) of the host's waits for this GPU in the window (idle.host_waits)
    host_waits: tuple = field(default_factory=lambda: (np.zeros(0, np.int64), np.zeros(0, np.int64)))
    # (starts, ends) of the GEMM-free stretches before its step boundaries (iterations.boundary_gaps)
    boundary_gaps: tuple = field(default_factory=lambda: (np.zeros(0, np.int64), np.zeros(0, np.int64)))
    step: dict = field(default_factory=dict)  # iterations.step_info, found on this GPU alone
    shift_ns: int = 0  # total clock shift applied (own clock = shared clock - shift_ns)
    # the steady window as the replay's dependency graph parts (profclass.replay.trace)
    replay_trace: GpuTrace | None = None
    # the full timeline, only when it stays in this process (diagnose(keep_timelines=True))
    timeline: GpuTimeline | None = None

    label = GpuTimeline.label
    steady = GpuTimeline.steady

    def on_shift(self, off: int) -> None:
        """Clock alignment moved ``ops`` by ``off``: move every other time of this GPU too."""
        self.shift_ns += off
        self.window = (self.window[0] + off, self.window[1] + off)
        self.iterations = _shift_iterations(self.iterations, off)
        self.compute = (self.compute[0] + off, self.compute[1] + off)
        self.host_waits = (self.host_waits[0] + off, self.host_waits[1] + off)
        self.boundary_gaps = (self.boundary_gaps[0] + off, self.boundary_gaps[1] + off)
        if self.timeline is not None:
            tl = self.timeline
            shift_timeline(tl, off)
            tl.window = self.window
            tl.iterations = self.iterations


@dataclass
class FileSummary:
    meta: ProfileMeta
    gpus: list[GpuSummary]
    config_ops: pd.DataFrame


def _shift_iterations(its: pd.DataFrame, off: int) -> pd.DataFrame:
    its = its.copy()
    for c in ("start", "end", "step_end"):
        if c in its:
            its[c] = its[c] + off
    return its


def summarise_profile(prof, source: int, iteration_regex: str | None,
                      keep_timelines: bool = False, forced: dict | None = None) -> FileSummary:
    """timeline -> iterations -> per-GPU analyzers for one loaded export.

    Iterations first on every GPU alone, then the step the file's GPUs agree on
    (``iterations.consensus``); ``forced`` ((pid, device) -> (job step, boundaries on this
    file's clock)) is the job's step from the facade when other files disagreed."""
    ops = build_ops(prof)
    # distinct rows first: text of a few rows, not of every op (the same rows either way)
    config_ops = (ops[CONFIG_COLUMNS].drop_duplicates().astype({"library": str, "collective": str})
                  .drop_duplicates())
    # the per-table frames are in ops now; analyzers read only these small ones of the profile
    prof.kernels = (prof.file_devices if prof.file_devices is not None
                    else prof.kernels[["device"]].drop_duplicates())
    # (copies of no rows: a slice of no rows would keep the whole table's arrays alive)
    prof.memcpy = prof.memset = prof.memcpy.iloc[:0].copy()
    if prof.sync_events is not None:  # only the columns the replay's event edges read are held
        prof.sync_events = prof.sync_events[[c for c in SYNC_EDGE_COLUMNS if c in prof.sync_events]]
    own = {}  # (pid, device) -> (iterations, source, marker, periods, step_info): one GPU at a time
    reuse = {}  # a one-GPU pass: its sorted API calls and NVTX ranges, for the second loop
    for g in iter_gpus(prof, source, ops, reuse):
        it.detect_iterations(g, iteration_regex)
        own[(g.pid, g.device)] = _found(g)
        del g  # else the last GPU's copies live on beside the next loop's first
    if reuse:  # the second loop takes the GPU's own copies: the process's frames are not read again
        prof.runtime, prof.nvtx = prof.runtime.iloc[:0].copy(), prof.nvtx.iloc[:0].copy()
    job = it.consensus([f[4] for f in own.values()])
    ref = _file_reference(own, job)
    gpus = []
    for g in iter_gpus(prof, source, ops, reuse):
        _restore(g, own[(g.pid, g.device)])
        step = own[(g.pid, g.device)][4]
        if forced and (g.pid, g.device) in forced:
            it.adopt_job_step(g, *forced[(g.pid, g.device)])
        elif it.takes_job_step(step, job):
            it.adopt_job_step(g, job, ref)
        gpus.append(_summarise_gpu(g, prof, source, step, keep_timelines))
        del g  # one GPU's rows at a time
    del ops
    meta = ProfileMeta(path=prof.path, command=list(prof.command), env=dict(prof.env),
                       nsys_version=prof.nsys_version, session_start_ns=prof.session_start_ns,
                       missing=list(prof.missing), gpus=prof.gpus.copy())
    return FileSummary(meta=meta, gpus=gpus, config_ops=config_ops.reset_index(drop=True))


def _found(g: GpuTimeline) -> tuple:
    # the summary's ``step``: with where the export began the process, read while its API calls are held
    return (g.iterations, g.window_source, g.marker, list(getattr(g, "periods", [])),
            dict(it.step_info(g), capture_start=capture_start(g)))


def _restore(g: GpuTimeline, found: tuple) -> None:
    g.iterations, g.window_source, g.marker, g.periods = found[:4]
    st = g.steady
    g.window = (int(st["start"].min()), int(st["step_end"].max()))


def _file_reference(own: dict, job: dict | None):
    """Step boundaries of this file's GPU that found the job's step (one clock per file)."""
    if job is None:
        return None
    holders = [_Found(*f[:2]) for f in own.values()]
    return it.reference_starts(holders, job)


@dataclass
class _Found:
    """Just what ``iterations.reference_starts`` reads of a GPU."""
    iterations: pd.DataFrame
    window_source: str
    steady = GpuTimeline.steady


def _summarise_gpu(g: GpuTimeline, prof, source: int, step: dict, keep_timelines: bool) -> GpuSummary:
    analysis = analyse_gpu(g, prof)
    o = g.ops
    is_kernel, is_comm = (o["op"] == "kernel").to_numpy(), o["is_comm"].to_numpy(bool)
    comp = o.loc[is_kernel & ~is_comm, ["start", "end"]]  # the columns read: no copy of the others
    comm = o.loc[is_kernel & is_comm, COMM_COLUMNS].assign(in_forward=in_forward(o, is_kernel & is_comm))
    return GpuSummary(
        source=source, path=g.path, pid=g.pid, device=g.device, rank=g.rank, window=g.window,
        window_source=g.window_source, iterations=g.iterations, analysis=analysis,
        ops=comm.reset_index(drop=True),
        compute=iv.union(comp["start"].to_numpy(), comp["end"].to_numpy()),
        kernel_agg=gpu_kernel_agg(g.ops, g.window), kernels_total=int(is_kernel.sum()), step=step,
        alltoall_peers=nccl_alltoall_peers(g.nvtx),
        host_waits=idle.host_waits(g), boundary_gaps=it.boundary_gaps(g),
        replay_trace=replay_trace(g, prof.sync_events,
                                  recomputes=analysis.memory.recompute_ratio >= MIN_RECOMPUTE_RATIO,
                                  sm_count=sm_count_of(g, prof)),
        timeline=g if keep_timelines else None)


def summarise_file(given: str, sqlite: str | None, source: int, iteration_regex: str | None,
                   keep_timelines: bool = False, forced: dict | None = None) -> FileSummary:
    """The per-file task. ``sqlite`` is the resolved export when this process can read it;
    a worker on another machine (where a decompressed temporary copy does not exist)
    resolves ``given`` itself."""
    if sqlite and os.path.exists(sqlite):
        return _summarise_sqlite(given, sqlite, source, iteration_regex, keep_timelines, forced)
    from .inputs import resolve
    with resolve([given]) as files:
        if len(files) != 1:
            raise ProfileError(given, f"expected one export, found {len(files)}")
        return _summarise_sqlite(given, files[0].sqlite, source, iteration_regex, keep_timelines, forced)


def _summarise_sqlite(given, sqlite, source, iteration_regex, keep_timelines, forced=None) -> FileSummary:
    """One export, one process at a time (``load_by_process``): peak memory follows the
    largest process, not the file; the per-process summaries are joined as one file's.
    ``forced`` is keyed by (pid, device), so each process takes its own GPUs' entries, and
    only the processes it names are read again."""
    pids = {pid for pid, _ in forced} if forced else None

    def summarise(prof):
        prof.path = given
        return summarise_profile(prof, source, iteration_regex, keep_timelines, forced)

    try:
        passes = load_by_process(sqlite, api_names=API_CALLS_USED, pids=pids)
        if passes.all_read:
            # every process's rows are in memory already: two at a time (numpy's sorts and
            # searches run without the GIL: 1.4x on 2 cores, bench/RESULTS.md), in file order
            with ThreadPoolExecutor(ANALYSIS_THREADS) as pool:
                parts = list(pool.map(summarise, passes))
        else:
            parts = [summarise(prof) for prof in passes]
    except ProfileError as exc:  # name what the user gave, not a decompressed temp copy
        raise ProfileError(given, exc.problem) from None
    if len(parts) == 1:
        return parts[0]
    meta = parts[0].meta
    meta.missing = list(dict.fromkeys(m for p in parts for m in p.meta.missing))
    config_ops = pd.concat([p.config_ops for p in parts], ignore_index=True).drop_duplicates()
    # in (pid, device) order, as one pass over the whole file gives them
    gpus = sorted((g for p in parts for g in p.gpus), key=lambda g: (g.pid, g.device))
    return FileSummary(meta=meta, gpus=gpus, config_ops=config_ops.reset_index(drop=True))


def assign_ranks(gpus: list[GpuSummary], profiles: list[ProfileMeta], hints) -> None:
    """Each GPU's rank: the captured RANK of its report, else the rank in the file name
    (``hints``), else (report, device) order; duplicates are renumbered in rank order."""
    sources = sorted({g.source for g in gpus})
    if len(sources) > 1:  # one report per rank: the captured RANK, else the file name
        for g in gpus:
            env_rank = profiles[g.source].env.get("RANK")
            if env_rank is not None and str(env_rank).isdigit():
                g.rank = int(env_rank)
            elif hints[g.source] is not None:
                g.rank = hints[g.source]
    if any(g.rank is None for g in gpus):
        # one report holding every rank (torchrun on one node: rank follows the device), or
        # no better source: by (report, device) order
        order = sorted(range(len(gpus)), key=lambda i: (gpus[i].source, gpus[i].device, gpus[i].pid))
        for r, i in enumerate(order):
            gpus[i].rank = r
    ranks = [g.rank for g in gpus]
    if len(set(ranks)) != len(ranks):
        for r, i in enumerate(sorted(range(len(gpus)), key=lambda i: (ranks[i], gpus[i].source))):
            gpus[i].rank = r
