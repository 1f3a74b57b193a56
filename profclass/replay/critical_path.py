"""The replayed step's critical path, by wall: the slowest GPU's binding path through the graph
after a replay (``Replayer.critical_path_ms``), each segment charged to the wall of the node it
waited for (an op's own wall, a call's host time, a transfer's communication; latencies and gaps
to the host)."""
from __future__ import annotations

import numpy as np

from ..classify import WALLS
from . import engine, scenario
from .engine import CALL, E_XFER, OP


def walls_ms(r, out: scenario.Outcome, weights) -> dict:
    """ms per step of the slowest GPU's binding path, by wall."""
    g = r.graph
    off, lag, base, own = scenario.node_costs(g, weights)
    steps = [(e - m) / max(t.iterations, 1) + s for e, m, t, s in
             zip(out.ends, r.measured_end, r.traces, r.inp.step_ns)]
    slow = int(np.argmax(steps)) if steps else 0
    mine = np.flatnonzero(g.gpu == slow)
    if not len(mine):  # a GPU with nothing in its window: no path
        return {w: 0.0 for w in WALLS}
    sink = mine[np.argmax((out.t + own)[mine])]
    g, lag = scenario.with_ready(g, weights, lag, own)  # a scenario's added edges bind too
    nodes, how = engine.critical_path(g, out.t, off, lag, int(sink))
    walls = np.zeros(len(WALLS))
    host = WALLS.index("host")
    parent_t = np.empty(len(nodes), np.int64)
    # each on-path node's segment: from its binding predecessor's time to its own
    seg = np.zeros(len(nodes), np.int64)
    src_wall = np.full(len(nodes), host)
    dur_part = np.zeros(len(nodes), np.int64)
    op_wall = np.concatenate([scenario.op_walls(t) for t in r.traces]) if r.traces else np.zeros(0, np.int8)
    call_wall = np.concatenate([scenario.call_walls(t) for t in r.traces]) if r.traces else np.zeros(0, np.int8)
    op_base = np.concatenate([[0], np.cumsum([t.n_ops for t in r.traces])]).astype(np.int64)
    call_base = np.concatenate([[0], np.cumsum([len(t.calls.c_start) for t in r.traces])]).astype(np.int64)
    par = _parents(g, out.t, off, lag, nodes, how)
    ok = par >= 0
    parent_t[ok] = out.t[par[ok]]
    # only the window's part of the path (its first nodes may have been placed before it)
    lo = r.traces[slow].lo + r.traces[slow].shift_ns
    hi = r.traces[slow].hi + r.traces[slow].shift_ns + (out.ends[slow] - r.measured_end[slow])
    seg[ok] = np.clip(np.minimum(out.t[nodes[ok]], hi) - np.maximum(parent_t[ok], lo), 0, None)
    pt = np.where(ok, g.ntype[np.clip(par, 0, None)], -1)
    pg = np.clip(g.gpu[np.clip(par, 0, None)], 0, None)
    pref = g.ref[np.clip(par, 0, None)]
    is_op_src = ok & (pt == OP)
    dur_part[is_op_src] = np.minimum(own[par[is_op_src]], seg[is_op_src])
    src_wall[is_op_src] = op_wall[op_base[pg[is_op_src]] + pref[is_op_src]]
    is_call_src = ok & (pt == CALL)
    src_wall[is_call_src] = call_wall[call_base[pg[is_call_src]] + pref[is_call_src]]
    dur_part[is_call_src] = seg[is_call_src]  # host time
    xfer = ok & (how == E_XFER)
    src_wall[xfer] = WALLS.index("communication")
    dur_part[xfer] = seg[xfer]
    np.add.at(walls, src_wall, dur_part)
    walls[host] += float((seg - dur_part)[ok].sum())  # latencies and gaps: the GPU waits
    # the sink's own time
    sink_dur = int(np.clip(min(out.t[sink] + own[sink], hi) - max(out.t[sink], lo), 0, None))
    if g.ntype[sink] == OP:
        walls[op_wall[op_base[g.gpu[sink]] + g.ref[sink]]] += sink_dur
    else:
        walls[host] += sink_dur
    its = max(r.traces[slow].iterations, 1)
    return {w: round(float(v) / its / 1e6, 3) for w, v in zip(WALLS, walls)}


def _parents(g, t, off, lag, nodes, how) -> np.ndarray:
    """Each on-path node's binding predecessor (-1 at the path's start)."""
    par = np.full(len(nodes), -1, np.int64)
    chain = how == -1
    par[chain] = g.cprev[nodes[chain]]
    cross = np.flatnonzero(how >= 0)
    if len(cross):
        live = lag > engine.NEG
        hit = np.flatnonzero(live & (np.where(live, t[g.esrc] + lag, engine.NEG) == t[g.edst]))
        order = np.argsort(g.edst[hit], kind="stable")
        dst, first = np.unique(g.edst[hit][order], return_index=True)  # a destination's first binding edge
        src = g.esrc[hit][order][first]
        at = np.clip(np.searchsorted(dst, nodes[cross]), 0, max(len(dst) - 1, 0))
        found = (dst[at] == nodes[cross]) if len(dst) else np.zeros(len(cross), bool)
        par[cross[found]] = src[at[found]]
    return par


def largest(cp: dict) -> str:
    """The wall with the most time on a critical path (ties: WALLS' order): "then the X wall"."""
    return max(cp, key=lambda k: (cp[k], -WALLS.index(k)))


# Where a step delta the graph does not replay comes off the critical path. A pipeline schedule
# change (more micro-batches, interleaving, balanced stages) shortens the stages' PP waits, the
# bubble, which the path charges to communication (a PP send/recv's wait); a larger micro-batch on
# a pipeline is priced by its host saving less the bubble it adds, so its net comes off the host.
DELTA_WALL = {"pp_schedule": "communication", "fewer_launches": "host"}


def after_delta(cp: dict, gain_ms: float, kind: str) -> dict:
    """The critical path's walls after a fix priced as a step delta of ``gain_ms`` (a schedule
    change, ``DELTA_WALL``): that wall less the gain, at least 0; the rest as they were."""
    wall = DELTA_WALL[kind]
    return {**cp, wall: round(max(cp[wall] - gain_ms, 0.0), 3)}
