"""What each change does to the graph's weights: the walls removed (``without_wall_ms``), the
profiler's overhead removed (``untraced_step_ms``) and every fix's transform, declared beside
its row in ``data/fixes.toml`` (``transform = { kind = ..., ... }``; docs/fixes.md says each
one's assumptions).

A transform's uncertain parameter is a triple ``[low, best, high]`` of the *gain's* low end,
best estimate and high end (for a duration factor, the largest factor first), fixed here and
in the table before any pair was looked at; ``point`` picks one of the three.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import collectives, collector, host_input, microbatch, overlap
from . import pipeline_schedule, tp_overlap
from .constants import GPU_TRACED_SHARE, TRACED_CALL_NS, TYPICAL_QUANTILE
from ..analyzers.compute import FUSION_FLAGS
from .scenario import Weights, drop_calls, drop_ops, stream_neighbours
from . import shapes
from .trace import ALLOC, COMM, COMPUTE, COPY, LAUNCH, SYNC, GpuTrace

POINTS = ("low", "best", "high")


def _pick(param, point: str) -> float:
    if isinstance(param, (list, tuple)):
        return float(param[POINTS.index(point)])
    return float(param)


def _selected_ops(t: GpuTrace, which: str, groups: np.ndarray | None) -> np.ndarray:
    if which == "gemm":
        return t.ops.gemm & (t.ops.kind == COMPUTE)
    if which == "compute":
        return t.ops.kind == COMPUTE
    if which.startswith("name:"):  # ops whose normalised name holds the text
        return t.ops_named(lambda n: which[5:] in n)
    if which.startswith("group:"):
        names = which.split(":", 1)[1].split(",")
        return (t.ops.kind == COMM) & np.isin(groups, names) if groups is not None else np.zeros(t.n_ops, bool)
    raise ValueError(f"unknown op selector {which!r}")


def without_wall(wall: str, t: GpuTrace, w: Weights) -> Weights:
    """The GPU's weights with one wall's time taken out."""
    if wall == "compute":
        return replace(w, op_dur=np.where((t.ops.kind == COMPUTE) & ~t.ops.recomputed, 0, w.op_dur))
    if wall == "communication":
        return replace(w, op_dur=np.where(t.ops.kind == COMM, 0, w.op_dur), transfer_scale=np.zeros(t.n_ops))
    if wall == "host":
        # an infinitely fast CPU: calls and the time between them cost nothing (the GPU's own
        # launch latency stays)
        return replace(w, c_dur=np.zeros_like(w.c_dur), c_gap=np.zeros_like(w.c_gap), h_lag=np.zeros_like(w.h_lag))
    if wall == "memory":
        w = drop_ops(t, w, t.ops.recomputed | t.ops.offload)
        return drop_calls(t, w, t.calls.c_recomputed | (t.calls.c_kind == ALLOC))
    raise ValueError(wall)


def untraced(t: GpuTrace, w: Weights, profiler_ns_per_step: float, point: int = 1) -> Weights:
    """The GPU's weights without the profiler: the host time the profiler's op ranges add, out
    of the CPU time between calls (in proportion to it: the ranges wrap the ops those calls
    launch), and what CUDA tracing adds to every traced API call (``TRACED_CALL_NS[kind][point]``,
    the calls folded into the gap included), out of the CPU time before the call, then the call;
    and its share of each compute kernel's time on the GPU (``GPU_TRACED_SHARE[point]``)."""
    total = float(w.c_gap.sum())
    cut = min(float(profiler_ns_per_step) * t.iterations, total)
    gap = (w.c_gap * (1.0 - cut / total if total > 0 else 1.0)).astype(np.int64)
    own = np.where(t.calls.c_kind == LAUNCH, TRACED_CALL_NS["launch"][point], TRACED_CALL_NS["other"][point])
    traced = own + t.calls.c_folded * TRACED_CALL_NS["other"][point]
    from_gap = np.minimum(traced, gap)
    on_gpu = np.where(t.ops.kind == COMPUTE, 1.0 - GPU_TRACED_SHARE[point], 1.0)
    return replace(w, c_gap=gap - from_gap, c_dur=np.maximum(w.c_dur - (traced - from_gap), 0),
                   op_dur=(w.op_dur * on_gpu).astype(np.int64))


