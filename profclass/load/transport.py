"""Transports: opening an export read-only, and running a query into a DataFrame through ADBC
(Arrow batches) or, where that cannot give the same result, Python's sqlite3. Nothing here
writes to or locks the input."""
from __future__ import annotations

import functools
import os
import sqlite3
import sys

import numpy as np
import pandas as pd

from .profile import empty_frame

# nsys holds a write lock while it writes an export: wait this long, then report it
BUSY_TIMEOUT_S = float(os.environ.get("PROFCLASS_BUSY_TIMEOUT", "2"))
# transport for the big tables: "arrow" (ADBC, the default) or "sqlite3" (for comparisons)
LOADER = os.environ.get("PROFCLASS_LOADER", "arrow")
# rows per Arrow batch from the ADBC driver (its default: 1024). Small batches leave millions
# of ~8 KB column buffers in the heap of the thread that read them, where they stay as free
# but resident memory after the table is converted; 64k-row batches are large enough to be
# mapped and unmapped whole (4 GB export: ~500 MiB less peak RSS, same rows)
BATCH_ROWS = 65536


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
        """The ADBC reader (``_AdbcReader``), or None where the driver is missing or cannot
        open the file (then every query takes the sqlite3 path)."""
        if self._arrow is None and not self._arrow_failed:
            if LOADER != "arrow":
                self._arrow_failed = True
                return None
            try:
                self._arrow = _AdbcReader(self.uri)
                self._arrow.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            except Exception:  # noqa: BLE001 - no driver, or it refused the file: use sqlite3
                self._arrow_failed = True
                self._close_arrow()
        return self._arrow

    def _close_arrow(self):
        if self._arrow is not None:
            self._arrow.close()
            self._arrow = None

    def close(self):
        self._close_arrow()
        super().close()


class _AdbcReader:
    """One ADBC SQLite database + connection, through the driver manager's own bindings: its
    DB-API module imports ``pyarrow.dataset`` (~50-90 ms of every cold run) for bulk ingest,
    which a reader never uses."""

    def __init__(self, uri: str):
        import adbc_driver_manager
        import adbc_driver_sqlite
        self._db = adbc_driver_sqlite.connect(uri)
        try:
            self._con = adbc_driver_manager.AdbcConnection(self._db)
        except Exception:
            self._db.close()
            raise

    def execute(self, sql: str):
        """The whole result of ``sql`` as one Arrow table (batches of BATCH_ROWS rows)."""
        import adbc_driver_manager
        import pyarrow as pa

        stmt = adbc_driver_manager.AdbcStatement(self._con)
        try:
            try:
                stmt.set_options(**{"adbc.sqlite.query.batch_rows": str(BATCH_ROWS)})
            except Exception:  # noqa: BLE001 - a driver without the option: its default batches
                pass
            stmt.set_sql_query(sql)
            stream, _ = stmt.execute_query()
            # the reader steps SQLite without the GIL: the loader's threads read side by side
            return pa.RecordBatchReader._import_from_c(stream.address).read_all()
        finally:
            stmt.close()

    def close(self):
        for handle in (self._con, self._db):
            try:
                handle.close()
            except Exception:  # noqa: BLE001 - closing a read-only handle has nothing to lose
                pass


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


def query(con: sqlite3.Connection, sql: str, cols: dict[str, str], params=()) -> pd.DataFrame:
    if not params and isinstance(con, _ExportConnection):
        df = _query_arrow(con, sql, cols)
        if df is not None:
            return df
    cur = con.execute(sql, params)
    rows = cur.fetchall()
    if not rows:
        return empty_frame(cols)
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
    """``query`` through ADBC: Arrow batches, columns converted without Python objects.

    Returns None, and the caller takes the sqlite3 path, whenever the result could differ
    from it: a value of an unexpected type in a column (SQLite columns are not typed), text
    that is not valid UTF-8, or any driver error (the sqlite3 path then reports it properly).
    """
    import pyarrow as pa

    ac = con.arrow()
    if ac is None:
        return None
    try:
        table = ac.execute(sql)
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    if table.num_columns != len(cols):
        return None
    if table.num_rows == 0:
        return empty_frame(cols)
    out = {}
    for (c, t), col in zip(cols.items(), table.columns):
        out[c] = _from_arrow(col, t)
        if out[c] is None:
            return None
    del table
    pa.default_memory_pool().release_unused()  # hand the batches' memory back before the next table
    for c, v in out.items():
        if isinstance(v, np.ndarray) and not v.flags.writeable:
            out[c] = v.copy()
    # copy=False: one block per column, no consolidation copy of the whole table
    return pd.DataFrame(out, copy=False)


def _from_arrow(col, t: str):
    """One Arrow column as the array (or Series, for text) of dtype ``t`` that the sqlite3 path
    would give, or None where it would not be the same."""
    import pyarrow as pa
    import pyarrow.compute as pc

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
        return arr.astype(bool) if t == "bool" else arr
    if t == "float64":
        if pa.types.is_null(typ):
            return np.full(len(col), np.nan)
        if pa.types.is_integer(typ) or pa.types.is_floating(typ):
            return pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
        return None
    if pa.types.is_null(typ):
        return pd.Series([None] * len(col), dtype=object)
    if not pa.types.is_string(typ) and not pa.types.is_large_string(typ):
        return None
    try:
        col.validate(full=True)  # invalid UTF-8 goes the lenient sqlite3 way
    except pa.ArrowInvalid:
        return None
    return pd.Series(col.to_pylist(), dtype=object) if col.null_count else col.to_pandas()


def release_memory() -> None:
    """Hand memory that is free but still resident back to the OS: Arrow's pool, and glibc's
    heap (``malloc_trim``; a no-op elsewhere). Between one process's pass and the next."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None off glibc (musl has none)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


# What reading a damaged file can raise. SQLite's error message quotes the damaged schema
# text, and Python's sqlite3 decodes that message as strict UTF-8 (the connection's lenient
# text_factory does not apply to it): a flipped byte there raises UnicodeDecodeError.
SQLITE_FAILURES = (sqlite3.Error, UnicodeDecodeError)


def sqlite_problem(exc: Exception) -> str:
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
