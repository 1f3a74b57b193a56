"""The replay's per-GPU input: one GPU's steady window as a dependency graph's raw parts.

Built per file (``profclass.ranks``) from the ``GpuTimeline``, so only these arrays, not the
timeline, reach the job level. Per op (kernel, copy, memset): its duration, stream, launch
call and what kind of work it is; per host API call on the launching threads: its duration,
the CPU time before it and, for a call that blocked on the GPU, the op it waited for; and
the cross-stream edges of CUDA event record -> stream-wait-event pairs.

Latencies are measured, not assumed: each op's start is explained by its binding
predecessor (the launch call, the op before it on its stream, an event's source op); the
binding edge keeps the measured latency up to a cap (``LATENCY_CAPS``), the others get the
GPU's typical latency (its low quantile). What a cap cuts off is time the graph does not
explain: ``unexplained_ns``, reported as the replay's blind spot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .. import intervals as iv
from ..analyzers.compute import fusion_codes
from ..analyzers.idle import attention_masks, copy_roles
from ..analyzers.recompute import recomputed_spans
from ..kernel_table import name_codes
from ..timeline import GpuTimeline
from .constants import LATENCY_CAPS, MAX_TRACE_ITERATIONS, MAX_TRACE_OPS
from .host_calls import ALLOC, LAUNCH, OTHER, SYNC, call_frame, window_calls  # noqa: F401 (kinds re-exported)
from .latency import inferred_edges, latencies

# op kinds
COMPUTE, COMM, COPY, MEMSET = 0, 1, 2, 3
# pair-kernel sides (``kernels``: a kernel only the forward, or only the backward, runs)
FWD, BWD = 1, 2
# input copies' host memory (``Ops.input``)
PINNED, PAGEABLE = 1, 2


@dataclass(frozen=True)
class Ops:
    """The window's ops (kernels, copies, memsets), sorted by start."""

    start: np.ndarray
    dur: np.ndarray
    stream: np.ndarray  # stream codes (0..)
    kind: np.ndarray  # COMPUTE / COMM / COPY / MEMSET
    gemm: np.ndarray  # bool
    fusion: np.ndarray  # int8: 1 + the fusion flag that replaces it (compute.FUSION_FLAGS), -1 other pointwise, 0
    recomputed: np.ndarray  # bool: inside the recomputed forward (memory wall)
    offload: np.ndarray  # bool: host<->device activation/optimizer offload copies (memory wall)
    launch: np.ndarray  # index of the launching call, -1 when outside the window/unknown
    launch_lag: np.ndarray  # ns from the launch call's start to the op's start when not blocked
    stream_gap: np.ndarray  # ns from the stream predecessor's end
    name: np.ndarray | None = None  # code into GpuTrace.names per op (-1: none); None: not kept
    grid: np.ndarray | None = None  # CTAs a kernel launched (0: not a kernel, or not in the export)
    side: np.ndarray | None = None  # int8: FWD / BWD for a forward- or backward-only pair kernel, 0 other
    input: np.ndarray | None = None  # int8: a host-to-device input copy (idle.copy_roles) from PINNED / PAGEABLE memory, 0 other
    mask: np.ndarray | None = None  # bool: an input copy that is the batch's attention mask (idle.attention_masks)


@dataclass(frozen=True)
class Calls:
    """API calls on the launching threads, sorted by (tid, start); calls that neither launch,
    block nor allocate are folded into the CPU time before the next kept one."""

    c_start: np.ndarray
    c_dur: np.ndarray  # the call's own time (blocking calls: without the wait)
    c_tid: np.ndarray
    c_kind: np.ndarray  # LAUNCH / SYNC / ALLOC / OTHER
    c_gap: np.ndarray  # CPU time since the previous call of the thread ended
    c_gc: np.ndarray  # of which inside garbage-collection NVTX ranges
    c_load: np.ndarray  # of which loading kernels at their first use (analyzers.host.kernel_load_ns)
    c_load_waits: np.ndarray  # bool: the call is such a load that waited for the device to drain
    c_target: np.ndarray  # op a blocking call waited for, -1: it did not wait
    c_wake: np.ndarray  # ns from that op's end to the call's return
    c_recomputed: np.ndarray  # bool: host work of the recomputed forward
    c_folded: np.ndarray  # API calls folded into c_gap (each one a traced call the profiler slowed)


@dataclass(frozen=True)
class Edges:
    """Cross-stream edges (op e_dst waits for op e_src's end, + e_lag ns: CUDA events, or
    timing where a wait's record is not traced) and host threads' hand-offs (call h_dst
    waited for call h_src of another thread, + h_lag ns)."""

    e_src: np.ndarray
    e_dst: np.ndarray
    e_lag: np.ndarray
    e_from_start: np.ndarray  # bool: from the source's start (a shared hardware queue), not its end
    h_src: np.ndarray
    h_dst: np.ndarray
    h_lag: np.ndarray


