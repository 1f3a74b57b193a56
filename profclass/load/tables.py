"""Table readers: one function per table profclass reads, each picking the variant of the
table this export has and returning a DataFrame with the documented columns (or an empty
one, plus a line in ``missing``)."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from .profile import (GPU_COLS, KERNEL_COLS, MEMCPY_COLS, MEMEV_COLS, MEMSET_COLS, METRIC_COLS, NVTX_COLS,
                      RUNTIME_COLS, RawProfile, empty_frame)
from .schema import Schema, column_or, columns_if, pid_expr, pid_filter
from .transport import query

KIND_NAMES = {1: "HtoD", 2: "DtoH", 8: "DtoD", 10: "PtoP", 9: "HtoH", 11: "HtoD", 12: "DtoH",
              13: "DtoD"}
PINNED_KIND = 1  # ENUM_CUDA_MEM_KIND: 0 pageable, 1 pinned
NVTX_RANGE_TYPES = (59, 60)  # NvtxPushPopRange, NvtxStartEndRange
_VERSION_SUFFIX = re.compile(r"_v\d+(_v\d+)?$")


# the name of one graph launch's GPU work under graph-level tracing (nsys's default for CUDA
# graphs: CUPTI_ACTIVITY_KIND_GRAPH_TRACE rows, no row per kernel inside); the graph id follows
GRAPH_LAUNCH_NAME = "cudaGraph (graph-level trace)"


def read_kernels(con, s: Schema, strings: str | None, missing: list, pid: int | None = None) -> pd.DataFrame:
    """Kernels; with ``pid``, only that process's (as every reader below). Graph launches traced
    at graph level (``read_graph_launches``) come as kernel rows too: they are the GPU's work."""
    graphs = read_graph_launches(con, s, pid)
    kernels = _read_kernel_table(con, s, strings, missing if graphs.empty else [], pid)
    if graphs.empty:
        return kernels
    if kernels.empty:
        return graphs
    out = pd.concat([kernels.astype({"name": object, "full_name": object}), graphs], ignore_index=True)
    for col in ("name", "full_name"):
        out[col] = pd.Categorical(out[col].astype(str))
    return out


def read_graph_launches(con, s: Schema, pid: int | None = None) -> pd.DataFrame:
    """CUDA graph launches traced at graph level (``CUPTI_ACTIVITY_KIND_GRAPH_TRACE``: start and
    end of the whole graph's execution on its stream, the launch's correlation id), one kernel-like
    row each, named ``GRAPH_LAUNCH_NAME`` with the graph id; ``graph_node`` holds the graph id
    (non-zero: graph work). Empty where the export has no such table (node-level or no graphs)."""
    T = "CUPTI_ACTIVITY_KIND_GRAPH_TRACE"
    if not s.has(T, "start", "end"):
        return empty_frame(KERNEL_COLS)
    c = s.columns[T]
    sql = (f"SELECT g.start, g.end, {column_or(c, 'deviceId', 'g')}, "
           f"{pid_expr('g.globalPid') if 'globalPid' in c else '0'}, {column_or(c, 'streamId', 'g')}, "
           f"{column_or(c, 'correlationId', 'g')}, {column_or(c, 'graphId', 'g', '-1')} FROM {s.t(T)} g "
           f"WHERE {pid_filter('g.globalPid' if 'globalPid' in c else None, pid)}g.end >= g.start "
           "AND g.start > 0")  # 0/0: CUPTI could not time that graph
    df = query(con, sql, dict(start="int64", end="int64", device="int64", pid="int64", stream="int64",
                              correlation="int64", graph="int64"))
    names = pd.Categorical([f"{GRAPH_LAUNCH_NAME} {int(g)}" for g in df["graph"]]) if len(df) \
        else pd.Categorical([])
    return pd.DataFrame({"start": df["start"], "end": df["end"], "device": df["device"], "pid": df["pid"],
                         "stream": df["stream"], "correlation": df["correlation"], "name": names,
                         "full_name": names.copy(), "grid": np.zeros(len(df), np.int64),
                         "block": np.zeros(len(df), np.int64),
                         "graph_node": np.maximum(df["graph"].to_numpy(np.int64), 1)})


