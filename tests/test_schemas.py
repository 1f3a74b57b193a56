"""Old and new export schemas: real exports of other nsys releases, and the table/column
variants the loader handles (docs/schemas.md), built with the shared builder."""
from __future__ import annotations

from pathlib import Path

import pytest

from nsys_builder import NsysExportBuilder
from profclass.errors import ProfileError
from profclass.inputs import resolve
from profclass.load import load
from profclass.pipeline import diagnose

SCHEMAS = Path(__file__).resolve().parents[1] / "fixtures" / "profiles" / "schemas"
MS = 1_000_000
T0 = 7_000_000_000


def test_nsys_2023_4_4_export_loads():
    """nsys 2023.4.4 (Debian trixie) imported a 2024.2.3 capture's .qdstrm but dropped every
    CUDA and NVTX event; its export (schema 3.7.2) writes only the tables that have rows."""
    f = SCHEMAS / "host_1gpu_nsys2023.4.4_no_cuda_events.sqlite.zst"
    with resolve([str(f)]) as files:
        prof = load(files[0].sqlite)
    assert prof.nsys_version == "2023.4.4.54"
    assert prof.kernels.empty and "kernels (CUPTI_ACTIVITY_KIND_KERNEL)" in prof.missing
    assert prof.command[:2] == ["python3", "-m"]
    assert len(prof.gpus) == 4 and prof.gpus["name"].str.contains("H200").all()
    with pytest.raises(ProfileError, match="no GPU kernels in the profile"):
        diagnose([str(f)])


def job(path, **variant):
    b = NsysExportBuilder(path, **variant)
    b.add_gpu(0)
    for i in range(6):
        s = T0 + i * 10 * MS
        b.add_nvtx(f"iteration {i}", s - MS, s + 9 * MS)
        b.add_kernel(s, s + 6 * MS, "sm90_xmma_gemm_bf16bf16", launch=(s - MS // 2, s - MS // 2 + 5000))
        b.add_kernel(s + 6 * MS, s + 8 * MS, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                     launch=(s - MS // 4, s - MS // 4 + 5000))
    b.add_meta_command(["python3", "train.py"])
    return b.write()


VARIANTS = {
    "plain": {},
    "kernel_table_V2": dict(rename_tables={"CUPTI_ACTIVITY_KIND_KERNEL": "CUPTI_ACTIVITY_KIND_KERNEL_V2"}),
    "runtime_and_nvtx_V3": dict(rename_tables={"CUPTI_ACTIVITY_KIND_RUNTIME": "CUPTI_ACTIVITY_KIND_RUNTIME_V3",
                                               "NVTX_EVENTS": "NVTX_EVENTS_V3"}),
    "TARGET_INFO_CUDA_GPU": dict(rename_tables={"TARGET_INFO_GPU": "TARGET_INFO_CUDA_GPU"}),
    "no_shortName": dict(drop_columns={"CUPTI_ACTIVITY_KIND_KERNEL": ["shortName"]}),
    "nvtx_text_only": dict(drop_columns={"NVTX_EVENTS": ["textId"]}),
    "no_graphNodeId_no_grid": dict(drop_columns={"CUPTI_ACTIVITY_KIND_KERNEL": ["graphNodeId", "gridX", "gridY",
                                                                                  "gridZ", "blockX", "blockY",
                                                                                  "blockZ"]}),
    "no_session_start_no_meta": dict(drop_tables=["TARGET_INFO_SESSION_START_TIME", "META_DATA_CAPTURE",
                                                  "META_DATA_EXPORT"]),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_schema_variants_diagnose_alike(tmp_path, name):
    d = diagnose([str(job(tmp_path / f"{name}.sqlite", **VARIANTS[name]))])
    assert d.window["source"] == "nvtx" and d.window["iterations"] >= 4
    assert d.window["step_ms"]["median"] == pytest.approx(10.0, abs=0.01)
    # 6 of 10 ms compute, 2 ms exposed all-reduce, in every variant
    assert d.walls["compute"]["ms_per_step"] == pytest.approx(6.0, abs=0.01)
    assert d.walls["communication"]["ms_per_step"] == pytest.approx(2.0, abs=0.01)


def test_nvtx_text_in_string_table(tmp_path):
    """NVTX_EVENTS.textId (registered strings) instead of text."""
    b = NsysExportBuilder(tmp_path / "reg.sqlite", drop_columns={"NVTX_EVENTS": ["text"]})
    b.add_gpu(0)
    for i in range(5):
        s = T0 + i * 10 * MS
        b.add_nvtx(f"iteration {i}", s - MS, s + 9 * MS, registered=True)
        b.add_kernel(s, s + 6 * MS, "sm90_xmma_gemm_bf16bf16", launch=(s - MS // 2, s - MS // 2 + 5000))
    b.write()
    d = diagnose([str(tmp_path / "reg.sqlite")])
    assert d.window["source"] == "nvtx"
