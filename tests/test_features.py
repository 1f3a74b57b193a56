"""Per-GPU features on hand-built timelines with exact expected nanoseconds.

Each timeline has fewer than 20 kernels and no NVTX, so the window is the whole capture
(first op start to last op end); every expected number below is read off the construction.
"""
from types import SimpleNamespace

import pytest

import profclass
from nsys_builder import NsysExportBuilder
from profclass.analyzers import analyse_gpu, feature_record
from profclass.analyzers.iterations import detect_iterations
from profclass.classify import gpu_walls
from profclass.load import load
from profclass.timeline import build_ops, split_gpus

U = 1_000_000  # 1 ms: far wider than the 50 us slack the idle split allows around calls
B = 1_000_000_000
ELEMENTWISE = "vectorized_elementwise_kernel"
NCCL_A2A = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
NCCL_AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
DEEPEP = "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*)"


def features_of(path):
    prof = load(str(path))
    (g,) = split_gpus(prof, 0, build_ops(prof))
    detect_iterations(g, None)
    a = analyse_gpu(g, prof)
    # every analyzer's fields flat, as the JSON ``features`` has them; ``analysis`` for classify
    return g, SimpleNamespace(**feature_record(a), analysis=a)


def at(x_ms: float) -> int:
    """The timestamp x_ms milliseconds after B, as an exact integer."""
    return B + round(x_ms * U)


def launch_at(t):
    return (int(t), int(t) + 10_000)


@pytest.fixture(scope="module")
def idle_profile(tmp_path_factory):
    """Six 1 ms compute kernels K1..K6 and five gaps, one of each idle kind:

    gap 1 [1U, 2U)   alloc:    cudaMalloc runs inside the gap
    gap 2 [3U, 5U)   offload:  a 1 MiB pinned DtoH copy ended exactly when the gap began (its
                               return, a 1 MiB HtoD copy under K1, makes it offload)
    gap 3 [6U, 9U)   sync:     cudaStreamSynchronize returned inside the gap
    gap 4 [10U, 14U) launch:   K5 was launched 3 ms after the gap began
    gap 5 [15U, 20U) other:    K6 was queued (launched) before the gap; nothing else explains it
    """
    path = tmp_path_factory.mktemp("idle") / "idle.sqlite"
    b = NsysExportBuilder(path)
    b.add_gpu(0)
    def k(s, launch, stream=7):  # a 1 ms kernel at s ms, launched at ``launch`` ms
        b.add_kernel(at(s), at(s + 1), ELEMENTWISE, stream=stream, launch=launch_at(at(launch)))

    k(0, -0.5)                                            # K1 [0, 1U)
    b.add_memcpy(at(0.2), at(0.7), 1 << 20, "HtoD", pinned=True, stream=8,
                 launch=launch_at(at(0.1)))               # the offload's return, hidden under K1
    b.add_runtime("cudaMalloc_v3020", at(1.2), at(1.4))
    k(2, 1.5)                                             # K2 [2U, 3U), launched late but alloc wins
    b.add_memcpy(at(2.5), at(3), 1 << 20, "DtoH", pinned=True, stream=8,
                 launch=launch_at(at(1.6)))               # offload copy, hidden under K2
    k(5, 4)                                               # K3 [5U, 6U)
    b.add_runtime("cudaStreamSynchronize_v3020", at(5.2), at(6.3))
    k(9, 8)                                               # K4 [9U, 10U)
    k(14, 13)                                             # K5 [14U, 15U)
    k(20, 11, stream=9)                                   # K6 [20U, 21U)
    b.write()
    return path


def test_idle_split_exact(idle_profile):
    g, f = features_of(idle_profile)
    assert g.window_source == "whole"
    assert g.window == (B, B + 21 * U)
    assert f.window_ns == 21 * U
    assert f.compute_ns == 6 * U
    assert f.gaps == 5
    assert f.idle_ns == 15 * U
    assert (f.idle_alloc_ns, f.idle_offload_ns, f.idle_sync_ns, f.idle_launch_ns, f.idle_other_ns) == (
        1 * U, 2 * U, 3 * U, 4 * U, 5 * U)
    assert f.alloc_calls == 1 and f.alloc_call_ns == 200_000
    assert f.sync_calls == 1 and f.sync_call_ns == 1_100_000
    assert f.offload_bytes == 2 << 20  # out and back
    assert f.offload_exposed_ns == 0 and f.exposed_copy_ns == 0  # the copy ran under K2
    assert f.comm_ns == 0 and f.exposed_comm_ns == 0