def _read_kernel_table(con, s: Schema, strings: str | None, missing: list, pid: int | None) -> pd.DataFrame:
    T = "CUPTI_ACTIVITY_KIND_KERNEL"
    c = columns_if(s, T, ("start", "end"), missing, "kernels (CUPTI_ACTIVITY_KIND_KERNEL)")
    if c is None:
        return empty_frame(KERNEL_COLS)
    short = "shortName" if "shortName" in c else ("demangledName" if "demangledName" in c else None)
    full = "demangledName" if "demangledName" in c else short
    if not (strings and short):
        missing.append("kernel names (StringIds/shortName)")
    dims = [d for d in ("gridX", "gridY", "gridZ") if d in c]
    bdims = [d for d in ("blockX", "blockY", "blockZ") if d in c]
    # plain products: CUPTI's dimensions are >= 1, and a 0 (a damaged row) gives 0, the value
    # for unknown dimensions. Guarding each with max(d, 1) cost six SQL function calls a row,
    # ~1 s of CPU on a 3M-kernel read (bench/RESULTS.md, seventh session)
    grid = "*".join(f"k.{d}" for d in dims) or "0"
    block = "*".join(f"k.{d}" for d in bdims) or "0"
    sql = (f"SELECT k.start, k.end, {column_or(c, 'deviceId', 'k')}, "
           f"{pid_expr('k.globalPid') if 'globalPid' in c else '0'}, {column_or(c, 'streamId', 'k')}, "
           f"{column_or(c, 'correlationId', 'k')}, {column_or(c, short, 'k', '-1') if short else '-1'}, "
           f"{column_or(c, full, 'k', '-1') if full else '-1'}, {grid}, {block}, "
           f"{column_or(c, 'graphNodeId', 'k')} FROM {s.t(T)} k "
           f"WHERE {pid_filter('k.globalPid' if 'globalPid' in c else None, pid)}k.end >= k.start")
    df = query(con, sql, dict(KERNEL_COLS, name="int64", full_name="int64"))
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


def _copy_columns(c: set) -> str:
    """start, end, device, pid, stream, correlation, bytes of a memcpy/memset row (alias m)."""
    return (f"m.start, m.end, {column_or(c, 'deviceId', 'm')}, "
            f"{pid_expr('m.globalPid') if 'globalPid' in c else '0'}, {column_or(c, 'streamId', 'm')}, "
            f"{column_or(c, 'correlationId', 'm')}, {column_or(c, 'bytes', 'm')}")


def _copy_pid(c: set, pid: int | None) -> str:
    return pid_filter("m.globalPid" if "globalPid" in c else None, pid)


def read_memcpy(con, s: Schema, missing: list, pid: int | None = None) -> pd.DataFrame:
    T = "CUPTI_ACTIVITY_KIND_MEMCPY"
    c = columns_if(s, T, ("start", "end"), missing, "memcpy (CUPTI_ACTIVITY_KIND_MEMCPY)")
    if c is None:
        return empty_frame(MEMCPY_COLS)
    host_kind = ("CASE WHEN m.copyKind=1 THEN m.srcKind WHEN m.copyKind=2 THEN m.dstKind ELSE -1 END"
                 if {"srcKind", "dstKind", "copyKind"} <= c else "-1")
    sql = (f"SELECT {_copy_columns(c)}, {column_or(c, 'copyKind', 'm')}, "
           f"{host_kind} FROM {s.t(T)} m WHERE {_copy_pid(c, pid)}m.end >= m.start")
    return _memcpy_kinds(query(con, sql, dict(MEMCPY_COLS, kind="int64", pinned="int64")))


def _memcpy_kinds(df: pd.DataFrame) -> pd.DataFrame:
    df["kind"] = df["kind"].map(KIND_NAMES).fillna("other")
    df["pinned"] = df["pinned"] == PINNED_KIND
    return df


def no_memcpy_rows() -> pd.DataFrame:
    """What ``read_memcpy`` returns for a process without copies."""
    return _memcpy_kinds(empty_frame(dict(MEMCPY_COLS, kind="int64", pinned="int64")))


def read_memset(con, s: Schema, missing: list, pid: int | None = None) -> pd.DataFrame:
    T = "CUPTI_ACTIVITY_KIND_MEMSET"
    c = columns_if(s, T, ("start", "end"), missing, "memset (CUPTI_ACTIVITY_KIND_MEMSET)")
    if c is None:
        return empty_frame(MEMSET_COLS)
    sql = f"SELECT {_copy_columns(c)} FROM {s.t(T)} m WHERE {_copy_pid(c, pid)}m.end >= m.start"
    return query(con, sql, MEMSET_COLS)


