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
    """Per host call: made once a step, not once a micro-batch. Between the launch of each step's
    last backward-only kernel and the launch of the next step's first forward-only kernel (the
    gradient reduction, the optimizer, the next batch's loading; the window's head and tail
    alike). None marked where a replayed iteration shows no pair kernel of either side."""
    c = t.calls.c_start
    none = np.zeros(len(c), bool)
    side, k = t.ops.side, t.iterations
    if side is None or not len(c) or k < 1:
        return none
    its = np.clip(np.searchsorted(np.asarray(t.iteration_starts, np.int64), t.ops.start, side="right") - 1, 0, k - 1)
    launched = t.ops.launch >= 0
    bwd, fwd = np.flatnonzero((side == BWD) & launched), np.flatnonzero((side == FWD) & launched)
    last_bwd, first_fwd = np.full(k, -1, np.int64), np.full(k, t.n_ops, np.int64)
    np.maximum.at(last_bwd, its[bwd], bwd)  # ops are sorted by start: the largest index ran last
    np.minimum.at(first_fwd, its[fwd], fwd)
    if (last_bwd < 0).any() or (first_fwd >= t.n_ops).any():
        return none
    # stretches (-inf, H0), (T0, H1), ..., (T(k-1), inf): T a step's last backward launch, H its first forward's
    lo = np.r_[np.iinfo(np.int64).min, c[t.ops.launch[last_bwd]]]
    hi = np.r_[c[t.ops.launch[first_fwd]], np.iinfo(np.int64).max]
    j = np.searchsorted(lo, c, side="left") - 1
    return c < hi[j]


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
