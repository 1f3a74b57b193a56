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
"""
from __future__ import annotations

import os
import re
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .errors import ProfileError

# Identifiers we may put into SQL: tables and columns discovered in a file are used only if
# they are in these sets (values always go through parameters).
KNOWN_TABLES = {
    "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
    "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", "NVTX_EVENTS",
    "StringIds", "StringTable", "TARGET_INFO_GPU", "TARGET_INFO_CUDA_GPU", "GPU_METRICS",
    "TARGET_INFO_GPU_METRICS", "CUDA_GPU_MEMORY_USAGE_EVENTS", "META_DATA_CAPTURE",
    "META_DATA_EXPORT", "TARGET_INFO_SESSION_START_TIME", "PROCESSES", "TARGET_INFO_SYSTEM_ENV",
    "ENUM_CUDA_MEMCPY_OPER", "ENUM_CUDA_MEM_KIND",
}
KNOWN_COLUMNS = {
    "start", "end", "deviceId", "streamId", "correlationId", "globalPid", "globalTid",
    "shortName", "demangledName", "mangledName", "name", "nameId", "gridX", "gridY", "gridZ",
    "blockX", "blockY", "blockZ", "graphNodeId", "bytes", "copyKind", "srcKind", "dstKind",
    "text", "textId", "domainId", "eventType", "id", "value", "smCount", "totalMemory",
    "timestamp", "typeId", "metricId", "metricName", "memoryOperationType", "utcEpochNs",
    "devStateName", "pid", "cuDevice", "memKind", "sourceId",
}

KIND_NAMES = {1: "HtoD", 2: "DtoH", 8: "DtoD", 10: "PtoP", 9: "HtoH", 11: "HtoD", 12: "DtoH",
              13: "DtoD"}
PINNED_KIND = 1  # ENUM_CUDA_MEM_KIND: 0 pageable, 1 pinned
NVTX_RANGE_TYPES = (59, 60)  # NvtxPushPopRange, NvtxStartEndRange
NVTX_DOMAIN_CREATE = 75
METRICS_WANTED = {
    "SMs Active": "sm_active", "SM Active": "sm_active", "SM Issue": "sm_issue",
    "Tensor Active": "tensor_active", "DRAM Read Bandwidth": "dram_read",
    "DRAM Write Bandwidth": "dram_write",
}
_VERSION_SUFFIX = re.compile(r"_v\d+(_v\d+)?$")
_TABLE_SUFFIX = re.compile(r"(.*?)(_V\d+)?")  # used with fullmatch: no newline tricks
# nsys holds a write lock while it writes an export: wait this long, then report it
BUSY_TIMEOUT_S = float(os.environ.get("PROFCLASS_BUSY_TIMEOUT", "2"))
# transport for the big tables: "arrow" (ADBC, the default) or "sqlite3" (for comparisons)
LOADER = os.environ.get("PROFCLASS_LOADER", "arrow")


@dataclass
class RawProfile:
    """Everything profclass reads from one export (see the module docstring for columns)."""

    path: str
    kernels: pd.DataFrame
    memcpy: pd.DataFrame
    memset: pd.DataFrame
    runtime: pd.DataFrame
    nvtx: pd.DataFrame
    gpus: pd.DataFrame
    gpu_metrics: pd.DataFrame
    memory_events: pd.DataFrame
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    nsys_version: str = ""
    session_start_ns: int | None = None
    missing: list[str] = field(default_factory=list)


def _empty(cols: dict[str, str]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in cols.items()})


KERNEL_COLS = dict(start="int64", end="int64", device="int64", pid="int64", stream="int64",
                   correlation="int64", name="object", full_name="object", grid="int64",
                   block="int64", graph_node="int64")
MEMCPY_COLS = dict(start="int64", end="int64", device="int64", pid="int64", stream="int64",
                   correlation="int64", bytes="int64", kind="object", pinned="bool")
MEMSET_COLS = dict(start="int64", end="int64", device="int64", pid="int64", stream="int64",
                   correlation="int64", bytes="int64")
RUNTIME_COLS = dict(start="int64", end="int64", pid="int64", tid="int64", correlation="int64",
                    name="object")
NVTX_COLS = dict(start="int64", end="int64", pid="int64", tid="int64", text="object", domain="object")
GPU_COLS = dict(device="int64", name="object", sm_count="int64", total_memory="int64")
METRIC_COLS = dict(timestamp="int64", device="int64", metric="object", value="float64")
MEMEV_COLS = dict(start="int64", pid="int64", device="int64", bytes="int64")


class Schema:
    """The tables and columns one export has, restricted to identifiers profclass knows."""

    def __init__(self, con: sqlite3.Connection):
        self.tables: dict[str, str] = {}  # canonical name -> real name (suffix variants)
        for (real,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'"):
            m = _TABLE_SUFFIX.fullmatch(str(real))
            base = m.group(1) if m else None
            if base in KNOWN_TABLES and (base not in self.tables or real > self.tables[base]):
                self.tables[base] = real
        self.columns: dict[str, set[str]] = {}
        for base, real in self.tables.items():
            cols = {r[1] for r in con.execute(f'PRAGMA table_info("{real}")')}
            self.columns[base] = cols & KNOWN_COLUMNS

    def has(self, table: str, *cols: str) -> bool:
        return table in self.tables and all(c in self.columns[table] for c in cols)

    def t(self, table: str) -> str:
        return f'"{self.tables[table]}"'


class _ExportConnection(sqlite3.Connection):
    """A read-only sqlite3 connection (schema, small tables) that also owns a lazily opened
    ADBC connection to the same file, the same read-only URI, for the big tables.

    Why ADBC: Python's sqlite3 builds a tuple of Python objects per row (~150k rows/s on
    this class of machine); the ADBC SQLite driver steps the query in C and hands Arrow
    record batches over, ~5x faster and at a fraction of the memory (bench/RESULTS.md).
    """

    uri: str = ""
    _arrow = None
    _arrow_failed = False

    def arrow(self):
        """The ADBC connection, or None where the driver is missing or cannot open the file
        (then every query takes the sqlite3 path)."""
        if self._arrow is None and not self._arrow_failed:
            if LOADER != "arrow":
                self._arrow_failed = True
                return None
            try:
                import adbc_driver_sqlite.dbapi as adbc_sqlite
                self._arrow = adbc_sqlite.connect(self.uri)
                cur = self._arrow.cursor()
                cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
                cur.close()
            except Exception:  # noqa: BLE001 - no driver, or it refused the file: use sqlite3
                self._arrow_failed = True
                self._close_arrow()
        return self._arrow

    def _close_arrow(self):
        if self._arrow is not None:
            try:
                self._arrow.close()
            except Exception:  # noqa: BLE001 - closing a read-only handle has nothing to lose
                pass
            self._arrow = None

    def close(self):
        self._close_arrow()
        super().close()


def connect_readonly(path: str) -> sqlite3.Connection:
    """Open an export read-only; never creates journal files or takes write locks."""
    uri = "file:" + _uri_path(path) + "?mode=ro"
    con = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=BUSY_TIMEOUT_S,
                          factory=_ExportConnection)
    con.uri = uri
    # names are not guaranteed UTF-8 (kernel names from any compiler, user NVTX text):
    # decode leniently rather than reject the whole profile
    con.text_factory = lambda b: b.decode("utf-8", errors="replace")
    con.execute("PRAGMA query_only=1")
    return con


def _uri_path(path: str) -> str:
    from urllib.parse import quote
    return quote(os.path.abspath(path))


def _query(con: sqlite3.Connection, sql: str, cols: dict[str, str], params=()) -> pd.DataFrame:
    if not params and isinstance(con, _ExportConnection):
        df = _query_arrow(con, sql, cols)
        if df is not None:
            return df
    cur = con.execute(sql, params)
    rows = cur.fetchall()
    if not rows:
        return _empty(cols)
    df = pd.DataFrame.from_records(rows, columns=list(cols))
    for c, t in cols.items():
        if t == "int64":
            df[c] = pd.to_numeric(df[c], errors="coerce").fillna(0).astype(np.int64)
        elif t == "float64":
            df[c] = pd.to_numeric(df[c], errors="coerce").astype(np.float64)
        elif t == "bool":
            df[c] = df[c].fillna(0).astype(bool)
    return df


def _query_arrow(con: "_ExportConnection", sql: str, cols: dict[str, str]) -> pd.DataFrame | None:
    """``_query`` through ADBC: Arrow batches, columns converted without Python objects.

    Returns None, and the caller takes the sqlite3 path, whenever the result could differ
    from it: a value of an unexpected type in a column (SQLite columns are not typed), text
    that is not valid UTF-8, or any driver error (the sqlite3 path then reports it properly).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    ac = con.arrow()
    if ac is None:
        return None
    try:
        cur = ac.cursor()
        try:
            cur.execute(sql)
            table = cur.fetch_arrow_table()
        finally:
            cur.close()
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    if table.num_columns != len(cols):
        return None
    if table.num_rows == 0:
        return _empty(cols)
    out = {}
    for (c, t), col in zip(cols.items(), table.columns):
        typ = col.type
        if t in ("int64", "bool"):
            if pa.types.is_null(typ):
                arr = np.zeros(len(col), np.int64)
            elif pa.types.is_integer(typ):
                arr = pc.fill_null(col, 0).to_numpy().astype(np.int64, copy=False)
            else:
                return None
            if not arr.flags.writeable:  # a zero-copy view of an Arrow buffer
                arr = arr.copy()
            out[c] = arr.astype(bool) if t == "bool" else arr
        elif t == "float64":
            if pa.types.is_null(typ):
                out[c] = np.full(len(col), np.nan)
            elif pa.types.is_integer(typ) or pa.types.is_floating(typ):
                out[c] = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
            else:
                return None
        else:
            if pa.types.is_null(typ):
                out[c] = pd.Series([None] * len(col), dtype=object)
                continue
            if not pa.types.is_string(typ) and not pa.types.is_large_string(typ):
                return None
            try:
                col.validate(full=True)  # invalid UTF-8 goes the lenient sqlite3 way
            except pa.ArrowInvalid:
                return None
            out[c] = pd.Series(col.to_pylist(), dtype=object) if col.null_count else col.to_pandas()
    del table
    pa.default_memory_pool().release_unused()  # hand the batches' memory back before the next table
    for c, v in out.items():
        if isinstance(v, np.ndarray) and not v.flags.writeable:
            out[c] = v.copy()
    # copy=False: one block per column, no consolidation copy of the whole table
    return pd.DataFrame(out, copy=False)


