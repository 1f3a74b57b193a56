"""The recomputed forward, found in the kernel sequence and timed (a helper of ``memory``).

Activation checkpointing (Megatron's ``CheckpointFunction``, ``torch.utils.checkpoint``)
re-runs a layer's forward at the start of that layer's backward: inside the backward region
of a step the *same* kernel sequence as the forward appears again. Per steady iteration:

- backward-only kernels (the ``bwd`` member of a forward/backward kernel pair,
  ``kernels.FWD_BWD_PAIRS``) cut the compute-kernel sequence into stretches; the long ones
  are forward passes (of the step or of each micro-batch), whatever the step's phase;
- a kernel of another stretch is recomputed when it belongs to a run of ``K_GRAM``
  consecutive compute kernels whose name sequence also occurs in a forward stretch;
- a run counts only when it holds a forward-only kernel (the ``fwd`` pair member), which a
  backward cannot run unless it recomputes: generic element-wise sequences that happen to
  repeat do not count.

Which stretches are forward passes is read from the thread that launched them where the export
says: PyTorch's autograd engine runs a CUDA backward on its own per-device thread, not on the
thread that called ``backward()``, and a checkpoint re-runs its forward inside that backward, so
a re-run layer is launched by the thread that launches the backward-only kernels and a forward
pass by another. A stretch then also ends where the launching thread changes. Where the threads
cannot tell (too many kernels without a launch call, or no forward-only kernel launched off the
backward's thread), a stretch's size tells instead (``FORWARD_STRETCH_SHARE``).

The recompute cost is the wall-clock span of those runs (first kernel's start to last
kernel's end): the recomputed kernels, the communication the recomputed forward re-issues
(MoE dispatch all-to-all) and the launch gaps between them, which is what turning recompute
off saves.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .. import intervals as iv
from ..kernels import OPTIMIZER_KERNEL

# kernels per matched name sequence: a transformer layer's forward launches tens of
# kernels, so 8 in a row is specific to it while two short element-wise chains that happen
# to repeat (3-4 kernels) are not
K_GRAM = 8
# a bwd-free stretch at least this share of the largest one is a forward pass, not a
# recomputed layer: a stage's forward runs its L layers, a recompute one layer (or a block
# of --recompute-num-layers), so for L >= 3 layers a recompute stretch is at most 1/3 of it.
# At L = 2 it is half, which this share reads as a forward: a two-layer stage's re-run layers
# are told apart only where its forward runs a pair kernel beyond its layers' (probe 22's stage
# 0: 9 against 4). Above half instead found 60.8 ms of recompute on mcore_pp4_m4_perrank, which
# recomputes nothing
FORWARD_STRETCH_SHARE = 0.5
# the threads tell forwards from re-runs only where at most this share of the compute kernels
# has no launch call (graph-replayed or unmatched kernels): a tenth unknown could at most move a
# few kernels of a layer between stretches, not a layer's k-grams
UNKNOWN_THREAD_SHARE = 0.1


def _kgrams(codes: np.ndarray, k: int) -> np.ndarray:
    """Each window of ``k`` consecutive codes as one integer id (equal windows, equal ids)."""
    w = np.lib.stride_tricks.sliding_window_view(codes, k)
    return np.unique(w, axis=0, return_inverse=True)[1].ravel()


def recomputed_spans(compute_ops: pd.DataFrame) -> iv.IntervalSet:
    """The recomputed-forward spans among one GPU's compute kernels (any phase of the step)."""
    ops = compute_ops.sort_values("start")
    empty = iv.union(np.empty(0, np.int64), np.empty(0, np.int64))
    side = ops["side"].to_numpy().astype(str)
    is_bwd = side == "bwd"
    if len(ops) < 2 * K_GRAM or not is_bwd.any():
        return empty
    codes = ops["full_name"].astype("category").cat.codes.to_numpy().astype(np.int32)
    start, end = ops["start"].to_numpy(np.int64), np.maximum.accumulate(ops["end"].to_numpy(np.int64))
    # stretches: the kernels between two backward-only kernels. A micro-batch's forward runs
    # all of the stage's layers without one, a recomputed forward one layer (or one
    # checkpointed block) before that layer's backward: the long stretches are forwards
    on_bwd_thread = _on_backward_thread(ops, side)
    if on_bwd_thread is not None:
        # a stretch also ends where the launching thread changes; it is a forward pass when the
        # thread that calls the model launched it, a re-run candidate when the backward's did
        stretch = np.cumsum(is_bwd | np.r_[False, on_bwd_thread[1:] != on_bwd_thread[:-1]])
        is_forward = np.bincount(stretch[~is_bwd & ~on_bwd_thread], minlength=stretch[-1] + 1) > 0
    else:
        stretch = np.cumsum(is_bwd)
        is_forward = _long_stretches(ops, side, is_bwd, stretch)
    grams = _kgrams(codes, K_GRAM)
    own = np.where(is_bwd, -1, stretch)  # a backward-only kernel belongs to no stretch
    same = (own[:-K_GRAM + 1] == own[K_GRAM - 1:]) & (own[:-K_GRAM + 1] >= 0)  # window in one stretch
    in_fwd = same & is_forward[stretch[:-K_GRAM + 1]]
    # the window's first and last stretches are cut by its edges: not judged
    inner = same & ~in_fwd & (stretch[:-K_GRAM + 1] > 0) & (stretch[:-K_GRAM + 1] < stretch[-1])
    hit = inner & np.isin(grams, grams[in_fwd])
    # kernel i is covered when some matching window starts in [i - K + 1, i]
    covered = np.convolve(hit.astype(np.int32), np.ones(K_GRAM, np.int32))[:codes.size] > 0
    edges = np.flatnonzero(np.diff(np.r_[0, covered.astype(np.int8), 0]))
    run_lo, run_hi = edges[0::2], edges[1::2]  # [lo, hi) kernel indices
    if run_lo.size == 0:
        return empty
    # kernels that differ from the forward (a router re-run) split one recomputed forward
    # into pieces; pieces of one stretch are one forward
    new = np.r_[True, stretch[run_lo[1:]] != stretch[run_hi[:-1] - 1]]
    run_lo, run_hi = run_lo[new], np.r_[run_hi[np.flatnonzero(new)[1:] - 1], run_hi[-1]]
    # it holds a forward-only kernel, which a backward runs only when it recomputes
    fwd_only = np.cumsum(np.r_[0, side == "fwd"])
    keep = fwd_only[run_hi] - fwd_only[run_lo] > 0
    return iv.union(start[run_lo[keep]], end[run_hi[keep] - 1])


