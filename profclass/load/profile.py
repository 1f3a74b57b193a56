"""What the loader returns: ``RawProfile``, and the columns and dtypes of each of its tables
(documented in the package docstring)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd


@dataclass
class RawProfile:
    """Everything profclass reads from one export (columns: see the ``profclass.load`` docstring)."""

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
    # read one process at a time (``load_by_process``): every device with kernels in the
    # file (column device), which per-GPU steps that number the file's devices need
    file_devices: pd.DataFrame | None = None
    # CUDA event records and synchronisations (the replay's cross-stream and host-wait edges)
    sync_events: pd.DataFrame | None = None
    # (median own time ns, calls read) of the host's fixed-work driver calls (``read_host_probe``)
    host_probe: tuple | None = None


def empty_frame(cols: dict[str, str]) -> pd.DataFrame:
    """A table with no rows and the given columns and dtypes."""
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
NVTX_COLS = dict(start="int64", end="int64", pid="int64", tid="int64", text="object")
GPU_COLS = dict(device="int64", name="object", sm_count="int64", total_memory="int64")
METRIC_COLS = dict(timestamp="int64", device="int64", metric="object", value="float64")
# kind: 0 event record (CUPTI_ACTIVITY_KIND_CUDA_EVENT), else CUPTI's syncType (1 event
# synchronize, 2 stream wait event, 3 stream synchronize, 4 context synchronize)
SYNC_COLS = dict(kind="int64", pid="int64", device="int64", stream="int64", event="int64",
                 correlation="int64", start="int64", end="int64")
MEMEV_COLS = dict(start="int64", pid="int64", device="int64", bytes="int64")