def _strings(con, schema: Schema) -> str | None:
    for t in ("StringIds", "StringTable"):
        if schema.has(t, "id", "value"):
            return schema.t(t)
    return None


def _pid_expr(col: str) -> str:
    return f"(({col} >> 24) & 16777215)"


def read_kernels(con, s: Schema, strings: str | None, missing: list) -> pd.DataFrame:
    T = "CUPTI_ACTIVITY_KIND_KERNEL"
    if not s.has(T, "start", "end"):
        missing.append("kernels (CUPTI_ACTIVITY_KIND_KERNEL)")
        return _empty(KERNEL_COLS)
    c = s.columns[T]
    short = "shortName" if "shortName" in c else ("demangledName" if "demangledName" in c else None)
    full = "demangledName" if "demangledName" in c else short
    if not (strings and short):
        missing.append("kernel names (StringIds/shortName)")
    dims = [d for d in ("gridX", "gridY", "gridZ") if d in c]
    bdims = [d for d in ("blockX", "blockY", "blockZ") if d in c]
    grid = "*".join(f"max(k.{d},1)" for d in dims) or "0"
    block = "*".join(f"max(k.{d},1)" for d in bdims) or "0"
    sql = (f"SELECT k.start, k.end, {_col(c, 'deviceId', 'k')}, "
           f"{_pid_expr('k.globalPid') if 'globalPid' in c else '0'}, {_col(c, 'streamId', 'k')}, "
           f"{_col(c, 'correlationId', 'k')}, {_col(c, short, 'k', '-1') if short else '-1'}, "
           f"{_col(c, full, 'k', '-1') if full else '-1'}, {grid}, {block}, "
           f"{_col(c, 'graphNodeId', 'k')} FROM {s.t(T)} k WHERE k.end >= k.start")
    df = _query(con, sql, dict(KERNEL_COLS, name="int64", full_name="int64"))
    # names travel as string ids and are mapped once per distinct id, not once per row
    names: dict[int, str] = {}
    if df.empty:
        for col in ("name", "full_name"):
            # object first: with no names at all, map() gives float NaN, which won't take a str
            df[col] = pd.Categorical(df[col].map(names).astype(object).fillna("<unknown>").astype(str))
        return df
    # hash, not sort: ids in first-seen order; categories are sorted below, per distinct name
    uniq = {}
    for c in ("name", "full_name"):
        inv, ids = pd.factorize(df[c].to_numpy())
        uniq[c] = (ids, inv)
    if strings and short:
        wanted = np.union1d(uniq["name"][0], uniq["full_name"][0])
        names = dict(con.execute(f"SELECT id, value FROM {strings} WHERE id IN "
                                 f"({','.join(str(int(i)) for i in wanted)})"))
    for col in ("name", "full_name"):
        ids, inv = uniq[col]
        values = np.array(["<unknown>" if (v := names.get(int(i))) is None or v != v else str(v)
                           for i in ids], dtype=object)
        cats, to_cat = np.unique(values, return_inverse=True)  # sorted, as pandas infers them
        df[col] = pd.Categorical.from_codes(to_cat[inv], categories=pd.Index(cats, dtype="str"))
    return df