def read_runtime(con, s: Schema, strings: str | None, missing: list,
                 api_names: re.Pattern | None = None, pid: int | None = None) -> pd.DataFrame:
    """CUDA API calls; with ``api_names``, only calls whose name (version suffix cut) matches.

    The filter runs in SQLite (``nameId IN (...)``, ids picked from the string table), so the
    many calls nobody reads (cudaEventRecord, cudaStreamIsCapturing, cuKernelGetName...:
    about 70% of a training capture's API calls) never leave the database.
    """
    got = _runtime_ids(con, s, strings, missing, api_names, pid)
    return got if isinstance(got, pd.DataFrame) else _runtime_names(*got)


def read_runtime_by_process(con, s: Schema, strings: str | None, missing: list,
                            api_names: re.Pattern | None = None,
                            other_than: int | None = None) -> dict[int, pd.DataFrame] | pd.DataFrame:
    """``read_runtime`` of every process (but ``other_than``) in one pass over the table:
    {pid: what ``read_runtime(..., pid=pid)`` returns} (a process without calls: absent), or
    the empty frame every process gets where the export has no usable API calls."""
    got = _runtime_ids(con, s, strings, missing, api_names, None, other_than)
    if isinstance(got, pd.DataFrame):
        return got
    df, plain = got
    pids = df["pid"].to_numpy()
    out = {}
    # a few processes: one mask each (no sort of the whole table); each process's rows in table order
    for p in np.sort(pd.unique(pids)):
        rows = np.flatnonzero(pids == p)
        # copy=False: a block per column, not one stacked 2-D copy
        out[int(p)] = _runtime_names(pd.DataFrame({c: df[c].to_numpy()[rows] for c in df.columns}, copy=False),
                                     plain)
    return out


def no_runtime_rows() -> pd.DataFrame:
    """What ``read_runtime`` returns for a process without kept API calls."""
    return _runtime_names(empty_frame(dict(RUNTIME_COLS, name="int64")), {})


def _runtime_ids(con, s: Schema, strings: str | None, missing: list, api_names: re.Pattern | None,
                 pid: int | None, other_than: int | None = None):
    """The kept API calls with their name ids, and the plain name of each id; or the finished
    (empty) frame where there is nothing to read."""
    T = "CUPTI_ACTIVITY_KIND_RUNTIME"
    if not s.has(T, "start", "end") or not strings:
        missing.append("CUDA API calls (CUPTI_ACTIVITY_KIND_RUNTIME)")
        return empty_frame(RUNTIME_COLS)
    c = s.columns[T]
    name_col = "nameId" if "nameId" in c else ("name" if "name" in c else None)
    if name_col is None:
        missing.append("CUDA API call names")
        return empty_frame(RUNTIME_COLS)
    # cudaLaunchKernel_v7000 -> cudaLaunchKernel: names stay comparable across CUDA versions
    plain = {i: _VERSION_SUFFIX.sub("", str(v)) for i, v in con.execute(f"SELECT id, value FROM {strings}")}
    if api_names is not None:
        plain = {i: v for i, v in plain.items() if api_names.match(v)}
        wanted = ",".join(str(int(i)) for i in plain) or "NULL"
        where = f"r.{name_col} IN ({wanted})"
    else:
        where = f"r.{name_col} IN (SELECT id FROM {strings})"
    tid = "r.globalTid" if "globalTid" in c else "0"
    sql = (f"SELECT r.start, r.end, {tid}, "
           f"{column_or(c, 'correlationId', 'r')}, r.{name_col} FROM {s.t(T)} r "
           f"WHERE {pid_filter('r.globalTid' if 'globalTid' in c else None, pid)}"
           f"{pid_filter('r.globalTid' if 'globalTid' in c else None, other_than, '!=')}"
           f"{where} AND r.end >= r.start")
    cols = dict(start="int64", end="int64", gtid="int64", correlation="int64", name="int64")
    return _pid_tid(query(con, sql, cols)), plain


def _pid_tid(df: pd.DataFrame) -> pd.DataFrame:
    """The ``gtid`` column (a globalTid, read as is) -> ``pid`` and ``tid`` in its place, as
    ``pid_expr(globalTid)`` and ``globalTid & 16777215`` would give them in SQL (a null: 0 for
    both, as the transports read a null): two fewer expressions and one fewer column per row."""
    at = df.columns.get_loc("gtid")
    g = df.pop("gtid").to_numpy(np.int64)
    df.insert(at, "tid", g & 16777215)
    df.insert(at, "pid", (g >> 24) & 16777215)
    return df


