"""Stage 1, load: schema-tolerant, read-only readers for Nsight Systems SQLite exports.

Exports from nsys 2021-2026 differ in tables and columns and any optional table can be
missing. Each reader discovers what is there (``sqlite_master``, ``PRAGMA table_info``),
picks the variant it knows, builds SQL only from identifiers on an allow-list, and returns a
DataFrame with documented columns (below), or an empty one plus an entry in ``missing``.

Columns (all times int64 ns, on the export's own clock):

- kernels: start, end, device, pid, stream, correlation, name (short name), full_name
  (demangled), grid (blocks), block (threads per block), graph_node (0 when not a graph)
- memcpy: start, end, device, pid, stream, correlation, bytes, kind (HtoD, DtoH, DtoD, PtoP,
  HtoH, other), pinned (host side is pinned memory)
- memset: start, end, device, pid, stream, correlation, bytes
- runtime: start, end, pid, tid, correlation, name (CUDA runtime/driver API, version suffix cut)
- nvtx: start, end, pid, tid, text (ranges only: push/pop and start/end; no analysis uses the
  domain, so it is not read)
- gpus: device, name, sm_count, total_memory
- gpu_metrics: timestamp, device, metric, value (SM Active, SM Issue, Tensor Active, DRAM)
- memory_events: start, pid, device, bytes (+ for allocation, - for free)

The package by concern: ``schema`` probes what an export has, ``tables`` reads each table,
``transport`` opens the file read-only and moves rows (ADBC or sqlite3), ``profile`` holds
``RawProfile`` and the column dtypes; ``load`` here puts them together.
"""
from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd

from ..errors import ProfileError
from .profile import MEMEV_COLS, SYNC_COLS, MEMSET_COLS, RawProfile, empty_frame
from .devices import read_gpu_metrics, read_gpus, read_memory_events
from .events import read_sync_events
from .schema import Schema, column_or, pid_expr, string_table
from .tables import (NVTX_EMPTY, no_runtime_rows, nvtx_empty, read_kernels,
                     no_memcpy_rows, read_memcpy, read_memset, read_meta, read_nvtx,
                     read_host_probe, read_nvtx_by_process,
                     read_runtime, read_runtime_by_process, split_by_pid)
from .transport import BUSY_TIMEOUT_S, LOADER, SQLITE_FAILURES, connect_readonly, release_memory, sqlite_problem

__all__ = ["BUSY_TIMEOUT_S", "LOADER", "SQLITE_FAILURES", "ProcessPasses", "RawProfile", "Schema",
           "connect_readonly", "load", "load_by_process"]


def load(path: str, api_names: re.Pattern | None = None) -> RawProfile:
    """Read one nsys SQLite export (read-only), every process at once.

    ``api_names``: keep only the CUDA API calls whose name matches (see ``read_runtime``).
    """
    con, schema, strings = _open(path)
    try:
        missing: list[str] = []
        try:
            frames = _read_process(path, con, schema, strings, api_names, None, missing)
            prof = RawProfile(path=path, **frames, gpus=read_gpus(con, schema, missing),
                              gpu_metrics=read_gpu_metrics(con, schema, missing), missing=missing)
            read_meta(con, schema, prof)
            prof.host_probe = read_host_probe(con, schema, strings)
        except SQLITE_FAILURES as exc:
            raise ProfileError(path, sqlite_problem(exc)) from None
        return prof
    finally:
        con.close()


class ProcessPasses:
    """The export one process at a time (iterate it: a ``RawProfile`` per process). ``all_read``:
    every process's rows were read at once (one pass per table), so a caller may work on
    several processes together without holding more rows than are already in memory."""

    def __init__(self, passes: Iterator[RawProfile], all_read: bool):
        self._passes, self.all_read = passes, all_read

    def __iter__(self) -> Iterator[RawProfile]:
        return self._passes