def host_speed(w: Weights, factor: float) -> Weights:
    """The weights with every host call's own time and the CPU time before it times ``factor``
    (a host that much slower or faster: ``run.host_range``)."""
    return replace(w, c_gap=(w.c_gap * factor).astype(np.int64), c_dur=(w.c_dur * factor).astype(np.int64))


@dataclass(frozen=True)
class Context:
    """What transforms read beside the traces: each op's collective group and type, each op's
    phase between EP all-to-alls (``collectives.segments``), the ops the graph lets a scenario
    detach, each matched collective's transfer, the micro-batches per step, and the job's graph
    and replay (a transform whose effect depends on the replayed times replays)."""

    op_groups: tuple
    ep_segments: tuple
    op_colls: tuple = ()
    detachable: tuple = ()
    transfer: tuple = ()
    microbatches: int | None = None
    graph: object = None
    replay: object = None
    members: tuple = ()  # per GPU: group -> member ranks


def apply(spec: dict, point: str, traces: list[GpuTrace], weights: list[Weights],
          ctx: Context) -> list[Weights] | None:
    """Every GPU's weights after the fix ``spec`` (its ``transform`` table); None when the
    profile has nothing the transform acts on."""
    if spec["kind"] == pipeline_schedule.KIND:  # a schedule change: no graph weights (run._price simulates it)
        return None
    return _KINDS[spec["kind"]](spec, point, traces, weights, ctx)


def _scale(spec, point, traces, weights, ctx):
    f = _pick(spec["factor"], point)
    out, hit = [], False
    for t, w, g in zip(traces, weights, ctx.op_groups):
        sel = _selected_ops(t, spec["ops"], g)
        hit |= bool(sel.any())
        if spec["ops"].startswith("group:"):
            # a matched collective's time is its transfer, an unmatched one's its duration
            out.append(replace(w, transfer_scale=np.where(sel, w.transfer_scale * f, w.transfer_scale),
                               op_dur=np.where(sel, (w.op_dur * f).astype(np.int64), w.op_dur)))
        else:
            out.append(replace(w, op_dur=np.where(sel, (w.op_dur * f).astype(np.int64), w.op_dur)))
    if hit and spec.get("unblock") == "token_counts":  # the dispatcher's token-count waits (``_unblock``)
        out = _unblock(spec, point, traces, out, ctx)
    return out if hit else None


def _fuse(spec, point, traces, weights, ctx):
    """Each chain a switched-on fusion flag replaces runs at ``factor`` of its time: a kernel of
    the flag's family (``compute.FUSION_FLAGS``; spec key = 1 fuses it, 0 keeps it) and the
    generic pointwise kernels next to it on its stream (its chain's other links). The launches
    stay: a compiled fusion is still one launch per call, plus its dispatch."""
    f = _pick(spec["factor"], point)
    on = [i + 1 for i, (key, _, _) in enumerate(FUSION_FLAGS) if spec.get(key, 1.0)]
    out, hit = [], False
    for t, w in zip(traces, weights):
        chain = np.isin(t.ops.fusion, on)
        if chain.any():
            hit = True
            for nb in stream_neighbours(t):
                links = nb[chain]
                links = links[links >= 0]
                chain[links[t.ops.fusion[links] == -1]] = True
        out.append(replace(w, op_dur=np.where(chain, (w.op_dur * f).astype(np.int64), w.op_dur)))
    return out if hit else None