def _on_backward_thread(ops: pd.DataFrame, side: np.ndarray) -> np.ndarray | None:
    """Per kernel (in ``ops``' order): launched by the backward's thread, the one that launched
    most backward-only kernels (a kernel without a launch call takes its predecessor's). None
    where the threads cannot tell: no thread column, more than ``UNKNOWN_THREAD_SHARE`` of the
    kernels without one, or no forward-only kernel launched by another thread."""
    if "launch_tid" not in ops:
        return None
    tid = ops["launch_tid"].to_numpy(np.int64)
    known = tid >= 0
    known_bwd = known & (side == "bwd")
    if known.mean() < 1 - UNKNOWN_THREAD_SHARE or not known_bwd.any():
        return None
    threads, counts = np.unique(tid[known_bwd], return_counts=True)
    on = tid == threads[np.argmax(counts)]
    if not (known & ~on & (side == "fwd")).any():
        return None  # one thread runs forwards and backwards: nothing to tell them by
    last_known = np.maximum.accumulate(np.where(known, np.arange(tid.size), 0))
    return on[last_known]


def _long_stretches(ops: pd.DataFrame, side: np.ndarray, is_bwd: np.ndarray, stretch: np.ndarray) -> np.ndarray:
    """Per stretch: a forward pass by its size, at least ``FORWARD_STRETCH_SHARE`` of the
    largest. Sized in forward-only pair kernels, which every layer's forward runs and nothing
    else does: the optimizer's kernels (once a step, between the last backward and the next
    forward) and a backward's pieces do not count, so with two layers a stage a forward still
    reads twice a recomputed layer (by all kernels the optimizer's stretch outnumbered the
    forwards, which then read as recomputes); without pair kernels, every kernel but the
    optimizer's."""
    fwd_len = np.bincount(stretch[side == "fwd"], minlength=stretch[-1] + 1)
    if fwd_len.max() == 0:
        optimizer = ops["full_name"].astype(str).str.contains("|".join(OPTIMIZER_KERNEL)).to_numpy()
        fwd_len = np.bincount(stretch[~is_bwd & ~optimizer], minlength=stretch[-1] + 1)
    return fwd_len >= FORWARD_STRETCH_SHARE * fwd_len.max()


