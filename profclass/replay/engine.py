"""The job's dependency graph and its replay (a discrete-event simulation solved as a longest
path, vectorised).

Nodes: each op's start, each matched collective's end, each host call's start, each blocking
call's return, and one transfer node per collective instance matched across ranks. Every
node lies on one *chain* (a host thread, a stream, or alone for a transfer) and must come
at least an offset after its chain predecessor; *cross edges* add lower bounds from other
chains (launch -> op, event source -> waiting op, awaited op -> the blocking call's return,
member arrival -> transfer start, transfer -> each member's end). A node's time is the
largest of its bounds: the graph's longest path.

The solve visits the nodes in a topological order (the captured times, repaired where clock
skew inverts an edge) in blocks. Inside a block it alternates two vectorised passes until
nothing moves: every cross edge into the block at once, then every chain at once as a running
maximum (``t_i = C_i + max_{j <= i}(r_j - C_j)`` with C the chain's cumulative offsets).
Each round settles one more cross-chain hop of the block's longest paths, so a block needs as
many rounds as its binding path changes chains; nodes before it are final.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .trace import COMM, GpuTrace

# node types
OP, COMM_END, CALL, RET, XFER = 0, 1, 2, 3, 4
# cross-edge types
E_LAUNCH, E_EVENT, E_SYNC, E_ARRIVE, E_XFER, E_THREAD, E_ORDER = 0, 1, 2, 3, 4, 5, 6
# a detachable op's stream order (kept as a cross edge, so a scenario can cut it: a collective
# moved to its own stream); an edge a scenario adds (an op ready once another has ended)
E_STREAM, E_READY = 7, 8
NEG = -(2 ** 45)  # "no bound": far below any time, far above int64's floor (no overflow)
BLOCK = 4096
_BIG = 2 ** 47  # separates chains in the segmented running maximum (times < 2**44 ns)


@dataclass(frozen=True)
class Instance:
    """Collectives matched across ranks, one row per member of each: (gpu, op), the member's
    transfer (its end after the last member arrived) and which instance (0..) the row is of."""

    gpu: np.ndarray
    op: np.ndarray
    transfer: np.ndarray
    k: np.ndarray
    group: str = ""


@dataclass(frozen=True)
class Graph:
    """The structure, fixed across scenarios; weights come per scenario (``scenario``)."""

    traces: tuple
    n: int
    meas: np.ndarray  # captured time of each node (shared clock)
    gpu: np.ndarray
    ntype: np.ndarray
    ref: np.ndarray  # op index, call index or instance index within its GPU / the job
    cprev: np.ndarray  # chain predecessor node, -1 at a chain's start
    esrc: np.ndarray
    edst: np.ndarray
    etype: np.ndarray
    eref: np.ndarray  # op index (launch, event: the waiting op), call index (sync), member row (xfer)
    op_node: tuple  # per GPU: node of each op's start
    end_node: tuple  # per GPU: node of each matched comm op's end, -1 if unmatched
    call_node: tuple  # per GPU: node of each call's start
    ret_node: tuple  # per GPU: node of each blocking call's return, -1
    members: Instance  # every matched instance's member rows (k: the instance's id in the job)
    order: np.ndarray  # processing order (topological)
    blocks: tuple  # per block: precomputed index structures


class _Parts:
    """Node and edge arrays as they are collected, GPU by GPU."""

    def __init__(self):
        self.n = 0
        self.meas, self.gpu, self.ntype, self.ref, self.cprev = [], [], [], [], []
        self.esrc, self.edst, self.etype, self.eref = [], [], [], []
        self.op_node, self.end_node, self.call_node, self.ret_node = [], [], [], []

    def take(self, count: int) -> np.ndarray:
        ids = self.n + np.arange(count)
        self.n += count
        return ids

    def edges(self, src, dst, etype: int, ref) -> None:
        self.esrc.append(src), self.edst.append(dst), self.eref.append(ref)
        self.etype.append(np.full(len(dst), etype))


def build_graph(traces: list[GpuTrace], instances: list[Instance], detachable: list | None = None) -> Graph:
    """``detachable``: per GPU, the ops whose stream order a scenario may cut (their chain edge
    becomes an E_STREAM cross edge of the same weight: the captured replay is unchanged)."""
    parts = _Parts()
    matched = [np.zeros(t.n_ops, bool) for t in traces]  # matched ops get an end node
    for inst in instances:
        for g in np.unique(inst.gpu):
            matched[g][inst.op[inst.gpu == g]] = True
    for gi, t in enumerate(traces):
        _gpu_nodes(parts, gi, t, matched[gi], None if detachable is None else detachable[gi])
    members = _instance_nodes(parts, traces, instances)
    cat = lambda xs, dt=np.int64: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    meas_a, cprev_a = cat(parts.meas), cat(parts.cprev)
    es, ed = cat(parts.esrc), cat(parts.edst)
    order = _topological(meas_a, cprev_a, es, ed)
    return Graph(traces=tuple(traces), n=parts.n, meas=meas_a, gpu=cat(parts.gpu), ntype=cat(parts.ntype, np.int8),
                 ref=cat(parts.ref), cprev=cprev_a, esrc=es, edst=ed, etype=cat(parts.etype, np.int8),
                 eref=cat(parts.eref), op_node=tuple(parts.op_node), end_node=tuple(parts.end_node),
                 call_node=tuple(parts.call_node), ret_node=tuple(parts.ret_node), members=members,
                 order=order, blocks=tuple(_blocks(order, cprev_a, es, ed, parts.n)))


def _gpu_nodes(p: _Parts, gi: int, t: GpuTrace, matched: np.ndarray, detach: np.ndarray | None) -> None:
    """One GPU's nodes (op starts, matched collectives' ends, call starts, blocking calls'
    returns), their chains, and its launch, event, sync, thread and detachable stream edges."""
    sh, ops, calls_, edges = t.shift_ns, t.ops, t.calls, t.edges
    first = p.n
    no, nc = t.n_ops, len(calls_.c_start)
    op_nodes = p.take(no)
    m_idx = np.flatnonzero(matched)
    ends = np.full(no, -1, np.int64)
    ends[m_idx] = p.take(len(m_idx))
    calls = p.take(nc)
    blocking = np.flatnonzero(calls_.c_target >= 0)
    rets = np.full(nc, -1, np.int64)
    rets[blocking] = p.take(len(blocking))
    p.op_node.append(op_nodes), p.end_node.append(ends), p.call_node.append(calls), p.ret_node.append(rets)
    end_t = ops.start + ops.dur
    own_end = calls_.c_start[blocking] + calls_.c_dur[blocking]
    p.meas += [ops.start + sh, end_t[m_idx] + sh, calls_.c_start + sh,
               np.maximum(own_end, end_t[calls_.c_target[blocking]] + calls_.c_wake[blocking]) + sh]
    p.gpu.append(np.full(no + len(m_idx) + nc + len(blocking), gi, np.int64))
    p.ntype += [np.full(no, OP), np.full(len(m_idx), COMM_END), np.full(nc, CALL), np.full(len(blocking), RET)]
    p.ref += [np.arange(no), m_idx, np.arange(nc), blocking]
    cprev = _chains(t, op_nodes, ends, calls, rets)
    p.cprev.append(cprev)
    has = ops.launch >= 0
    p.edges(calls[ops.launch[has]], op_nodes[has], E_LAUNCH, np.flatnonzero(has))
    # an event's and a sync's source is the op's end: its end node when it has one
    src_end = lambda o: np.where(ends[o] >= 0, ends[o], op_nodes[o])  # noqa: E731
    fs = edges.e_from_start
    p.edges(np.where(fs, op_nodes[edges.e_src], src_end(edges.e_src)), op_nodes[edges.e_dst], E_EVENT,
            np.arange(len(edges.e_src)))
    p.etype[-1] = np.where(fs, E_ORDER, E_EVENT)
    p.edges(src_end(calls_.c_target[blocking]), rets[blocking], E_SYNC, blocking)
    # thread hand-offs: from the other thread's call end (its return when it blocked)
    p.edges(np.where(rets[edges.h_src] >= 0, rets[edges.h_src], calls[edges.h_src]), calls[edges.h_dst],
            E_THREAD, np.arange(len(edges.h_src)))
    if detach is not None and detach.any():
        d = np.flatnonzero(detach)
        prev = cprev[op_nodes[d] - first]
        d, prev = d[prev >= 0], prev[prev >= 0]
        cprev[op_nodes[d] - first] = -1  # each a chain's head; its stream order an edge
        p.edges(prev, op_nodes[d], E_STREAM, d)


def _instance_nodes(p: _Parts, traces, instances: list[Instance]) -> Instance:
    """One transfer node per matched instance: members' arrivals -> transfer -> members' ends."""
    cat = lambda name: (np.concatenate([getattr(i, name) for i in instances]).astype(np.int64)  # noqa: E731
                        if instances else np.zeros(0, np.int64))
    ig, io, itr = cat("gpu"), cat("op"), cat("transfer")
    sizes = [int(i.k.max()) + 1 if len(i.k) else 0 for i in instances]
    first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    iid = (np.concatenate([i.k + first[j] for j, i in enumerate(instances)]) if instances
           else np.zeros(0, np.int64))
    n_inst = int(first[-1])
    xnodes = p.take(n_inst)
    if n_inst:
        xmeas = np.full(n_inst, NEG, np.int64)
        np.maximum.at(xmeas, iid, _member_times(traces, ig, io))
        p.meas.append(xmeas), p.gpu.append(np.full(n_inst, -1)), p.ntype.append(np.full(n_inst, XFER))
        p.ref.append(np.arange(n_inst)), p.cprev.append(np.full(n_inst, -1))
        p.edges(_member_nodes(p.op_node, ig, io), xnodes[iid], E_ARRIVE, np.arange(len(ig)))
        p.edges(xnodes[iid], _member_nodes(p.end_node, ig, io), E_XFER, np.arange(len(ig)))
    return Instance(gpu=ig, op=io, transfer=itr, k=iid)


def _member_nodes(per_gpu: list, g: np.ndarray, o: np.ndarray) -> np.ndarray:
    base = np.concatenate([[0], np.cumsum([len(x) for x in per_gpu])])
    flat = np.concatenate(per_gpu) if per_gpu else np.zeros(0, np.int64)
    return flat[base[g] + o]


def _member_times(traces, g: np.ndarray, o: np.ndarray) -> np.ndarray:
    base = np.concatenate([[0], np.cumsum([t.n_ops for t in traces])])
    flat = np.concatenate([t.ops.start + t.shift_ns for t in traces])
    return flat[base[g] + o]


def _chains(t: GpuTrace, ops_nodes, ends, calls, rets) -> np.ndarray:
    """Chain predecessors of one GPU's nodes, in node order (ops, ends, calls, returns)."""
    no, nc = t.n_ops, len(t.calls.c_start)
    total = no + int((ends >= 0).sum()) + nc + int((rets >= 0).sum())
    out = np.full(total, -1, np.int64)
    base = ops_nodes[0] if no else (calls[0] if nc else 0)
    # streams: op -> (its end node) -> next op
    order = np.lexsort((t.ops.start, t.ops.stream))
    last = np.where(ends[order] >= 0, ends[order], ops_nodes[order])  # what the next op follows
    same = np.zeros(no, bool)
    same[1:] = t.ops.stream[order][1:] == t.ops.stream[order][:-1]
    out[ops_nodes[order][1:][same[1:]] - base] = last[:-1][same[1:]]
    m = ends >= 0
    out[ends[m] - base] = ops_nodes[m]
    # threads: call -> (its return) -> next call (calls are sorted by thread, start)
    after = np.where(rets >= 0, rets, calls)
    same_t = np.zeros(nc, bool)
    same_t[1:] = t.calls.c_tid[1:] == t.calls.c_tid[:-1]
    out[calls[1:][same_t[1:]] - base] = after[:-1][same_t[1:]]
    b = rets >= 0
    out[rets[b] - base] = calls[b]
    return out