def _col(cols: set, name: str, alias: str, default: str = "0") -> str:
    return f"coalesce({alias}.{name}, {default})" if name in cols else default


def _copy_columns(c: set) -> str:
    """start, end, device, pid, stream, correlation, bytes of a memcpy/memset row (alias m)."""
    return (f"m.start, m.end, {_col(c, 'deviceId', 'm')}, "
            f"{_pid_expr('m.globalPid') if 'globalPid' in c else '0'}, {_col(c, 'streamId', 'm')}, "
            f"{_col(c, 'correlationId', 'm')}, {_col(c, 'bytes', 'm')}")


def read_memcpy(con, s: Schema, missing: list) -> pd.DataFrame:
    T = "CUPTI_ACTIVITY_KIND_MEMCPY"
    if not s.has(T, "start", "end"):
        missing.append("memcpy (CUPTI_ACTIVITY_KIND_MEMCPY)")
        return _empty(MEMCPY_COLS)
    c = s.columns[T]
    host_kind = ("CASE WHEN m.copyKind=1 THEN m.srcKind WHEN m.copyKind=2 THEN m.dstKind ELSE -1 END"
                 if {"srcKind", "dstKind", "copyKind"} <= c else "-1")
    sql = (f"SELECT {_copy_columns(c)}, {_col(c, 'copyKind', 'm')}, "
           f"{host_kind} FROM {s.t(T)} m WHERE m.end >= m.start")
    df = _query(con, sql, dict(MEMCPY_COLS, kind="int64", pinned="int64"))
    df["kind"] = df["kind"].map(KIND_NAMES).fillna("other")
    df["pinned"] = df["pinned"] == PINNED_KIND
    return df


