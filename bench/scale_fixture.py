"""Grow a real nsys export into a big one by replicating its steady-state iterations.

    python bench/scale_fixture.py [--source fixtures/profiles/dpoverlap_4gpu.sqlite.xz]
                                  [--sizes 100M,1G,4G] [--out bench/out]

Writes ``<out>/<name>_<size>.sqlite``. The copy keeps the source's schema, strings, kernel
names and shapes; only rows are added:

- Per process (``globalPid``), the steady span runs from the start of its second NVTX
  iteration range to the start of its last one (the first is warm-up, the last stays as the
  capture's tail). Every row of every activity table (kernels, copies, memsets, CUDA API calls,
  synchronisation, NVTX ranges, GPU metrics, memory events) that starts inside the span is
  copied k times, shifted by k x P (P: the longest span over the processes, so a copy
  never overlaps its original, and ranks stay in step for the collectives).
- ``correlationId`` of a copy is offset by k x (max correlationId + 1), in every table that has
  it, so each copied kernel still joins its copied launch call and no other.
- NVTX ``iteration N`` ranges are renumbered (N + k x steady iterations), so iteration labels
  stay unique and increasing.
- Rows after the span (the last iteration, teardown) move to after the last copy; NVTX
  ranges that enclose the span's end (an outer ``train`` range) are stretched.

Each INSERT ... SELECT copies all replicas made so far, so the replicated span doubles per
statement (log2(k) statements). The output is written with journaling off (it is ours).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sqlite3
import sys
import time

import zstandard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SOURCE = os.path.join(ROOT, "fixtures", "profiles", "dpoverlap_4gpu.sqlite.xz")
ITERATION = re.compile(r"^\s*iteration\s+(\d+)\s*$", re.I)
# tables whose rows only move (not copied): profiler bookkeeping, not workload activity
MOVE_ONLY = {"PROFILER_OVERHEAD", "DIAGNOSTIC_EVENT", "CUPTI_ACTIVITY_KIND_CUDA_EVENT"}
SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMG]?)B?$", re.I)


def parse_size(text: str) -> int:
    m = SIZE.match(text.strip())
    if not m:
        raise SystemExit(f"scale_fixture: bad size {text!r} (e.g. 100M, 1G)")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()])


def size_label(n: int) -> str:
    return f"{n // 2**30}G" if n % 2**30 == 0 else f"{n // 2**20}M"


def decompress(src: str, dst: str) -> None:
    if src.endswith(".zst"):
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            zstandard.ZstdDecompressor().copy_stream(fi, fo)
    elif src.endswith(".xz"):
        import lzma
        with lzma.open(src, "rb") as fi, open(dst, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
    else:
        shutil.copyfile(src, dst)


def columns(con, table: str) -> list[str]:
    return [r[1] for r in con.execute(f'PRAGMA table_info("{table}")')]


def activity_tables(con) -> dict[str, list[str]]:
    """Tables with a ``start`` or ``timestamp`` column and rows: name -> columns."""
    out = {}
    for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name"):
        cols = columns(con, t)
        if ("start" in cols or "timestamp" in cols) and con.execute(f'SELECT 1 FROM "{t}" LIMIT 1').fetchone():
            out[t] = cols
    return out


def pid_key(cols: list[str], alias: str = "") -> str | None:
    """SQL for the process key (pid bits of globalPid/globalTid) of a row, or None."""
    a = f"{alias}." if alias else ""
    if "globalPid" in cols:
        return f"({a}globalPid >> 24)"
    if "globalTid" in cols:
        return f"({a}globalTid >> 24)"
    return None


def steady_spans(con) -> tuple[dict[int, tuple[int, int]], int, int]:
    """Per process: (start of 2nd iteration, start of last iteration); iterations replicated."""
    rows = con.execute("SELECT start, globalTid >> 24, text FROM NVTX_EVENTS "
                       "WHERE eventType IN (59, 60) AND text IS NOT NULL").fetchall()
    per: dict[int, list[tuple[int, int]]] = {}
    for start, pk, text in rows:
        m = ITERATION.match(text)
        if m:
            per.setdefault(pk, []).append((int(m.group(1)), start))
    spans, counts = {}, set()
    for pk, its in per.items():
        its.sort()
        if len(its) < 3:
            continue
        spans[pk] = (its[1][1], its[-1][1])
        counts.add(len(its) - 2)
    if not spans:
        raise SystemExit("scale_fixture: the source has no process with 3+ NVTX 'iteration N' ranges")
    period = max(t1 - t0 for t0, t1 in spans.values())
    return spans, period, min(counts)


def grow(source_sqlite: str, out_path: str, target_bytes: int, log=print) -> dict:
    tmp = out_path + ".part"
    shutil.copyfile(source_sqlite, tmp)
    con = sqlite3.connect(tmp, isolation_level=None)
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    con.execute("PRAGMA cache_size=-262144")
    tables = activity_tables(con)
    spans, period, n_iters = steady_spans(con)
    g0 = min(t0 for t0, _ in spans.values())
    g1 = max(t1 for _, t1 in spans.values())
    con.execute("CREATE TEMP TABLE win (pk INTEGER PRIMARY KEY, t0 INTEGER, t1 INTEGER)")
    con.executemany("INSERT INTO win VALUES (?,?,?)", [(pk, a, b) for pk, (a, b) in spans.items()])
    corr_step = 1 + max((con.execute(f'SELECT coalesce(max(correlationId), 0) FROM "{t}"').fetchone()[0]
                         for t, cols in tables.items() if "correlationId" in cols), default=0)

    def window(cols, alias="x"):
        """SQL for this row's (t0, t1): its process's span, else the union of all spans."""
        pk = pid_key(cols, alias)
        if pk is None:
            return str(g0), str(g1)
        return (f"coalesce((SELECT t0 FROM win WHERE pk = {pk}), {g0})",
                f"coalesce((SELECT t1 FROM win WHERE pk = {pk}), {g1})")

    # how many rows one replica adds, to pick the replica count for the target size
    size0 = os.path.getsize(tmp)
    total_rows, span_rows = 0, 0
    for t, cols in tables.items():
        tcol = "start" if "start" in cols else "timestamp"
        t0, t1 = window(cols)
        n_all = con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]
        total_rows += n_all
        if t not in MOVE_ONLY:
            span_rows += con.execute(f'SELECT count(*) FROM "{t}" x WHERE x.{tcol} >= {t0} '
                                     f'AND x.{tcol} < {t1}').fetchone()[0]
    # the activity tables hold nearly all of an export's bytes
    bytes_per_replica = size0 * span_rows / max(total_rows, 1)
    copies = max(1, round((target_bytes - size0) / bytes_per_replica) + 1)  # incl. the original
    shift = (copies - 1) * period
    log(f"  {os.path.basename(out_path)}: {len(spans)} processes, steady span {period / 1e6:.1f} ms "
        f"({n_iters} iterations), {span_rows} rows per copy, {copies} copies")

    # 1. the tail (rows after the span) moves behind the last copy
    for t, cols in tables.items():
        tcol = "start" if "start" in cols else "timestamp"
        t0, t1 = window(cols, t)
        sets = [f"{tcol} = {tcol} + {shift}"] + (["end = end + " + str(shift)] if "end" in cols else [])
        con.execute(f'UPDATE "{t}" SET {", ".join(sets)} WHERE {tcol} >= {t1.replace("x.", t + ".")}')
        if t == "NVTX_EVENTS":  # ranges enclosing the span's end (an outer "train" range) stretch
            con.execute(f'UPDATE "{t}" SET end = end + {shift} WHERE start < {t1} AND end >= {t1}'
                        .replace("x.", t + "."))

    # 2. copies, doubling the replicated span per statement
    made = 1
    while made < copies:
        n = min(made, copies - made)
        for t, cols in tables.items():
            if t in MOVE_ONLY:
                continue
            tcol = "start" if "start" in cols else "timestamp"
            t0, _ = window(cols)
            exprs = []
            for c in cols:
                q = f'x."{c}"'
                if c in ("start", "end", "timestamp"):
                    exprs.append(f"{q} + {made * period}")
                elif c == "correlationId":
                    exprs.append(f"{q} + {made * corr_step}")
                elif c == "text" and t == "NVTX_EVENTS":
                    exprs.append(f"CASE WHEN x.text LIKE 'iteration %' AND trim(substr(x.text, 11)) "
                                 f"GLOB '[0-9]*' THEN 'iteration ' || (CAST(substr(x.text, 11) AS INTEGER) "
                                 f"+ {made * n_iters}) ELSE x.text END")
                else:
                    exprs.append(q)
            where = f"x.{tcol} >= {t0} AND x.{tcol} < {t0} + {n * period}"
            if t == "NVTX_EVENTS":
                where += " AND x.eventType IN (59, 60)"  # not domain/category registrations
            con.execute(f'INSERT INTO "{t}" ({", ".join(chr(34) + c + chr(34) for c in cols)}) '
                        f'SELECT {", ".join(exprs)} FROM "{t}" x WHERE {where}')
        made += n
    con.close()
    os.replace(tmp, out_path)
    return dict(copies=copies, period_ns=period, rows_per_copy=span_rows, bytes=os.path.getsize(out_path))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default=DEFAULT_SOURCE, help="a real export (.sqlite or .sqlite.zst)")
    ap.add_argument("--sizes", default="100M,1G,4G", help="comma-separated target sizes")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    ap.add_argument("--force", action="store_true", help="rebuild files that exist")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    name = os.path.basename(args.source).split(".")[0]
    base = os.path.join(args.out, name + ".sqlite")
    if not os.path.exists(base) or args.force:
        decompress(args.source, base)
    for text in args.sizes.split(","):
        target = parse_size(text)
        out = os.path.join(args.out, f"{name}_{size_label(target)}.sqlite")
        if os.path.exists(out) and not args.force:
            print(f"  {out}: exists ({os.path.getsize(out) / 2**20:.0f} MiB)")
            continue
        t = time.perf_counter()
        info = grow(base, out, target)
        print(f"  {out}: {info['bytes'] / 2**20:.0f} MiB in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