def _drop_recomputed(spec, point, traces, weights, ctx):
    if not any(t.ops.recomputed.any() for t in traces):
        return None
    keep = _pick(spec.get("keep", 0.0), point)  # share of the recomputed forward still re-run
    out = []
    for gi, (t, w) in enumerate(zip(traces, weights)):
        # a layer's re-run forward re-issues its own collectives (TP, the MoE dispatch), never a
        # pipeline exchange: a PP send/recv that ran inside a recomputed span, and the calls that
        # launched it or waited for it, stay
        recomputed, c_recomputed = t.ops.recomputed, t.calls.c_recomputed
        if gi < len(ctx.op_groups) and (ctx.op_groups[gi] == "PP").any():
            pp = ctx.op_groups[gi] == "PP"
            recomputed = recomputed & ~pp
            launched = np.zeros(len(c_recomputed), bool)
            launched[t.ops.launch[pp & (t.ops.launch >= 0)]] = True
            waited = (t.calls.c_target >= 0) & pp[np.clip(t.calls.c_target, 0, None)]
            c_recomputed = c_recomputed & ~launched & ~waited
        if keep > 0:
            # selective recompute keeps re-running a share of it: the rest is dropped, taken
            # evenly (every k-th recomputed op runs again)
            idx = np.flatnonzero(recomputed)
            kept = idx[np.linspace(0, len(idx) - 1, int(round(keep * len(idx)))).astype(int)] if len(idx) else idx
            ops = recomputed.copy()
            ops[kept] = False
            cidx = np.flatnonzero(c_recomputed)
            ckept = cidx[np.linspace(0, len(cidx) - 1, int(round(keep * len(cidx)))).astype(int)] if len(cidx) else cidx
            calls = c_recomputed.copy()
            calls[ckept] = False
        else:
            ops, calls = recomputed, c_recomputed
        out.append(drop_calls(t, drop_ops(t, w, ops), calls))
    return out


def _graph_runs(t: GpuTrace, outside: np.ndarray | None = None) -> np.ndarray:
    """Per call: the id of its capturable run (consecutive calls of a thread with no blocking
    call or allocation among them: a CUDA graph can hold neither, nor a launch of an op the
    graphs' scope leaves ``outside``), -1 outside any."""
    m = len(t.calls.c_start)
    if m == 0:
        return np.zeros(0, np.int64)
    breaker = (t.calls.c_target >= 0) | (t.calls.c_kind == ALLOC) | (t.calls.c_kind != LAUNCH)
    if outside is not None and outside.any():
        has = (t.ops.launch >= 0) & outside
        breaker = breaker.copy()
        breaker[t.ops.launch[has]] = True
    new_thread = np.ones(m, bool)
    new_thread[1:] = t.calls.c_tid[1:] != t.calls.c_tid[:-1]
    starts = breaker | new_thread
    starts[1:] |= breaker[:-1]
    run = np.cumsum(starts) - 1
    run = np.where(breaker, -1, run)
    sizes = np.bincount(run[run >= 0], minlength=int(run.max(initial=-1)) + 1)
    ok = run >= 0
    ok[ok] = sizes[run[ok]] >= 2  # one launch is no graph
    return np.where(ok, run, -1)


def _cuda_graphs(spec, point, traces, weights, ctx):
    """Each capturable run of launches becomes one graph launch. Per-layer graphs of a dropless
    MoE job (the fix's partial scope) leave the experts' phase eager (``expert_phase`` = 0: its
    launches break the runs); graphing it too (1) is what static shapes (drop-and-pad) allow."""
    node_gap = _pick(spec["node_gap_ns"], point)
    scoped = not _pick(spec.get("expert_phase", 1), point)
    segs = ctx.ep_segments or (None,) * len(traces)
    groups = ctx.op_groups or (None,) * len(traces)
    out, hit = [], False
    for t, w, seg, g in zip(traces, weights, segs, groups):
        run = _graph_runs(t, collectives.expert_phase(t, seg, g) if scoped else None)
        inside = run >= 0
        if not inside.any():
            out.append(w)
            continue
        hit = True
        first = inside.copy()
        first[1:] &= run[1:] != run[:-1]
        # one graph launch per run (it costs what one launch call costs); the Python and the
        # other launch calls of the run are gone
        c_dur = np.where(inside & ~first, 0, w.c_dur)
        c_gap = np.where(inside & ~first, 0, w.c_gap)
        graphed_op = np.zeros(t.n_ops, bool)
        has = t.ops.launch >= 0
        graphed_op[has] = inside[t.ops.launch[has]]
        # on the GPU, a graph's kernels follow each other node_gap_ns apart (the graph's
        # per-node cost), not a launch latency apart
        out.append(replace(w, c_dur=c_dur, c_gap=c_gap,
                           stream_gap=np.where(graphed_op, np.minimum(w.stream_gap, int(node_gap)), w.stream_gap)))
    return out if hit else None