def _topological(meas: np.ndarray, cprev: np.ndarray, es: np.ndarray, ed: np.ndarray) -> np.ndarray:
    """Nodes by captured time, each moved after its predecessors where skew inverted an edge."""
    key = meas.astype(np.int64).copy()
    src = np.concatenate([cprev[cprev >= 0], es])
    dst = np.concatenate([np.flatnonzero(cprev >= 0), ed])
    for _ in range(64):  # each pass repairs one more hop of an inverted chain; usually none
        bad = key[src] > key[dst]
        if not bad.any():
            break
        np.maximum.at(key, dst[bad], key[src[bad]])
    # ties: a node after its predecessors (a chain's order, then a transfer after its arrivals)
    depth = np.zeros(len(key), np.int64)
    for _ in range(4):
        np.maximum.at(depth, dst, depth[src] + (key[src] == key[dst]))
    return np.lexsort((depth, key))


def _blocks(order, cprev, es, ed, n) -> list:
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)
    eorder = np.argsort(pos[ed], kind="stable")
    epos = pos[ed][eorder]
    out = []
    for a in range(0, n, BLOCK):
        b = min(a + BLOCK, n)
        nodes = order[a:b]
        perm = np.argsort(chain_key(cprev, nodes, pos), kind="stable")
        seq = nodes[perm]  # chain order within the block
        cp = cprev[seq]
        inside_prev = (cp >= 0) & (pos[np.clip(cp, 0, None)] >= a) & (pos[np.clip(cp, 0, None)] < b)
        seg_start = ~inside_prev
        seg = np.cumsum(seg_start) - 1
        e0, e1 = np.searchsorted(epos, a), np.searchsorted(epos, b)
        eidx = eorder[e0:e1]
        src_in = (pos[es[eidx]] >= a) & (pos[es[eidx]] < b)
        local = np.empty(n, np.int64)  # not kept: a view of where each block node sits in seq
        local[seq] = np.arange(len(seq))
        out.append(dict(seq=seq, cp=cp, seg_start=seg_start, seg=seg, ext=eidx[~src_in], int_=eidx[src_in],
                        ext_dst=local[ed[eidx[~src_in]]], int_dst=local[ed[eidx[src_in]]],
                        int_src=local[es[eidx[src_in]]]))
    return out


