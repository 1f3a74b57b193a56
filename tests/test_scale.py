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


def test_bounded_clock_matching_aligns_as_every_pair_does(rank_files, single, monkeypatch):
    """Each report is matched against the last ``FINE_CANDIDATES`` aligned GPUs (per collective
    type and count), not all: on 32 ranks, a bound of 4 gives the diagnosis that matching every
    pair gives (the default bound, 64, covers every pair of this job)."""
    from profclass import clocks
    assert clocks.FINE_CANDIDATES >= N_RANKS
    monkeypatch.setattr(clocks, "FINE_CANDIDATES", 4)
    assert diagnose(rank_files).to_json() == single.to_json()


def test_no_fit_among_the_recent_falls_back_to_every_aligned_gpu():
    """The bound narrows the search, never the answer's existence: a report whose only match
    is the first aligned GPU still finds it."""
    import numpy as np
    from profclass.clocks import _Aligned
    a = _Aligned()
    peer = np.arange(0, 100_000_000, 1_000_000, dtype=np.int64)
    a.add({"all_reduce": peer})
    for k in range(1, 10):  # same count, other instances: ends milliseconds away
        a.add({"all_reduce": peer + k * 5_000_000 + np.arange(len(peer)) * 700_000})
    mine = {"all_reduce": peer - 1234}
    assert a.fits(mine, 3) == []
    assert a.fits(mine, None) == [(1234, 0, len(peer), 0, 0)]
