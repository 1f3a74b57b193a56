"""A larger micro-batch on the replay's graph (the ``fewer_launches`` transform): k times fewer,
k times larger micro-batches do the same GPU work in k times fewer, longer kernels, launched by k
times less host work; what a step does once (the gradient reduction, the optimizer) stays, and
what a micro-batch does at the weights' size (the main_grad accumulation) runs k times less.

More micro-batches of one size on a job without a pipeline (the ``accumulate`` transform, priced
per the base's work): k times the micro-batches a step share what the step does once, so per the
base's work that once-a-step part runs 1/k as long and the rest as captured."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .trace import BWD, FWD, GpuTrace


def per_step_calls(t: GpuTrace) -> np.ndarray:
    """Per host call: made once a step, not once a micro-batch. A step's micro-batches each end
    with a backward and the next begins with a forward, so the host's launches turn from a
    backward-only kernel to a forward-only one once a micro-batch; one of those turns a period is
    the step's own (the gradient reduction, the optimizer, the next batch's loading), the one
    the host takes longest over: the calls there are marked. The window's head and tail are
    marked where the window opens or closes on a step's turn (``_window_edges``). The replay's
    iterations are periods of the step whose phase may be anywhere (a periodicity window), so
    the turn is found, not assumed at an iteration's start. None marked where the window shows
    no turn."""
    c = t.calls.c_start
    none = np.zeros(len(c), bool)
    side, k = t.ops.side, t.iterations
    if side is None or not len(c) or k < 1:
        return none
    pairs = np.flatnonzero(((side == FWD) | (side == BWD)) & (t.ops.launch >= 0))  # pair kernels, in start order
    turns = np.flatnonzero((side[pairs[:-1]] == BWD) & (side[pairs[1:]] == FWD))
    if not len(turns):
        return none
    lo, hi = c[t.ops.launch[pairs[turns]]], c[t.ops.launch[pairs[turns + 1]]]
    # m turns a step (a whole window of k steps holds m k of them, one fewer where it opens or
    # closes on a step's own turn); of the m phases, the step's turn is the one the host spends
    # longest over
    m = max(int(round((len(turns) + 1) / k)), 1)
    phase = int(np.argmax([(hi - lo)[p::m].sum() for p in range(min(m, len(turns)))]))
    steps = np.arange(phase, len(turns), m)
    lo, hi = lo[steps], hi[steps]
    head, tail = _window_edges(side[pairs], phase == m - 1, len(turns) - 1 - steps[-1] == m - 1)
    if head:
        lo = np.r_[np.iinfo(np.int64).min, lo]
        hi = np.r_[c[t.ops.launch[pairs[0]]], hi]
    if tail:
        lo = np.r_[lo, c[t.ops.launch[pairs[-1]]]]
        hi = np.r_[hi, np.iinfo(np.int64).max]
    j = np.searchsorted(lo, c, side="left") - 1
    return (j >= 0) & (c < hi[np.maximum(j, 0)])


def _window_edges(sides: np.ndarray, opens_step: bool, closes_step: bool) -> tuple[bool, bool]:
    """Whether the window's head (before its first pair kernel) is the tail of a step's turn and
    its tail the head of one: where it opens on a step's whole first forward (``opens_step``: the
    turns before the step's are the step's other micro-batches'; the first run of forward
    kernels as long as the window's whole ones, within 10%), and closes on a step's whole last
    backward. ``sides``: the pair kernels' sides in launch order."""
    starts = np.r_[0, np.flatnonzero(np.diff(sides)) + 1]
    runs = np.diff(np.r_[starts, len(sides)])
    inner, inner_sides = runs[1:-1], sides[starts[1:-1]]
    if not ((inner_sides == FWD).any() and (inner_sides == BWD).any()):
        return False, False
    whole = {s: 0.9 * np.median(inner[inner_sides == s]) for s in (FWD, BWD)}
    return (bool(opens_step and sides[0] == FWD and runs[0] >= whole[FWD]),
            bool(closes_step and sides[-1] == BWD and runs[-1] >= whole[BWD]))