def test_walls_sum_to_window_and_job_shares(idle_profile):
    _, f = features_of(idle_profile)
    walls = gpu_walls(f.analysis)
    # memory = alloc + offload idle; host = the rest of the idle; compute = kernels
    assert walls == {"compute": 6 * U, "communication": 0, "host": 12 * U, "memory": 3 * U}
    d = profclass.diagnose(str(idle_profile))
    assert d.walls["compute"]["share"] == round(6 / 21, 4)
    assert d.walls["host"]["share"] == round(12 / 21, 4)
    assert d.walls["memory"]["share"] == round(3 / 21, 4)
    assert d.walls["host"]["ms_per_step"] == 12.0
    assert d.verdict["wall"] == "host"


def test_pageable_dtoh_copy_counts_as_a_host_sync(tmp_path):
    # a cudaMemcpy to pageable memory returns only when the GPU drained: the gap that opens
    # when it returns is sync idle, even with no explicit synchronise call
    b = NsysExportBuilder(tmp_path / "p.sqlite")
    b.add_gpu(0)
    b.add_kernel(B, B + U, ELEMENTWISE, launch=launch_at(B - U))
    # an async copy API call, so the sync comes from the pageable destination alone
    b.add_memcpy(B + U, B + U + 10_000, 4, "DtoH", pinned=False, launch=(at(0.5), at(1.5)))
    b.add_kernel(B + 4 * U, B + 5 * U, ELEMENTWISE, launch=launch_at(B + 3 * U))
    b.write()
    _, f = features_of(tmp_path / "p.sqlite")
    # gap [U + 10 us, 4U): the copy's call returned at 1.5U, inside it
    assert f.idle_ns == 3 * U - 10_000
    assert f.idle_sync_ns == 3 * U - 10_000
    assert f.idle_launch_ns == 0
    assert f.sync_calls == 1


@pytest.fixture(scope="module")
def comm_profile(tmp_path_factory):
    """Compute C1 [0, 10U) and C2 [12U, 14U) on stream 7; on stream 20 an NCCL SendRecv
    (all-to-all) [5U, 15U), a DeepEP dispatch [16U, 17U) and an NCCL AllReduce [20U, 22U)."""
    path = tmp_path_factory.mktemp("comm") / "comm.sqlite"
    b = NsysExportBuilder(path)
    b.add_gpu(0)
    b.add_kernel(B, B + 10 * U, "sm90_xmma_gemm_bf16bf16_bf16f32", launch=launch_at(B - U))
    b.add_kernel(B + 12 * U, B + 14 * U, ELEMENTWISE, launch=launch_at(B + U))
    for s, e, name in ((5, 15, NCCL_A2A), (16, 17, DEEPEP), (20, 22, NCCL_AR)):
        short = name.split("(")[0].split("<")[0].split()[-1]
        b.add_kernel(B + s * U, B + e * U, short, demangled=name, stream=20, launch=launch_at(B + 2 * U))
    b.write()
    return path


def test_exposed_vs_overlapped_communication(comm_profile):
    _, f = features_of(comm_profile)
    assert f.window_ns == 22 * U
    assert f.compute_ns == 12 * U
    assert f.gemm_ns == 10 * U  # the xmma GEMM only
    assert f.comm_ns == 13 * U
    # SendRecv [5U,15U) is under compute during [5U,10U) and [12U,14U): 7U hidden, 3U exposed
    assert f.overlapped_comm_ns == 7 * U
    assert f.exposed_comm_ns == 6 * U
    assert f.comm_by_type_ns == {"all_to_all": 11 * U, "all_reduce": 2 * U}
    assert f.exposed_comm_by_type_ns == {"all_to_all": 4 * U, "all_reduce": 2 * U}
    assert f.comm_libraries == {"nccl": 2, "deepep": 1}
    # idle: [15U, 16U) and [17U, 20U)
    assert f.idle_ns == 4 * U
    assert gpu_walls(f.analysis) == {"compute": 12 * U, "communication": 6 * U, "host": 4 * U, "memory": 0}


def test_single_rank_collectives_are_all_transfer(comm_profile):
    d = profclass.diagnose(str(comm_profile))
    rows = {r["collective"]: r for r in d.collectives}
    assert rows["all_to_all"]["instances"] == 2
    assert rows["all_to_all"]["transfer_ms_per_step"] == 11.0
    assert rows["all_to_all"]["exposed_transfer_ms_per_step"] == 4.0
    assert rows["all_to_all"]["overlapped_ms_per_step"] == 7.0
    assert rows["all_to_all"]["wait_ms_per_step"] == 0.0
    assert rows["all_reduce"]["exposed_transfer_ms_per_step"] == 2.0
    assert d.stragglers == []