def load_by_process(path: str, api_names: re.Pattern | None = None,
                    pids: set[int] | None = None, one_pass: bool | None = None) -> ProcessPasses:
    """The export one process at a time: a ``RawProfile`` per process with kernels, holding
    only that process's rows, plus the file-wide GPU properties, metrics and metadata (shared
    by all).

    Two ways, the same rows (tests/test_stream.py):
    - *one pass per table* where the file's tables are small enough (``fits_one_pass``): each
      table is read once for every process and split by process in memory. SQLite has no index
      on an export, so every ``WHERE pid = ?`` is a scan of the whole table: a 4-process file
      read this way takes one scan per table instead of four.
    - *a pass per process* above that: only one or two processes' rows are in memory at once,
      whatever the file's size. The next process is read in a thread while the caller works on
      the current one when processes are small (``READ_AHEAD_MAX_BYTES``), else after it;
      freed memory goes back to the OS between processes (``release_memory``).

    Order: the first process the kernel table holds, then the others by pid. A file whose
    kernels carry no process ids (or that has no kernels) comes as one ``load``. ``pids``: only
    these processes (the re-read of the GPUs that must take the job's step). ``one_pass``:
    force a way (tests, benchmarks); None decides by size.
    """
    if one_pass is None:
        one_pass = fits_one_pass(path)
    return ProcessPasses((_by_process_one_pass if one_pass else _by_process_passes)(path, api_names, pids),
                         one_pass)


# The one-pass way holds every process's rows at once: it is taken where the tables have at
# most this many rows (largest rowid, no scan); the CUDA API calls are counted apart
# (ONE_PASS_API_ROWS) because the loader keeps only ~30% of them. Basis: the 1 GB 4-GPU export
# (5.4M kernel, copy, memset and NVTX rows; 13.5M API calls) peaks at 1311-1324 MiB read this way
# with two processes analysed at once, ~0.2 GiB of it the interpreter and libraries; in
# proportion, 7M rows and 16M API calls come to ~1.7 GiB, under the 2 GiB bound (bench/RESULTS.md,
# fifth session). The 4 GB export (23.6M rows) takes a pass per process
ONE_PASS_ACTIVITY_ROWS = 7_000_000
_ACTIVITY_TABLES = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
                    "NVTX_EVENTS", "CUDA_GPU_MEMORY_USAGE_EVENTS")


def fits_one_pass(path: str) -> bool:
    """Whether ``load_by_process`` reads ``path`` one pass per table (see ONE_PASS_*)."""
    con, schema, _ = _open(path)
    try:
        return (sum(_table_rows(con, schema, t) for t in _ACTIVITY_TABLES) <= ONE_PASS_ACTIVITY_ROWS
                and _table_rows(con, schema, "CUPTI_ACTIVITY_KIND_RUNTIME") <= ONE_PASS_API_ROWS)
    finally:
        con.close()


def _by_process_one_pass(path: str, api_names: re.Pattern | None, pids: set[int] | None) -> Iterator[RawProfile]:
    con, schema, strings = _open(path)
    try:
        if not _has_process_ids(schema):
            yield load(path, api_names)
            return
        missing: list[str] = []
        try:
            parts = _read_every_process(path, con, schema, strings, api_names, missing)
            if not parts:
                yield load(path, api_names)
                return
            rows = [(p, d) for p, frames in parts.items() for d in np.unique(frames["kernels"]["device"])]
            shared = _shared(con, schema, strings, path, rows)
        except SQLITE_FAILURES as exc:
            raise ProfileError(path, sqlite_problem(exc)) from None
        order = list(parts)  # the first process in the kernel table first, then by pid
        for p in order:
            frames = parts.pop(p)  # nothing here holds a process's rows once the caller drops them
            if pids is None or p in pids:
                yield _with_shared(shared, frames, list(missing))
    finally:
        con.close()