def _unblock(spec, point, traces, weights, ctx):
    """The host's waits for the MoE dispatcher's token counts no longer block: a wait for a small
    device-to-host copy, or any sync made once a micro-batch (``microbatch.per_step_calls``: a step's
    own syncs, the loss's and the gradient norm's, stay) that awaits no collective (a pipeline's
    batched send/recv is followed by a sync each micro-batch too). docs/fixes.md, the unblock row."""
    out, hit = [], False
    for t, w in zip(traces, weights):
        tg = t.calls.c_target
        small = np.zeros(len(tg), bool)
        ok = tg >= 0
        small[ok] = (t.ops.kind[tg[ok]] == COPY) & (t.ops.dur[tg[ok]] < 50_000)
        small &= t.calls.c_kind != ALLOC  # a free's implicit device sync is no token-count wait
        once = microbatch.per_step_calls(t)
        if once.any():  # none marked: the micro-batches cannot be told from the step's own work
            # a sync that awaits a collective is no token-count wait (PP's batched send/recv sync)
            own = ok & (t.calls.c_kind == SYNC) & ~once
            own[ok] &= t.ops.kind[tg[ok]] != COMM
            small |= own
        hit |= bool(small.any())
        out.append(replace(w, c_blocks=w.c_blocks & ~small))
    return out if hit else (weights if spec.get("kind") != "unblock" else None)


def _host_rate(spec, point, traces, weights, ctx):
    """The slowest host (CPU time between its calls per step) runs at the median rank's rate."""
    if len(traces) < 2:
        return None
    busy = np.array([(w.c_gap.sum() + w.c_dur.sum()) / max(t.iterations, 1) for t, w in zip(traces, weights)])
    med = float(np.median(busy))
    worst = int(np.argmax(busy))
    if busy[worst] <= med * 1.02:
        return None
    share = _pick(spec.get("recovered", 1.0), point)
    f = 1.0 - share * (1.0 - med / busy[worst])
    out = list(weights)
    out[worst] = host_speed(weights[worst], f)
    return out


def _balance(spec, point, traces, weights, ctx):
    """Balanced routing: between two all-to-alls every EP rank computes the mean of what the
    ranks computed there (an overloaded rank's extra tokens spread over the others), and each
    EP all-to-all moves the mean rank's volume instead of the largest (``_ep_transfer_factor``)."""
    if len(traces) < 2:
        return None
    share = _pick(spec.get("recovered", 1.0), point)
    seg = ctx.ep_segments
    sums = collectives.segment_work(traces, weights, seg, lambda gi, t, s: t.ops.kind == COMPUTE)
    if not sums.shape[1]:
        return None
    present = sums > 0
    mean = np.where(present.any(axis=0), sums.sum(axis=0) / np.maximum(present.sum(axis=0), 1), 0)
    if not (sums > mean * 1.02).any() and not spec.get("host"):
        return None
    xfer = _ep_transfer_factor(traces, ctx, mean / np.maximum(sums.max(axis=0), 1), share)
    out = []
    for gi, (t, w, s) in enumerate(zip(traces, weights, seg)):
        f = np.where(sums[gi] > 0, 1.0 - share * (1.0 - mean / np.maximum(sums[gi], 1)), 1.0)
        sel = (t.ops.kind == COMPUTE) & (s >= 0)
        factor = np.ones(t.n_ops)
        factor[sel] = f[s[sel]]
        out.append(replace(w, op_dur=(w.op_dur * factor).astype(np.int64),
                           transfer_scale=w.transfer_scale * xfer[gi]))
    if spec.get("host"):
        # the overloaded rank's host also handles its extra tokens (the dispatcher's per-token
        # work between its syncs): balanced, it issues at the median rank's rate
        out = _host_rate(spec, point, traces, out, ctx) or out
    if spec.get("shapes"):  # static expert shapes: no kernel loads, no per-shape host work (replay/shapes.py)
        out = [shapes.repeat_shapes(t, shapes.drop_loads(t, w, share), s, g, share)
               for t, w, s, g in zip(traces, out, seg, ctx.op_groups)]
    return out


