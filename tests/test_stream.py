"""One process at a time (``load_by_process``) on real multi-process exports: each pass holds
exactly its process's rows of what ``load`` reads at once, and nothing else."""
import os
import stat

import pandas as pd
import pytest

from conftest import decompress_fixture, profile_path
from profclass.load import load, load_by_process
from profclass.ranks import API_CALLS_USED

PER_PROCESS = ("kernels", "memcpy", "memset", "runtime", "nvtx", "memory_events")


def _export(tmp_path, name):
    src = profile_path(name)
    dst = decompress_fixture(src, tmp_path / src.name.rsplit(".", 1)[0])
    os.chmod(dst, stat.S_IRUSR | stat.S_IRGRP)  # not as root, a reader that tried to write would fail
    return str(dst)


def _plain(df: pd.DataFrame) -> pd.DataFrame:
    # a pass's categoricals list the names its process uses, the whole file's list all of them
    return df.astype({c: str for c in df.columns if isinstance(df[c].dtype, pd.CategoricalDtype)}
                     ).reset_index(drop=True)


@pytest.mark.parametrize("one_pass", [True, False], ids=["one pass per table", "a pass per process"])
@pytest.mark.parametrize("name", ["dpoverlap_4gpu", "mcore_pp2_ep2_m4", "mcore_memwall_full", "compute_1gpu"])
def test_passes_partition_the_whole_load(tmp_path, name, one_pass):
    path = _export(tmp_path, name)
    whole = load(path, API_CALLS_USED)
    read = load_by_process(path, API_CALLS_USED, one_pass=one_pass)
    assert read.all_read == one_pass
    # the first process in the kernel table comes first
    first = int(whole.kernels["pid"].iloc[0])
    passes = list(read)
    assert int(passes[0].kernels["pid"].iloc[0]) == first
    passes.sort(key=lambda p: int(p.kernels["pid"].iloc[0]))
    pids = sorted(whole.kernels["pid"].unique())
    assert [sorted(p.kernels["pid"].unique()) for p in passes] == [[q] for q in pids]
    for table in PER_PROCESS:
        full = getattr(whole, table)
        for pid, p in zip(pids, passes):
            pd.testing.assert_frame_equal(_plain(getattr(p, table)), _plain(full[full["pid"] == pid]),
                                          check_index_type=False)
    for p in passes:
        assert p.file_devices["device"].tolist() == sorted(whole.kernels["device"].unique())
        assert set(p.missing) == set(whole.missing)
        assert (p.command, p.env, p.nsys_version) == (whole.command, whole.env, whole.nsys_version)
        pd.testing.assert_frame_equal(p.gpus, whole.gpus)
        pd.testing.assert_frame_equal(p.gpu_metrics, whole.gpu_metrics)


def test_streamed_diagnosis_leaves_the_input_alone(tmp_path):
    import hashlib

    from profclass.pipeline import diagnose
    path = _export(tmp_path, "dpoverlap_4gpu")
    before = (hashlib.sha256(open(path, "rb").read()).hexdigest(), sorted(os.listdir(tmp_path)))
    d = diagnose(path)
    assert len(d.devices) == 4
    assert (hashlib.sha256(open(path, "rb").read()).hexdigest(), sorted(os.listdir(tmp_path))) == before


def test_locked_multi_process_export_is_one_error(tmp_path, monkeypatch):
    import shutil
    import sqlite3

    from profclass.errors import ProfileError
    from profclass.load import transport
    from profclass.pipeline import diagnose
    f = tmp_path / "being_written.sqlite"
    shutil.copyfile(_export(tmp_path, "dpoverlap_4gpu"), f)
    f.chmod(0o644)
    monkeypatch.setattr(transport, "BUSY_TIMEOUT_S", 0.2)
    writer = sqlite3.connect(f, isolation_level=None)
    writer.execute("BEGIN EXCLUSIVE")
    writer.execute("CREATE TABLE still_writing (x)")
    try:
        with pytest.raises(ProfileError, match="database is locked"):
            diagnose(str(f))
    finally:
        writer.execute("COMMIT")
        writer.close()


@pytest.mark.parametrize("name", ["dpoverlap_4gpu", "mcore_pp2_ep2_m4"])
def test_both_ways_give_the_same_diagnosis(tmp_path, monkeypatch, name):
    """One pass per table (processes analysed two at a time) and a pass per process (one at a
    time): the same JSON, byte for byte."""
    import profclass.load as loader
    from profclass.pipeline import diagnose
    path = _export(tmp_path, name)
    assert loader.fits_one_pass(path)
    one_pass = diagnose(path).to_json()
    monkeypatch.setattr(loader, "ONE_PASS_ACTIVITY_ROWS", 0)
    assert not loader.fits_one_pass(path)
    assert diagnose(path).to_json() == one_pass