def _runtime_names(df: pd.DataFrame, plain: dict) -> pd.DataFrame:
    """Name ids -> a categorical of plain names."""
    # names travel as string ids and are mapped once per distinct id
    ids = df["name"].to_numpy()
    if not len(ids):
        df["name"] = pd.Categorical(pd.Series([], dtype=object))
        return df
    codes, uniq = pd.factorize(ids)  # hash, not sort: ids in first-seen order
    # two ids can carry one plain name (two versions of a call): categories by plain name
    cats, to_cat = np.unique(np.array([plain.get(int(i), "") for i in uniq], dtype=object),
                             return_inverse=True)
    df["name"] = pd.Categorical.from_codes(to_cat[codes], categories=pd.Index(cats, dtype="str"))
    return df


def read_nvtx(con, s: Schema, strings: str | None, missing: list, pid: int | None = None) -> pd.DataFrame:
    """NVTX ranges. With ``pid`` (one process of many), an empty result is not reported as
    missing: ``nvtx_empty`` answers that for the whole file."""
    raw = _nvtx_rows(con, s, strings, missing, pid)
    if raw is None:
        return empty_frame(NVTX_COLS)
    df = _nvtx_finish(con, strings, raw)
    if df.empty and pid is None:
        missing.append(NVTX_EMPTY)
    return df


def read_nvtx_by_process(con, s: Schema, strings: str | None,
                         missing: list) -> tuple[dict[int, pd.DataFrame], pd.DataFrame]:
    """``read_nvtx(..., pid=p)`` of every process ``p`` in one pass over the table: ({pid:
    ranges}, what a process without ranges gets). Text ids are resolved per process, as a
    pass of its own would."""
    raw = _nvtx_rows(con, s, strings, missing, None)
    if raw is None:
        return {}, empty_frame(NVTX_COLS)
    parts = {p: _nvtx_finish(con, strings, part) for p, part in split_by_pid(raw).items()}
    return parts, _nvtx_finish(con, strings, raw.iloc[:0].copy())


def _nvtx_rows(con, s: Schema, strings: str | None, missing: list, pid: int | None) -> pd.DataFrame | None:
    """The ranges as read (``text_id`` beside ``text`` where registered strings travel as ids),
    or None where the export has no usable NVTX table."""
    sql = _nvtx_sql(s, strings, missing, pid)
    if sql is None:
        return None
    cols = dict(start="int64", end="int64", gtid="int64", text="object")
    if "textId" in s.columns["NVTX_EVENTS"] and strings:  # looked up once per distinct id, not per row
        cols = dict(start="int64", end="int64", gtid="int64", text="object", text_id="int64")
    return _pid_tid(query(con, sql, cols))


def _nvtx_finish(con, strings: str | None, df: pd.DataFrame) -> pd.DataFrame:
    if "text_id" in df.columns:
        _texts_from_ids(con, strings, df)
    df["text"] = df["text"].fillna("")
    return df


def split_by_pid(df: pd.DataFrame) -> dict[int, pd.DataFrame]:
    """{pid: that process's rows}, in table order, as a read ``WHERE pid = ?`` gives them: a
    categorical lists only the names its process uses. One stable counting sort of the rows by
    process (a few distinct ids: radix on small codes), one gather per column, and each process
    a slice of it (views: the whole table's rows are held once, not twice)."""
    pids = df["pid"].to_numpy()
    codes, uniq = pd.factorize(pids)  # hash, first-seen order
    if len(uniq) == 1:
        return {int(uniq[0]): df}
    order = np.argsort(codes.astype(np.int16 if len(uniq) < 2**15 else np.int64), kind="stable")  # int16: radix
    bounds = np.concatenate([[0], np.cumsum(np.bincount(codes, minlength=len(uniq)))])
    cols = {}
    for c in df.columns:
        col = df[c]
        if isinstance(col.dtype, pd.CategoricalDtype):
            cols[c] = (col.cat.codes.to_numpy()[order], col.cat.categories)
        else:
            cols[c] = (col.to_numpy()[order] if col.dtype != object and not isinstance(col.dtype, pd.StringDtype)
                       else col.take(order).reset_index(drop=True), None)
    out = {}
    for k in np.argsort(uniq):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        part = {}
        for c, (arr, cats) in cols.items():
            if cats is not None:
                part[c] = _used_categories(arr[lo:hi], cats)
            elif isinstance(arr, pd.Series):
                part[c] = arr.iloc[lo:hi].reset_index(drop=True)
            else:
                part[c] = arr[lo:hi]
        out[int(uniq[k])] = pd.DataFrame(part, copy=False)
    return out


