"""The GPUs' properties, their sampled metrics and the memory-usage events: the per-device
tables of an export (split from ``tables`` for size)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from .profile import GPU_COLS, MEMEV_COLS, METRIC_COLS, empty_frame
from .schema import Schema, columns_if, pid_expr, pid_filter
from .transport import query

METRICS_WANTED = {
    "SMs Active": "sm_active", "SM Active": "sm_active", "SM Issue": "sm_issue",
    "Tensor Active": "tensor_active", "DRAM Read Bandwidth": "dram_read",
    "DRAM Write Bandwidth": "dram_write",
}


def read_gpus(con, s: Schema, missing: list) -> pd.DataFrame:
    for T in ("TARGET_INFO_GPU", "TARGET_INFO_CUDA_GPU"):
        if s.has(T, "id"):
            c = s.columns[T]
            dev = "cuDevice" if T == "TARGET_INFO_CUDA_GPU" and "cuDevice" in c else "id"
            sql = (f"SELECT {dev}, {'name' if 'name' in c else 'NULL'}, "
                   f"{'smCount' if 'smCount' in c else '0'}, {'totalMemory' if 'totalMemory' in c else '0'} "
                   f"FROM {s.t(T)}")
            df = query(con, sql, GPU_COLS).drop_duplicates("device")
            df["name"] = df["name"].fillna("").astype(str)
            return df
    missing.append("GPU properties (TARGET_INFO_GPU)")
    return empty_frame(GPU_COLS)


def read_gpu_metrics(con, s: Schema, missing: list) -> pd.DataFrame:
    if not (s.has("GPU_METRICS", "timestamp", "metricId", "value")
            and s.has("TARGET_INFO_GPU_METRICS", "metricId", "metricName")):
        missing.append("GPU metrics (GPU_METRICS; capture with --gpu-metrics-device)")
        return empty_frame(METRIC_COLS)
    names = {}
    for mid, mname in con.execute(
            f"SELECT DISTINCT metricId, metricName FROM {s.t('TARGET_INFO_GPU_METRICS')}"):
        base = str(mname).split(" [")[0]
        if base in METRICS_WANTED and "Throughput %" in str(mname):
            names[mid] = METRICS_WANTED[base]
    if not names:
        missing.append("GPU metrics (no SM Active metric)")
        return empty_frame(METRIC_COLS)
    ids = ",".join("?" * len(names))
    # typeId identifies the GPU; with one GPU per report (the usual case) it maps to device 0,
    # else to devices in typeId order (nsys numbers metric sources in device order).
    type_ids = [r[0] for r in con.execute(
        f"SELECT DISTINCT typeId FROM {s.t('GPU_METRICS')} ORDER BY typeId")]
    dev_of = {t: i for i, t in enumerate(type_ids)}
    df = query(con, f"SELECT timestamp, typeId, metricId, value FROM {s.t('GPU_METRICS')} "
                     f"WHERE metricId IN ({ids})", dict(timestamp="int64", device="int64",
                                                         metric="int64", value="float64"),
                params=tuple(names))
    df["device"] = df["device"].map(dev_of).astype(np.int64)
    df["metric"] = df["metric"].map(names)
    return df


def read_memory_events(con, s: Schema, missing: list, pid: int | None = None) -> pd.DataFrame:
    T = "CUDA_GPU_MEMORY_USAGE_EVENTS"
    c = columns_if(s, T, ("start", "bytes", "memoryOperationType"), missing,
                    "GPU memory usage (CUDA_GPU_MEMORY_USAGE_EVENTS; capture with --cuda-memory-usage=true)")
    if c is None:
        return empty_frame(MEMEV_COLS)
    # memoryOperationType 0 = allocation, 1 = deallocation; memKind 2 = device memory
    kind = "AND memKind=2" if "memKind" in c else ""
    sql = (f"SELECT start, {pid_expr('globalPid') if 'globalPid' in c else '0'}, "
           f"{'deviceId' if 'deviceId' in c else '0'}, "
           f"CASE WHEN memoryOperationType=0 THEN bytes ELSE -bytes END FROM {s.t(T)} "
           f"WHERE {pid_filter('globalPid' if 'globalPid' in c else None, pid)}1=1 {kind}")
    return query(con, sql, MEMEV_COLS)