def chain_key(cprev, nodes, pos):
    """A key grouping a block's nodes by chain, in chain order: the chain's first node in the
    block, found by pointer jumping over the predecessors inside the block (log2 of the
    longest chain rounds, not one round per node)."""
    local = np.full(len(pos), -1, np.int64)
    local[nodes] = np.arange(len(nodes))
    cp = cprev[nodes]
    parent = np.where(cp >= 0, local[np.clip(cp, 0, None)], -1)
    head = np.where(parent >= 0, parent, np.arange(len(nodes)))
    while True:
        nxt = head[head]
        if np.array_equal(nxt, head):
            break
        head = nxt
    return pos[nodes[head]] * (len(pos) + 1) + pos[nodes]


def solve(g: Graph, off: np.ndarray, lag: np.ndarray, base: np.ndarray, max_rounds: int = 10_000,
          extra: tuple | None = None) -> tuple[np.ndarray, int]:
    """Each node's time under these weights: ``off`` (offset after the chain predecessor),
    ``lag`` (per cross edge; NEG disables it), ``base`` (a node's own lower bound); ``extra``:
    cross edges a scenario adds, (src, dst, lag) node arrays, each from a node before its
    destination in the graph's order (the solve visits nodes in that order)."""
    t = np.full(g.n, NEG, np.int64)
    rounds = 0
    xs = _extra_by_block(g, extra)
    for bi, blk in enumerate(g.blocks):
        seq, cp, seg_start, seg = blk["seq"], blk["cp"], blk["seg_start"], blk["seg"]
        r0 = base[seq].copy()
        entry = seg_start & (cp >= 0)
        r0[entry] = np.maximum(r0[entry], t[cp[entry]] + off[seq[entry]])
        if len(blk["ext"]):
            e = blk["ext"]
            np.maximum.at(r0, blk["ext_dst"], np.where(lag[e] > NEG, t[g.esrc[e]] + lag[e], NEG))
        o = np.where(seg_start, 0, off[seq])
        C = np.cumsum(o)
        C = C - np.repeat(C[seg_start], np.diff(np.append(np.flatnonzero(seg_start), len(seq))))
        sep = seg * _BIG
        cur = _chain_max(r0, C, sep)
        ie = blk["int_"]
        ilag = lag[ie]
        live = ilag > NEG
        isrc, idst, ilag = blk["int_src"][live], blk["int_dst"][live], ilag[live]
        if xs is not None and xs[bi] is not None:
            (x_ext_dst, x_ext_src, x_ext_lag, x_int_src, x_int_dst, x_int_lag) = xs[bi]
            np.maximum.at(r0, x_ext_dst, t[x_ext_src] + x_ext_lag)
            cur = _chain_max(r0, C, sep)
            isrc, idst = np.concatenate([isrc, x_int_src]), np.concatenate([idst, x_int_dst])
            ilag = np.concatenate([ilag, x_int_lag])
        while True:
            rounds += 1
            r = r0.copy()
            if len(idst):
                np.maximum.at(r, idst, cur[isrc] + ilag)
            nxt = _chain_max(r, C, sep)
            if np.array_equal(nxt, cur) or rounds > max_rounds:
                break
            cur = nxt
        t[seq] = cur
    return t, rounds


