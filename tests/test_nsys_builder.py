"""The shared builder writes what nsys writes: the same DDL as a real export of the corpus,
and identifiers profclass decodes back to the pid/tid it was given."""
import sqlite3


from conftest import decompress_fixture, profile_path
from nsys_builder import DEFAULT_TABLES, NsysExportBuilder, global_pid, global_tid
from profclass.load import load


def schema_of(path, tables):
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {t: con.execute("SELECT sql FROM sqlite_master WHERE name=?", (t,)).fetchone() for t in tables}
    finally:
        con.close()


def test_built_ddl_equals_a_real_export(tmp_path):
    real = tmp_path / "real.sqlite"
    decompress_fixture(profile_path("comm_4gpu"), real)
    built = NsysExportBuilder(tmp_path / "built.sqlite").write()
    assert schema_of(built, DEFAULT_TABLES) == schema_of(real, DEFAULT_TABLES)


def test_ids_and_variants_round_trip(tmp_path):
    assert global_pid(958) == 281491049283584  # a real PROCESSES row: python3, pid 958
    assert (global_tid(978, 1001) >> 24) & 0xFFFFFF == 978 and global_tid(978, 1001) & 0xFFFFFF == 1001
    b = NsysExportBuilder(tmp_path / "v.sqlite", drop_columns={"NVTX_EVENTS": ["textId"]},
                          rename_tables={"TARGET_INFO_GPU": "TARGET_INFO_CUDA_GPU"},
                          drop_tables=["META_DATA_CAPTURE"])
    b.add_gpu(2, name="NVIDIA H100 80GB HBM3", sm_count=132)
    b.add_kernel(10, 20, "k", device=2, pid=77, tid=78, launch=(1, 2))
    b.add_nvtx("iteration 0", 0, 30, pid=77, tid=78)
    b.write()
    prof = load(str(b.path))
    assert prof.kernels[["pid", "device"]].values.tolist() == [[77, 2]]
    assert prof.runtime[["pid", "tid", "name"]].values.tolist() == [[77, 78, "cudaLaunchKernel"]]
    assert prof.nvtx["text"].tolist() == ["iteration 0"]
    assert prof.gpus[["device", "name"]].values.tolist() == [[2, "NVIDIA H100 80GB HBM3"]]
    assert any("META_DATA_CAPTURE" in m for m in prof.missing)