def read_memset(con, s: Schema, missing: list) -> pd.DataFrame:
    T = "CUPTI_ACTIVITY_KIND_MEMSET"
    if not s.has(T, "start", "end"):
        missing.append("memset (CUPTI_ACTIVITY_KIND_MEMSET)")
        return _empty(MEMSET_COLS)
    c = s.columns[T]
    sql = f"SELECT {_copy_columns(c)} FROM {s.t(T)} m WHERE m.end >= m.start"
    return _query(con, sql, MEMSET_COLS)


def read_runtime(con, s: Schema, strings: str | None, missing: list,
                 api_names: re.Pattern | None = None) -> pd.DataFrame:
    """CUDA API calls; with ``api_names``, only calls whose name (version suffix cut) matches.

    The filter runs in SQLite (``nameId IN (...)``, ids picked from the string table), so the
    many calls nobody reads (cudaEventRecord, cudaStreamIsCapturing, cuKernelGetName...:
    about 70% of a training capture's API calls) never leave the database.
    """
    T = "CUPTI_ACTIVITY_KIND_RUNTIME"
    if not s.has(T, "start", "end") or not strings:
        missing.append("CUDA API calls (CUPTI_ACTIVITY_KIND_RUNTIME)")
        return _empty(RUNTIME_COLS)
    c = s.columns[T]
    name_col = "nameId" if "nameId" in c else ("name" if "name" in c else None)
    if name_col is None:
        missing.append("CUDA API call names")
        return _empty(RUNTIME_COLS)
    # cudaLaunchKernel_v7000 -> cudaLaunchKernel: names stay comparable across CUDA versions
    plain = {i: _VERSION_SUFFIX.sub("", str(v)) for i, v in con.execute(f"SELECT id, value FROM {strings}")}
    if api_names is not None:
        plain = {i: v for i, v in plain.items() if api_names.match(v)}
        wanted = ",".join(str(int(i)) for i in plain) or "NULL"
        where = f"r.{name_col} IN ({wanted})"
    else:
        where = f"r.{name_col} IN (SELECT id FROM {strings})"
    tid = "r.globalTid" if "globalTid" in c else "0"
    sql = (f"SELECT r.start, r.end, {_pid_expr(tid)}, ({tid} & 16777215), "
           f"{_col(c, 'correlationId', 'r')}, r.{name_col} FROM {s.t(T)} r "
           f"WHERE r.end >= r.start AND {where}")
    df = _query(con, sql, dict(RUNTIME_COLS, name="int64"))
    # names travel as string ids and are mapped once per distinct id
    ids = df["name"].to_numpy()
    if not len(ids):
        df["name"] = pd.Categorical(pd.Series([], dtype=object))
        return df
    uniq, codes = np.unique(ids, return_inverse=True)
    # two ids can carry one plain name (two versions of a call): categories by plain name
    cats, to_cat = np.unique(np.array([plain.get(int(i), "") for i in uniq], dtype=object),
                             return_inverse=True)
    df["name"] = pd.Categorical.from_codes(to_cat[codes], categories=pd.Index(cats, dtype="str"))
    return df


