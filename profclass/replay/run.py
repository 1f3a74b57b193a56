"""The replay stage: the job's graph replayed as captured, without each wall, without the
profiler, and with each fix; the fix plan. Takes the job's per-GPU traces, the collectives'
groups and the chosen fixes (with their table rows); the analyzers do not know it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..classify import WALLS
from . import collectives, engine, pipeline_schedule, scenario, transforms
from .engine import CALL, COMM_END, E_ARRIVE, E_EVENT, E_LAUNCH, E_SYNC, E_XFER, OP, RET
from .trace import GpuTrace

PLAN_STEPS = 4
# a plan step must shorten the replayed step by this share of it: less is inside the replay's own
# latency model and the run-to-run noise of a timer (5-10% of a step, docs/fixes.md)
PLAN_MIN_GAIN_SHARE = 0.005


@dataclass(frozen=True)
class ReplayInputs:
    traces: tuple  # GpuTrace per GPU, on the job's clock
    comm_kernels: tuple  # per GPU: its NCCL kernels with their group (communication analyzer)
    members: tuple  # per GPU: group -> member ranks
    ranks: tuple
    step_ns: tuple  # per GPU: the measured steady step
    profiler_ns_per_step: tuple  # per GPU: host time the profiler's op ranges add (profiler analyzer)
    microbatches: int | None = None  # per step (the layout's), None where unknown
    pipeline: object = None  # the pipeline analyzer's PipelineResult (stages, sizes, per-stage times)


@dataclass(frozen=True)
class FixPrice:
    id: str
    low_ms: float
    best_ms: float
    high_ms: float
    basis: str


@dataclass(frozen=True)
class ReplayResult:
    section: dict
    prices: dict  # fix id -> FixPrice
    plan: list
    missing: list = field(default_factory=list)


class Replayer:
    """One job's graph and its captured weights; replays scenarios of it."""

    def __init__(self, inp: ReplayInputs):
        self.inp = inp
        self.traces = list(inp.traces)
        insts, self.matched, self.lone = collectives.match(self.traces, list(inp.comm_kernels),
                                                          list(inp.members), list(inp.ranks))
        self.groups = [collectives._keyed(t, k) for t, k in zip(self.traces, inp.comm_kernels)]
        op_groups = tuple(_op_groups(t, kd, "group") for t, kd in zip(self.traces, self.groups))
        op_colls = tuple(_op_groups(t, kd, "collective") for t, kd in zip(self.traces, self.groups))
        detach = tuple(transforms.detachable(t, g, c) for t, g, c in zip(self.traces, op_groups, op_colls))
        self.graph = engine.build_graph(self.traces, insts, list(detach))
        self.captured = [scenario.captured(t) for t in self.traces]
        # per GPU, per op: a matched collective's captured transfer (ns), -1 for every other op
        self.transfer = tuple(_transfers(self.graph, self.traces))
        self.ctx = transforms.Context(
            op_groups=op_groups, ep_segments=tuple(collectives.segments(self.traces, insts, "EP")),
            op_colls=op_colls, detachable=detach, transfer=tuple(np.maximum(x, 0) for x in self.transfer),
            microbatches=inp.microbatches, graph=self.graph, replay=self.replay)
        _, _, _, own = scenario.node_costs(self.graph, self.captured)
        self.measured_end = _ends(self.graph, self.graph.meas, own, len(self.traces))
        self.base = self.replay(self.captured)
        # the pipeline schedule's inputs: PP fixes change the schedule, not the graph's weights
        self.stages, self.no_schedule = pipeline_schedule.from_job(self.traces, self.groups, inp.ranks,
                                                                   inp.pipeline, inp.step_ns)

    def replay(self, weights) -> scenario.Outcome:
        return scenario.run(self.graph, weights)

    def step_ms(self, out: scenario.Outcome) -> float:
        """The job's step (mean over GPUs, as the diagnosis's) after a replay: each GPU's
        measured step moved by its replayed window's change."""
        per = [(s + (e - m) / max(t.iterations, 1)) / 1e6
               for s, e, m, t in zip(self.inp.step_ns, out.ends, self.measured_end, self.traces)]
        return float(np.mean(per))

    def critical_path_ms(self, out: scenario.Outcome, weights) -> dict:
        return _critical_path(self, out, weights)


def _op_groups(t: GpuTrace, kd: dict, key: str) -> np.ndarray:
    g = np.full(t.n_ops, "", object)
    g[kd["op"]] = kd[key]
    return g


def _transfers(g, traces) -> list[np.ndarray]:
    """Per GPU, per op: a matched collective's captured transfer (-1 for every other op)."""
    out = [np.full(t.n_ops, -1, np.int64) for t in traces]
    m = g.members
    for gi, tr in enumerate(out):
        mine = m.gpu == gi
        tr[m.op[mine]] = m.transfer[mine]
    return out


