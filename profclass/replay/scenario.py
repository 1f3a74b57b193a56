"""A scenario: the graph's weights as captured, or as a change (a wall removed, a fix applied)
leaves them. Nodes never change; a dropped op or call keeps its node at zero cost. A scenario
may cut what holds a detachable op (a collective moved to its own stream: its stream order,
launch and event waits) and add edges that make an op wait for another op's end (``ready_*``:
the collective starts when its inputs are ready)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .engine import (CALL, COMM_END, E_ARRIVE, E_EVENT, E_LAUNCH, E_ORDER, E_READY, E_STREAM, E_SYNC, E_THREAD,
                     E_XFER, NEG, OP, RET, Graph, solve)
from .trace import ALLOC, COMM, COMPUTE, GpuTrace


@dataclass(frozen=True)
class Weights:
    """One GPU's costs in a scenario (arrays aligned with its trace's ops and calls)."""

    op_dur: np.ndarray
    launch_lag: np.ndarray
    stream_gap: np.ndarray
    transfer_scale: np.ndarray  # per op: factor on a matched collective's transfer
    c_dur: np.ndarray
    c_gap: np.ndarray
    c_blocks: np.ndarray  # bool: the call still waits for its op
    h_lag: np.ndarray  # per thread hand-off: ns from the other thread's call end
    detached: np.ndarray  # bool per op: its stream order, launch and event waits no longer hold it
    ready_src: np.ndarray  # added edges: op ready_dst starts ready_lag ns (may be < 0) after op ready_src ends
    ready_dst: np.ndarray
    ready_lag: np.ndarray
    ahead: np.ndarray  # per op: ns an op nothing in the window holds may start before its captured start


def captured(t: GpuTrace) -> Weights:
    none = np.zeros(0, np.int64)
    return Weights(op_dur=t.ops.dur.copy(), launch_lag=t.ops.launch_lag.copy(), stream_gap=t.ops.stream_gap.copy(),
                   transfer_scale=np.ones(t.n_ops), c_dur=t.calls.c_dur.copy(), c_gap=t.calls.c_gap.copy(),
                   c_blocks=t.calls.c_target >= 0, h_lag=t.edges.h_lag.copy(), detached=np.zeros(t.n_ops, bool),
                   ready_src=none, ready_dst=none, ready_lag=none, ahead=np.zeros(t.n_ops, np.int64))


def drop_ops(t: GpuTrace, w: Weights, mask: np.ndarray) -> Weights:
    """Ops that no longer run: no time, no latency before them, no transfer."""
    return replace(w, op_dur=np.where(mask, 0, w.op_dur), launch_lag=np.where(mask, 0, w.launch_lag),
                   stream_gap=np.where(mask, 0, w.stream_gap), transfer_scale=np.where(mask, 0.0, w.transfer_scale))


def drop_calls(t: GpuTrace, w: Weights, mask: np.ndarray) -> Weights:
    """Host calls (and the CPU time before them) that no longer happen."""
    return replace(w, c_dur=np.where(mask, 0, w.c_dur), c_gap=np.where(mask, 0, w.c_gap),
                   c_blocks=w.c_blocks & ~mask)


@dataclass(frozen=True)
class Outcome:
    t: np.ndarray  # node times
    ends: np.ndarray  # per GPU: replayed end of its window
    rounds: int


def run(g: Graph, weights: list[Weights]) -> Outcome:
    off, lag, base, own = _arrays(g, weights)
    # solved on times relative to the window's first node: the solver keeps chains apart by
    # offsets that hold for spans below 2**44 ns, not for clocks that count from an epoch
    t0 = int(g.meas.min()) if g.n else 0
    t, rounds = solve(g, off, lag, np.where(base > NEG, base - t0, NEG), extra=ready_edges(g, weights, own))
    t = np.where(t > NEG // 2, t + t0, t)
    return Outcome(t=t, ends=_ends(g, t, own), rounds=rounds)


def node_costs(g: Graph, weights: list[Weights]):
    """(off, lag, base, own): the solver's weights and each node's own duration."""
    return _arrays(g, weights)


def ready_edges(g: Graph, weights: list[Weights], own: np.ndarray) -> tuple | None:
    """The scenario's added edges as (src, dst, lag) nodes: from the source op's end (its end
    node when matched, else its start plus its own time) to the op's start."""
    if not any(len(w.ready_src) for w in weights):
        return None
    src, dst, lag = [], [], []
    for on, en, w in zip(g.op_node, g.end_node, weights):
        s_node = np.where(en[w.ready_src] >= 0, en[w.ready_src], on[w.ready_src])
        src.append(s_node), dst.append(on[w.ready_dst]), lag.append(w.ready_lag + own[s_node])
    return tuple(np.concatenate(x).astype(np.int64) for x in (src, dst, lag))


