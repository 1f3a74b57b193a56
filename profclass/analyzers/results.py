"""The analyzers' result types, in a module that imports none of them: the per-GPU results
(one per per-GPU analyzer, together ``GpuAnalysis``) and the cross-rank stages' outputs
(``CommAnalysis``, ``PipelineResult``). The analyzer modules, the job context (``job``) and
the stages after them read these types from here, so no import runs back up.

A per-GPU result is built by its analyzer's ``analyse`` and not changed after it; the
cross-rank outputs are frozen.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class WindowResult:
    window_ns: int = 0
    iterations: int = 0  # steady iterations (0 only for an empty window)
    step_ns: list[int] = field(default_factory=list)  # each steady step, start to next start


@dataclass
class ComputeResult:
    compute_ns: int = 0  # |compute| (WindowSets)
    gemm_ns: int = 0
    exposed_copy_ns: int = 0  # |copies - compute - comm|: copies and memsets nothing hides
    fp8_kernels: int = 0
    sm_active: float | None = None
    sm_active_estimate: float | None = None
    sm_active_source: str = ""
    tensor_active: float | None = None
    fusible_ns: int = 0  # kernels of the fusion flags' families (compute.fusion_codes), summed (ns in the window)
    per_step_kernel_ns: int = 0  # kernels of PER_STEP_KERNELS (optimizer, grad norm), summed
    norm_rows: int = 0  # rows a forward normalisation kernel launch covers (``compute.norm_rows``)


@dataclass
class CommResult:
    """One GPU's communication over its window, against its own compute (no peers needed)."""

    comm_ns: int = 0  # |comm|
    exposed_comm_ns: int = 0  # |comm - compute|
    overlapped_comm_ns: int = 0  # |comm & compute|
    comm_by_type_ns: dict[str, int] = field(default_factory=dict)
    exposed_comm_by_type_ns: dict[str, int] = field(default_factory=dict)
    comm_libraries: dict[str, int] = field(default_factory=dict)  # kernels per library


@dataclass
class IdleResult:
    idle_ns: int = 0
    gaps: int = 0
    idle_alloc_ns: int = 0
    idle_offload_ns: int = 0
    idle_input_ns: int = 0  # gaps an input copy (host-to-device, not offload) closes or opens
    idle_sync_ns: int = 0
    idle_launch_ns: int = 0
    idle_other_ns: int = 0
    idle_stall_ns: int = 0  # idle in gaps of at least STALL_GAP_NS (any cause): the host was away
    alloc_calls: int = 0  # allocator calls in the window
    alloc_call_ns: int = 0
    free_calls: int = 0  # of which memory handed back to the driver (cudaFree-type, cuMemUnmap), in the window
    sync_calls: int = 0  # host syncs (and blocking pageable device-to-host copies) in the window
    sync_call_ns: int = 0
    device_syncs: int = 0  # of which whole-device syncs (DEVICE_SYNC_CALLS)
    input_bytes: int = 0  # host-to-device input copies in the window (not offload)
    input_pageable_bytes: int = 0  # of which from pageable host memory (a blocking copy)
    input_mask_bytes: int = 0  # of which attention masks (``idle.attention_masks``)
    input_exposed_ns: int = 0  # input copies nothing hides


@dataclass
class HostResult:
    kernels: int = 0  # kernels in the window
    launch_bound_kernels: int = 0  # kernels shorter than the CUDA call that launched them
    launch_bound_kernel_ns: int = 0
    graph_kernels: int = 0
    graph_launches: int = 0
    gc_ns: int = 0  # inside NVTX ranges named like garbage collection
    pause_ns: int = 0  # without such ranges: the launching thread's pauses (host.host_pauses)
    probe_call_ns: int | None = None  # median own time of the fixed-work driver call (load.tables.PROBE_CALL_NAMES)
    probe_calls: int = 0
    kernel_loads: int = 0  # kernels a library loaded at their first use inside the window (host.KERNEL_LOAD_CALLS)
    kernel_load_ns: int = 0  # host time in those loads' calls