@dataclass(frozen=True)
class GpuTrace:
    """One GPU's replay window (times on the file's own clock; ``shift_ns`` is added by the
    job level, as clock alignment moved the summary)."""

    lo: int  # window start (first replayed steady iteration)
    hi: int  # window end
    iterations: int  # steady iterations in [lo, hi)
    ops: Ops
    calls: Calls
    edges: Edges
    edge_source: str  # "cuda events" (plus timing where a wait's record is not traced) or "timing"
    measured_end: int  # last op or call end in the window (the replay's reference)
    unexplained_ns: int  # waiting no edge explains (latencies above their caps)
    shift_ns: int = 0
    names: tuple = ()  # normalised op names (what ``diff`` matches by): ``Ops.name`` codes into it
    iteration_starts: np.ndarray | tuple = ()  # each replayed iteration's start (``span.common`` cuts by them)
    sm_count: int = 0  # the GPU's SMs (the export's TARGET_INFO_GPU; 0: not in it)
    mask_bytes_share: float = 0.0  # the attention masks' share of the window's input bytes (``Ops.mask``)

    @property
    def n_ops(self) -> int:
        return len(self.ops.start)

    def ops_named(self, match) -> np.ndarray:
        """Per op: whether its normalised name satisfies ``match`` (str -> truthy), each distinct
        name tested once; False for an op without a name, and for all where names are not kept."""
        if self.ops.name is None:
            return np.zeros(self.n_ops, bool)
        hit = np.array([bool(match(n)) for n in self.names] + [False])  # code -1 reads the trailing False
        return hit[self.ops.name]


def _window(gpu: GpuTimeline) -> tuple[int, int, np.ndarray]:
    """The steady iterations replayed, as (start, end, each iteration's start): all of them, or
    the first ones up to MAX_TRACE_OPS ops (a long capture's step is the same step again:
    replaying more adds time, not fidelity)."""
    st = gpu.steady
    if st.empty:
        return gpu.window[0], gpu.window[1], np.zeros(0, np.int64)
    starts = st["start"].to_numpy(np.int64)
    ends = st["step_end"].to_numpy(np.int64) if "step_end" in st else st["end"].to_numpy(np.int64)
    op_starts = gpu.ops["start"].to_numpy(np.int64)
    counts = np.searchsorted(op_starts, ends) - np.searchsorted(op_starts, starts)
    k = max(1, int(np.searchsorted(np.cumsum(counts), MAX_TRACE_OPS, side="right")))
    k = min(k, len(starts), MAX_TRACE_ITERATIONS)
    return int(starts[0]), int(ends[k - 1]), starts[:k]