def with_ready(g: Graph, weights: list[Weights], lag: np.ndarray, own: np.ndarray) -> tuple[Graph, np.ndarray]:
    """The graph with the scenario's added edges among its cross edges (E_READY), and their
    lags: for following a replayed step's binding path."""
    extra = ready_edges(g, weights, own)
    if extra is None:
        return g, lag
    src, dst, xlag = extra
    return (replace(g, esrc=np.concatenate([g.esrc, src]), edst=np.concatenate([g.edst, dst]),
                    etype=np.concatenate([g.etype, np.full(len(src), E_READY, np.int8)]),
                    eref=np.concatenate([g.eref, np.full(len(src), -1, np.int64)])),
            np.concatenate([lag, xlag]))


def _flat(g: Graph, weights: list[Weights], name: str) -> np.ndarray:
    return np.concatenate([getattr(w, name) for w in weights]) if weights else np.zeros(0)


def _bases(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(list(sizes))]).astype(np.int64)


def _arrays(g: Graph, weights: list[Weights]):
    """(off, lag, base, own): each node's offset after its chain predecessor, each cross
    edge's lag, each node's own lower bound and own duration, under these weights."""
    op_base = _bases(t.n_ops for t in g.traces)
    call_base = _bases(len(t.calls.c_start) for t in g.traces)
    c_dur = _flat(g, weights, "c_dur").astype(np.int64)
    gi = np.clip(g.gpu, 0, None)
    is_op, is_call = g.ntype == OP, g.ntype == CALL
    op_i = np.where(is_op | (g.ntype == COMM_END), op_base[gi] + g.ref, 0)
    call_i = np.where(is_call | (g.ntype == RET), call_base[gi] + g.ref, 0)
    # a node's own duration: an op's (a matched collective's end node holds its end); a
    # non-blocking call's (a blocking call's own time lies between its start and its return)
    blocked_call = np.zeros(g.n, bool)
    matched = np.zeros(g.n, bool)
    for cn, rn, on, en in zip(g.call_node, g.ret_node, g.op_node, g.end_node):
        blocked_call[cn[rn >= 0]] = True
        matched[on[en >= 0]] = True
    own = np.zeros(g.n, np.int64)
    own[is_op] = _flat(g, weights, "op_dur").astype(np.int64)[op_i[is_op]]
    own[is_call & ~blocked_call] = c_dur[call_i[is_call & ~blocked_call]]
    own[matched] = 0
    off = np.zeros(g.n, np.int64)
    hp = g.cprev >= 0
    pp = np.clip(g.cprev, 0, None)
    s_gap, c_gap = _flat(g, weights, "stream_gap").astype(np.int64), _flat(g, weights, "c_gap").astype(np.int64)
    off[is_op & hp] = s_gap[op_i[is_op & hp]] + own[pp[is_op & hp]]
    off[is_call & hp] = c_gap[call_i[is_call & hp]] + own[pp[is_call & hp]]
    off[g.ntype == RET] = c_dur[call_i[g.ntype == RET]]
    lag = _lags(g, weights, own, op_base, call_base)
    # a node with no predecessor in the window (or none a scenario left) stays where it was
    # captured, or starts as far ahead of it as the scenario lets it
    has_pred = hp.copy()
    has_pred[g.edst[lag > NEG]] = True
    added = ready_edges(g, weights, own)
    if added is not None:
        has_pred[added[1]] = True
    ahead = np.zeros(g.n, np.int64)
    ahead[is_op] = _flat(g, weights, "ahead").astype(np.int64)[op_i[is_op]]
    base = np.where(has_pred, NEG, g.meas - ahead).astype(np.int64)
    return off, lag, base, own