def apply(spec, pick, selected_ops, point, traces, weights, ctx):
    """A k times larger micro-batch (k times fewer of them): the same GPU work per step in k
    times fewer, k times longer kernels, launched by k times less host work. The ops keep
    their time, but for the work done once per micro-batch at the weights' size, not the
    rows' (``per_microbatch``: the fp32 main_grad accumulation, one add per parameter per
    micro-batch), which runs k times less. The host's time per micro-batch and its kernels'
    launch latencies and stream gaps fall by k; its work once a step (``per_step_calls``), and
    the latencies of the kernels that work launches, stay."""
    k = float(spec.get("microbatch_factor", 2.0))
    share = pick(spec.get("recovered", 1.0), point)
    f = 1.0 - share * (1.0 - 1.0 / k)
    out = []
    for t, w, g in zip(traces, weights, ctx.op_groups or [None] * len(traces)):
        once = selected_ops(t, spec["per_microbatch"], g) if spec.get("per_microbatch") else np.zeros(t.n_ops, bool)
        per_step = per_step_calls(t)
        fc = np.where(per_step, 1.0, f)  # per call
        fo = np.where(np.append(per_step, False)[t.ops.launch], 1.0, f)  # per op, by its launch call (-1: none)
        out.append(_scaled(t, w, fc, fo, once, k))
    return out


def accumulate(spec, pick, selected_ops, point, traces, weights, ctx):
    """k times the micro-batches of one size a step (gradient accumulation), per the base's work:
    the host calls made once a step (``per_step_calls``) and the kernels they launch (the
    optimizer, a gradient reduction after the backward) take 1/k of their time; the calls' share
    (``once``) at ``point``: the stretch also holds the next batch's loading, which each
    micro-batch does. A GEMM or a weight-sized accumulation (``per_microbatch``) those calls
    launch is a micro-batch's (the last backward's tail, the next forward's head: no optimizer
    runs a GEMM) and keeps its time. None where no replayed iteration shows where its step's
    once-a-step work is (no forward and backward kernels told apart)."""
    k = float(spec.get("microbatches", 2.0))
    f_calls = 1.0 - pick(spec.get("once", 1.0), point) * (1.0 - 1.0 / k)
    out = []
    for t, w, g in zip(traces, weights, ctx.op_groups or [None] * len(traces)):
        tail = selected_ops(t, "gemm", g)
        if spec.get("per_microbatch"):
            tail = tail | selected_ops(t, spec["per_microbatch"], g)
        per_step = per_step_calls(t)
        if not per_step.any():
            return None
        fc = np.where(per_step, f_calls, 1.0)
        launched_once = np.append(per_step, False)[t.ops.launch]  # by a once-a-step call (-1: none)
        fo = np.where(launched_once, f_calls, 1.0)
        once = launched_once & ~tail
        out.append(_scaled(t, w, fc, fo, once, k))
    return out


def _scaled(t: GpuTrace, w, per_call: np.ndarray, per_op: np.ndarray, ops: np.ndarray, k: float):
    """The weights with each host call's time (its gap, duration and the host edges into it) by
    ``per_call``, each op's launch latency and stream gap by ``per_op``, and the ``ops`` picked
    take 1/k of their time."""
    return replace(w, c_gap=(w.c_gap * per_call).astype(np.int64), c_dur=(w.c_dur * per_call).astype(np.int64),
                   h_lag=(w.h_lag * per_call[t.edges.h_dst]).astype(np.int64),
                   launch_lag=(w.launch_lag * per_op).astype(np.int64), stream_gap=(w.stream_gap * per_op).astype(np.int64),
                   op_dur=np.where(ops, (w.op_dur / k).astype(np.int64), w.op_dur))