def _static_shapes(spec, point, traces, weights, ctx):
    """Drop-and-pad: every expert takes its capacity, so the experts' shapes are fixed (no kernel
    loads, no per-shape host work before any launch of their phase: ``shapes.fixed_shapes``), their
    work is even over the EP ranks (``balance``, where there are EP all-to-alls), and the
    dispatcher's token counts are known on the host, so its syncs made once a micro-batch no
    longer block (``unblock``)."""
    out = _balance(spec, point, traces, weights, ctx) or weights  # even work where there are EP all-to-alls
    share = _pick(spec.get("recovered", 1.0), point)
    segs, groups = ctx.ep_segments or (None,) * len(traces), ctx.op_groups or (None,) * len(traces)
    out = [shapes.fixed_shapes(t, shapes.drop_loads(t, w, share), s, g, share)
           for t, w, s, g in zip(traces, out, segs, groups)]
    return _unblock(spec, point, traces, out, ctx)


def _ep_transfer_factor(traces, ctx, ratio: np.ndarray, share: float) -> list[np.ndarray]:
    """Per GPU, per op: the factor on a matched EP collective's transfer once routing is
    balanced (1 elsewhere). An all-to-all ends when its most loaded member has moved its tokens:
    the bandwidth part of its transfer scales by mean / max load (``ratio``, per segment) of
    the expert work it feeds (a dispatch: the next segment with work) or drains (a combine:
    the last one before it); the trace cannot tell the two apart, so the larger imbalance of
    the two sides counts (the other side is the layer's dense part, balanced by construction).
    Segments with no compute on any rank (between a dispatch's token and probability
    all-to-alls) are skipped. The latency part stays: the collective's typical (low-quantile)
    captured transfer, the time it takes with next to nothing to move."""
    ones = [np.ones(t.n_ops) for t in traces]
    if not ctx.transfer:
        return ones
    n = len(ratio)
    ep = [(t.ops.kind == COMM) & (g == "EP") & (x > 0) & (s >= 0)
          for t, g, x, s in zip(traces, ctx.op_groups, ctx.transfer, ctx.ep_segments)]
    if not any(e.any() for e in ep):
        return ones
    # the EP instances in time order (ids are per (group, collective), not time-ordered across them)
    first = np.full(n, np.iinfo(np.int64).max)
    for t, e, s in zip(traces, ep, ctx.ep_segments):
        np.minimum.at(first, s[e], t.ops.start[e] + t.shift_ns)
    ids = np.flatnonzero(first < np.iinfo(np.int64).max)
    ids = ids[np.argsort(first[ids], kind="stable")]
    m = len(ids)
    # the segment an instance opens is its after side; a segment with no compute has ratio 0
    worked = ratio[ids] > 0
    pos = np.arange(m)
    after = np.minimum.accumulate(np.where(worked, pos, m)[::-1])[::-1]
    before = np.concatenate([[-1], np.maximum.accumulate(np.where(worked, pos, -1))[:-1]])
    side = np.append(ratio[ids], 1.0)  # m (no work after) and -1 (none before) read 1: balanced
    r = np.minimum(side[after], side[before])
    f_inst = np.ones(n)
    f_inst[ids] = 1.0 - share * (1.0 - r)
    # the latency floor of each collective type of the group, over all its members' transfers
    cs = np.concatenate([np.asarray(c, dtype=str)[e] if len(c) else np.full(int(e.sum()), "")
                         for c, e in zip(ctx.op_colls or [()] * len(traces), ep)])
    xs = np.concatenate([np.asarray(x)[e] for x, e in zip(ctx.transfer, ep)]).astype(np.float64)
    kinds, kind_of = np.unique(cs, return_inverse=True)
    floor = np.array([np.quantile(xs[kind_of == k], TYPICAL_QUANTILE) for k in range(len(kinds))])
    fl = np.minimum(floor[kind_of], xs)
    f_all = (fl + (xs - fl) * f_inst[np.concatenate([s[e] for s, e in zip(ctx.ep_segments, ep)])]) / xs
    out, at = [], 0
    for t, e in zip(traces, ep):
        f = np.ones(t.n_ops)
        f[e] = f_all[at:at + int(e.sum())]
        at += int(e.sum())
        out.append(f)
    return out