def read_nvtx(con, s: Schema, strings: str | None, missing: list) -> pd.DataFrame:
    T = "NVTX_EVENTS"
    if not s.has(T, "start"):
        missing.append("NVTX ranges (NVTX_EVENTS)")
        return _empty(NVTX_COLS)
    c = s.columns[T]
    if "text" in c and "textId" in c and strings:
        text = f"coalesce(n.text, (SELECT value FROM {strings} WHERE id=n.textId))"
    elif "text" in c:
        text = "n.text"
    elif "textId" in c and strings:
        text = f"(SELECT value FROM {strings} WHERE id=n.textId)"
    else:
        text = "NULL"
    tid = "n.globalTid" if "globalTid" in c else "0"
    dom = "coalesce(n.domainId, 0)" if "domainId" in c else "0"
    types = ",".join(str(t) for t in NVTX_RANGE_TYPES)
    et = f"n.eventType IN ({types}) AND " if "eventType" in c else ""
    end = "n.end" if "end" in c else "n.start"
    sql = (f"SELECT n.start, {end}, {_pid_expr(tid)}, ({tid} & 16777215), {text}, {dom} "
           f"FROM {s.t(T)} n WHERE {et}{end} IS NOT NULL AND {end} >= n.start")
    df = _query(con, sql, dict(NVTX_COLS, domain="int64"))
    domains = {0: ""}
    if "eventType" in c and "domainId" in c and "text" in c:
        for dom_id, name in con.execute(
                f"SELECT domainId, text FROM {s.t(T)} WHERE eventType=?", (NVTX_DOMAIN_CREATE,)):
            domains[dom_id] = name or ""
    df["domain"] = df["domain"].map(domains).fillna("")
    df["text"] = df["text"].fillna("")
    if df.empty:
        missing.append("NVTX ranges (NVTX_EVENTS empty)")
    return df