def build(gpu: GpuTimeline, sync_events: pd.DataFrame | None, recomputes: bool = True, sm_count: int = 0) -> GpuTrace:
    """``recomputes``: the memory analyzer found recompute on this GPU (``_recomputed``); ``sm_count``:
    the GPU's SMs (0: unknown)."""
    lo, hi, its_starts = _window(gpu)
    o = gpu.ops
    s_all = o["start"].to_numpy(np.int64)
    sel = slice(np.searchsorted(s_all, lo), np.searchsorted(s_all, hi))
    ops = o.iloc[sel]
    start = ops["start"].to_numpy(np.int64)
    end = ops["end"].to_numpy(np.int64)
    n = len(start)
    opname = ops["op"].astype(str).to_numpy()
    is_comm = ops["is_comm"].to_numpy(bool)
    kind = np.where(opname == "memcpy", COPY, np.where(opname == "memset", MEMSET,
                                                       np.where(is_comm, COMM, COMPUTE))).astype(np.int8)
    stream = pd.factorize(ops["stream"].to_numpy(np.int64))[0].astype(np.int64)
    calls = window_calls(gpu, lo, hi)
    launch = _launch_index(ops["correlation"].to_numpy(np.int64), ops["launch_start"].to_numpy(np.int64), calls)
    recomputed = _recomputed(ops, kind, lo, hi, recomputes)
    inputs, masks, offload = _copy_roles(ops, kind)
    nbytes = ops["bytes"].to_numpy(np.int64)
    mask_share = float(nbytes[masks].sum() / nbytes[inputs > 0].sum()) if masks.any() else 0.0
    e_src, e_dst, source = _event_edges(ops, stream, sync_events, gpu.pid)
    from_start = np.zeros(len(e_src), bool)
    c_end = calls["end"].to_numpy(np.int64)
    lags, gaps, e_lag, unexplained, waiting = latencies(start, end, stream, launch, calls["start"], e_src, e_dst,
                                                        c_end=c_end)
    if waiting.any():
        # an op that waited for something no traced edge names (an event recorded with
        # cudaEventRecordWithFlags, which CUPTI does not report, or no event tables at all)
        # waited for the op of another stream that ended just before it started
        i_src, i_dst, i_start = inferred_edges(start, end, stream, np.flatnonzero(waiting))
        if len(i_src):
            e_src, e_dst = np.concatenate([e_src, i_src]), np.concatenate([e_dst, i_dst])
            from_start = np.concatenate([from_start, i_start])
            lags, gaps, e_lag, unexplained, _ = latencies(start, end, stream, launch, calls["start"], e_src, e_dst,
                                                          from_start, c_end)
    c = call_frame(calls, start, end, launch, recomputed, gpu.nvtx, lo, hi)
    remap = c.pop("remap")
    launch = np.where(launch >= 0, remap[np.clip(launch, 0, None)] if len(remap) else -1, -1)
    measured_end = int(max(end.max(initial=lo), calls["start"].to_numpy(np.int64).max(initial=lo)))
    # a kernel load's time after the drain it waited for is the load's own work, not a late wake;
    # so is a free's (the memory unmapped once the device drained)
    own_work = c["c_load_waits"] | (c["c_kind"] == ALLOC)
    unexplained += int(np.clip(c["c_wake"] - LATENCY_CAPS["wake"], 0, None)[~own_work].sum())
    h = {k: c.pop(k) for k in ("h_src", "h_dst", "h_lag")}
    name_code, names = name_codes(ops["full_name"])
    return GpuTrace(
        lo=lo, hi=hi, iterations=len(its_starts), iteration_starts=its_starts,
        ops=Ops(start=start, dur=end - start, stream=stream, kind=kind, gemm=ops["is_gemm"].to_numpy(bool),
                fusion=_fusion(ops, kind), recomputed=recomputed, offload=offload, launch=launch,
                launch_lag=lags, stream_gap=gaps, name=name_code, grid=ops["grid"].to_numpy(np.int64), side=_sides(ops, kind),
                input=inputs, mask=masks),
        calls=Calls(**c), edges=Edges(e_src=e_src, e_dst=e_dst, e_lag=e_lag, e_from_start=from_start, **h),
        edge_source=source, measured_end=measured_end, unexplained_ns=unexplained, names=names,
        sm_count=int(sm_count), mask_bytes_share=mask_share)