def _drop_allocs(spec, point, traces, weights, ctx):
    if not any((t.calls.c_kind == ALLOC).any() for t in traces):
        return None
    # an allocation call that no longer happens takes no time, and a free no longer waits for the device
    return [replace(w, c_dur=np.where(t.calls.c_kind == ALLOC, 0, w.c_dur),
                    c_blocks=w.c_blocks & (t.calls.c_kind != ALLOC)) for t, w in zip(traces, weights)]


def _drop_offload(spec, point, traces, weights, ctx):
    if not any(t.ops.offload.any() for t in traces):
        return None
    return [drop_ops(t, w, t.ops.offload) for t, w in zip(traces, weights)]


def _ep_overlap(spec, point, traces, weights, ctx):
    """Megatron's --overlap-moe-expert-parallel-comm: in the steady 1F1B pairs (the forward of
    micro-batch i + 1 beside the backward of i) each pass's all-to-alls run under the other's
    compute. Of m micro-batches' 2m passes, 2(m - 1) are paired (the first forward and the last
    backward have no partner); a pair hides its all-to-alls up to the compute beside them (per
    GPU: its compute time over its matched EP transfer time, capped at 1). The hidden time is
    not all won: compute under an all-to-all loses the SMs NCCL's channels hold (``slowdown``
    s), which costs (s - 1) of it back. Each matched EP collective's transfer scales by
    1 - f (2 - s), f the hidden fraction."""
    m = ctx.microbatches
    if not m or m < 2:
        return None
    s = _pick(spec["slowdown"], point)
    out, hit = [], False
    for t, w, g, x in zip(traces, weights, ctx.op_groups, ctx.transfer):
        ep = (t.ops.kind == COMM) & (g == "EP") & (x > 0)
        transfer = float((x[ep] * w.transfer_scale[ep]).sum())
        if not ep.any() or transfer <= 0:
            out.append(w)
            continue
        hit = True
        compute = float(w.op_dur[t.ops.kind == COMPUTE].sum())
        f = (m - 1) / m * min(1.0, compute / transfer)
        out.append(replace(w, transfer_scale=np.where(ep, w.transfer_scale * (1 - f * (2 - s)), w.transfer_scale)))
    return out if hit else None


def detachable(t: GpuTrace, groups: np.ndarray, colls: np.ndarray) -> np.ndarray:
    """The ops a scenario may move off their stream: the data-parallel gradient reductions
    (``overlap.MOVABLE``); the graph keeps their stream order as a cuttable edge."""
    return overlap.movable(t, groups, colls)


_KINDS = {"scale": _scale, "fuse": _fuse, "drop_recomputed": _drop_recomputed, "cuda_graphs": _cuda_graphs,
          "remove_gc": lambda spec, point, traces, weights, ctx: collector.remove_gc(spec, _pick, point, traces,
                                                                                     weights),
          "unblock": _unblock, "host_rate": _host_rate, "balance": _balance, "static_shapes": _static_shapes,
          "drop_allocs": _drop_allocs, "drop_offload": _drop_offload,
          "drop_loads": lambda spec, point, traces, weights, ctx: shapes.loads_gone(spec, _pick, point, traces,
                                                                                     weights),
          "fewer_launches": lambda spec, point, traces, weights, ctx: microbatch.apply(spec, _pick, _selected_ops, point, traces, weights, ctx),
          "accumulate": lambda spec, point, traces, weights, ctx: microbatch.accumulate(spec, _pick, _selected_ops, point, traces, weights, ctx),
          "overlap": lambda spec, point, traces, weights, ctx: overlap.apply(spec, _pick, point, traces, weights, ctx),
          "ep_overlap": _ep_overlap,
          "host_input": lambda spec, point, traces, weights, ctx: host_input.apply(spec, _pick, point, traces, weights, ctx),
          "tp_overlap": lambda spec, point, traces, weights, ctx: tp_overlap.apply(spec, _pick, point, traces, weights, ctx)}
# the PP schedule changes are priced by the schedule simulation, not on the graph's weights
KINDS = tuple(_KINDS) + (pipeline_schedule.KIND,)
