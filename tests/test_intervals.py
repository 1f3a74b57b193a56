"""Interval algebra against a brute-force reference: a boolean grid, one cell per nanosecond.

Random small cases (hypothesis) on [0, 64): every operation must give exactly the cells the
grid gives, and results must be canonical interval sets (sorted, disjoint, non-touching,
non-empty intervals).
"""
import numpy as np
from hypothesis import given, settings, strategies as st

from profclass import intervals as iv

N = 64
raw_intervals = st.lists(st.tuples(st.integers(0, N), st.integers(0, N)), max_size=12)


def grid(pairs) -> np.ndarray:
    g = np.zeros(N, dtype=bool)
    for s, e in pairs:
        g[s:e] = True  # s >= e marks nothing: such intervals are empty
    return g


def grid_of(ivset) -> np.ndarray:
    return grid(zip(ivset[0].tolist(), ivset[1].tolist()))


def build(pairs):
    s = np.array([p[0] for p in pairs], dtype=np.int64)
    e = np.array([p[1] for p in pairs], dtype=np.int64)
    return iv.union(s, e)


def assert_canonical(ivset):
    s, e = ivset
    assert s.dtype == np.int64 and e.dtype == np.int64
    assert (e > s).all(), "empty interval in a set"
    assert (s[1:] > e[:-1]).all(), "overlapping or touching intervals not merged"


@given(raw_intervals)
def test_union_matches_grid(pairs):
    u = build(pairs)
    assert_canonical(u)
    assert (grid_of(u) == grid(pairs)).all()
    assert iv.total(u) == grid(pairs).sum()


@given(raw_intervals, raw_intervals)
def test_intersect_and_subtract_match_grid(a_pairs, b_pairs):
    a, b = build(a_pairs), build(b_pairs)
    ga, gb = grid(a_pairs), grid(b_pairs)
    inter = iv.intersect(a, b)
    diff = iv.subtract(a, b)
    assert_canonical(inter)
    assert_canonical(diff)
    assert (grid_of(inter) == (ga & gb)).all()
    assert (grid_of(diff) == (ga & ~gb)).all()


@given(raw_intervals, st.integers(0, N), st.integers(0, N))
def test_clip_and_complement_match_grid(pairs, lo, hi):
    lo, hi = min(lo, hi), max(lo, hi)
    u = build(pairs)
    window = np.zeros(N, dtype=bool)
    window[lo:hi] = True
    clipped = iv.clip(u, lo, hi)
    gaps = iv.complement(u, lo, hi)
    assert_canonical(clipped)
    assert_canonical(gaps)
    assert (grid_of(clipped) == (grid(pairs) & window)).all()
    assert (grid_of(gaps) == (~grid(pairs) & window)).all()


@settings(max_examples=200)
@given(raw_intervals, st.lists(st.tuples(st.integers(0, N), st.integers(0, N)), min_size=1, max_size=8))
def test_measure_within_matches_grid(pairs, queries):
    u = build(pairs)
    g = grid(pairs)
    qs = np.array([min(q) for q in queries], dtype=np.int64)
    qe = np.array([max(q) for q in queries], dtype=np.int64)
    got = iv.measure_within(u, qs, qe)
    want = [int(g[s:e].sum()) for s, e in zip(qs, qe)]
    assert got.tolist() == want
    # covered_before(t) is the covered length of (-inf, t), i.e. cells 0..t-1
    ts = np.arange(0, N + 1, dtype=np.int64)
    assert iv.covered_before(u, ts).tolist() == [int(g[:t].sum()) for t in ts]


def test_touching_intervals_merge_and_empty_inputs():
    u = iv.union([0, 5, 20], [5, 10, 20])  # [0,5) and [5,10) touch; [20,20) is empty
    assert u[0].tolist() == [0] and u[1].tolist() == [10]
    assert iv.total(iv.union([], [])) == 0
    assert iv.intersect(iv.EMPTY, u)[0].size == 0
    assert iv.subtract(u, iv.EMPTY)[1].tolist() == [10]
    gaps = iv.complement(iv.EMPTY, 3, 9)
    assert gaps[0].tolist() == [3] and gaps[1].tolist() == [9]


def test_large_values_stay_exact():
    # real timestamps are ~1e18 ns (UTC epoch): no float round-off anywhere
    base = 1_795_659_794_721_005_514
    a = iv.union(np.array([base, base + 3]), np.array([base + 2, base + 7]))
    b = iv.union(np.array([base + 1]), np.array([base + 4]))
    assert iv.total(iv.intersect(a, b)) == 2  # [base+1, base+2) and [base+3, base+4)
    assert iv.total(iv.subtract(a, b)) == 4
    assert iv.measure_within(a, np.array([base]), np.array([base + 7])).tolist() == [6]


def test_union_sets_equals_the_union_of_the_concatenation():
    """``union_sets`` (the idle and memory analyzers' merge of two sets, without an argsort)
    gives the very arrays ``union`` gives on the two sets' concatenation: sorted sets with tied
    starts and touching ends, an empty side, and unsorted input (which falls back to ``union``)."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        sets = []
        for n in rng.integers(0, 40, size=2):
            s = np.sort(rng.integers(0, 200, size=n))
            sets.append((s.astype(np.int64), (s + rng.integers(0, 30, size=n)).astype(np.int64)))
        if rng.random() < 0.1:  # unsorted starts: the fallback
            sets[1] = (sets[1][0][::-1].copy(), sets[1][1][::-1].copy())
        (a_s, a_e), (b_s, b_e) = sets
        want = iv.union(np.r_[a_s, b_s], np.r_[a_e, b_e])
        got = iv.union_sets(sets[0], sets[1])
        assert all(np.array_equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want)), (sets, got, want)