def _read_every_process(path, con, schema, strings, api_names, missing) -> dict[int, dict]:
    """{pid: its tables} for every process with kernels, each table read in one pass for all
    processes and split: the kernels here, the CUDA API calls in one thread and the copies,
    memsets, NVTX ranges and memory events in another, each on a connection of its own (SQLite
    and the Arrow transfer run without the GIL)."""
    with ThreadPoolExecutor(2) as pool:
        calls = pool.submit(_read_runtime_all, path, api_names, None)
        rest = pool.submit(_read_apart, path, _copies_nvtx_and_memory_events)
        kernels = read_kernels(con, schema, strings, missing, None)
        if kernels.empty:
            return {}
        first = int(kernels["pid"].iat[0])
        # (parts by pid, what a pass of its own gives a process without rows)
        tables = dict(kernels=(split_by_pid(kernels), None))
        del kernels
        (copies, copies_missing, marks), marks_missing = rest.result()
        by_pid, runtime_missing = calls.result()
    tables.update(copies)
    tables["runtime"] = ((by_pid, no_runtime_rows()) if isinstance(by_pid, dict)
                         else ({}, by_pid))  # no usable API calls: the same empty frame for each
    tables.update(marks)
    # in the order a pass per process reports them: kernels, copies, API calls, NVTX, memory
    missing.extend(copies_missing + runtime_missing + marks_missing)
    parts = {}
    for p in [first] + sorted(set(tables["kernels"][0]) - {first}):
        parts[p] = {t: by.pop(p) if p in by else none.copy() for t, (by, none) in tables.items()}
    return parts


def _copies_nvtx_and_memory_events(con, schema, strings, missing):
    """Copies, memsets, NVTX ranges and memory events of every process, one pass each, split by
    process: {table: (parts, what a process without rows gets)} of the copies, what they miss
    (apart: it is reported before the API calls'), and the same of the rest."""
    copies_missing: list[str] = []
    copies = dict(memcpy=(split_by_pid(read_memcpy(con, schema, copies_missing, None)), no_memcpy_rows()),
                  memset=(split_by_pid(read_memset(con, schema, copies_missing, None)), empty_frame(MEMSET_COLS)))
    marks = dict(nvtx=read_nvtx_by_process(con, schema, strings, missing),
                 memory_events=(split_by_pid(read_memory_events(con, schema, missing, None)),
                                empty_frame(MEMEV_COLS)),
                 sync_events=(split_by_pid(read_sync_events(con, schema, missing, None)), empty_frame(SYNC_COLS)))
    return copies, copies_missing, marks


def _read_apart(path: str, read):
    """``read(con, schema, strings, missing)`` on a connection of its own: (result, missing)."""
    con = connect_readonly(path)
    try:
        schema = Schema(con)
        missing: list[str] = []
        try:
            return read(con, schema, string_table(con, schema), missing), missing
        except SQLITE_FAILURES as exc:
            raise ProfileError(path, sqlite_problem(exc)) from None
    finally:
        con.close()


def _by_process_passes(path: str, api_names: re.Pattern | None, pids: set[int] | None) -> Iterator[RawProfile]:
    con, schema, strings = _open(path)
    try:
        with ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(1) as apart:
            try:
                scan = _process_scan(con, schema)
                first = scan.fetchone() if scan is not None else None
                if first is None:
                    yield load(path, api_names)
                    return
                # the first process reads its own API calls; the others' come from one pass
                # beside it, where they are few (else one pass per process)
                ahead = pool.submit(_read_one_process, path, api_names, int(first[0]))
                calls = None
                if _table_rows(con, schema, "CUPTI_ACTIVITY_KIND_RUNTIME") <= ONE_PASS_API_ROWS:
                    calls = apart.submit(_read_runtime_all, path, api_names, int(first[0]))
                rows = [first, *scan.fetchall()]  # sqlite3 steps without the GIL: beside that read
                shared = _shared(con, schema, strings, path, rows)
            except SQLITE_FAILURES as exc:
                raise ProfileError(path, sqlite_problem(exc)) from None
            others = sorted({int(p) for p, _ in rows} - {int(first[0])})
            if pids is not None:
                others = [p for p in others if p in pids]
                if int(first[0]) not in pids:  # read beside the scan before the pids were known
                    if not others:
                        return
                    ahead = pool.submit(_read_one_process, path, api_names, others.pop(0), calls)
            for nxt in others + [None]:
                frames, missing = ahead.result()
                ahead = None
                if nxt is not None and _nbytes(frames) <= READ_AHEAD_MAX_BYTES:
                    ahead = pool.submit(_read_one_process, path, api_names, nxt, calls)  # while the caller works
                yield _with_shared(shared, frames, missing)
                release_memory()  # the caller is done with that process
                if nxt is not None and ahead is None:
                    ahead = pool.submit(_read_one_process, path, api_names, nxt, calls)
    finally:
        con.close()