def _used_categories(codes: np.ndarray, cats: pd.Index) -> pd.Categorical:
    """``Categorical.from_codes(codes, cats).remove_unused_categories()`` by counting, not
    sorting, the codes (no -1 codes: every row has a name)."""
    used = np.bincount(codes, minlength=len(cats)) > 0
    renumber = (np.cumsum(used) - 1).astype(codes.dtype)
    return pd.Categorical.from_codes(renumber[codes], categories=cats[used])


def _texts_from_ids(con, strings: str, df: pd.DataFrame) -> None:
    """Fill ``text`` where it is null from the string table by ``text_id`` (-1: none), as
    ``coalesce(text, (SELECT value FROM strings WHERE id = textId))`` would; drops ``text_id``."""
    ids = df.pop("text_id").to_numpy(np.int64)
    text = df["text"].to_numpy(object, na_value=None).copy()
    need = pd.isna(text) & (ids >= 0)
    if need.any():
        uniq, inv = np.unique(ids[need], return_inverse=True)
        wanted = ",".join(str(int(i)) for i in uniq)
        found = dict(con.execute(f"SELECT id, value FROM {strings} WHERE id IN ({wanted})"))
        text[need] = np.array([found.get(int(i)) for i in uniq], dtype=object)[inv]
    # the dtype the transport gives a text column: str, or object where a value is null
    df["text"] = pd.Series(text, index=df.index, dtype=object if pd.isna(text).any() else "str")


NVTX_EMPTY = "NVTX ranges (NVTX_EVENTS empty)"


def nvtx_empty(con, s: Schema, strings: str | None) -> bool:
    """Whether the file has no NVTX range ``read_nvtx`` would keep (stops at the first one)."""
    sql = _nvtx_sql(s, strings, [], None)
    return sql is not None and con.execute(f"SELECT 1 FROM ({sql}) LIMIT 1").fetchone() is None


def _nvtx_sql(s: Schema, strings: str | None, missing: list, pid: int | None) -> str | None:
    T = "NVTX_EVENTS"
    c = columns_if(s, T, ("start",), missing, "NVTX ranges (NVTX_EVENTS)")
    if c is None:
        return None
    text = "n.text" if "text" in c else "NULL"
    if "textId" in c and strings:
        text += ", coalesce(n.textId, -1)"  # see _texts_from_ids
    tid = "n.globalTid" if "globalTid" in c else "0"
    types = ",".join(str(t) for t in NVTX_RANGE_TYPES)
    et = f"n.eventType IN ({types}) AND " if "eventType" in c else ""
    end = "n.end" if "end" in c else "n.start"
    return (f"SELECT n.start, {end}, {tid}, {text} "
            f"FROM {s.t(T)} n WHERE {pid_filter('n.globalTid' if 'globalTid' in c else None, pid)}"
            f"{et}{end} IS NOT NULL AND {end} >= n.start")


# the host's speed (analyzers/host.py): a driver call of fixed CPU work that PyTorch makes once per
# kernel launch (cuKernelGetAttribute's count varies with the job, so it is not mixed in); this
# many are enough for a stable median
PROBE_CALL_NAMES = ("cuKernelGetName",)
PROBE_CALLS_READ = 50_000


def read_host_probe(con, s: Schema, strings: str | None) -> tuple | None:
    """(median own time in ns, calls read) of the export's ``PROBE_CALL_NAMES`` calls, every
    process's, at most ``PROBE_CALLS_READ`` of them: a host property, not a window's."""
    T = "CUPTI_ACTIVITY_KIND_RUNTIME"
    if not strings or not s.has(T, "start", "end", "nameId"):
        return None
    names = ",".join("?" * len(PROBE_CALL_NAMES))
    ids = [i for (i,) in con.execute(f"SELECT id FROM {strings} WHERE value IN ({names})", PROBE_CALL_NAMES)]
    if not ids:
        return None
    own = np.fromiter((d for (d,) in con.execute(
        f"SELECT end - start FROM {s.t(T)} WHERE nameId IN ({','.join(map(str, map(int, ids)))}) "
        f"AND end >= start LIMIT {PROBE_CALLS_READ}")), np.int64)
    return (int(np.median(own)), int(len(own))) if len(own) else None


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
