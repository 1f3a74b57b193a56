"""The one shared builder of small Nsight Systems SQLite exports for unit tests.

Tables are created from the real nsys 2024.2.3 DDL (``tests/data/nsys_2024_2_3_schema.sql``,
copied verbatim from exports of the corpus), so a built file is what profclass meets in the
field, only smaller. Rows are added with one method per kind of event; ``write()`` creates
the file. Every time is an int64 nanosecond on the export's own clock.

    b = NsysExportBuilder(tmp_path / "run.sqlite")
    b.add_gpu(0)
    b.add_kernel(1_000, 2_000, "gemm_kernel", launch=(500, 600))  # + its cudaLaunchKernel row
    b.add_nvtx("iteration 0", 400, 2_100)
    b.write()

Identifiers follow nsys: ``globalPid = (vm << 48) | (pid << 24)`` and ``globalTid = globalPid
| tid`` (profclass decodes ``(g >> 24) & 0xFFFFFF``); the main thread's tid is the pid.

Schema variants (for loader tests and for bad-input / fuzzing helpers), all constructor
options:

- ``tables``: create exactly these tables (logical names from the DDL file). Default: the
  tables of a plain ``nsys profile -t cuda,nvtx`` export, plus GPU_METRICS /
  TARGET_INFO_GPU_METRICS / CUDA_GPU_MEMORY_USAGE_EVENTS when rows were added for them
  (nsys writes those only when the capture option was on).
- ``drop_tables``: leave these out (their rows are discarded).
- ``drop_columns``: ``{table: [column, ...]}``; the DDL is rebuilt without them and row values
  for them are discarded (e.g. NVTX_EVENTS without ``textId``).
- ``rename_tables``: ``{logical: real}``, e.g. ``{"TARGET_INFO_GPU": "TARGET_INFO_CUDA_GPU"}`` or
  ``{"CUPTI_ACTIVITY_KIND_KERNEL": "CUPTI_ACTIVITY_KIND_KERNEL_V2"}``.
- ``extra_ddl``: more SQL run after the tables exist (extra tables, indexes, triggers).

``add_row(table, **values)`` adds a row to any table with any columns (the generic escape
hatch); ``after_write`` (a list of SQL statements or callables taking the connection) runs
after the rows are in, to damage a file on purpose.
"""
from __future__ import annotations

import os
import re
import sqlite3
from collections import defaultdict
from pathlib import Path

SCHEMA_FILE = Path(__file__).parent / "data" / "nsys_2024_2_3_schema.sql"
NSYS_VERSION = "2024.2.3.38"
EXPORT_SCHEMA_VERSION = "3.11.1"

# tables every `nsys profile -t cuda,nvtx` export of the corpus has
DEFAULT_TABLES = (
    "StringIds", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
    "CUPTI_ACTIVITY_KIND_MEMSET", "CUPTI_ACTIVITY_KIND_RUNTIME",
    "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", "NVTX_EVENTS", "TARGET_INFO_GPU",
    "TARGET_INFO_SESSION_START_TIME", "META_DATA_CAPTURE", "META_DATA_EXPORT", "PROCESSES",
    "ENUM_CUDA_MEMCPY_OPER", "ENUM_CUDA_MEM_KIND",
)
# written by nsys only when the matching capture option was on
OPTIONAL_TABLES = ("GPU_METRICS", "TARGET_INFO_GPU_METRICS", "CUDA_GPU_MEMORY_USAGE_EVENTS")