def read_gpus(con, s: Schema, missing: list) -> pd.DataFrame:
    for T in ("TARGET_INFO_GPU", "TARGET_INFO_CUDA_GPU"):
        if s.has(T, "id"):
            c = s.columns[T]
            dev = "cuDevice" if T == "TARGET_INFO_CUDA_GPU" and "cuDevice" in c else "id"
            sql = (f"SELECT {dev}, {'name' if 'name' in c else 'NULL'}, "
                   f"{'smCount' if 'smCount' in c else '0'}, {'totalMemory' if 'totalMemory' in c else '0'} "
                   f"FROM {s.t(T)}")
            df = _query(con, sql, GPU_COLS).drop_duplicates("device")
            df["name"] = df["name"].fillna("").astype(str)
            return df
    missing.append("GPU properties (TARGET_INFO_GPU)")
    return _empty(GPU_COLS)


def read_gpu_metrics(con, s: Schema, missing: list) -> pd.DataFrame:
    if not (s.has("GPU_METRICS", "timestamp", "metricId", "value")
            and s.has("TARGET_INFO_GPU_METRICS", "metricId", "metricName")):
        missing.append("GPU metrics (GPU_METRICS; capture with --gpu-metrics-device)")
        return _empty(METRIC_COLS)
    names = {}
    for mid, mname in con.execute(
            f"SELECT DISTINCT metricId, metricName FROM {s.t('TARGET_INFO_GPU_METRICS')}"):
        base = str(mname).split(" [")[0]
        if base in METRICS_WANTED and "Throughput %" in str(mname):
            names[mid] = METRICS_WANTED[base]
    if not names:
        missing.append("GPU metrics (no SM Active metric)")
        return _empty(METRIC_COLS)
    ids = ",".join("?" * len(names))
    # typeId identifies the GPU; with one GPU per report (the usual case) it maps to device 0,
    # else to devices in typeId order (nsys numbers metric sources in device order).
    type_ids = [r[0] for r in con.execute(
        f"SELECT DISTINCT typeId FROM {s.t('GPU_METRICS')} ORDER BY typeId")]
    dev_of = {t: i for i, t in enumerate(type_ids)}
    df = _query(con, f"SELECT timestamp, typeId, metricId, value FROM {s.t('GPU_METRICS')} "
                     f"WHERE metricId IN ({ids})", dict(timestamp="int64", device="int64",
                                                         metric="int64", value="float64"),
                params=tuple(names))
    df["device"] = df["device"].map(dev_of).astype(np.int64)
    df["metric"] = df["metric"].map(names)
    return df