# The next process is read while the caller works on the current one only when the current
# one's tables (the size to expect of the next) take at most this much: a process of a 1 GB
# 4-GPU export (~130 MiB) is read ahead, one of a 4 GB export (~510 MiB) after the one before
# it is done (its analysis holds ~1.3 GiB; both at once would pass 2 GiB)
READ_AHEAD_MAX_BYTES = 256 * 2**20


def _nbytes(frames: dict) -> int:
    return int(sum(df.memory_usage(index=False).sum() for df in frames.values() if df is not None))


def _shared(con, schema: Schema, strings: str | None, path: str, rows: list) -> RawProfile:
    """What every process's pass shares: GPU properties and metrics, metadata, whether the
    file has NVTX ranges at all, and (as ``kernels``) every device with kernels."""
    devices = pd.DataFrame({"device": pd.Series(sorted({int(d) for _, d in rows}), dtype="int64")})
    shared = RawProfile(path=path, kernels=devices, memcpy=None, memset=None, runtime=None, nvtx=None,
                        gpus=None, gpu_metrics=None, memory_events=None)
    shared.gpus = read_gpus(con, schema, shared.missing)
    shared.gpu_metrics = read_gpu_metrics(con, schema, shared.missing)
    if nvtx_empty(con, schema, strings):  # a pass sees only its own process's ranges
        shared.missing.append(NVTX_EMPTY)
    read_meta(con, schema, shared)
    shared.host_probe = read_host_probe(con, schema, strings)
    return shared


def _with_shared(shared: RawProfile, frames: dict, missing: list[str]) -> RawProfile:
    # popped out of the read's result, so nothing here holds this process's rows after the caller drops them
    prof = RawProfile(path=shared.path, **{k: frames.pop(k) for k in list(frames)}, gpus=shared.gpus,
                      gpu_metrics=shared.gpu_metrics,
                      command=list(shared.command), env=dict(shared.env), nsys_version=shared.nsys_version,
                      session_start_ns=shared.session_start_ns, host_probe=shared.host_probe,
                      missing=missing + [m for m in shared.missing if m not in missing],
                      file_devices=shared.kernels)
    return prof


def _open(path: str):
    try:
        con = connect_readonly(path)
    except sqlite3.Error as exc:
        raise ProfileError(path, f"cannot open as SQLite ({exc})") from None
    try:
        schema = Schema(con)
        if not schema.tables:
            raise ProfileError(path, "not an Nsight Systems export (no nsys tables)")
        return con, schema, string_table(con, schema)
    except SQLITE_FAILURES as exc:
        con.close()
        raise ProfileError(path, sqlite_problem(exc)) from None
    except ProfileError:
        con.close()
        raise


def _has_process_ids(schema: Schema) -> bool:
    return schema.has("CUPTI_ACTIVITY_KIND_KERNEL", "start", "end", "globalPid")


def _process_scan(con, schema: Schema):
    """A cursor over the distinct (process, device) pairs with kernels (as ``read_kernels``
    keeps them), or None where the kernel table has no process ids."""
    T = "CUPTI_ACTIVITY_KIND_KERNEL"
    if not _has_process_ids(schema):
        return None
    dev = column_or(schema.columns[T], "deviceId", "k")
    return con.execute(f"SELECT DISTINCT {pid_expr('k.globalPid')}, {dev} FROM {schema.t(T)} k "
                       "WHERE k.end >= k.start")