def _ends(g, times, own, n_gpus) -> np.ndarray:
    out = np.full(n_gpus, engine.NEG, np.int64)
    ok = g.gpu >= 0
    np.maximum.at(out, g.gpu[ok], (times + own)[ok])
    return out


def _critical_path(r: Replayer, out: scenario.Outcome, weights) -> dict:
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


def replay_job(inp: ReplayInputs, chosen: list[dict], table: dict, verdict_wall: str,
               also: tuple[str, ...] = ()) -> ReplayResult:
    """The ``replay`` section, each chosen fix's replayed gain and the fix plan; ``also``: fix
    ids priced too though not chosen (the gain-pair tables price the pair's fix)."""
    measured = float(np.mean(inp.step_ns)) / 1e6 if inp.step_ns else 0.0
    if measured <= 0 or not any(t.n_ops for t in inp.traces):
        return ReplayResult(section={}, prices={}, plan=[],
                            missing=["replay: no steady step with GPU work to replay"])
    r = Replayer(inp)
    step = r.step_ms(r.base)
    without = {}
    for wall in WALLS:
        out = r.replay([transforms.without_wall(wall, t, w) for t, w in zip(r.traces, r.captured)])
        without[wall] = round(r.step_ms(out) - step + measured, 3)
    start = _untraced(r)
    untraced = r.replay(start)
    its = [t.iterations for t in r.traces]
    largest = min(without, key=lambda w: (without[w], WALLS.index(w)))
    section = dict(
        step_ms=round(step, 3), measured_step_ms=round(measured, 3),
        error_pct=round(100.0 * (step - measured) / measured, 2) if measured else None,
        critical_path_ms=r.critical_path_ms(r.base, r.captured), without_wall_ms=without,
        untraced_step_ms=round(r.step_ms(untraced) - step + measured, 3),
        largest_removal=largest, graph=_graph_facts(r, its))
    if largest != verdict_wall and without[largest] < without.get(verdict_wall, measured) - 0.01 * measured:
        section["note"] = _disagreement(verdict_wall, largest, without, measured)
    if r.stages is not None:  # the schedule simulation's fidelity (PP fixes are priced on it)
        section["pipeline_schedule"] = pipeline_schedule.fidelity(r.stages)
    # fixes are priced and planned on the step without the profiler: the gain is banked in the
    # job that runs without it, where the host's calls cost less (docs/replay.md)
    prices = _price(r, chosen + [_requested(i) for i in also if i not in {f["id"] for f in chosen}], table,
                    start, untraced)
    plan = _plan(r, chosen, table, prices, (start, r.step_ms(untraced)), step, measured)
    if also:  # asked for by id (the gain-pair tables): only then in the section
        section["requested"] = {i: vars(p) for i, p in prices.items() if i in also}
    return ReplayResult(section=section, prices=prices, plan=plan, missing=_missing(r))


def _untraced(r: Replayer) -> list:
    return [transforms.untraced(t, w, p) for t, w, p in zip(r.traces, r.captured, r.inp.profiler_ns_per_step)]


def _graph_facts(r: Replayer, its: list[int]) -> dict:
    g = r.graph
    return dict(nodes=int(g.n), edges=int(len(g.esrc)), iterations=int(min(its)) if its else 0,
                matched_collective_kernels=int(r.matched), unmatched_collective_kernels=int(r.lone),
                edge_source=sorted({t.edge_source for t in r.traces}),
                unexplained_ms_per_step=round(float(np.mean([t.unexplained_ns / max(t.iterations, 1)
                                                             for t in r.traces])) / 1e6, 3))


def _disagreement(verdict: str, largest: str, without: dict, measured: float) -> str:
    gain_v = measured - without.get(verdict, measured)
    gain_l = measured - without[largest]
    return (f"the verdict is the {verdict} wall (the largest share of the step), but removing the {largest} "
            f"wall shortens the replayed step most ({gain_l:.1f} vs {gain_v:.1f} ms/step): the {verdict} "
            f"time is partly hidden behind other work, so the step does not fall by its share")


def _requested(item: str) -> dict:
    """A fix asked for by id, with the change a pair made where its transform takes it
    ("host_bigger_launches:microbatch_factor=4")."""
    fid, _, rest = item.partition(":")
    change = dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
    return {"id": fid, "request": item, "change": {k: float(v) for k, v in change.items()}}