def _copy_roles(ops: pd.DataFrame, kind: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per op, the copies' roles as the idle and memory analyzers read them (``idle.copy_roles``,
    one rule for all three): PINNED / PAGEABLE for a host-to-device input copy (the batch), 0 for
    every other op; whether it is the batch's attention mask (``idle.attention_masks``); whether
    it is an offload copy (large copies both ways, of similar volume)."""
    out, mask, offload = np.zeros(len(kind), np.int8), np.zeros(len(kind), bool), np.zeros(len(kind), bool)
    pos = np.flatnonzero(kind == COPY)
    if not len(pos):
        return out, mask, offload
    off, inp = copy_roles(ops.iloc[pos].reset_index(drop=True))
    offload[pos[off.index.to_numpy()]] = True
    at = pos[inp.index.to_numpy()]
    out[at] = np.where(inp["pinned"].to_numpy(bool), PINNED, PAGEABLE)
    mask[at] = attention_masks(inp["bytes"].to_numpy(np.int64))
    return out, mask, offload


def _sides(ops: pd.DataFrame, kind: np.ndarray) -> np.ndarray:
    side = ops["side"].astype(str).to_numpy() if "side" in ops else np.full(len(kind), "")
    return np.where(kind != COMPUTE, 0, np.where(side == "fwd", FWD, np.where(side == "bwd", BWD, 0))).astype(np.int8)


def _launch_index(corr: np.ndarray, launch_start: np.ndarray, calls: pd.DataFrame) -> np.ndarray:
    cc = calls["correlation"].to_numpy(np.int64)
    order = np.argsort(cc, kind="stable")
    pos = np.searchsorted(cc[order], corr)
    pos = np.clip(pos, 0, max(len(cc) - 1, 0))
    found = (len(cc) > 0) & (launch_start >= 0) & (corr > 0)
    if len(cc):
        found &= cc[order][pos] == corr
    return np.where(found, order[pos] if len(cc) else -1, -1).astype(np.int64)


def _recomputed(ops: pd.DataFrame, kind: np.ndarray, lo: int, hi: int, recomputes: bool) -> np.ndarray:
    """Ops inside the recomputed forward (``recompute.recomputed_spans``): its compute kernels and
    what ran with them. None where the memory analyzer found no recompute (its MIN_RECOMPUTE_RATIO
    gate: a pipeline's later micro-batch forwards between backwards look like recompute)."""
    comp = ops[kind == COMPUTE]
    if comp.empty or not recomputes:
        return np.zeros(len(ops), bool)
    spans = iv.clip(recomputed_spans(comp), lo, hi)
    if not len(spans[0]):
        return np.zeros(len(ops), bool)
    s = ops["start"].to_numpy(np.int64)
    k = np.searchsorted(spans[0], s, side="right") - 1
    return (k >= 0) & (s < spans[1][np.clip(k, 0, None)])


def _fusion(ops: pd.DataFrame, kind: np.ndarray) -> np.ndarray:
    """Per op: the fusion flag that replaces it (``compute.fusion_codes``); GEMMs and others 0."""
    return np.where((kind == COMPUTE) & ~ops["is_gemm"].to_numpy(bool), fusion_codes(ops["full_name"]), 0).astype(np.int8)


def _event_edges(ops: pd.DataFrame, stream: np.ndarray, ev: pd.DataFrame | None, pid: int):
    """(src, dst) op pairs of CUDA event waits: a stream-wait-event makes the first op launched
    on the waiting stream after it wait for the last op launched on the recording stream
    before the event's record (correlation ids order the API calls of a process)."""
    empty = np.zeros(0, np.int64)
    if ev is None or ev.empty:
        return empty, empty, "timing"
    ev = ev[ev["pid"] == pid] if "pid" in ev else ev
    rec = ev[ev["kind"] == 0]
    # which synchronisation a row is, by what it names: CUPTI's syncType numbers moved between
    # releases (nsys 2024.2.3 with CUDA 13 writes 3 for cudaStreamWaitEvent, which its own enum
    # table calls a stream synchronize); a stream wait names both a stream and an event
    unknown = 0xFFFFFFFF
    wait = ev[(ev["kind"] != 0) & (ev["stream"] != unknown) & (ev["event"] != unknown)]
    if rec.empty or wait.empty:
        return empty, empty, "cuda events"
    raw_stream = ops["stream"].to_numpy(np.int64)
    corr = ops["correlation"].to_numpy(np.int64)
    # ops keyed by (stream, launch correlation)
    okey = (raw_stream << 32) | (corr & 0xFFFFFFFF)
    oorder = np.argsort(okey, kind="stable")
    okey_s = okey[oorder]
    rkey = (rec["event"].to_numpy(np.int64) << 32) | (rec["correlation"].to_numpy(np.int64) & 0xFFFFFFFF)
    rorder = np.argsort(rkey, kind="stable")
    rkey_s = rkey[rorder]
    wev = wait["event"].to_numpy(np.int64)
    wcorr = wait["correlation"].to_numpy(np.int64)
    r = np.searchsorted(rkey_s, (wev << 32) | (wcorr & 0xFFFFFFFF)) - 1
    ok = (r >= 0) & ((rkey_s[np.clip(r, 0, None)] >> 32) == wev)
    rrow = rorder[np.clip(r, 0, None)]
    rstream = rec["stream"].to_numpy(np.int64)[rrow]
    rcorr = rec["correlation"].to_numpy(np.int64)[rrow]
    src = np.searchsorted(okey_s, (rstream << 32) | (rcorr & 0xFFFFFFFF)) - 1
    ok &= (src >= 0) & ((okey_s[np.clip(src, 0, None)] >> 32) == rstream)
    wstream = wait["stream"].to_numpy(np.int64)
    dst_s = np.searchsorted(okey_s, (wstream << 32) | (wcorr & 0xFFFFFFFF))
    ok &= (dst_s < len(okey_s)) & ((okey_s[np.clip(dst_s, 0, len(okey_s) - 1)] >> 32) == wstream)
    dst = oorder[np.clip(dst_s, 0, len(okey_s) - 1)]
    src_i = oorder[np.clip(src, 0, None)][ok]
    dst_i = dst[ok]
    start = ops["start"].to_numpy(np.int64)
    end = ops["end"].to_numpy(np.int64)
    # an edge the measured times contradict was not binding in this capture's order
    keep = (src_i != dst_i) & (end[src_i] <= start[dst_i]) & (stream[src_i] != stream[dst_i])
    pairs = np.unique(np.stack([src_i[keep], dst_i[keep]]), axis=1) if keep.any() else np.zeros((2, 0), np.int64)
    return pairs[0].astype(np.int64), pairs[1].astype(np.int64), "cuda events"
