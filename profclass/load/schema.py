"""Schema probing: which known tables and columns one export has, and the small SQL fragments
that depend on them."""
from __future__ import annotations

import re
import sqlite3

# Identifiers we may put into SQL: tables and columns discovered in a file are used only if
# they are in these sets (values always go through parameters).
KNOWN_TABLES = {
    "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
    "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", "NVTX_EVENTS",
    "CUPTI_ACTIVITY_KIND_CUDA_EVENT",
    "StringIds", "StringTable", "TARGET_INFO_GPU", "TARGET_INFO_CUDA_GPU", "GPU_METRICS",
    "TARGET_INFO_GPU_METRICS", "CUDA_GPU_MEMORY_USAGE_EVENTS", "META_DATA_CAPTURE",
    "META_DATA_EXPORT", "TARGET_INFO_SESSION_START_TIME", "PROCESSES", "TARGET_INFO_SYSTEM_ENV",
    "ENUM_CUDA_MEMCPY_OPER", "ENUM_CUDA_MEM_KIND", "CUPTI_ACTIVITY_KIND_GRAPH_TRACE",
}
KNOWN_COLUMNS = {
    "start", "end", "deviceId", "streamId", "correlationId", "globalPid", "globalTid",
    "shortName", "demangledName", "mangledName", "name", "nameId", "gridX", "gridY", "gridZ",
    "blockX", "blockY", "blockZ", "graphNodeId", "bytes", "copyKind", "srcKind", "dstKind",
    "text", "textId", "eventType", "id", "value", "smCount", "totalMemory",
    "timestamp", "typeId", "metricId", "metricName", "memoryOperationType", "utcEpochNs",
    "devStateName", "pid", "cuDevice", "memKind", "sourceId", "syncType", "eventId", "graphId",
    "graphExecId",
}
_TABLE_SUFFIX = re.compile(r"(.*?)(_V\d+)?")  # used with fullmatch: no newline tricks


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


def string_table(con, schema: Schema) -> str | None:
    """The quoted name of the export's string table (its name changed across nsys versions)."""
    for t in ("StringIds", "StringTable"):
        if schema.has(t, "id", "value"):
            return schema.t(t)
    return None


def pid_expr(col: str) -> str:
    """SQL for the process id inside a globalPid/globalTid (bits 24-47)."""
    return f"(({col} >> 24) & 16777215)"


def pid_filter(col: str | None, pid: int | None, op: str = "=") -> str:
    """A ``... AND `` prefix for a WHERE clause keeping one process's rows (``col``: its
    globalPid/globalTid column); empty when reading every process. Put first: it rejects
    most rows of a many-process file before SQLite decodes the rest of the row (a pass over
    the CUDA API calls ran 1.6x faster so, bench/RESULTS.md). The pid is an int, never text.
    ``op`` "!=": every process but that one."""
    if pid is None or col is None:
        return ""
    return f"{pid_expr(col)} {'!=' if op == '!=' else '='} {int(pid)} AND "


def column_or(cols: set, name: str, alias: str, default: str = "0") -> str:
    """SQL for ``alias.name`` where the table has that column (NULL read as ``default``), else
    ``default``."""
    return f"coalesce({alias}.{name}, {default})" if name in cols else default


def columns_if(s: Schema, table: str, needed: tuple[str, ...], missing: list, what: str) -> set[str] | None:
    """The known columns of ``table``, or None (and ``what`` noted as missing) where the export
    lacks the table or one of the ``needed`` columns."""
    if not s.has(table, *needed):
        missing.append(what)
        return None
    return s.columns[table]
