"""CUDA event records and synchronisations: what the replay's cross-stream and host-wait edges
are read from (``profclass.replay.trace``)."""
from __future__ import annotations

import pandas as pd

from .profile import SYNC_COLS, empty_frame
from .schema import Schema, column_or, pid_expr, pid_filter
from .transport import query


def read_sync_events(con, s: Schema, missing: list, pid: int | None = None) -> pd.DataFrame:
    """CUDA event records and synchronisations (``SYNC_COLS``); no rows where the export has
    neither table (the replay then infers its edges from timing and says so)."""
    parts = []
    for T, kind in (("CUPTI_ACTIVITY_KIND_CUDA_EVENT", "0"), ("CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", "syncType")):
        if not s.has(T, "streamId", "eventId", "correlationId"):
            continue
        c = s.columns[T]
        gp = "globalPid" if "globalPid" in c else None
        times = "start, end" if {"start", "end"} <= c else "0, 0"
        if kind == "syncType" and "syncType" not in c:
            continue
        parts.append(f"SELECT {kind}, {pid_expr(gp) if gp else '0'}, {column_or(c, 'deviceId', 'e')}, "
                     f"e.streamId, e.eventId, e.correlationId, {times} FROM {s.t(T)} e "
                     f"WHERE {pid_filter(gp, pid)}1=1")
    if not parts:
        return empty_frame(SYNC_COLS)
    return query(con, " UNION ALL ".join(parts), SYNC_COLS)