def _extra_by_block(g: Graph, extra: tuple | None) -> list | None:
    """A scenario's added edges, per block of their destination: (destinations of edges from
    earlier blocks as block slots, their sources, lags, then the in-block edges' source slots,
    destination slots and lags). An edge against the graph's order cannot be solved in one
    pass: it is an error of the transform that added it."""
    if extra is None or not len(extra[0]):
        return None
    src, dst, xlag = (np.asarray(a, np.int64) for a in extra)
    pos = np.empty(g.n, np.int64)
    pos[g.order] = np.arange(g.n)
    if (pos[src] >= pos[dst]).any():
        raise ValueError("an added edge runs against the graph's order")
    slot = np.empty(g.n, np.int64)
    for blk in g.blocks:
        slot[blk["seq"]] = np.arange(len(blk["seq"]))
    out = []
    for bi in range(len(g.blocks)):
        m = pos[dst] // BLOCK == bi
        inner = m & (pos[src] // BLOCK == bi)
        ext = m & ~inner
        out.append((slot[dst[ext]], src[ext], xlag[ext], slot[src[inner]], slot[dst[inner]], xlag[inner])
                   if m.any() else None)
    return out


def _chain_max(r: np.ndarray, C: np.ndarray, sep: np.ndarray) -> np.ndarray:
    x = np.maximum(r - C, NEG)
    return np.maximum.accumulate(x + sep) - sep + C


def critical_path(g: Graph, t: np.ndarray, off: np.ndarray, lag: np.ndarray, sink: int) -> tuple[np.ndarray, np.ndarray]:
    """The nodes on the binding path into ``sink`` and, for each, its binding edge type
    (-1: the chain predecessor, else the cross edge's type; -2: the path's start)."""
    n = g.n
    parent = np.full(n, -1, np.int64)
    how = np.full(n, -2, np.int64)
    has = g.cprev >= 0
    via_chain = np.full(n, NEG, np.int64)
    via_chain[has] = t[g.cprev[has]] + off[has]
    hit = has & (via_chain == t)
    parent[hit], how[hit] = g.cprev[hit], -1
    live = lag > NEG
    val = np.where(live, t[g.esrc] + lag, NEG)
    eh = live & (val == t[g.edst]) & (parent[g.edst] < 0)
    parent[g.edst[eh]] = g.esrc[eh]
    how[g.edst[eh]] = g.etype[eh]
    # binary lifting: is a node an ancestor of the sink along binding parents?
    depth = _depths(parent)
    up = np.where(parent >= 0, parent, np.arange(n))
    k = depth[sink] - depth
    kk = np.where(k >= 0, k, 0)
    node = np.full(n, sink, np.int64)
    bit = 0
    jump = up.copy()
    while (kk >> bit).any():
        sel = ((kk >> bit) & 1).astype(bool)
        node[sel] = jump[node[sel]]
        jump = jump[jump]
        bit += 1
    on = (k >= 0) & (node == np.arange(n))
    return np.flatnonzero(on), how[on]


def _depths(parent: np.ndarray) -> np.ndarray:
    """Distance to the root along parent pointers (list ranking by pointer doubling)."""
    step = (parent >= 0).astype(np.int64)
    anc = parent.copy()
    while (anc >= 0).any():
        a = anc >= 0
        safe = np.clip(anc, 0, None)
        step, anc = step + np.where(a, step[safe], 0), np.where(a, anc[safe], -1)
    return step
