"""Many ranks: per-file work in worker processes (--jobs) and on a Dask cluster (--scheduler)
gives the same diagnosis as one process, on a 32-rank job made of the real per-rank captures."""
from __future__ import annotations

import os
import sys

import pytest

from profclass.errors import ProfileError
from profclass.pipeline import diagnose

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from rank_copies import make_rank_copies  # noqa: E402

N_RANKS = 32


@pytest.fixture(scope="module")
def rank_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    return make_rank_copies(os.path.join(ROOT, "fixtures", "profiles", "imbalance_4gpu_perrank"),
                            N_RANKS, str(out))


@pytest.fixture(scope="module")
def single(rank_files):
    return diagnose(rank_files)


def test_single_process_sees_every_rank(single):
    assert sorted(d["rank"] for d in single.devices) == list(range(N_RANKS))
    # the real capture's hot rank 0 stays the straggler among its 31 copies
    assert single.stragglers and single.stragglers[0]["rank"] == 0


def test_jobs_identical(rank_files, single):
    assert diagnose(rank_files, jobs=2).to_json() == single.to_json()


def test_dask_local_cluster_identical(rank_files, single):
    distributed = pytest.importorskip("dask.distributed")
    with distributed.LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        d = diagnose(rank_files, scheduler=cluster.scheduler_address)
    assert d.to_json() == single.to_json()


def test_worker_error_names_the_file(tmp_path, rank_files):
    bad = tmp_path / "rank99.sqlite"
    bad.write_bytes(b"not a database" * 100)
    with pytest.raises(ProfileError) as exc:
        diagnose(rank_files[:2] + [str(bad)], jobs=2)
    assert exc.value.path == str(bad)
