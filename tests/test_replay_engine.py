"""The replay's engine on small graphs whose longest paths are worked out by hand: chains,
launches, CUDA event waits, blocking syncs, thread hand-offs and a collective matched across
two ranks, then the same graphs under changes (an op dropped, a call no longer blocking, the
MoE routing balanced)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from profclass.replay import engine, scenario
from profclass.replay.engine import Instance
from profclass.replay.trace import COMM, COMPUTE, LAUNCH, SYNC, Calls, Edges, GpuTrace, Ops

US = 1_000


def _trace(ops: list[tuple], calls: list[tuple], events=(), threads=(), lo=0) -> GpuTrace:
    """ops: (start, dur, stream, kind, launch call, launch_lag, stream_gap); calls: (start,
    dur, tid, kind, gap, target, wake); events: (src op, dst op, lag); threads: (src, dst, lag)."""
    o = np.array(ops, dtype=np.int64).reshape(-1, 7)
    c = np.array(calls, dtype=np.int64).reshape(-1, 7)
    ev = np.array(events, dtype=np.int64).reshape(-1, 3)
    th = np.array(threads, dtype=np.int64).reshape(-1, 3)
    n, m = len(o), len(c)
    return GpuTrace(
        lo=lo, hi=int(max(o[:, 0].max(initial=0), c[:, 0].max(initial=0))) + 1, iterations=1,
        ops=Ops(start=o[:, 0], dur=o[:, 1], stream=o[:, 2], kind=o[:, 3].astype(np.int8),
                gemm=np.zeros(n, bool), fusion=np.zeros(n, np.int8), recomputed=np.zeros(n, bool),
                offload=np.zeros(n, bool), launch=o[:, 4], launch_lag=o[:, 5], stream_gap=o[:, 6]),
        calls=Calls(c_start=c[:, 0], c_dur=c[:, 1], c_tid=c[:, 2], c_kind=c[:, 3].astype(np.int8),
                    c_gap=c[:, 4], c_gc=np.zeros(m, np.int64), c_load=np.zeros(m, np.int64),
                    c_load_waits=np.zeros(m, bool), c_target=c[:, 5], c_wake=c[:, 6],
                    c_recomputed=np.zeros(m, bool), c_folded=np.zeros(m, np.int64)),
        edges=Edges(e_src=ev[:, 0], e_dst=ev[:, 1], e_lag=ev[:, 2], e_from_start=np.zeros(len(ev), bool), h_src=th[:, 0], h_dst=th[:, 1],
                    h_lag=th[:, 2]),
        edge_source="cuda events", measured_end=0, unexplained_ns=0)


def _times(trace_list, instances=()):
    g = engine.build_graph(list(trace_list), list(instances))
    w = [scenario.captured(t) for t in trace_list]
    out = scenario.run(g, w)
    return g, w, out


def _op_start(g, out, gpu, op):
    return int(out.t[g.op_node[gpu][op]])


def _launch_bound(call_ns: int) -> GpuTrace:
    """Three 5 us kernels launched 20 us apart (each call ``call_ns``, the rest of the 20 us CPU
    time between calls), 4 us launch latency: the GPU waits for each launch."""
    calls = [(20 * US * i, call_ns, 1, LAUNCH, 0 if i == 0 else 20 * US - call_ns, -1, 0) for i in range(3)]
    ops = [(20 * US * i + 4 * US, 5 * US, 0, COMPUTE, i, 4 * US, 0 if i == 0 else 1 * US) for i in range(3)]
    return _trace(ops, calls)


def test_a_launch_bound_stream_follows_its_host():
    t = _launch_bound(2 * US)
    g, w, out = _times([t])
    assert [_op_start(g, out, 0, i) for i in range(3)] == [4 * US, 24 * US, 44 * US]
    assert out.ends[0] == 49 * US
    # a faster host (no CPU time between calls): the stream is now the bound
    fast = [scenario.Weights(**{**vars(w[0]), "c_gap": np.zeros(3, np.int64)})]
    out2 = scenario.run(g, fast)
    # calls at 0, 2, 4 us; ops: 4, max(6, 4+5+1)=10, max(8, 10+5+1)=16
    assert [int(out2.t[g.op_node[0][i]]) for i in range(3)] == [4 * US, 10 * US, 16 * US]
    assert out2.ends[0] == 21 * US


def test_without_the_profiler_each_traced_call_costs_less_and_a_host_paced_step_follows():
    from profclass.replay.constants import GPU_TRACED_SHARE, TRACED_CALL_NS
    from profclass.replay.transforms import untraced
    # the launch-bound stream above, the second launch with 4 calls folded into its gap (an
    # event record, a stream wait ...): every call is cheaper, the GPU still waits for each
    call = 6 * US  # above what tracing adds to a launch
    t = _launch_bound(call)
    t = GpuTrace(**{**vars(t), "calls": Calls(**{**vars(t.calls), "c_folded": np.array([0, 4, 0])})})
    g, w, out = _times([t])
    launch, other = TRACED_CALL_NS["launch"][1], TRACED_CALL_NS["other"][1]
    assert launch < call and launch + 4 * other < 20 * US - call
    w2 = untraced(t, w[0], 0.0)
    # the first call has no CPU time before it: its own time pays
    assert w2.c_dur.tolist() == [call - launch, call, call]
    assert w2.c_gap.tolist() == [0, 20 * US - call - launch - 4 * other, 20 * US - call - launch]
    out2 = scenario.run(g, [w2])
    # and each 5 us kernel sheds CUDA tracing's GPU-side share: the last one's ends the step
    assert w2.op_dur.tolist() == [int(5 * US * (1 - GPU_TRACED_SHARE[1]))] * 3
    assert out.ends[0] - out2.ends[0] == 3 * launch + 4 * other + 5 * US - int(5 * US * (1 - GPU_TRACED_SHARE[1]))
    # a call cheaper than what tracing adds to it costs nothing, never less
    tiny = GpuTrace(**{**vars(t), "calls": Calls(**{**vars(t.calls), "c_dur": np.full(3, 500), "c_gap": np.zeros(3, np.int64)})})
    assert untraced(tiny, scenario.captured(tiny), 0.0).c_dur.tolist() == [0, 0, 0]


def test_an_event_wait_holds_the_other_stream_and_a_dropped_op_releases_it():
    calls = [(0, 1 * US, 1, LAUNCH, 0, -1, 0), (2 * US, 1 * US, 1, LAUNCH, 1 * US, -1, 0)]
    # op 0: 100 us on stream 0; op 1 on stream 1 waits for op 0's end (event, 2 us)
    ops = [(5 * US, 100 * US, 0, COMPUTE, 0, 5 * US, 0), (107 * US, 10 * US, 1, COMPUTE, 1, 5 * US, 0)]
    t = _trace(ops, calls, events=[(0, 1, 2 * US)])
    g, w, out = _times([t])
    assert _op_start(g, out, 0, 1) == 107 * US and out.ends[0] == 117 * US
    dropped = scenario.drop_ops(t, w[0], np.array([True, False]))
    out2 = scenario.run(g, [dropped])
    # op 0 takes no time: op 1 starts at max(launch 2 + 5, op 0's start 5 + 0 + 2) = 7 us
    assert int(out2.t[g.op_node[0][1]]) == 7 * US


def test_a_blocking_sync_returns_after_its_op_and_unblocked_it_does_not_wait():
    # launch (op 0, 50 us), then a sync that waited for op 0 (wake 3 us), then a launch of op 1
    calls = [(0, 2 * US, 1, LAUNCH, 0, -1, 0), (3 * US, 1 * US, 1, SYNC, 1 * US, 0, 3 * US),
             (60 * US, 2 * US, 1, LAUNCH, 2 * US, -1, 0)]
    ops = [(5 * US, 50 * US, 0, COMPUTE, 0, 5 * US, 0), (65 * US, 5 * US, 0, COMPUTE, 2, 5 * US, 0)]
    t = _trace(ops, calls)
    g, w, out = _times([t])
    ret = g.ret_node[0][1]
    assert int(out.t[ret]) == 58 * US  # op 0 ends at 55, + 3 us wake
    assert int(out.t[g.call_node[0][2]]) == 60 * US and _op_start(g, out, 0, 1) == 65 * US
    free = scenario.Weights(**{**vars(w[0]), "c_blocks": np.zeros(3, bool)})
    out2 = scenario.run(g, [free])
    # no wait: the sync returns after its own 1 us (at 4), the next call 2 us later
    assert int(out2.t[g.call_node[0][2]]) == 6 * US
    assert int(out2.t[g.op_node[0][1]]) == 55 * US  # the stream is still busy until 55


def test_a_thread_hand_off_moves_with_the_thread_it_waited_for():
    # thread 1 launches op 0 after 30 us of CPU; thread 2's first call waited for it (+5 us)
    calls = [(30 * US, 2 * US, 1, LAUNCH, 30 * US, -1, 0), (37 * US, 2 * US, 2, LAUNCH, 0, -1, 0)]
    ops = [(35 * US, 5 * US, 0, COMPUTE, 0, 5 * US, 0), (42 * US, 5 * US, 0, COMPUTE, 1, 5 * US, 2 * US)]
    t = _trace(ops, calls, threads=[(0, 1, 5 * US)])
    g, w, out = _times([t])
    assert int(out.t[g.call_node[0][1]]) == 37 * US
    # the first call of thread 1 is where the window pins it; halve thread 1's own time
    half = scenario.Weights(**{**vars(w[0]), "c_dur": np.array([1 * US, 2 * US])})
    out2 = scenario.run(g, [half])
    assert int(out2.t[g.call_node[0][1]]) == 36 * US  # 30 + 1 + 5


def test_a_collective_transfers_after_its_last_member_arrives():
    # two ranks, one all-reduce each; rank 1 arrives 40 us late; transfer 10 us
    def rank(arrive):
        calls = [(0, 1 * US, 1, LAUNCH, 0, -1, 0), (arrive - 5 * US, 1 * US, 1, LAUNCH, arrive - 6 * US, -1, 0)]
        ops = [(5 * US, 10 * US, 0, COMPUTE, 0, 5 * US, 0), (arrive, 60 * US - arrive, 1, COMM, 1, 5 * US, 0)]
        return _trace(ops, calls)
    r0, r1 = rank(20 * US), rank(50 * US)
    inst = Instance(gpu=np.array([0, 1]), op=np.array([1, 1]), transfer=np.array([10 * US, 10 * US]),
                    k=np.array([0, 0]), group="DP")
    g, w, out = _times([r0, r1], [inst])
    assert out.ends[0] == out.ends[1] == 60 * US
    # rank 1's host 30 us faster: both ranks' collectives end 30 us sooner
    fast = scenario.Weights(**{**vars(w[1]), "c_gap": np.array([0, 14 * US])})
    out2 = scenario.run(g, [w[0], fast])
    assert out2.ends[1] == 30 * US and out2.ends[0] == 30 * US
    # no transfer: each ends when the last member arrives
    none = [scenario.Weights(**{**vars(x), "transfer_scale": np.zeros(2)}) for x in w]
    assert scenario.run(g, none).ends.tolist() == [50 * US, 50 * US]


def test_the_solver_agrees_with_a_plain_longest_path_on_a_random_graph():
    rng = np.random.default_rng(7)
    n_calls, n_ops = 300, 300
    gaps = rng.integers(0, 30 * US, n_calls)
    cs = np.cumsum(gaps + 2 * US)
    kinds = np.where(rng.random(n_calls) < 0.1, SYNC, LAUNCH)
    calls = [(int(cs[i]), 2 * US, 1, int(kinds[i]), int(gaps[i]), -1, 0) for i in range(n_calls)]
    ops = [(int(cs[i] + 5 * US), int(rng.integers(1, 40) * US), int(rng.integers(0, 3)), COMPUTE, i, 5 * US, US)
           for i in range(n_ops)]
    ev = [(i, i + 3, 2 * US) for i in range(0, n_ops - 3, 17)]
    t = _trace(sorted(ops), calls, events=ev)
    g = engine.build_graph([t], [])
    off, lag, base, own = scenario.node_costs(g, [scenario.captured(t)])
    got, _ = engine.solve(g, off, lag, base)
    assert np.array_equal(got, _relaxed(g, off, lag, base))


def _relaxed(g, off, lag, base, extra=None):
    """Repeated relaxation until nothing moves (Bellman-Ford on the DAG)."""
    src, dst, xl = (g.esrc, g.edst, lag) if extra is None else (
        np.concatenate([g.esrc, extra[0]]), np.concatenate([g.edst, extra[1]]), np.concatenate([lag, extra[2]]))
    ref = np.where(base > engine.NEG, base, engine.NEG).astype(np.int64)
    for _ in range(g.n):
        new = ref.copy()
        has = g.cprev >= 0
        new[has] = np.maximum(new[has], ref[g.cprev[has]] + off[has])
        live = xl > engine.NEG
        np.maximum.at(new, dst[live], ref[src[live]] + xl[live])
        if np.array_equal(new, ref):
            break
        ref = new
    return ref


def test_the_solver_agrees_with_a_plain_longest_path_with_detached_ops_and_added_edges():
    rng = np.random.default_rng(11)
    n = 300
    gaps = rng.integers(0, 30 * US, n)
    cs = np.cumsum(gaps + 2 * US)
    calls = [(int(cs[i]), 2 * US, 1, LAUNCH, int(gaps[i]), -1, 0) for i in range(n)]
    ops = sorted((int(cs[i] + 5 * US), int(rng.integers(1, 40) * US), int(rng.integers(0, 3)), COMPUTE, i, 5 * US, US)
                 for i in range(n))
    t = _trace(ops, calls, events=[(i, i + 3, 2 * US) for i in range(0, n - 3, 17)])
    detachable = np.zeros(n, bool)
    detachable[10::10] = True
    g = engine.build_graph([t], [], [detachable])
    w = scenario.captured(t)
    # the captured weights replay the same with the stream order as a cuttable edge
    plain = engine.build_graph([t], [])
    assert np.array_equal(scenario.run(g, [w]).t, scenario.run(plain, [w]).t)
    dst = np.flatnonzero(detachable)[::2]
    moved = scenario.Weights(**{**vars(w), "detached": np.isin(np.arange(n), dst), "ready_src": dst - 5,
                                "ready_dst": dst, "ready_lag": rng.integers(-20, 20, len(dst)) * US})
    off, lag, base, own = scenario.node_costs(g, [moved])
    extra = scenario.ready_edges(g, [moved], own)
    got, _ = engine.solve(g, off, lag, base, extra=extra)
    assert np.array_equal(got, _relaxed(g, off, lag, base, extra))


def _ep_layer(expert_us: list[int]) -> tuple[list[GpuTrace], Instance]:
    """An MoE layer on EP ranks, one stream each: a 4 us token-count all-to-all, the dispatch
    (40 us transfer), the rank's expert compute, the combine (40 us transfer) and, 1 us later,
    20 us of dense compute. Every rank waits in the combine for the busiest one."""
    end = 44 * US + max(expert_us) * US
    traces = []
    for e in expert_us:
        ops = [(0, 4 * US, 0, COMM, -1, 0, 0), (4 * US, 40 * US, 0, COMM, -1, 0, 0),
               (44 * US, e * US, 0, COMPUTE, -1, 0, 0),
               (44 * US + e * US, end + 40 * US - (44 * US + e * US), 0, COMM, -1, 0, 0),  # waits, then 40 us
               (end + 41 * US, 20 * US, 0, COMPUTE, -1, 0, US)]
        traces.append(_trace(ops, []))
    n = len(expert_us)
    inst = Instance(gpu=np.tile(np.arange(n), 3), op=np.repeat([0, 1, 3], n),
                    transfer=np.repeat([4 * US, 40 * US, 40 * US], n), k=np.repeat([0, 1, 2], n), group="EP")
    return traces, inst


def test_balanced_routing_spreads_the_expert_work_and_the_all_to_alls_move_the_mean_volume():
    from profclass.replay import collectives, transforms
    from profclass.replay.run import _transfers
    traces, inst = _ep_layer([30, 10])
    g, w, out = _times(traces, [inst])
    assert out.ends.tolist() == [135 * US, 135 * US]
    groups = tuple(np.where(t.ops.kind == COMM, "EP", "").astype(object) for t in traces)
    colls = tuple(np.where(t.ops.kind == COMM, "all_to_all", "").astype(object) for t in traces)
    ctx = transforms.Context(op_groups=groups, ep_segments=tuple(collectives.segments(traces, [inst], "EP")),
                             op_colls=colls, transfer=tuple(np.maximum(x, 0) for x in _transfers(g, traces)))
    spec = {"kind": "balance", "recovered": [0.5, 1.0, 1.0]}
    # balanced: 20 us of expert work each (30 and 10 us, mean 20); the dispatch and combine move
    # the mean volume, 2/3 of the busiest rank's: the 4 us floor (the all-to-alls' low-quantile
    # transfer) plus 36 x 2/3 = 28 us; the token counts' all-to-all stays at its floor.
    # 4 + 28 + 20 + 28 + 1 + 20 = 101 us (the compute alone balanced: 4 + 40 + 20 + 40 + 1 + 20 = 125)
    best = scenario.run(g, transforms.apply(spec, "best", traces, w, ctx))
    assert best.ends.tolist() == [101 * US, 101 * US]
    # half the imbalance recovered: experts 25 and 15 us, transfers 4 + 36 x 5/6 = 34 us:
    # 4 + 34 + 25 + 34 + 1 + 20 = 118 us (to the ns the scaled transfers are truncated to)
    low = scenario.run(g, transforms.apply(spec, "low", traces, w, ctx))
    assert np.abs(low.ends - 118 * US).max() <= 2
    # balanced already: nothing to move
    traces, inst = _ep_layer([20, 20])
    g, w, _ = _times(traces, [inst])
    ctx = replace(ctx, ep_segments=tuple(collectives.segments(traces, [inst], "EP")),
                  transfer=tuple(np.maximum(x, 0) for x in _transfers(g, traces)))
    assert transforms.apply({**spec, "host": True}, "best", traces, w, ctx)[0].transfer_scale.tolist() == [1.0] * 5
