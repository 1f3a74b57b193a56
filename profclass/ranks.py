"""Per-file work and the compact per-rank summaries the cross-rank steps need.

Everything up to the features (load -> timeline -> iterations -> features) depends on one
file alone, so it runs per file: in this process, in ``--jobs N`` local processes, or on a
Dask distributed cluster (``--scheduler ADDRESS`` or ``local``). A worker returns a
``FileSummary``, never the DataFrames it read: per GPU the features, the steady window and
iterations, the communication kernels (start, end, collective: for clock alignment and
collective matching), the compute interval set (for exposed waiting) and the per-kernel
table rows; per file the metadata the job-level checks read. That is kilobytes to a few MB
per rank where the export is gigabytes.

Per-file work runs on the file's own clock. Clock alignment later shifts a summary's times
(``GpuSummary.shift``); iterations and features do not depend on the clock origin.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import pandas as pd

from . import intervals as iv
from .errors import ProfileError
from .features import ALLOC_CALLS, SYNC_CALLS, GpuFeatures, compute_features
from .kernel_table import gpu_kernel_agg
from .load import load
from .timeline import LAUNCH_CALLS, GpuTimeline, build_ops, detect_iterations, iter_gpus

# the CUDA API calls any later stage reads (launches for the launch join, allocator and sync
# calls for the idle split, graph launches): the loader keeps only these (filtered in SQLite)
API_CALLS_USED = re.compile("|".join(f"(?:{p.pattern})" for p in (LAUNCH_CALLS, ALLOC_CALLS, SYNC_CALLS)))
# the columns of all ops that the job-level configuration reads (distinct rows suffice)
CONFIG_COLUMNS = ["is_comm", "library", "collective", "is_fp8"]
COMM_COLUMNS = ["start", "end", "op", "is_comm", "collective", "launch_start", "launch_end"]


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

    ``ops`` holds only the communication kernels; ``runtime`` and ``nvtx`` are empty.
    """

    source: int
    path: str
    pid: int
    device: int
    rank: int | None
    window: tuple[int, int]
    window_source: str
    iterations: pd.DataFrame
    features: GpuFeatures
    ops: pd.DataFrame
    compute: iv.IntervalSet  # compute kernels over the whole capture
    kernel_agg: pd.DataFrame  # per (full_name, op) in the window: count, ns (see kernel_table)
    runtime: pd.DataFrame = field(default_factory=lambda: pd.DataFrame({"start": [], "end": []}))
    nvtx: pd.DataFrame = field(default_factory=lambda: pd.DataFrame({"start": [], "end": []}))
    # the full timeline, only when it stays in this process (diagnose(keep_timelines=True))
    timeline: GpuTimeline | None = None

    label = GpuTimeline.label
    steady = GpuTimeline.steady

    def on_shift(self, off: int) -> None:
        """Clock alignment moved ``ops`` by ``off``: move every other time of this GPU too."""
        self.window = (self.window[0] + off, self.window[1] + off)
        self.iterations = _shift_iterations(self.iterations, off)
        self.compute = (self.compute[0] + off, self.compute[1] + off)
        if self.timeline is not None:
            from .comm import _shift
            tl = self.timeline
            _shift(tl, off)
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
                      keep_timelines: bool = False) -> FileSummary:
    """load -> timeline -> iterations -> features for one loaded export."""
    ops = build_ops(prof)
    config_ops = ops[CONFIG_COLUMNS].astype({"library": str, "collective": str}).drop_duplicates()
    # the per-table frames are in ops now; features read only these small ones of the profile
    prof.kernels = prof.kernels[["device"]].drop_duplicates()
    prof.memcpy = prof.memset = prof.memcpy.iloc[:0]
    gpus = []
    for g in iter_gpus(prof, source, ops):
        detect_iterations(g, iteration_regex)
        feats = compute_features(g, prof)
        o = g.ops
        comp = o[(o["op"] == "kernel") & ~o["is_comm"]]
        comm = o[o["is_comm"] & (o["op"] == "kernel")]
        gpus.append(GpuSummary(
            source=source, path=g.path, pid=g.pid, device=g.device, rank=g.rank, window=g.window,
            window_source=g.window_source, iterations=g.iterations, features=feats,
            ops=comm[COMM_COLUMNS].reset_index(drop=True),
            compute=iv.union(comp["start"].to_numpy(), comp["end"].to_numpy()),
            kernel_agg=gpu_kernel_agg(g.ops, g.window),
            timeline=g if keep_timelines else None))
        del g, o, comp, comm  # one GPU's rows at a time
    del ops
    meta = ProfileMeta(path=prof.path, command=list(prof.command), env=dict(prof.env),
                       nsys_version=prof.nsys_version, session_start_ns=prof.session_start_ns,
                       missing=list(prof.missing), gpus=prof.gpus.copy())
    return FileSummary(meta=meta, gpus=gpus, config_ops=config_ops.reset_index(drop=True))


