"""The column-wise fast paths against the plain pandas they replace (issue 16): the same rows,
the same groups, the same tests, on real exports and on edge cases the fixtures lack."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from conftest import profile_path
from profclass.analyzers.sets import contains_per_distinct, name_matches
from profclass.inputs import resolve
from profclass.kernel_table import _first_seen, _group_sums, gpu_kernel_agg
from profclass.load import load
from profclass.timeline import build_ops, build_ops_pandas, iter_gpus

# memcpy of several kinds (peer copies), memsets, four processes; one process with copies
REAL = ["comm_4gpu", "mcore_ep4_input_pageable", "memory_offload_1gpu"]


@pytest.fixture(scope="module", params=REAL)
def loaded(request):
    with resolve([str(profile_path(request.param))]) as files:
        yield load(files[0].sqlite)


def test_build_ops_is_build_ops_pandas(loaded):
    fast, plain = build_ops(loaded), build_ops_pandas(loaded)
    assert list(fast.columns) == list(plain.columns)
    for c in ("name", "full_name"):  # both categorical, categories the names that occur, sorted
        assert list(fast[c].cat.categories) == list(plain[c].cat.categories)
        assert (fast[c].astype(str).to_numpy() == plain[c].astype(str).to_numpy()).all()
    rest = [c for c in fast.columns if c not in ("name", "full_name")]
    pd.testing.assert_frame_equal(fast[rest].astype({c: object for c in ("op", "kind", "library", "collective",
                                                                          "pair", "side")}),
                                  plain[rest].astype({c: object for c in ("op", "kind", "library", "collective",
                                                                           "pair", "side")}),
                                  check_dtype=False)


def _agg_plain(ops: pd.DataFrame, window) -> pd.DataFrame:
    """gpu_kernel_agg's generic path: the names as text, groupby and drop_duplicates."""
    return gpu_kernel_agg(ops.assign(full_name=ops["full_name"].astype(str).astype(object)), window)


def test_kernel_aggregate_is_the_groupby(loaded):
    ops = build_ops(loaded)
    for g in iter_gpus(loaded, 0, ops):
        lo, hi = int(g.ops["start"].min()), int(g.ops["start"].max())
        window = (lo + (hi - lo) // 4, hi)  # a window that cuts the rows
        fast, plain = gpu_kernel_agg(g.ops, window), _agg_plain(g.ops, window)
        pd.testing.assert_frame_equal(fast.astype({"full_name": object, "op": object}),
                                      plain.astype({"full_name": object, "op": object}), check_dtype=False)


def test_group_sums_exact_past_float_precision():
    rng = np.random.default_rng(7)
    group = rng.integers(0, 5, 1000)
    small = rng.integers(0, 10**9, 1000)
    huge = small + 2**62 // 1000  # partial sums past 2^53: the integer path
    for values in (small, huge, -small):
        want = pd.Series(values).groupby(group).sum().to_numpy()
        assert (_group_sums(group, values) == want).all()
    assert _group_sums(np.array([], np.int64), np.array([], np.int64)).size == 0


def test_first_seen_rows():
    codes, _ = pd.factorize(np.array([5, 5, 9, 5, 2, 9, 7]))
    assert list(_first_seen(codes)) == [0, 2, 4, 6]
    assert _first_seen(np.array([], np.int64)).size == 0


@pytest.mark.parametrize("missing", [False, True])
def test_name_tests_on_categoricals_match_text(missing):
    names = ["cudaLaunchKernel_v7000", "cudaFree", "cudaLaunchKernel", "nanfoo"] * 3
    if missing:
        names[1] = None
    cat = pd.Series(pd.Categorical(names, categories=["unused", "cudaFree", "cudaLaunchKernel",
                                                      "cudaLaunchKernel_v7000", "nanfoo"]))
    text = pd.Series(names, dtype=object)
    as_text = ["nan" if v is None else v for v in names]  # a missing value is tested as "nan"
    for pattern in (re.compile("cudaLaunch"), re.compile("nan"), re.compile("unused"), re.compile("Free")):
        want = np.array([bool(pattern.match(v)) for v in as_text])
        assert (name_matches(cat, pattern) == want).all()
        assert (name_matches(text, pattern) == want).all()
        want = np.array([bool(pattern.search(v)) for v in as_text])
        assert (contains_per_distinct(cat, pattern) == want).all()
        assert (contains_per_distinct(text, pattern) == want).all()


def test_build_ops_categories_are_the_names_that_occur(loaded):
    """A kernel table whose categoricals list names no row uses (a process's share of a
    file-wide table): the ops' categories are still only the names that occur."""
    prof = loaded
    kernels = prof.kernels
    try:
        prof.kernels = kernels.assign(name=kernels["name"].cat.add_categories(["aaa_unused"]),
                                      full_name=kernels["full_name"].cat.add_categories(["zzz_unused"]))
        fast, plain = build_ops(prof), build_ops_pandas(prof)
    finally:
        prof.kernels = kernels
    for c in ("name", "full_name"):
        assert list(fast[c].cat.categories) == list(plain[c].cat.categories)
        assert not any(str(v).endswith("_unused") for v in fast[c].cat.categories)
        assert (fast[c].astype(str).to_numpy() == plain[c].astype(str).to_numpy()).all()


def test_kernel_aggregate_names_under_several_ops():
    """A name under two ops (a kernel named like a copy) and ops interleaved: the groups in
    first-seen order, each name's flags from its first row."""
    names = ["k1", "memcpy HtoD", "k2", "memcpy HtoD", "k1", "k3", "k2"]
    op = ["kernel", "kernel", "kernel", "memcpy", "kernel", "kernel", "memset"]
    n = len(names)
    ops = pd.DataFrame({
        "start": np.arange(n) * 10, "end": np.arange(n) * 10 + np.arange(1, n + 1),
        "full_name": pd.Categorical(names), "op": pd.Categorical(op),
        "library": ["", "", "nccl", "", "", "", ""], "collective": ["", "", "all_reduce", "", "", "", ""],
        "is_comm": [False, False, True, False, False, False, True], "is_gemm": [True] + [False] * (n - 1),
        "is_fp8": [False, True, False, False, False, False, False]})
    fast, plain = gpu_kernel_agg(ops, (0, 10 * n)), _agg_plain(ops, (0, 10 * n))
    pd.testing.assert_frame_equal(fast.astype({"full_name": object, "op": object}),
                                  plain.astype({"full_name": object, "op": object}), check_dtype=False)
    assert list(fast["full_name"]) == ["k1", "memcpy HtoD", "k2", "memcpy HtoD", "k3", "k2"]
    assert list(fast["is_comm"]) == [False, False, True, False, False, True]  # k2's first row