def outside(ops: pd.DataFrame, spans: iv.IntervalSet) -> pd.DataFrame:
    """The kernels of ``ops`` that start outside every span of the interval set ``spans``."""
    if spans[0].size == 0:
        return ops
    t = ops["start"].to_numpy(np.int64)
    i = np.searchsorted(spans[0], t, side="right") - 1
    inside = (i >= 0) & (t < spans[1][np.clip(i, 0, None)])
    return ops[~inside]


def forward_passes(compute_ops: pd.DataFrame, step_starts: np.ndarray) -> tuple[float | None, float | None]:
    """(forward passes per step, forward passes in the step's longest backward-free stretch)
    on one GPU, from its compute kernels in the window, or (None, None) where they do not show.
    ``compute_ops`` holds no recomputed forward (``outside(ops, recomputed_spans(ops))``).

    A forward pass of one micro-batch (of one model chunk, with VPP) runs its layers' forward-
    only pair kernels (``fwd`` side) with no backward-only kernel among them: a stretch between
    backward-only kernels. Stretches in the middle of a step are single forwards in 1F1B's steady
    phase; the first and last of a step may be cut by the step's edge or hold several warm-up
    forwards, so the fwd kernels of one forward are the median over the middle stretches (over
    all of them where a step has no middle one). Passes per step = fwd kernels per step / fwd
    kernels per forward: the same kernels counted twice, where a count of their backward
    partners would carry the pairs' own imbalance (57 backward-only against 52 forward-only
    kernels a pass on mcore_rc_none_ample). The longest stretch holds the warm-up's forwards
    in a row (``layout_stage``: VPP from the last stage's)."""
    ops = compute_ops.sort_values("start", kind="stable")
    side = ops["side"].to_numpy().astype(str)
    is_bwd, is_fwd = side == "bwd", side == "fwd"
    steps = len(step_starts)
    if steps == 0 or not is_bwd.any() or not is_fwd.any():
        return None, None
    step = np.searchsorted(step_starts, ops["start"].to_numpy(np.int64), side="right") - 1
    # a new stretch at each backward-only kernel and at each step boundary
    stretch = np.cumsum(is_bwd | np.r_[True, step[1:] != step[:-1]])
    fwd = np.bincount(stretch[is_fwd], minlength=stretch[-1] + 1)
    step_of = np.zeros(stretch[-1] + 1, np.int64)
    step_of[stretch] = step
    has = np.flatnonzero(fwd > 0)
    if not has.size:
        return None, None
    first = np.r_[True, step_of[has][1:] != step_of[has][:-1]]
    last = np.r_[step_of[has][1:] != step_of[has][:-1], True]
    middle = has[~first & ~last]
    # with one or two forwards a step (PP = 1, few micro-batches: F B F B) there is no middle
    # stretch, and no warm-up to merge forwards either: every stretch with fwd kernels is one.
    # The stretch that holds the median fwd kernel: a bwd-side kernel inside a forward (the
    # loss's) splits it into a long stretch and a short one (52 and 5 kernels a pass on
    # mcore_rc_none_ample), whose plain median is half a forward
    sizes = np.sort(fwd[middle] if middle.size else fwd[has])
    unit = float(sizes[np.searchsorted(np.cumsum(sizes), 0.5 * sizes.sum())])
    longest = float(np.median([fwd[has][step_of[has] == k].max() for k in np.unique(step_of[has])]))
    return is_fwd.sum() / steps / unit, longest / unit
