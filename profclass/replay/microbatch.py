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
    """Per host call: made once a step, not once a micro-batch (``step_turns``)."""
    return step_turns(t)[0] >= 0


def step_turns(t: GpuTrace) -> tuple[np.ndarray, np.ndarray]:
    """Per host call, the step's turn that holds it (-1: none), and per turn whether the window
    holds it whole. A step's micro-batches each end with a backward and the next begins with a
    forward, so the host's launches turn from a backward-only kernel to a forward-only one once a
    micro-batch; one of those turns a period is the step's own (the gradient reduction, the
    optimizer, the next batch's loading), the one the host takes longest over: the calls there
    are marked. The window's head and tail are marked where the window opens or closes on a
    step's turn (``_window_edges``), as turns it does not hold whole. The replay's iterations are
    periods of the step whose phase may be anywhere (a periodicity window), so the turn is found,
    not assumed at an iteration's start. None marked where the window shows no turn."""
    c = t.calls.c_start
    none = np.full(len(c), -1), np.zeros(0, bool)
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
    whole = np.ones(len(steps), bool)
    head, tail = _window_edges(side[pairs], phase == m - 1, len(turns) - 1 - steps[-1] == m - 1)
    if head:
        lo, hi = np.r_[np.iinfo(np.int64).min, lo], np.r_[c[t.ops.launch[pairs[0]]], hi]
        whole = np.r_[False, whole]
    if tail:
        lo, hi = np.r_[lo, c[t.ops.launch[pairs[-1]]]], np.r_[hi, np.iinfo(np.int64).max]
        whole = np.r_[whole, False]
    j = np.searchsorted(lo, c, side="left") - 1
    return np.where((j >= 0) & (c < hi[np.maximum(j, 0)]), j, -1), whole


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
        out.append(_scaled(t, w, fc, fo, np.where(once, 1.0 / k, 1.0)))
    return out


def accumulate(spec, pick, selected_ops, point, traces, weights, ctx):
    """k times the micro-batches of one size a step (gradient accumulation), per the base's work.
    The window's n steps of work hold n turns of once-a-step work (``step_turns``: the
    optimizer, a gradient reduction after the backward, the step's syncs); k times the
    micro-batches run n/k of them. Whole turns are dropped, spread evenly (``dropped_turns``),
    so the window runs as the candidate's steps would: k m micro-batches, then one turn, with no
    sync between them (a dropped turn's syncs wait for nothing). A share of every turn's time
    kept every turn's gradient-norm sync, which held the host back from the next forward (call
    MI's dense stage: 4.9 priced against 8.92 run, 7.94 with whole turns and their syncs dropped,
    4.93 with whole turns alone). What whole drops
    cannot reach (n (1 - 1/k) not whole, or turns the window cuts) is a share of every other
    turn's time. A dropped turn's kernels go, and its calls' time but for the share that is the
    next batch's loading (``once``, at ``point``: the share of those calls' time that is once a
    step); a GEMM or a weight-sized accumulation (``per_microbatch``) a turn launches is a
    micro-batch's (the last backward's tail, the next forward's head: no optimizer runs a GEMM)
    and keeps its time. None where no replayed iteration shows where its step's once-a-step work
    is (no forward and backward kernels told apart)."""
    k = float(spec.get("microbatches", 2.0))
    once = pick(spec.get("once", 1.0), point)
    out = []
    for t, w, g in zip(traces, weights, ctx.op_groups or [None] * len(traces)):
        tail = selected_ops(t, "gemm", g)
        if spec.get("per_microbatch"):
            tail = tail | selected_ops(t, spec["per_microbatch"], g)
        turn, whole = step_turns(t)
        if not (turn >= 0).any():
            return None
        share = np.append(dropped_turns(whole, t.iterations, k), 0.0)  # per turn; [-1]: no turn
        fc = 1.0 - once * share[turn]
        op_turn = np.append(turn, -1)[t.ops.launch]  # the turn of the op's launch call (-1: none)
        kept = np.where(tail, 1.0, 1.0 - share[op_turn])  # per op, the share of its time left
        fo = np.where(tail, np.append(fc, 1.0)[t.ops.launch], kept)  # its latencies
        scaled = _scaled(t, w, fc, fo, kept)
        out.append(replace(scaled, c_blocks=scaled.c_blocks & (share[turn] < 1.0)))  # a dropped turn's syncs wait for nothing
    return out


def dropped_turns(whole: np.ndarray, iterations: int, k: float) -> np.ndarray:
    """Per turn, the share of it that k times the micro-batches no longer run: of the window's
    ``iterations`` turns of work, n (1 - 1/k); the whole turns the window holds, as many as fit,
    dropped outright and spread evenly; the rest a share of every other turn's."""
    n = max(int(iterations), 1)
    want = n * (1.0 - 1.0 / k)
    idx = np.flatnonzero(whole)
    d = min(len(idx), int(np.floor(want + 1e-9)))
    share = np.full(len(whole), (want - d) / (n - d) if n > d else 0.0)
    share[idx[np.arange(d) * len(idx) // max(d, 1)]] = 1.0
    return share


def _scaled(t: GpuTrace, w, per_call: np.ndarray, per_op: np.ndarray, op_time: np.ndarray):
    """The weights with each host call's time (its gap, duration and the host edges into it) by
    ``per_call``, each op's launch latency and stream gap by ``per_op``, and its time by
    ``op_time``."""
    return replace(w, c_gap=(w.c_gap * per_call).astype(np.int64), c_dur=(w.c_dur * per_call).astype(np.int64),
                   h_lag=(w.h_lag * per_call[t.edges.h_dst]).astype(np.int64),
                   launch_lag=(w.launch_lag * per_op).astype(np.int64), stream_gap=(w.stream_gap * per_op).astype(np.int64),
                   op_dur=np.where(op_time == 1.0, w.op_dur, (w.op_dur * op_time).astype(np.int64)))
