"""The layout inference's partner shares in one pass over all ranks (``layout_infer._shares``
over a ``_pool``) are the rank-by-rank nearest-end test (``end_gap`` <= ``END_TOL_NS``), on
real captures: the SendRecv buckets of EP and PP jobs, and a TP job's per-layer collectives."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import profile_path
from profclass.analyzers import layout_infer as li
from profclass.pipeline import diagnose
from profclass.timeline import comm_kernels


@pytest.mark.parametrize("name,collective", [("mcore_alltoall_4gpu", "all_to_all"), ("mcore_pp4_m4", "all_to_all"),
                                             ("mcore_dense_tp2_dp2", "all_reduce")])
def test_pooled_shares_are_the_pairwise_shares(name, collective):
    d = diagnose(str(profile_path(name)), keep_timelines=True)
    ranks = [g.rank for g in d.timelines]
    kernels = [comm_kernels(g) for g in d.timelines]
    ends = {r: np.sort(k.loc[k["collective"] == collective, "end"].to_numpy()) for r, k in zip(ranks, kernels)}
    pool = li._pool(ends)
    checked = 0
    for r, k in zip(ranks, kernels):
        for _, b in k[k["collective"] == collective].groupby("stream", observed=True):
            x = b["end"].to_numpy()
            for stride in (1, 2):
                pairwise = {j: (li.end_gap(x, ends[j]) <= li.END_TOL_NS).mean()
                            for j in ranks if j != r and (j - r) % stride == 0}
                pooled = li._shares(x, r, ranks, pool, stride)
                assert list(pooled) == list(pairwise)
                assert all(pooled[j] == pairwise[j] for j in pooled), (r, pooled, pairwise)
                checked += sum(v > 0 for v in pooled.values())
    assert checked > 0  # some rank's ends meet another's: not a comparison of zeros


def test_an_end_at_int64s_limit_does_not_wrap_the_window():
    """A kernel end within the tolerance of int64's largest value (a damaged export; the fuzz
    test's generated one had a SendRecv there): its window's upper bound saturates, where the
    sum wrapped to a negative count of near ends."""
    big = np.iinfo(np.int64).max
    ends = {0: np.array([1_000, big - 5], np.int64), 1: np.array([1_000, big - 3], np.int64)}
    shares = li._shares(ends[0], 0, [0, 1], li._pool(ends), 1)
    assert shares == {1: 1.0}
