"""Measure candidate SQLite -> DataFrame transports on one export (rows/s, peak RSS).

    python bench/loaders.py bench/out/dpoverlap_4gpu_1G.sqlite [--candidates a,b]

Each candidate runs in its own process (so peak RSS is its own) and reads the same two
queries the loader issues for its biggest tables: kernels (numeric columns + name ids) and
CUDA API calls (numeric columns + name id). Candidates:

- sqlite3_records: Python's sqlite3, fetchall -> DataFrame.from_records (the old loader)
- pandas_read_sql: pandas.read_sql_query on a sqlite3 connection
- adbc: the ADBC SQLite driver (C, Arrow record batches) -> pyarrow -> numpy
- connectorx: connectorx.read_sql (Rust, Arrow) -> pyarrow
- adbc_rowid_ranges: ADBC on several read-only connections at once (one per core), each
  reading one rowid range of the table (threads: the driver steps SQLite without the GIL)
- duckdb_sqlite: DuckDB's SQLite scanner (``ATTACH ... (TYPE sqlite, READ_ONLY)``; the
  extension from the ``duckdb-extension-sqlite-scanner`` wheel, no download)
- adbc_per_process: what the loader does now inside a multi-process export: one
  ``WHERE pid = ?`` pass per process over each table (pid test first), one after another

A candidate that cannot open the file read-only is reported as such and not used.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

QUERIES = {
    "kernels": ("SELECT start, end, deviceId, (globalPid >> 24) & 16777215 AS pid, streamId, "
                "correlationId, shortName, demangledName, gridX*gridY*gridZ AS grid, "
                "blockX*blockY*blockZ AS block, coalesce(graphNodeId, 0) AS graph_node "
                "FROM CUPTI_ACTIVITY_KIND_KERNEL"),
    "runtime": ("SELECT start, end, (globalTid >> 24) & 16777215 AS pid, globalTid & 16777215 AS tid, "
                "correlationId, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME"),
}
CANDIDATES = ("sqlite3_records", "pandas_read_sql", "adbc", "connectorx", "adbc_rowid_ranges", "duckdb_sqlite",
              "adbc_per_process")
PID_COLUMN = {"kernels": "globalPid", "runtime": "globalTid"}


def uri(path: str) -> str:
    from urllib.parse import quote
    return "file:" + quote(os.path.abspath(path)) + "?mode=ro"


def run_one(name: str, path: str) -> dict:
    t0 = time.perf_counter()
    rows = 0
    if name == "sqlite3_records":
        import sqlite3
        import pandas as pd
        con = sqlite3.connect(uri(path), uri=True)
        for q in QUERIES.values():
            cur = con.execute(q)
            df = pd.DataFrame.from_records(cur.fetchall(), columns=[d[0] for d in cur.description])
            rows += len(df)
            del df
    elif name == "pandas_read_sql":
        import sqlite3
        import pandas as pd
        con = sqlite3.connect(uri(path), uri=True)
        for q in QUERIES.values():
            df = pd.read_sql_query(q, con)
            rows += len(df)
            del df
    elif name == "adbc":
        import adbc_driver_sqlite.dbapi as adbc
        con = adbc.connect(uri(path))
        for q in QUERIES.values():
            cur = con.cursor()
            cur.execute(q)
            df = cur.fetch_arrow_table().to_pandas()
            rows += len(df)
            cur.close()
            del df
        con.close()
    elif name == "connectorx":
        import connectorx as cx
        for q in QUERIES.values():
            # connectorx takes a sqlite:// URL; it has no read-only flag of its own
            df = cx.read_sql("sqlite://" + os.path.abspath(path), q, return_type="arrow").to_pandas()
            rows += len(df)
            del df
    elif name in ("adbc_rowid_ranges", "duckdb_sqlite", "adbc_per_process"):
        rows = globals()["_" + name](path)
    wall = time.perf_counter() - t0
    use = resource.getrusage(resource.RUSAGE_SELF)
    return dict(candidate=name, rows=rows, wall_s=round(wall, 3), rows_per_s=int(rows / wall),
                cpu_s=round(use.ru_utime + use.ru_stime, 2), peak_rss_mib=round(use.ru_maxrss * 1024 / 2**20, 1))


def _adbc_table(path: str, sql: str):
    import adbc_driver_sqlite.dbapi as adbc
    con = adbc.connect(uri(path))
    try:
        cur = con.cursor()
        cur.execute(sql)
        return cur.fetch_arrow_table()
    finally:
        con.close()


def _adbc_rowid_ranges(path: str) -> int:
    import sqlite3
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    n = os.cpu_count() or 2
    rows = 0
    for q in QUERIES.values():
        table = q.split(" FROM ")[1].split()[0]
        con = sqlite3.connect(uri(path), uri=True)
        lo, hi = con.execute(f"SELECT min(rowid), max(rowid) FROM {table}").fetchone()
        con.close()
        cuts = [lo + (hi - lo + 1) * i // n for i in range(n)] + [hi + 1]
        parts = [f"{q} WHERE rowid >= {a} AND rowid < {b}" for a, b in zip(cuts, cuts[1:])]
        with ThreadPoolExecutor(n) as pool:
            df = pa.concat_tables(pool.map(lambda sql: _adbc_table(path, sql), parts)).to_pandas()
        rows += len(df)
        del df
    return rows


def _duckdb_attached(path: str):
    """A DuckDB connection with the export attached read-only as ``nsys`` (the scanner
    extension loaded from its wheel: no download)."""
    import duckdb
    import duckdb_extension_sqlite_scanner as ext
    ext_dir = os.path.join(os.path.dirname(ext.__file__), "extensions")
    con = duckdb.connect()
    con.execute(f"LOAD '{_find(ext_dir, 'sqlite_scanner.duckdb_extension')}'")
    con.execute(f"ATTACH '{os.path.abspath(path)}' AS nsys (TYPE sqlite, READ_ONLY)")
    return con


def _duckdb_sqlite(path: str) -> int:
    con = _duckdb_attached(path)
    rows = 0
    for q in QUERIES.values():
        sql = q.replace(" end,", ' "end",').replace("FROM CUPTI", "FROM nsys.CUPTI")
        df = con.execute(sql).df()
        rows += len(df)
        del df
    con.close()
    return rows


def _find(root: str, name: str) -> str:
    for d, _, files in os.walk(root):
        if name in files:
            return os.path.join(d, name)
    raise FileNotFoundError(name)


def _adbc_per_process(path: str) -> int:
    import sqlite3
    con = sqlite3.connect(uri(path), uri=True)
    pids = [r[0] for r in con.execute("SELECT DISTINCT (globalPid >> 24) & 16777215 "
                                      "FROM CUPTI_ACTIVITY_KIND_KERNEL")]
    con.close()
    rows = 0
    for pid in pids:
        for key, q in QUERIES.items():
            head, table = q.split(" FROM ")
            df = _adbc_table(path, f"{head} FROM {table} WHERE (({PID_COLUMN[key]} >> 24) & 16777215) = {int(pid)}"
                             ).to_pandas()
            rows += len(df)
            del df
    return rows


def _refuses_write(write, note: str = "") -> str:
    """'yes (...)' when the transport refuses the write, 'NO: ...' when it wrote."""
    try:
        write()
        return "NO: wrote to the file"
    except Exception as exc:  # noqa: BLE001 - any refusal is the answer we want
        return f"yes ({note}{type(exc).__name__}: {str(exc).splitlines()[0][:60]})"


def readonly_ok(name: str, path: str) -> str:
    """Whether the candidate opened the file without write access (it must fail to write)."""
    if name == "adbc":
        import adbc_driver_sqlite.dbapi as adbc
        con = adbc.connect(uri(path))
        cur = con.cursor()
        try:
            return _refuses_write(lambda: cur.execute("CREATE TABLE profclass_probe (x)"))
        finally:
            cur.close()
            con.close()
    if name == "duckdb_sqlite":
        con = _duckdb_attached(path)
        try:
            return _refuses_write(lambda: con.execute("CREATE TABLE nsys.profclass_probe (x INTEGER)"),
                                  "READ_ONLY attach; ")
        finally:
            con.close()
    if name in ("adbc_rowid_ranges", "adbc_per_process"):
        return readonly_ok("adbc", path)
    if name == "connectorx":
        return ("NO: no read-only mode; given sqlite://PATH?mode=ro it creates a new empty database "
                "named PATH?mode=ro (tried), so not usable")
    return "yes (sqlite3 URI mode=ro)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.path)))
        return 0
    results = []
    for name in args.candidates.split(","):
        p = subprocess.run([sys.executable, __file__, args.path, "--one", name], capture_output=True, text=True)
        if p.returncode != 0:
            res = dict(candidate=name, error=(p.stderr.strip().splitlines() or ["failed"])[-1][:200])
        else:
            res = json.loads(p.stdout.strip().splitlines()[-1])
        try:
            res["read_only"] = readonly_ok(name, args.path)
        except Exception as exc:  # noqa: BLE001
            res["read_only"] = f"could not check ({exc})"
        results.append(res)
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
