"""Advice that fits the job in front of it (issue 31 part 4): fixes that assume a MoE model
appear only when the profile shows one, and a profile that is not a training step says so
(config ``scope``, ``missing[]``) and gets only the fixes that apply to any CUDA program."""
from __future__ import annotations

import tomllib

import pytest
from conftest import PROFILES, ROOT, profile_path

import profclass
from nsys_builder import NsysExportBuilder

FIXES = tomllib.loads((ROOT / "profclass" / "data" / "fixes.toml").read_text())["fix"]
MOE_FIXES = {f["id"] for f in FIXES if f.get("requires", {}).get("moe") is True}
TRAINING_FIXES = {f["id"] for f in FIXES if f.get("requires", {}).get("scope") == "training"}
SQLITE = [n for n in PROFILES if profile_path(n).suffix != ".nsys-rep"]
DENSE = [n for n in PROFILES if n.startswith("mcore_dense_")]

MS = 1_000_000
T0 = 10_000_000_000


def test_the_moe_fixes_are_the_ones_that_assume_moe():
    # every fix naming experts, routing, dispatchers or the MoE layer requires MoE evidence
    named = {f["id"] for f in FIXES if any(w in (f["title"] + f["why"]).lower()
                                           for w in ("expert", "routing", "dispatcher", "moe layer", "token"))}
    assert named <= MOE_FIXES, named - MOE_FIXES
    assert {"compute_grouped_gemm", "host_moe_token_sync", "ep_deepep", "ep_balance_routing"} <= MOE_FIXES


@pytest.mark.parametrize("name", SQLITE)
def test_no_moe_fix_without_moe_evidence(name, diagnosis):
    d = diagnosis(name)
    moe, scope = d.config["moe"], d.config["scope"]
    assert scope["value"] == "training", scope  # every corpus capture is a training step
    if not moe["value"]:
        assert not MOE_FIXES & {f["id"] for f in d.fixes}


@pytest.mark.parametrize("name", DENSE)
def test_dense_megatron_jobs_show_no_moe(name, diagnosis):
    d = diagnosis(name)
    assert d.config["moe"]["value"] is False
    assert "compute_grouped_gemm" not in {f["id"] for f in d.fixes}


@pytest.mark.parametrize("name", ["mcore_ep4_base", "mcore_gb_dp4_base", "comm_4gpu"])
def test_moe_jobs_show_moe(name, diagnosis):
    """EP > 1, or the router's top-k kernels of a MoE model with EP = 1 (gb_dp4: DP only)."""
    assert diagnosis(name).config["moe"]["value"] is True


def jacobi(path, ranks=2, steps=8):
    """An MPI-style Jacobi solver, 2 GPUs in one report: per iteration a stencil kernel, a halo
    exchange between the two ranks (NCCL send/recv), a norm reduced to the host (small D2H copy
    and a stream synchronise the GPU idles behind): no backward, no optimizer, no router."""
    b = NsysExportBuilder(path)
    for r in range(ranks):
        pid, dev = 301 + r, r
        b.add_gpu(dev)
        for i in range(steps):
            t = T0 + i * 10 * MS
            b.add_nvtx(f"iteration {i}", t - MS // 2, t + 9 * MS, pid=pid)
            b.add_kernel(t, t + 4 * MS, "jacobi_kernel(float*, const float*, float*, int, int)", device=dev,
                         pid=pid, launch=(t - MS // 4, t - MS // 4 + 5_000))
            b.add_kernel(t + 4 * MS, t + 5 * MS, "ncclDevKernel_SendRecv", device=dev, pid=pid, stream=20,
                         demangled="ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                         launch=(t - MS // 5, t - MS // 5 + 5_000))
            b.add_memcpy(t + 5 * MS, t + 5 * MS + 10_000, 4, kind="DtoH", device=dev, pid=pid)
            b.add_runtime("cudaStreamSynchronize", t + 5 * MS, t + 8 * MS, pid=pid)
            b.add_kernel(t + 8 * MS + 100_000, t + 8 * MS + 600_000, "reduce_norm_kernel", device=dev, pid=pid,
                         launch=(t + 8 * MS, t + 8 * MS + 5_000))
    b.write()
    return path


def test_a_solver_is_not_a_training_step(tmp_path):
    """The issue's case: a public MPI Jacobi export was told to remove 'the host-side token-count
    sync from the MoE layer'. Its verdict stands; its advice is what any CUDA program can use."""
    d = profclass.diagnose(str(jacobi(tmp_path / "jacobi.sqlite")))
    assert d.config["moe"]["value"] is False and d.config["scope"]["value"] == "other"
    ids = {f["id"] for f in d.fixes}
    assert not ids & (MOE_FIXES | TRAINING_FIXES), ids
    assert any(m.startswith("scope:") for m in d.missing)
    assert d.verdict["wall"] in ("compute", "communication", "host", "memory")
