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
- nvtx: start, end, pid, tid, text, domain (ranges only: push/pop and start/end)
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
from concurrent.futures import ThreadPoolExecutor

import pandas as pd

from ..errors import ProfileError
from .profile import RawProfile
from .schema import Schema, string_table
from .tables import (read_gpu_metrics, read_gpus, read_kernels, read_memcpy, read_memory_events, read_memset,
                     read_meta, read_nvtx, read_runtime)
from .transport import BUSY_TIMEOUT_S, LOADER, SQLITE_FAILURES, connect_readonly, sqlite_problem

__all__ = ["BUSY_TIMEOUT_S", "LOADER", "SQLITE_FAILURES", "RawProfile", "Schema", "connect_readonly", "load"]


def load(path: str, api_names: re.Pattern | None = None) -> RawProfile:
    """Read one nsys SQLite export (read-only).

    ``api_names``: keep only the CUDA API calls whose name matches (see ``read_runtime``).
    """
    try:
        con = connect_readonly(path)
    except sqlite3.Error as exc:
        raise ProfileError(path, f"cannot open as SQLite ({exc})") from None
    try:
        try:
            schema = Schema(con)
        except SQLITE_FAILURES as exc:
            raise ProfileError(path, sqlite_problem(exc)) from None
        if not schema.tables:
            raise ProfileError(path, "not an Nsight Systems export (no nsys tables)")
        missing: list[str] = []
        strings = string_table(con, schema)
        # the two biggest tables are read at once: the CUDA API calls on a second read-only
        # connection in a thread (SQLite and the Arrow transfer run without the GIL)
        pool = ThreadPoolExecutor(1)
        try:
            runtime_job = pool.submit(_read_runtime_apart, path, api_names)
            kernels = read_kernels(con, schema, strings, missing)
            memcpy = read_memcpy(con, schema, missing)
            memset = read_memset(con, schema, missing)
            runtime, runtime_missing = runtime_job.result()
            missing.extend(runtime_missing)
            prof = RawProfile(
                path=path, kernels=kernels, memcpy=memcpy, memset=memset, runtime=runtime,
                nvtx=read_nvtx(con, schema, strings, missing), gpus=read_gpus(con, schema, missing),
                gpu_metrics=read_gpu_metrics(con, schema, missing),
                memory_events=read_memory_events(con, schema, missing), missing=missing)
            read_meta(con, schema, prof)
        except SQLITE_FAILURES as exc:
            raise ProfileError(path, sqlite_problem(exc)) from None
        finally:
            pool.shutdown(wait=True)
        return prof
    finally:
        con.close()


def _read_runtime_apart(path: str, api_names: re.Pattern | None) -> tuple[pd.DataFrame, list[str]]:
    """``read_runtime`` on a connection of its own (for the loader's second thread)."""
    con = connect_readonly(path)
    try:
        schema = Schema(con)
        missing: list[str] = []
        return read_runtime(con, schema, string_table(con, schema), missing, api_names), missing
    finally:
        con.close()