def _lags(g: Graph, weights: list[Weights], own, op_base, call_base) -> np.ndarray:
    """Each cross edge's lag: a latency, plus the source op's or call's own time where the
    edge leaves its end; NEG where a call no longer blocks."""
    lag = np.zeros(len(g.esrc), np.int64)
    et = g.etype
    dgi = np.clip(g.gpu[g.edst], 0, None)
    m = et == E_LAUNCH
    lag[m] = _flat(g, weights, "launch_lag").astype(np.int64)[op_base[dgi[m]] + g.eref[m]]
    ev_lag = np.concatenate([t.edges.e_lag for t in g.traces]) if g.traces else np.zeros(0, np.int64)
    ev_base = _bases(len(t.edges.e_lag) for t in g.traces)
    m = (et == E_EVENT) | (et == E_ORDER)
    # an event edge leaves its source's end; an order edge its start (a shared hardware queue)
    lag[m] = ev_lag[ev_base[dgi[m]] + g.eref[m]] + np.where(et[m] == E_EVENT, own[g.esrc[m]], 0)
    m = et == E_SYNC
    wake = np.concatenate([t.calls.c_wake for t in g.traces]) if g.traces else np.zeros(0, np.int64)
    ci = call_base[dgi[m]] + g.eref[m]
    lag[m] = np.where(_flat(g, weights, "c_blocks").astype(bool)[ci], wake[ci] + own[g.esrc[m]], NEG)
    m = et == E_XFER
    if m.any():
        rows, mem = g.eref[m], g.members
        xscale = _flat(g, weights, "transfer_scale").astype(np.float64)
        lag[m] = (mem.transfer[rows] * xscale[op_base[mem.gpu[rows]] + mem.op[rows]]).astype(np.int64)
    lag[et == E_ARRIVE] = 0
    m = et == E_STREAM  # a detachable op's stream order: its chain offset
    lag[m] = _flat(g, weights, "stream_gap").astype(np.int64)[op_base[dgi[m]] + g.eref[m]] + own[g.esrc[m]]
    # a detached op: its stream order, launch and event waits no longer hold it
    held = ((et == E_LAUNCH) | (et == E_EVENT) | (et == E_ORDER) | (et == E_STREAM)) & (g.ntype[g.edst] == OP)
    det = _flat(g, weights, "detached").astype(bool)
    if det.any() and held.any():
        cut = np.zeros(len(et), bool)
        cut[held] = det[op_base[dgi[held]] + g.ref[g.edst[held]]]
        lag[cut] = NEG
    m = et == E_THREAD
    if m.any():
        h_lag = _flat(g, weights, "h_lag").astype(np.int64)
        lag[m] = h_lag[_bases(len(t.edges.h_lag) for t in g.traces)[dgi[m]] + g.eref[m]] + own[g.esrc[m]]
    return lag


def _ends(g: Graph, t: np.ndarray, own: np.ndarray) -> np.ndarray:
    fin = t + own
    gpu = g.gpu
    out = np.full(len(g.traces), NEG, np.int64)
    ok = gpu >= 0
    np.maximum.at(out, gpu[ok], fin[ok])
    return out


def op_walls(t: GpuTrace) -> np.ndarray:
    """The wall each op's time belongs to (index into WALLS)."""
    from ..classify import WALLS
    w = np.full(t.n_ops, WALLS.index("host"), np.int8)
    w[t.ops.kind == COMPUTE] = WALLS.index("compute")
    w[t.ops.kind == COMM] = WALLS.index("communication")
    mem = t.ops.recomputed | t.ops.offload
    w[mem] = WALLS.index("memory")
    return w


def call_walls(t: GpuTrace) -> np.ndarray:
    from ..classify import WALLS
    w = np.full(len(t.calls.c_start), WALLS.index("host"), np.int8)
    w[(t.calls.c_kind == ALLOC) | t.calls.c_recomputed] = WALLS.index("memory")
    return w


def stream_neighbours(t: GpuTrace) -> tuple[np.ndarray, np.ndarray]:
    """Each op's predecessor and successor on its stream (-1 at a stream's ends)."""
    order = np.lexsort((t.ops.start, t.ops.stream))
    prev, nxt = np.full(t.n_ops, -1, np.int64), np.full(t.n_ops, -1, np.int64)
    same = t.ops.stream[order][1:] == t.ops.stream[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    nxt[order[:-1][same]] = order[1:][same]
    return prev, nxt
