"""The recomputed forward told from a forward pass by the thread that launched it
(analyzers/recompute.py): PyTorch's autograd engine launches a CUDA backward, and the forward a
checkpoint re-runs inside it, from its own device thread; a forward pass comes from the thread
that called the model. Real captures first, then the rule's edges on hand-built sequences."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conftest import decompress_fixture, profile_path
from profclass import intervals as iv
from profclass.analyzers import recompute
from profclass.analyzers.iterations import detect_iterations
from profclass.analyzers.recompute import K_GRAM, recomputed_spans
from profclass.analyzers.sets import window_sets
from profclass.load import load
from profclass.timeline import build_ops, split_gpus


def _by_sizes(ops: pd.DataFrame) -> iv.IntervalSet:
    """The spans the stretch-size rule alone finds (the threads' column dropped)."""
    return recomputed_spans(ops.drop(columns="launch_tid"))


def _gpus(name: str, tmp_path_factory):
    path = decompress_fixture(profile_path(name), tmp_path_factory.mktemp(name) / f"{name}.sqlite")
    prof = load(str(path))
    out = []
    for g in split_gpus(prof, 0, build_ops(prof)):
        detect_iterations(g, None)
        out.append((g, window_sets(g)))
    return out


def _starts_inside(spans: iv.IntervalSet, t: np.ndarray) -> int:
    i = np.searchsorted(spans[0], t, side="right") - 1
    return int(((i >= 0) & (t < spans[1][np.clip(i, 0, None)])).sum())


@pytest.fixture(scope="module")
def aa1(tmp_path_factory):
    return _gpus("mcore_wrapped_pp2_rc_m2", tmp_path_factory)


def test_a_flagless_pipeline_recomputes_each_layer_once_per_microbatch(aa1):
    """Dense PP 2, two layers a stage, 2 micro-batches, full recompute (one layer a checkpoint):
    by threads both stages re-run 2 x 2 layers a step and no communication kernel starts inside
    a re-run. By sizes the first stage's spans held PP send/recv (9 spans over 3 steps, not 12):
    a stretch of the first stage's warm-up and its exchanges read as a re-run layer."""
    for stage, (g, s) in enumerate(aa1):
        spans = iv.clip(recomputed_spans(s.compute_ops), s.lo, s.hi)
        steps = int(g.iterations["steady"].sum())
        comm_starts = g.ops.loc[g.ops["is_comm"].to_numpy(bool), "start"].to_numpy(np.int64)
        assert spans[0].size == 2 * 2 * steps, (stage, spans[0].size, steps)
        assert _starts_inside(spans, comm_starts) == 0, stage
    g0, s0 = aa1[0]
    sized = iv.clip(_by_sizes(s0.compute_ops), s0.lo, s0.hi)
    comm0 = g0.ops.loc[g0.ops["is_comm"].to_numpy(bool), "start"].to_numpy(np.int64)
    assert _starts_inside(sized, comm0) > 0 and sized[0].size < 2 * 2 * int(g0.iterations["steady"].sum())


@pytest.mark.parametrize("name", ["memory_recompute_1gpu", "mcore_recompute_4gpu"])
def test_where_sizes_tell_the_threads_give_the_same_spans(name, tmp_path_factory):
    """On captures whose forwards are several layers long the size rule was right: the threads
    give exactly its spans (same starts, same ends), and some recompute is found."""
    for g, s in _gpus(name, tmp_path_factory):
        by_threads, by_sizes = recomputed_spans(s.compute_ops), _by_sizes(s.compute_ops)
        assert by_threads[0].size > 0
        assert np.array_equal(by_threads[0], by_sizes[0]) and np.array_equal(by_threads[1], by_sizes[1])


# ------------------------------------------------------------------ hand-built kernel sequences

MAIN, AUTOGRAD = 101, 202  # the thread that calls the model, the autograd engine's device thread


def _two_layer_stage(tids: str = "real") -> pd.DataFrame:
    """forward of 2 layers | per layer, last first: its re-run forward then its backward | the
    next forward. A re-run layer is half a forward, which the size share reads as a forward.
    ``tids``: "real" (forwards by MAIN, the backward and re-runs by AUTOGRAD), "one" (one thread
    for all), "unknown" (a fifth of the kernels without a launch call)."""
    layer = [f"k{i}" for i in range(K_GRAM + 2)] + ["ln_fwd"]
    side_l = [""] * (K_GRAM + 2) + ["fwd"]
    back = ["ln_bwd", "g1", "g2"]
    side_b = ["bwd", "", ""]
    # the backward opens with the output layer's backward-only kernel, then each layer's re-run
    backward = (["ln_bwd"] + (layer + back) * 2, ["bwd"] + (side_l + side_b) * 2, AUTOGRAD)
    names, sides, tid = [], [], []
    for part, side, who in ((layer * 2, side_l * 2, MAIN), backward, (["optimizer"], [""], MAIN),
                            (layer * 2, side_l * 2, MAIN), backward, (layer * 2, side_l * 2, MAIN)):
        names += part
        sides += side
        tid += [who] * len(part)
    tid = np.array(tid, np.int64)
    if tids == "one":
        tid[:] = MAIN
    elif tids == "unknown":
        tid[::5] = -1
    start = np.arange(len(names), dtype=np.int64) * 1000
    return pd.DataFrame({"start": start, "end": start + 900, "full_name": names, "side": sides, "launch_tid": tid})


def test_threads_find_the_reruns_of_a_two_layer_stage_that_sizes_miss():
    ops = _two_layer_stage()
    by_threads = recomputed_spans(ops)
    assert by_threads[0].size == 4  # two re-run layers in each of the two inner backwards
    assert _by_sizes(ops)[0].size == 0  # each re-run stretch is half a forward: read as one


def test_one_thread_or_unknown_threads_fall_back_to_sizes():
    """One thread launching both (no autograd device thread to tell by) or more than a tenth
    of the kernels without a launch call: the size rule decides, as without the column."""
    for tids in ("one", "unknown"):
        ops = _two_layer_stage(tids)
        assert recompute._on_backward_thread(ops, ops["side"].to_numpy().astype(str)) is None, tids
        got, sized = recomputed_spans(ops), _by_sizes(ops)
        assert np.array_equal(got[0], sized[0]) and np.array_equal(got[1], sized[1]), tids


def test_a_kernel_without_a_launch_call_takes_its_predecessors_thread():
    ops = _two_layer_stage()
    tid = ops["launch_tid"].to_numpy().copy()
    tid[[3, 40]] = -1  # below the tenth: the rule still applies
    on = recompute._on_backward_thread(ops.assign(launch_tid=tid), ops["side"].to_numpy().astype(str))
    assert on is not None and on[3] == (tid[2] == AUTOGRAD) and on[40] == (tid[39] == AUTOGRAD)