@dataclass
class MemoryResult:
    recompute_ratio: float = 0.0  # extra forward passes per backward pass
    pair_fwd_ns: int = 0  # forward kernels that have a backward partner
    recompute_ns: int = 0  # measured when recompute_measured_ns is known, else the ratio estimate
    recompute_measured_ns: int | None = None  # recomputed-forward spans; None: no backward seen
    recompute_compute_ns: int = 0  # of the measured spans: compute kernels
    recompute_comm_ns: int = 0  # communication no compute hides (the re-run dispatch)
    recompute_idle_ns: int = 0  # GPU idle between the recomputed kernels (launch gaps)
    offload_bytes: int = 0
    offload_exposed_ns: int = 0  # offload copies nothing hides
    peak_memory_bytes: int | None = None
    total_memory_bytes: int | None = None
    # forward passes per step and in the longest backward-free stretch (recompute.forward_passes;
    # None without recompute-free backward kernels): micro-batches x VPP chunks, and the warm-up
    forward_passes: float | None = None
    warmup_forwards: float | None = None


@dataclass
class ProfilerResult:
    op_ranges: int = 0  # emit_nvtx-style op ranges in the window
    nvtx_ranges: int = 0  # all NVTX ranges of the process in the window
    op_range_cost_ns: int | None = None  # measured per-range host cost; None: too few ranges
    profiler_inflation_ns: int = 0  # host time the op ranges add over the window


@dataclass(frozen=True)
class GpuAnalysis:
    """One GPU's analyzer results: one field per per-GPU analyzer (its ``Analyzer.per_gpu_field``)."""

    window: WindowResult
    compute: ComputeResult
    communication: CommResult
    idle: IdleResult
    host: HostResult
    memory: MemoryResult
    profiler: ProfilerResult


# ---------------------------------------------------------------------------------------------
# cross-rank stages

@dataclass
class RankComm:
    """One rank's collectives against its peers (summed while they are matched)."""

    wait_ns: int = 0
    exposed_wait_ns: int = 0
    transfer_ns: int = 0
    exposed_transfer_ns: int = 0
    blame_ns: int = 0
    by_type: dict = field(default_factory=dict)  # type -> dict(wait_ns, transfer_ns, exposed_*)


@dataclass(frozen=True)
class CommAnalysis:
    """The communication stage (``matching.analyse_ranks``): collectives matched across ranks."""

    ranks: tuple[RankComm, ...]  # per GPU (record order): wait vs transfer, blame
    collectives: list[dict]  # one row per collective type (job level, ms per step)
    # per GPU: its communication kernels with their ``group`` and ``group_source`` (comm_groups)
    kernels: tuple = ()
    members: tuple = ()  # per GPU: group -> member ranks (comm_groups)
    matched_instances: int = 0
    # the busiest EP member's compute over the members' mean between consecutive EP
    # collectives, summed per step (mean over the job's EP groups): work, not timing
    ep_work_imbalance_ms: float = 0.0
    # per GPU: (end, exposed transfer ns) of each EP and DP collective in its window, the
    # traffic a faster fabric speeds up (``fabric_bankable``)
    fabric_transfers: tuple = ()
    # per GPU: of its exposed waiting, ns estimated for collectives whose peers are not in the
    # profile (``_lone_waits``): waiting for ranks nobody saw, for reasons nobody measured
    unseen_exposed_wait_ns: tuple = ()


@dataclass(frozen=True)
class PipelineResult:
    """The pipeline stage (``pipeline_bubbles.measure``): PP bubble and stage imbalance."""

    stages: int | None = None
    virtual_stages: int | None = None
    microbatches: int | None = None
    bubble_ms_per_step: float | None = None
    bubble_share: float | None = None
    theory_share: float | None = None
    slowest_stage: int | None = None
    stage_imbalance_ms: float | None = None
    imbalance_at_end_stage: bool = False  # the slowest stage is the first or the last
    p2p: str | None = None  # how its exchanges ran: "batched" or "overlapped" (pp_program.captured_p2p)
    per_stage: list = field(default_factory=list)  # {stage, rank, busy_ms, bubble_ms, idle_ms}

    def to_dict(self) -> dict:
        return asdict(self)