# ENUM_CUDA_MEMCPY_OPER / ENUM_CUDA_MEM_KIND rows as nsys 2024.2.3 writes them
MEMCPY_OPER = [(0, "CUDA_MEMCPY_KIND_UNKNOWN", "Unknown"), (1, "CUDA_MEMCPY_KIND_HTOD", "Host-to-Device"),
               (2, "CUDA_MEMCPY_KIND_DTOH", "Device-to-Host"), (3, "CUDA_MEMCPY_KIND_HTOA", "Host-to-Array"),
               (4, "CUDA_MEMCPY_KIND_ATOH", "Array-to-Host"), (5, "CUDA_MEMCPY_KIND_ATOA", "Array-to-Array"),
               (6, "CUDA_MEMCPY_KIND_ATOD", "Array-to-Device"), (7, "CUDA_MEMCPY_KIND_DTOA", "Device-to-Array"),
               (8, "CUDA_MEMCPY_KIND_DTOD", "Device-to-Device"), (9, "CUDA_MEMCPY_KIND_HTOH", "Host-to-Host"),
               (10, "CUDA_MEMCPY_KIND_PTOP", "Peer-to-Peer"),
               (11, "CUDA_MEMCPY_KIND_UVM_HTOD", "Unified Host-to-Device"),
               (12, "CUDA_MEMCPY_KIND_UVM_DTOH", "Unified Device-to-Host"),
               (13, "CUDA_MEMCPY_KIND_UVM_DTOD", "Unified Device-to-Device")]
MEM_KIND = [(0, "CUDA_MEMOPR_MEMORY_KIND_PAGEABLE", "Pageable"), (1, "CUDA_MEMOPR_MEMORY_KIND_PINNED", "Pinned"),
            (2, "CUDA_MEMOPR_MEMORY_KIND_DEVICE", "Device"), (3, "CUDA_MEMOPR_MEMORY_KIND_ARRAY", "Array"),
            (4, "CUDA_MEMOPR_MEMORY_KIND_MANAGED", "Managed"),
            (5, "CUDA_MEMOPR_MEMORY_KIND_DEVICE_STATIC", "Device Static"),
            (6, "CUDA_MEMOPR_MEMORY_KIND_MANAGED_STATIC", "Managed Static"),
            (7, "CUDA_MEMOPR_MEMORY_KIND_UNKNOWN", "Unknown")]
COPY_KIND = {"HtoD": 1, "DtoH": 2, "DtoD": 8, "HtoH": 9, "PtoP": 10}
MEM_PAGEABLE, MEM_PINNED, MEM_DEVICE = 0, 1, 2
NVTX_PUSHPOP, NVTX_STARTEND, NVTX_DOMAIN_CREATE = 59, 60, 75
RUNTIME_EVENT_CLASS = 1  # ENUM_NSYS_EVENT_CLASS of CUDA runtime calls in real exports
# runtime call names carry the CUDA version suffix, as nsys records them
LAUNCH_KERNEL = "cudaLaunchKernel_v7000"
MEMCPY_ASYNC = "cudaMemcpyAsync_v3020"
MEMSET_ASYNC = "cudaMemsetAsync_v3020"


def global_pid(pid: int, vm: int = 1) -> int:
    """nsys's serialized GlobalId of a process."""
    return (vm << 48) | ((pid & 0xFFFFFF) << 24)


def global_tid(pid: int, tid: int | None = None, vm: int = 1) -> int:
    """nsys's serialized GlobalId of a thread (tid defaults to the process's main thread)."""
    return global_pid(pid, vm) | ((pid if tid is None else tid) & 0xFFFFFF)


class Column:
    def __init__(self, name: str, definition: str):
        self.name = name
        self.definition = definition  # "name TYPE [NOT NULL] [PRIMARY KEY]"
        self.not_null = "NOT NULL" in definition.upper()
        self.type = definition.split()[1].upper() if len(definition.split()) > 1 else "INTEGER"


def parse_schema(path: Path = SCHEMA_FILE) -> dict[str, tuple[str, list[Column]]]:
    """{table: (verbatim DDL, columns)} from an ``sqlite3 .schema`` dump."""
    text = Path(path).read_text()
    out = {}
    for m in re.finditer(r"^CREATE TABLE (\w+) \((.*?)\n\);", text, re.S | re.M):
        name, body = m.group(1), m.group(2)
        cols = []
        for line in body.splitlines():
            code = line.split("--", 1)[0].strip().rstrip(",").strip()
            if code:
                cols.append(Column(code.split()[0], " ".join(code.split())))
        out[name] = (m.group(0), cols)
    return out