def read_memory_events(con, s: Schema, missing: list) -> pd.DataFrame:
    T = "CUDA_GPU_MEMORY_USAGE_EVENTS"
    if not s.has(T, "start", "bytes", "memoryOperationType"):
        missing.append("GPU memory usage (CUDA_GPU_MEMORY_USAGE_EVENTS; capture with --cuda-memory-usage=true)")
        return _empty(MEMEV_COLS)
    c = s.columns[T]
    # memoryOperationType 0 = allocation, 1 = deallocation; memKind 2 = device memory
    kind = "AND memKind=2" if "memKind" in c else ""
    sql = (f"SELECT start, {_pid_expr('globalPid') if 'globalPid' in c else '0'}, "
           f"{'deviceId' if 'deviceId' in c else '0'}, "
           f"CASE WHEN memoryOperationType=0 THEN bytes ELSE -bytes END FROM {s.t(T)} WHERE 1=1 {kind}")
    return _query(con, sql, MEMEV_COLS)


def read_meta(con, s: Schema, prof: RawProfile) -> None:
    if s.has("META_DATA_CAPTURE", "name", "value"):
        args: dict[int, str] = {}
        for name, value in con.execute(f"SELECT name, value FROM {s.t('META_DATA_CAPTURE')}"):
            name, value = str(name), "" if value is None else str(value)
            m = re.match(r"PROCESS_0:(COMMAND|ARGUMENT_(\d+)|ENVIRONMENT_VARIABLE)$", name)
            if not m:
                continue
            if m.group(1) == "COMMAND":
                args[-1] = value
            elif m.group(2) is not None:
                args[int(m.group(2))] = value
            else:
                k, _, v = value.partition("=")
                prof.env[k.strip()] = v.strip().strip('"')
        prof.command = [args[k] for k in sorted(args)]
    else:
        prof.missing.append("captured command line (META_DATA_CAPTURE)")
    if s.has("META_DATA_EXPORT", "name", "value"):
        row = con.execute(f"SELECT value FROM {s.t('META_DATA_EXPORT')} "
                          "WHERE name='EXPORT_PRODUCT_VERSION'").fetchone()
        prof.nsys_version = str(row[0]) if row and row[0] is not None else ""
    if s.has("TARGET_INFO_SESSION_START_TIME", "utcEpochNs"):
        row = con.execute(f"SELECT utcEpochNs FROM {s.t('TARGET_INFO_SESSION_START_TIME')}").fetchone()
        try:
            prof.session_start_ns = int(row[0]) if row and row[0] is not None else None
        except (TypeError, ValueError):  # a damaged value is as good as none
            prof.session_start_ns = None


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
            raise ProfileError(path, _sqlite_problem(exc)) from None
        if not schema.tables:
            raise ProfileError(path, "not an Nsight Systems export (no nsys tables)")
        missing: list[str] = []
        strings = _strings(con, schema)
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
            raise ProfileError(path, _sqlite_problem(exc)) from None
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
        return read_runtime(con, schema, _strings(con, schema), missing, api_names), missing
    finally:
        con.close()


# What reading a damaged file can raise. SQLite's error message quotes the damaged schema
# text, and Python's sqlite3 decodes that message as strict UTF-8 (the connection's lenient
# text_factory does not apply to it): a flipped byte there raises UnicodeDecodeError.
SQLITE_FAILURES = (sqlite3.Error, UnicodeDecodeError)


def _sqlite_problem(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return "corrupt or truncated SQLite file (damaged schema: its text is not UTF-8)"
    msg = str(exc)
    if "locked" in msg:
        return "database is locked (is nsys still writing it?)"
    if "readonly" in msg or "read-only" in msg:
        # a hot journal next to the file: nsys stopped mid-write; recovering it would write
        return "unfinished write (a -journal file is next to it; was nsys interrupted?)"
    if "not a database" in msg or "malformed" in msg or "disk image" in msg:
        return f"corrupt or truncated SQLite file ({msg})"
    return f"SQLite error: {msg}"