def _price(r: Replayer, chosen: list[dict], table: dict, start: list, start_out: scenario.Outcome) -> dict:
    """Each fix's gain: the step from ``start`` (weights, replayed as ``start_out``) replayed
    with the fix's transform at its low, best and high parameters, against it."""
    prices = {}
    start_ms = r.step_ms(start_out)
    for f in chosen:
        spec = table.get(f["id"], {}).get("transform")
        if spec and f.get("change"):
            spec = {**spec, **{k: v for k, v in f["change"].items() if k in spec}}
        if not spec:
            continue
        if spec["kind"] == pipeline_schedule.KIND:
            gains = pipeline_schedule.gains_ms(spec, r.stages) if r.stages is not None else None
            if gains:
                prices[f.get("request", f["id"])] = FixPrice(
                    f["id"], round(min(gains.values()), 2), round(gains["best"], 2), round(max(gains.values()), 2),
                    f"replay:{spec['kind']}: Megatron-Core's schedule simulated with each stage's measured "
                    f"per-micro-batch work, rest and exchange cost ({_describe(spec)}), against the schedule "
                    f"simulated at the captured (p, v, m); from the traced capture (the schedule's inputs keep "
                    f"the profiler's host cost)")
            continue
        gains = {}
        rescheduled = spec["kind"] == "fewer_launches" and r.stages is not None
        for point in transforms.POINTS:
            w = transforms.apply(spec, point, r.traces, start, r.ctx)
            if w is None:
                break
            out = r.replay(w)
            if rescheduled:  # fewer micro-batches: the pipeline's bubble grows (the schedule's, not the graph's)
                gains[point] = _rescheduled_ms(r, spec, start_out, out)
                if gains[point] is None:
                    break
            else:
                gains[point] = start_ms - r.step_ms(out)
        if len(gains) < 3:
            continue
        lo, hi = min(gains.values()), max(gains.values())
        basis = (f"replay:{spec['kind']}: the captured step replayed with the fix's transform "
                 f"({_describe(spec) or 'no parameter'}), against the step replayed as captured, both "
                 f"without the profiler's cost")
        if rescheduled:
            basis += ("; on this pipelined job each stage's host time saved per step is fed to Megatron-Core's "
                      "schedule simulated with micro_batch_factor times fewer, larger micro-batches (the bubble "
                      "grows), against the schedule at the captured count")
        prices[f.get("request", f["id"])] = FixPrice(f["id"], round(lo, 2), round(gains["best"], 2), round(hi, 2), basis)
    return prices


def _rescheduled_on(r: Replayer, spec: dict, weights) -> float | None:
    w = transforms.apply(spec, "best", r.traces, weights, r.ctx)
    return None if w is None else _rescheduled_ms(r, spec, r.replay(weights), r.replay(w))


def _rescheduled_ms(r: Replayer, spec: dict, start_out: scenario.Outcome, out: scenario.Outcome) -> float | None:
    """A larger micro-batch on a pipelined job: the graph replay's host time saved per step,
    per stage (mean of its GPUs), priced by the schedule with m / k micro-batches."""
    st = r.stages
    saved = np.zeros(st.p)
    n = np.zeros(st.p)
    for gi, (t, s) in enumerate(zip(r.traces, st.gpu_stage)):
        saved[s] += (start_out.ends[gi] - out.ends[gi]) / max(t.iterations, 1)
        n[s] += 1
    return pipeline_schedule.bigger_microbatch_ms(st, float(spec.get("microbatch_factor", 2.0)),
                                                  saved / np.maximum(n, 1))


def _describe(spec: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("kind", "basis"))


def _plan(r: Replayer, chosen, table, prices, start, step, measured) -> list[dict]:
    """Apply the best fix, replay, take the next on top of it (up to PLAN_STEPS), from
    ``start``: (weights, replayed step ms) of the step without the profiler."""
    left = [f for f in chosen if f["id"] in prices and prices[f["id"]].best_ms > 0
            and not _reschedules(r, table[f["id"]]["transform"])]
    weights, now = start
    plan = []
    while left and len(plan) < PLAN_STEPS:
        trial = []
        for f in left:
            w = transforms.apply(table[f["id"]]["transform"], "best", r.traces, weights, r.ctx)
            if w is None:
                continue
            out = r.replay(w)
            trial.append((r.step_ms(out), f, w, out))
        if not trial:
            break
        after, f, w, out = min(trial, key=lambda x: x[0])
        if after >= now - PLAN_MIN_GAIN_SHARE * step:
            break
        cp = r.critical_path_ms(out, w)
        plan.append(dict(id=f["id"], gain_ms=round(now - after, 2),
                         step_ms_after=round(after - step + measured, 2),
                         wall_after=max(cp, key=lambda k: (cp[k], -WALLS.index(k)))))
        weights, now = w, after
        left = [x for x in left if x is not f]
    return plan + _schedule_steps(r, chosen, table, prices, step, measured, now, len(plan),
                                  plan[-1]["wall_after"] if plan else None, weights)