def _read_one_process(path: str, api_names: re.Pattern | None, pid: int, calls=None) -> tuple[dict, list[str]]:
    """One process's tables on a connection of its own (the look-ahead thread); ``calls``:
    every process's API calls read in one pass (a future), else they are read for this one."""
    con, schema, strings = _open(path)
    try:
        missing: list[str] = []
        try:
            return _read_process(path, con, schema, strings, api_names, pid, missing, calls), missing
        except SQLITE_FAILURES as exc:
            raise ProfileError(path, sqlite_problem(exc)) from None
    finally:
        con.close()


def _read_process(path, con, schema, strings, api_names, pid, missing, calls=None) -> dict:
    """The per-process tables (all processes with ``pid`` None). The two biggest are read at
    once: the CUDA API calls on a second read-only connection in a thread (SQLite and the
    Arrow transfer run without the GIL), or taken from ``calls`` (see ``_read_one_process``)."""
    with ThreadPoolExecutor(1) as pool:
        runtime_job = pool.submit(_read_runtime_apart, path, api_names, pid) if calls is None else None
        frames = dict(kernels=read_kernels(con, schema, strings, missing, pid),
                      memcpy=read_memcpy(con, schema, missing, pid), memset=read_memset(con, schema, missing, pid))
        frames["runtime"], runtime_missing = (runtime_job.result() if calls is None
                                              else _calls_of(calls.result(), pid))
    missing.extend(runtime_missing)
    frames["nvtx"] = read_nvtx(con, schema, strings, missing, pid)
    frames["memory_events"] = read_memory_events(con, schema, missing, pid)
    frames["sync_events"] = read_sync_events(con, schema, missing, pid)
    return frames


# the API calls are read in one pass (and split by process in memory; in the pass-per-process
# way, those of every process but the first) where the table has at most this many rows, of
# which the loader keeps ~30% (launch, allocator and sync calls): two scans of the table
# instead of one per process (1 GB 4-GPU export, 13.5M rows: wall 7.7-7.9 -> 7.2-7.3 s, peak
# RSS +240 MiB); above it (4 GB: 54M rows), one pass per process keeps memory bounded
ONE_PASS_API_ROWS = 16_000_000


def _table_rows(con, schema: Schema, table: str) -> float:
    """About how many rows ``table`` has (its largest rowid: no scan); inf when unknown."""
    if table not in schema.tables:
        return 0
    try:
        row = con.execute(f"SELECT max(rowid) FROM {schema.t(table)}").fetchone()
    except SQLITE_FAILURES:
        return float("inf")
    return 0 if not row or row[0] is None else row[0]  # no row: an empty table


def _read_runtime_all(path: str, api_names: re.Pattern | None,
                      other_than: int | None) -> tuple[dict | pd.DataFrame, list[str]]:
    """``read_runtime_by_process`` (every process but ``other_than``) on a connection of its own."""
    return _read_apart(path, lambda con, schema, strings, missing: read_runtime_by_process(
        con, schema, strings, missing, api_names, other_than))


def _calls_of(calls: tuple, pid: int) -> tuple[pd.DataFrame, list[str]]:
    """One process's share of ``_read_runtime_all``, as ``_read_runtime_apart`` would give it."""
    by_pid, missing = calls
    if isinstance(by_pid, pd.DataFrame):  # nothing to read: the same empty frame for each
        return by_pid.copy(), list(missing)
    df = by_pid.pop(pid, None)  # each process's calls are taken once
    return (no_runtime_rows() if df is None else df), list(missing)


def _read_runtime_apart(path: str, api_names: re.Pattern | None,
                        pid: int | None) -> tuple[pd.DataFrame, list[str]]:
    """``read_runtime`` on a connection of its own (for the loader's second thread)."""
    return _read_apart(path, lambda con, schema, strings, missing: read_runtime(
        con, schema, strings, missing, api_names, pid))