class NsysExportBuilder:
    """Collects rows, then ``write()`` creates an nsys-shaped SQLite export at ``path``."""

    def __init__(self, path, tables=None, *, drop_tables=(), drop_columns=None, rename_tables=None,
                 extra_ddl=(), after_write=(), session_start_ns: int | None = 1_795_659_794_721_005_514,
                 nsys_version: str | None = NSYS_VERSION, default_pid: int = 1000, vm: int = 1,
                 schema_file: Path = SCHEMA_FILE):
        self.path = Path(path)
        self.schema = parse_schema(schema_file)
        self.tables = None if tables is None else list(tables)
        unknown = set(self.tables or ()) - set(self.schema)
        if unknown:
            raise ValueError(f"tables not in {schema_file.name}: {sorted(unknown)}")
        self.drop_tables = set(drop_tables)
        self.drop_columns = {t: set(c) for t, c in (drop_columns or {}).items()}
        self.rename_tables = dict(rename_tables or {})
        self.extra_ddl = list(extra_ddl)
        self.after_write = list(after_write)
        self.session_start_ns = session_start_ns
        self.nsys_version = nsys_version
        self.default_pid = default_pid
        self.vm = vm
        self.rows: dict[str, list[dict]] = defaultdict(list)
        self._strings: dict[str, int] = {}
        self._next_corr: dict[int, int] = defaultdict(lambda: 1)
        self._domains: dict[tuple[int, str], int] = {}
        self._metric_ids: dict[str, int] = {}
        self._processes: set[int] = set()

    # -- identifiers ---------------------------------------------------------------------
    def string_id(self, value: str) -> int:
        """The StringIds id of ``value`` (added on first use)."""
        if value not in self._strings:
            self._strings[value] = len(self._strings) + 1
        return self._strings[value]

    def gpid(self, pid: int | None) -> int:
        pid = self.default_pid if pid is None else pid
        self._processes.add(pid)
        return global_pid(pid, self.vm)

    def gtid(self, pid: int | None, tid: int | None = None) -> int:
        pid = self.default_pid if pid is None else pid
        self._processes.add(pid)
        return global_tid(pid, tid, self.vm)

    def correlation(self, pid: int | None = None) -> int:
        """A fresh correlation id for ``pid`` (they are per process in nsys)."""
        pid = self.default_pid if pid is None else pid
        c = self._next_corr[pid]
        self._next_corr[pid] = c + 1
        return c

    def _corr(self, pid, correlation):
        if correlation is None:
            return self.correlation(pid)
        pid = self.default_pid if pid is None else pid
        self._next_corr[pid] = max(self._next_corr[pid], correlation + 1)
        return correlation

    # -- rows ----------------------------------------------------------------------------
    def add_row(self, table: str, **values) -> None:
        """Any row for any table in the DDL file; unspecified NOT NULL columns become 0."""
        if table not in self.schema:
            raise ValueError(f"unknown table {table}")
        self.rows[table].append(values)

    def add_kernel(self, start: int, end: int, name: str, *, device: int = 0, pid: int | None = None,
                   tid: int | None = None, stream: int = 7, correlation: int | None = None,
                   grid=(1, 1, 1), block=(128, 1, 1), launch: tuple[int, int] | None = None,
                   demangled: str | None = None, graph_node: int | None = None, context: int = 1,
                   launch_name: str = LAUNCH_KERNEL) -> int:
        """A kernel; ``launch=(start, end)`` also adds its cudaLaunchKernel call (same
        correlationId, on thread ``tid`` of ``pid``). ``name`` is the short name and, unless
        ``demangled`` is given, the demangled name too. Returns the correlation id."""
        corr = self._corr(pid, correlation)
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        self.add_row("CUPTI_ACTIVITY_KIND_KERNEL", start=start, end=end, deviceId=device, contextId=context,
                     streamId=stream, correlationId=corr, globalPid=self.gpid(pid),
                     demangledName=self.string_id(demangled or name), shortName=self.string_id(name),
                     mangledName=self.string_id(demangled or name), registersPerThread=32,
                     gridX=grid[0], gridY=grid[1], gridZ=grid[2], blockX=block[0], blockY=block[1],
                     blockZ=block[2], staticSharedMemory=0, dynamicSharedMemory=0, localMemoryPerThread=0,
                     localMemoryTotal=0, gridId=len(self.rows["CUPTI_ACTIVITY_KIND_KERNEL"]) + 1,
                     graphNodeId=graph_node)
        if launch is not None:
            self.add_runtime(launch_name, launch[0], launch[1], pid=pid, tid=tid, correlation=corr)
        return corr

    def add_memcpy(self, start: int, end: int, bytes: int, kind: str = "DtoH", pinned: bool = False, *,
                   device: int = 0, pid: int | None = None, tid: int | None = None, stream: int = 7,
                   correlation: int | None = None, launch: tuple[int, int] | None = None,
                   launch_name: str = MEMCPY_ASYNC, context: int = 1) -> int:
        """A copy (kind HtoD, DtoH, DtoD, HtoH, PtoP); the host side is pinned or pageable."""
        corr = self._corr(pid, correlation)
        host = MEM_PINNED if pinned else MEM_PAGEABLE
        src, dst = {"HtoD": (host, MEM_DEVICE), "DtoH": (MEM_DEVICE, host),
                    "HtoH": (host, host)}.get(kind, (MEM_DEVICE, MEM_DEVICE))
        self.add_row("CUPTI_ACTIVITY_KIND_MEMCPY", start=start, end=end, deviceId=device, contextId=context,
                     streamId=stream, correlationId=corr, globalPid=self.gpid(pid), bytes=bytes,
                     copyKind=COPY_KIND[kind], srcKind=src, dstKind=dst, srcDeviceId=device,
                     dstDeviceId=device)
        if launch is not None:
            self.add_runtime(launch_name, launch[0], launch[1], pid=pid, tid=tid, correlation=corr)
        return corr

    def add_memset(self, start: int, end: int, bytes: int, *, value: int = 0, device: int = 0,
                   pid: int | None = None, tid: int | None = None, stream: int = 7,
                   correlation: int | None = None, launch: tuple[int, int] | None = None,
                   launch_name: str = MEMSET_ASYNC, context: int = 1) -> int:
        corr = self._corr(pid, correlation)
        self.add_row("CUPTI_ACTIVITY_KIND_MEMSET", start=start, end=end, deviceId=device, contextId=context,
                     streamId=stream, correlationId=corr, globalPid=self.gpid(pid), value=value,
                     bytes=bytes, memKind=MEM_DEVICE)
        if launch is not None:
            self.add_runtime(launch_name, launch[0], launch[1], pid=pid, tid=tid, correlation=corr)
        return corr

    def add_runtime(self, name: str, start: int, end: int, *, pid: int | None = None,
                    tid: int | None = None, correlation: int | None = None, return_value: int = 0) -> int:
        """A CUDA API call, named as nsys records it (``cudaMalloc_v3020``, ``cuMemCreate``...)."""
        corr = self._corr(pid, correlation)
        self.add_row("CUPTI_ACTIVITY_KIND_RUNTIME", start=start, end=end, eventClass=RUNTIME_EVENT_CLASS,
                     globalTid=self.gtid(pid, tid), correlationId=corr, nameId=self.string_id(name),
                     returnValue=return_value)
        return corr

    def add_synchronization(self, start: int, end: int, *, device: int = 0, pid: int | None = None,
                            stream: int = 7, correlation: int | None = None, sync_type: int = 3,
                            event_id: int = 0, context: int = 1) -> None:
        self.add_row("CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", start=start, end=end, deviceId=device,
                     contextId=context, streamId=stream, correlationId=correlation,
                     globalPid=self.gpid(pid), syncType=sync_type, eventId=event_id)

    def add_nvtx(self, text: str, start: int, end: int | None, *, pid: int | None = None,
                 tid: int | None = None, domain: str | None = None, registered: bool = False,
                 event_type: int = NVTX_PUSHPOP) -> None:
        """An NVTX range (push/pop by default). ``domain`` names a domain (its create event is
        added once per process); ``registered`` stores the text in StringIds via ``textId``
        (as NCCL's registered strings are) instead of the ``text`` column."""
        dom = 0
        if domain is not None:
            key = (self.default_pid if pid is None else pid, domain)
            if key not in self._domains:
                self._domains[key] = len(self._domains) + 1
                self.add_row("NVTX_EVENTS", start=start, end=None, eventType=NVTX_DOMAIN_CREATE, text=domain,
                             globalTid=self.gtid(pid, tid), domainId=self._domains[key])
            dom = self._domains[key]
        row = dict(start=start, end=end, eventType=event_type, globalTid=self.gtid(pid, tid), domainId=dom)
        if registered:
            row["textId"] = self.string_id(text)
        else:
            row["text"] = text
        self.add_row("NVTX_EVENTS", **row)

    def add_gpu(self, device: int = 0, name: str = "NVIDIA H200", sm_count: int = 132,
                total_memory: int = 150_109_880_320, *, cu_device: int | None = None,
                chip: str = "GH100") -> None:
        self.add_row("TARGET_INFO_GPU", vmId=global_pid(0, self.vm), id=device, name=name,
                     busLocation=f"0000:00:{device + 9:02x}.0", isDiscrete=1, totalMemory=total_memory,
                     smCount=sm_count, chipName=chip, cuDevice=device if cu_device is None else cu_device,
                     computeMajor=9, computeMinor=0)

    def add_process(self, pid: int, name: str = "python3") -> None:
        self._processes.discard(pid)
        self.add_row("PROCESSES", globalPid=global_pid(pid, self.vm), pid=pid, name=name)

    def add_meta_command(self, args: list[str], env: dict[str, str] | None = None,
                         working_dir: str = "") -> None:
        """The captured command line (``PROCESS_0:COMMAND`` + ``ARGUMENT_i``) and environment
        (``ENVIRONMENT_VARIABLE`` rows ``NAME="value"``), as nsys records them."""
        self.add_row("META_DATA_CAPTURE", name="PROCESS_0:COMMAND", value=args[0])
        for i, a in enumerate(args[1:]):
            self.add_row("META_DATA_CAPTURE", name=f"PROCESS_0:ARGUMENT_{i}", value=a)
        self.add_row("META_DATA_CAPTURE", name="PROCESS_0:WORKING_DIR", value=working_dir)
        for k, v in (env or {}).items():
            self.add_row("META_DATA_CAPTURE", name="PROCESS_0:ENVIRONMENT_VARIABLE", value=f'{k}="{v}"')

    def add_memory_event(self, start: int, bytes: int, *, free: bool = False, device: int = 0,
                         pid: int | None = None, address: int = 0, mem_kind: int = MEM_DEVICE,
                         correlation: int | None = None, context: int = 1) -> None:
        """A CUDA_GPU_MEMORY_USAGE_EVENTS row (``--cuda-memory-usage=true``): an allocation,
        or a free with ``free=True`` (memoryOperationType 0 / 1)."""
        self.add_row("CUDA_GPU_MEMORY_USAGE_EVENTS", start=start, globalPid=self.gpid(pid), deviceId=device,
                     contextId=context, address=address, pc=0, bytes=bytes, memKind=mem_kind,
                     memoryOperationType=1 if free else 0, correlationId=correlation)

    def add_gpu_metric(self, timestamp: int, metric: str, value: int, *, device: int = 0) -> None:
        """A GPU_METRICS sample; ``metric`` is nsys's full name, e.g. "SMs Active [Throughput %]".
        The metric's TARGET_INFO_GPU_METRICS row is added on first use; ``typeId`` identifies
        the GPU (one per device, in device order, as nsys numbers metric sources)."""
        type_id = 0x1_0000_0000_0000 + (device << 8)
        key = f"{type_id}:{metric}"
        if key not in self._metric_ids:
            mid = len({k for k in self._metric_ids if k.startswith(f"{type_id}:")})
            self._metric_ids[key] = mid
            self.add_row("TARGET_INFO_GPU_METRICS", typeId=type_id, sourceId=type_id,
                         typeName="GPU Metrics", metricId=mid, metricName=metric)
        self.add_row("GPU_METRICS", timestamp=timestamp, typeId=type_id, metricId=self._metric_ids[key],
                     value=value)

    # -- writing -------------------------------------------------------------------------
    def _table_list(self) -> list[str]:
        if self.tables is not None:
            names = list(self.tables)
        else:
            names = list(DEFAULT_TABLES) + [t for t in OPTIONAL_TABLES if self.rows.get(t)]
        return [t for t in names if t not in self.drop_tables]

    def _ddl(self, table: str) -> tuple[str, list[str]]:
        verbatim, cols = self.schema[table]
        real = self.rename_tables.get(table, table)
        dropped = self.drop_columns.get(table, set())
        kept = [c for c in cols if c.name not in dropped]
        if not dropped and real == table:
            return verbatim, [c.name for c in kept]
        body = ",\n    ".join(c.definition for c in kept)
        return f"CREATE TABLE {real} (\n    {body}\n);", [c.name for c in kept]

    def _default_rows(self) -> dict[str, list[dict]]:
        rows = {t: list(r) for t, r in self.rows.items()}
        rows["StringIds"] = [dict(id=i, value=v) for v, i in self._strings.items()] + rows.get("StringIds", [])
        rows["ENUM_CUDA_MEMCPY_OPER"] = [dict(id=i, name=n, label=lbl) for i, n, lbl in MEMCPY_OPER]
        rows["ENUM_CUDA_MEM_KIND"] = [dict(id=i, name=n, label=lbl) for i, n, lbl in MEM_KIND]
        if self.session_start_ns is not None:
            rows.setdefault("TARGET_INFO_SESSION_START_TIME", []).insert(0, dict(utcEpochNs=self.session_start_ns))
        if self.nsys_version is not None:
            rows.setdefault("META_DATA_EXPORT", [])[:0] = [
                dict(name="EXPORT_PRODUCT_NAME", value="NVIDIA Nsight Systems"),
                dict(name="EXPORT_PRODUCT_VERSION", value=self.nsys_version),
                dict(name="EXPORT_SCHEMA_VERSION", value=EXPORT_SCHEMA_VERSION)]
        rows["PROCESSES"] = rows.get("PROCESSES", []) + [
            dict(globalPid=global_pid(p, self.vm), pid=p, name="python3") for p in sorted(self._processes)]
        return rows

    def write(self) -> Path:
        """Create the file (replacing any earlier one) and return its path."""
        if self.path.exists():
            os.remove(self.path)
        rows = self._default_rows()
        con = sqlite3.connect(self.path)
        try:
            for table in self._table_list():
                ddl, cols = self._ddl(table)
                con.execute(ddl)
                required = {c.name for c in self.schema[table][1] if c.not_null}
                data = rows.get(table, [])
                if not data:
                    continue
                real = self.rename_tables.get(table, table)
                sql = f'INSERT INTO "{real}" ({", ".join(cols)}) VALUES ({", ".join("?" * len(cols))})'
                con.executemany(sql, [[r.get(c, 0 if c in required else None) for c in cols] for r in data])
            for stmt in self.extra_ddl:
                con.execute(stmt)
            con.commit()
            for step in self.after_write:
                if callable(step):
                    step(con)
                else:
                    con.execute(step)
            con.commit()
        finally:
            con.close()
        return self.path