def summarise_file(given: str, sqlite: str | None, source: int, iteration_regex: str | None,
                   keep_timelines: bool = False) -> FileSummary:
    """The per-file task. ``sqlite`` is the resolved export when this process can read it;
    a worker on another machine (where a decompressed temporary copy does not exist)
    resolves ``given`` itself."""
    if sqlite and os.path.exists(sqlite):
        return _summarise_sqlite(given, sqlite, source, iteration_regex, keep_timelines)
    from .inputs import resolve
    with resolve([given]) as files:
        if len(files) != 1:
            raise ProfileError(given, f"expected one export, found {len(files)}")
        return _summarise_sqlite(given, files[0].sqlite, source, iteration_regex, keep_timelines)


def _summarise_sqlite(given, sqlite, source, iteration_regex, keep_timelines) -> FileSummary:
    try:
        prof = load(sqlite, api_names=API_CALLS_USED)
    except ProfileError as exc:  # name what the user gave, not a decompressed temp copy
        raise ProfileError(given, exc.problem) from None
    prof.path = given
    return summarise_profile(prof, source, iteration_regex, keep_timelines)


def _task(args) -> FileSummary:
    return summarise_file(*args)


def summarise_files(files, iteration_regex: str | None = None, jobs: int = 1,
                    scheduler: str | None = None, keep_timelines: bool = False,
                    progress=None) -> list[FileSummary]:
    """Summaries of every resolved input file, in input order.

    ``jobs`` > 1: that many local worker processes. ``scheduler``: a Dask distributed
    scheduler address (``tcp://host:8786``) or ``local`` (a LocalCluster on this machine with
    ``jobs`` workers). Timelines are kept only in the single-process run.
    """
    tasks = [(f.given, f.sqlite, src, iteration_regex) for src, f in enumerate(files)]
    if scheduler:
        return _on_dask(tasks, scheduler, jobs, progress)
    if jobs > 1 and len(tasks) > 1:
        import concurrent.futures as cf
        import multiprocessing as mp
        # spawn, not fork: the parent may hold threads (Arrow, BLAS) that fork would copy mid-lock
        with cf.ProcessPoolExecutor(max_workers=min(jobs, len(tasks)),
                                    mp_context=mp.get_context("spawn")) as pool:
            out = []
            for i, s in enumerate(pool.map(_task, tasks)):
                if progress:
                    progress(f"summarised {files[i].given}", (i + 1) / len(files))
                out.append(s)
            return out
    out = []
    for src, f in enumerate(files):
        if progress:
            progress(f"loading {f.given}", src / len(files))
        out.append(summarise_file(f.given, f.sqlite, src, iteration_regex, keep_timelines))
    return out


def _on_dask(tasks, scheduler: str, jobs: int, progress) -> list[FileSummary]:
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise ProfileError("--scheduler", "needs Dask distributed: pip install 'profclass[dask]'") from None
    cluster = None
    if scheduler == "local":
        cluster = LocalCluster(n_workers=max(jobs, 1), threads_per_worker=1, processes=True,
                               dashboard_address=None)
        client = Client(cluster)
    else:
        try:
            client = Client(scheduler, timeout="30s")
        except (OSError, TimeoutError) as exc:
            raise ProfileError("--scheduler", f"cannot reach Dask scheduler {scheduler} ({exc})") from None
    try:
        if progress:
            progress(f"running {len(tasks)} file(s) on Dask ({scheduler})")
        futures = client.map(_task, tasks, pure=False)
        return client.gather(futures)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