def test_peak_memory_from_usage_events(tmp_path):
    b = NsysExportBuilder(tmp_path / "m.sqlite")
    b.add_gpu(0, total_memory=80 * 2**30)
    b.add_kernel(B, B + U, ELEMENTWISE, launch=launch_at(B - U))
    b.add_memory_event(B - 3 * U, 10 * 2**30)
    b.add_memory_event(B - 2 * U, 30 * 2**30)
    b.add_memory_event(B - U, 10 * 2**30, free=True)
    b.add_memory_event(B - U // 2, 5 * 2**30)
    b.add_memory_event(B - U // 2, 1 * 2**30, mem_kind=1)  # pinned host memory: not the GPU's
    b.write()
    _, f = features_of(tmp_path / "m.sqlite")
    assert f.peak_memory_bytes == 40 * 2**30
    assert f.total_memory_bytes == 80 * 2**30


def test_gpu_metrics_give_sm_active(tmp_path):
    b = NsysExportBuilder(tmp_path / "g.sqlite")
    b.add_gpu(0)
    b.add_kernel(B, B + 10 * U, ELEMENTWISE, launch=launch_at(B - U))
    for i, v in enumerate((20, 40, 60, 80)):
        b.add_gpu_metric(B + i * 2 * U, "SMs Active [Throughput %]", v)
        b.add_gpu_metric(B + i * 2 * U, "Tensor Active [Throughput %]", v // 2)
        b.add_gpu_metric(B + i * 2 * U, "GPC Clock Frequency [MHz]", 1980)
    b.add_gpu_metric(B + 12 * U, "SMs Active [Throughput %]", 100)  # outside the window
    b.write()
    _, f = features_of(tmp_path / "g.sqlite")
    assert f.sm_active == pytest.approx(0.5)
    assert f.tensor_active == pytest.approx(0.25)
    assert "GPU_METRICS" in f.sm_active_source


def test_userbuffers_kernels_are_tp_overlap_communication_not_compute():
    """Transformer Engine's userbuffers (Megatron --tp-comm-overlap) carry TP's all-gather and
    reduce-scatter outside NCCL; their ring-exchange kernels must not pass for SendRecv (EP/PP)."""
    from profclass.kernels import describe_name
    rs = describe_name("void userbuffers_fp16_sum_inplace_gpu_rr_rs<2>(int, int, int, void**, int, unsigned long)")
    ag = describe_name("void userbuffers_fp16_sum_inplace_gpu_rr_ag<4>(int, int, void**)")
    oop = describe_name("void userbuffers_fp8_sum_inplace_gpu_rr_rs_oop<__nv_fp8_e4m3, 8>(float*, int)")
    ring = describe_name("kuserbuffers_pushsendrecv_multiatomic(int*, int*, void*, void*)")
    assert rs["is_comm"] and not rs["is_gemm"] and rs["library"] == "userbuffers"
    assert (rs["collective"], ag["collective"], oop["collective"]) == ("reduce_scatter", "all_gather", "reduce_scatter")
    assert ring["is_comm"] and ring["collective"] == "other"
    # NCCL's own kernels are matched as before, argument list included
    assert describe_name("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)")["collective"] == "all_to_all"


def test_sm_estimate_leaves_out_kernels_without_grid_dimensions(tmp_path):
    """A grid of 0 (no or damaged dimensions in the export) is unknown, not an empty GPU: the
    SM estimate weighs only kernels whose grid is known, and none known gives no estimate."""
    def sm_estimate(grids):
        path = tmp_path / f"g{len(grids)}_{grids[0][0]}.sqlite"
        b = NsysExportBuilder(path)
        b.add_gpu(0)
        for i, grid in enumerate(grids):
            b.add_kernel(B + 2 * i * U, B + (2 * i + 1) * U, ELEMENTWISE, grid=grid, launch=launch_at(B + 2 * i * U - U))
        b.write()
        return features_of(path)[1].sm_active_estimate

    full = sm_estimate([(100000, 1, 1)] * 4)
    assert full is not None and full > 0
    assert sm_estimate([(100000, 1, 1)] * 2 + [(0, 1, 1)] * 2) == pytest.approx(full)
    assert sm_estimate([(0, 1, 1)] * 4) is None