def _schedule_steps(r: Replayer, chosen, table, prices, step, measured, now, done, wall, weights) -> list[dict]:
    """Schedule changes (PP fixes) after the graph's steps, each applied as a step delta: the
    schedule simulated with it on top of the schedule changes before it (so two changes that
    shrink the same bubble do not both claim it), against the schedule without it. The
    simulation does not see the graph's fixes before it: its delta is added to theirs, capped
    at the step that is left; the wall after is the graph's (the change is not replayed on it)."""
    out, applied = [], []
    left = [table[f["id"]]["transform"] for f in chosen if f["id"] in prices
            and _reschedules(r, table[f["id"]].get("transform", {}))]
    if not left:
        return []
    if wall is None:  # no graph step before: the wall after is the captured step's
        cp = r.critical_path_ms(r.base, r.captured)
        wall = max(cp, key=lambda k: (cp[k], -WALLS.index(k)))
    ids = {id(table[f["id"]]["transform"]): f["id"] for f in chosen if f["id"] in prices}
    while left and done + len(out) < PLAN_STEPS:
        before = pipeline_schedule.combined_ms(applied, r.stages)
        trial = [(before - after, spec) for spec in left if spec["kind"] == pipeline_schedule.KIND
                 and (after := pipeline_schedule.combined_ms(applied + [spec], r.stages)) is not None]
        # a larger micro-batch (fewer of them): its host saving replayed on top of the graph's steps
        # (``weights``), priced by the schedule at m / k; the changes after it are simulated on its
        # m / k micro-batches (without its saving, which the simulation's inputs do not hold)
        trial += [(g, spec) for spec in left if spec["kind"] != pipeline_schedule.KIND
                  and pipeline_schedule.combined_ms(applied + [spec], r.stages) is not None
                  and (g := _rescheduled_on(r, spec, weights)) is not None]
        if not trial:
            break
        gain, spec = max(trial, key=lambda t: t[0])
        gain = min(gain, now)
        if gain < PLAN_MIN_GAIN_SHARE * step:
            break
        now -= gain
        applied.append(spec)
        # more micro-batches and fewer, larger ones are opposite changes: one of them is taken
        left = [x for x in left if x is not spec and not (_more_microbatches(x) and _fewer_microbatches(spec))
                and not (_fewer_microbatches(x) and _more_microbatches(spec))]
        out.append(dict(id=ids[id(spec)], gain_ms=round(gain, 2), step_ms_after=round(now - step + measured, 2),
                        wall_after=wall, applied_as=(
                            "step delta: the pipeline schedule simulated with this change on top of the plan's "
                            "schedule changes before it, added to the graph's steps" if spec["kind"] == pipeline_schedule.KIND
                            else "step delta: its host saving replayed on top of the graph's steps, priced by the "
                                 "pipeline schedule simulated with fewer, larger micro-batches")))
    return out


def _reschedules(r: Replayer, spec: dict) -> bool:
    """A schedule change: a PP fix, or a larger micro-batch on a pipelined job (fewer micro-batches)."""
    return spec.get("kind") == pipeline_schedule.KIND or (_fewer_microbatches(spec) and r.stages is not None)


def _more_microbatches(spec: dict) -> bool:
    return spec.get("kind") == pipeline_schedule.KIND and int(spec.get("microbatches", 1)) > 1


def _fewer_microbatches(spec: dict) -> bool:
    return spec.get("kind") == "fewer_launches"


def _missing(r: Replayer) -> list[str]:
    out = []
    if r.lone:
        out.append(f"replay: {r.lone} collective kernels replayed with their captured time (PP send/recv, "
                   "or peers outside the profile): their waiting moves with this rank, not with the peers")
    if r.no_schedule:
        out.append(f"replay: pipeline schedule not simulated: {r.no_schedule}; the PP fixes keep their share models")
    if any(t.edge_source == "timing" for t in r.traces):
        out.append("replay: no CUDA event tables in the export: cross-stream waits are not in the graph")
    return out


def priced(chosen: list[dict], prices: dict, step_ms: float) -> list[dict]:
    """The chosen fixes with each replayed gain in place of its share model's (the share
    model's stays where the fix has no transform: its basis says so)."""
    from ..fixes import rank_key
    out = []
    for f in chosen:
        p = prices.get(f["id"])
        if p is None:
            if f.get("gain_basis"):
                f = {**f, "gain_basis": f["gain_basis"] + " (share model: no replay transform)"}
            out.append(f)
            continue
        out.append({**f, "expected_gain_ms": p.best_ms,
                    "expected_gain_pct": round(100.0 * p.best_ms / step_ms, 1) if step_ms else None,
                    "gain_low_ms": p.low_ms, "gain_high_ms": p.high_ms, "gain_basis": p.basis,
                    "gain_model": p.basis.split(": ", 1)[0]})
    out.sort(key=rank_key)
    return out
