"""Kernel-to-launch join in SQLite against the loader's way (two reads, joined in numpy).

    python bench/launch_join.py bench/out/dpoverlap_4gpu_1G.sqlite

Per process (as the loader now reads a multi-process export), times:

- sql_join: kernels LEFT JOIN the launch calls on correlationId inside SQLite (no index in an
  nsys export: SQLite builds an automatic partial index on the launch calls per query);
- two_reads: the kernels, and the launch calls, each read on its own (what the loader does;
  the join is then a sorted-array lookup in numpy, ~0.1 s for a million kernels).

Read-only URI; nothing is written to the file.
"""
from __future__ import annotations

import os
import sys
import time
from urllib.parse import quote

import adbc_driver_sqlite.dbapi as adbc

LAUNCH_LIKE = ("cudaLaunch%", "cuLaunch%", "cudaMemcpy%", "cuMemcpy%", "cudaMemset%", "cuMemset%",
               "cudaGraphLaunch%", "cuGraphLaunch%")


def fetch(con, sql: str):
    cur = con.cursor()
    cur.execute(sql)
    return cur.fetch_arrow_table()


def main(path: str) -> int:
    con = adbc.connect("file:" + quote(os.path.abspath(path)) + "?mode=ro")
    like = " OR ".join(f"value LIKE '{p}'" for p in LAUNCH_LIKE)
    ids = ",".join(str(i) for i in fetch(con, f"SELECT id FROM StringIds WHERE {like}").column(0).to_pylist())
    pids = fetch(con, "SELECT DISTINCT (globalPid >> 24) & 16777215 FROM CUPTI_ACTIVITY_KIND_KERNEL").column(0)
    launches = ("SELECT correlationId, start, end FROM CUPTI_ACTIVITY_KIND_RUNTIME "
                "WHERE ((globalTid >> 24) & 16777215) = {pid} AND nameId IN ({ids})")
    kernels = ("SELECT start, end, correlationId FROM CUPTI_ACTIVITY_KIND_KERNEL "
               "WHERE ((globalPid >> 24) & 16777215) = {pid}")
    total = {"sql_join": 0.0, "two_reads": 0.0}
    for pid in pids.to_pylist():
        t = time.perf_counter()
        joined = fetch(con, f"SELECT k.start, k.end, r.start, r.end FROM ({kernels.format(pid=pid)}) k LEFT JOIN "
                            f"({launches.format(pid=pid, ids=ids)}) r ON r.correlationId = k.correlationId")
        total["sql_join"] += time.perf_counter() - t
        t = time.perf_counter()
        k = fetch(con, kernels.format(pid=pid))
        r = fetch(con, launches.format(pid=pid, ids=ids))
        total["two_reads"] += time.perf_counter() - t
        print(f"pid {pid}: {joined.num_rows} joined rows; {k.num_rows} kernels + {r.num_rows} launch calls",
              flush=True)
    con.close()
    for name, s in total.items():
        print(f"{name}: {s:.2f} s over {len(pids)} processes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
