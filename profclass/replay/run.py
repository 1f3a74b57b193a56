"""The replay stage: the job's graph replayed as captured, without each wall, without the
profiler, and with each fix; the fix plan. Takes the job's per-GPU traces, the collectives'
groups and the chosen fixes (with their table rows); the analyzers do not know it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache, cached_property

import numpy as np

from ..classify import WALLS
from . import calibrate, collectives, collector, critical_path, engine, pipeline_schedule, pipelined, scenario
from . import routing, span, transforms
from ..analyzers.host import PROBE_NS_CORPUS
from ..fixes import requested
from .constants import HOST_SPEED
from .plan import fix_plan, plan_pool
from . import notes
from .trace import GpuTrace

# a window whose times pass this (146 years of ns) is a damaged export: the replay adds times and
# their differences in int64, which overflows near 2**63
CLOCK_LIMIT_NS = 2 ** 62


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
    host_probe_ns: float | None = None  # the host's speed (analyzers/host.py: the probe's median), None unread
    untraced_step_ms: float | None = None  # the job's own step without the profiler, as the user gave it
    untraced_step_source: str = ""  # where it came from (--untraced-step-ms, a train log: train_log.GivenStep)
    run_start_window: bool = False  # the window is among the run's first steps (window.capture_start "process")


@dataclass(frozen=True)
class FixPrice:
    id: str
    low_ms: float
    best_ms: float
    high_ms: float
    basis: str
    trade_off: dict | None = None  # what the fix costs besides time, where it has a price outside the step
    wall_after: str | None = None  # the largest wall on the critical path with the fix at its best


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
        # one count of steady iterations on every GPU: an iteration only some GPUs hold has
        # collectives without their peers (``span``)
        self.traces = span.common(list(inp.traces))
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
            microbatches=inp.microbatches, graph=self.graph, replay=self.replay, members=tuple(inp.members))
        _, _, _, own = scenario.node_costs(self.graph, self.captured)
        self.measured_end = _ends(self.graph, self.graph.meas, own, len(self.traces))
        self.base = self.replay(self.captured)
        # the pipeline schedule's inputs: PP fixes change the schedule, not the graph's weights.
        # Measured on the capture (``stages``: the schedule's fidelity); the fixes are priced on
        # ``untraced_stages``
        self.stages, self.no_schedule = pipeline_schedule.from_job(
            self.traces, self.groups, inp.ranks, inp.pipeline, inp.step_ns,
            [collector.pause_per_step(t) for t in self.traces])

    # The step without the profiler: fixes are priced and planned from it (the gain is banked in
    # the job that runs without it, where the host's calls cost less; docs/replay.md). Worked out
    # on first use: diff's split builds Replayers that never price a fix.
    @cached_property
    def per_call_untraced(self) -> list:
        """The weights less the profiler's op ranges and CUDA tracing's per-call cost."""
        return [transforms.untraced(t, w, p) for t, w, p in
                zip(self.traces, self.captured, self.inp.profiler_ns_per_step)]

    @cached_property
    def calibration(self) -> calibrate.HostCalibration | None:
        """The untraced host's factor that meets the job's own step, where the user gave it."""
        if not self.inp.untraced_step_ms:
            return None
        measured = float(np.mean(self.inp.step_ns)) / 1e6
        shift = measured - self.step_ms(self.base)  # as the section's steps
        return calibrate.solve(lambda f: self.step_ms(self.replay(
            [transforms.host_speed(w, f) for w in self.per_call_untraced])) + shift,
            float(self.inp.untraced_step_ms), measured, self.inp.untraced_step_source)

    @cached_property
    def untraced(self) -> list:
        c = self.calibration
        if c is None or c.host_factor == 1.0:
            return self.per_call_untraced
        return [transforms.host_speed(w, c.host_factor) for w in self.per_call_untraced]

    @cached_property
    def untraced_out(self) -> scenario.Outcome:
        return self.replay(self.untraced)

    @cached_property
    def host_factors(self) -> tuple:
        """The untraced host's time at each end of a fix's range (``host_range``)."""
        return host_range(self.inp.host_probe_ns)

    @cached_property
    def host_variants(self) -> tuple:
        """(factor, weights, outcome, stages) with the untraced host's time times each of
        ``host_factors``: a fix's range holds its gain on a host that much slower or faster."""
        out = []
        for f in self.host_factors:
            w = [transforms.host_speed(x, f) for x in self.untraced]
            o = self.replay(w)
            out.append((f, w, o, self._stages_after(o, w)))
        return tuple(out)

    @property
    def one_stage(self) -> bool:
        """The job has no pipeline, as the pipeline analyzer read it (one stage; a pipelined job
        whose stages one capture cannot show is not one)."""
        return getattr(self.inp.pipeline, "stages", None) == 1

    @cached_property
    def untraced_stages(self):
        """The schedule's stages without the profiler: each stage's host time less what the
        untraced replay takes off it."""
        return self._stages_after(self.untraced_out, self.untraced)

    def _stages_after(self, out: scenario.Outcome, weights):
        """The captured stages less what the replay ``out`` of the host's ``weights`` took off each
        one's time, their refill and exchange gaps on that host."""
        if self.stages is None:
            return None
        st = pipeline_schedule.less_host(self.stages, pipelined.stage_saving(self, self.base, out))
        return pipeline_schedule.host_paced(st, pipelined.host_ratio(self, weights))

    @cached_property
    def tokens_dropped(self) -> dict:
        """Drop-and-pad's trade: the routed tokens capacity factor 1.0 drops, from the capture."""
        return routing.dropped_tokens(self.traces, self.captured, self.ctx.ep_segments, self.ctx.op_groups)

    def replay(self, weights) -> scenario.Outcome:
        return scenario.run(self.graph, weights)

    def step_ms(self, out: scenario.Outcome) -> float:
        """The job's step (mean over GPUs, as the diagnosis's) after a replay: each GPU's
        measured step moved by its replayed window's change."""
        per = [(s + (e - m) / max(t.iterations, 1)) / 1e6
               for s, e, m, t in zip(self.inp.step_ns, out.ends, self.measured_end, self.traces)]
        return float(np.mean(per))

    def critical_path_ms(self, out: scenario.Outcome, weights) -> dict:
        return critical_path.walls_ms(self, out, weights)


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


def replay_job(inp: ReplayInputs, chosen: list[dict], table: dict, verdict_wall: str,
               also: tuple[str, ...] = (), quiet: tuple[str, ...] = (),
               plan_walls: dict | None = None) -> ReplayResult:
    """The ``replay`` section, each chosen fix's replayed gain and the fix plan; ``also``: fix
    ids priced too though not chosen (the gain-pair tables price the pair's fix), ``quiet``:
    likewise but kept out of the section (the fixes that price pitfalls); ``plan_walls``: each
    wall's fixes that apply (``fixes.select``'s rows), which the plan takes up when a step leaves
    that wall the largest (``plan.fix_plan``), and whose ``quiet`` ones it may take from the start."""
    measured = float(np.mean(inp.step_ns)) / 1e6 if inp.step_ns else 0.0
    why_not = not_replayable(inp)
    if why_not:
        return ReplayResult(section={}, prices={}, plan=[], missing=[why_not])
    r = Replayer(inp)
    step = r.step_ms(r.base)
    without = {}
    for wall in WALLS:
        out = r.replay([transforms.without_wall(wall, t, w) for t, w in zip(r.traces, r.captured)])
        without[wall] = round(r.step_ms(out) - step + measured, 3)
    start, untraced = r.untraced, r.untraced_out
    largest = min(without, key=lambda w: (without[w], WALLS.index(w)))
    untraced_ms = round(r.step_ms(untraced) - step + measured, 3)
    section = dict(
        step_ms=round(step, 3), measured_step_ms=round(measured, 3),
        error_pct=round(100.0 * (step - measured) / measured, 2) if measured else None,
        critical_path_ms=r.critical_path_ms(r.base, r.captured), without_wall_ms=without,
        untraced_step_ms=untraced_ms, untraced_step_bound=notes.untraced_bound(r.calibration, untraced_ms, measured, inp.run_start_window),
        largest_removal=largest, graph=_graph_facts(r, [t.iterations for t in r.traces]))
    if largest != verdict_wall and without[largest] < without.get(verdict_wall, measured) - 0.01 * measured:
        section["note"] = notes.disagreement(verdict_wall, largest, without, measured)
    if r.calibration is not None:
        section["host_calibration"] = r.calibration.section()
    if r.stages is not None:  # the schedule simulation's fidelity (PP fixes are priced on it)
        section["pipeline_schedule"] = pipeline_schedule.fidelity(r.stages)
    # fixes are priced and planned on the step without the profiler: the gain is banked in the
    # job that runs without it, where the host's calls cost less (docs/replay.md)
    # the plan classifies again before its first step too: the wall whose removal shortens the
    # replayed step most joins the verdict's and runner-up's, its fixes priced from the start
    covered = frozenset(f["wall"] for f in chosen if f.get("wall"))
    pool = plan_pool(chosen, plan_walls or {}, quiet, None if largest in covered else largest)
    asked = dict.fromkeys(i for i in (*also, *quiet) if i not in {f["id"] for f in pool})
    tried: dict = {}  # the graph fixes' best replays from the start: the plan's first step tries them again
    prices = _price(r, pool + [requested(i) for i in asked], table, start, untraced, tried=tried)
    plan = fix_plan(r, pool, table, prices, (start, r.step_ms(untraced)), step, measured, plan_walls,
                    covered | {largest}, tried)
    taken = {p["id"] for p in plan} - set(prices)  # from a wall a step exposed: listed too (fixes.joined)
    prices.update(_price(r, [f for fs in (plan_walls or {}).values() for f in fs if f["id"] in taken], table, start, untraced))
    if also:  # asked for by id (the gain-pair tables): only then in the section, with the gain the
        # traced run would show (the captured step, profiler kept), for pairs judged on traced windows
        traced = price_requests(r, also, table, traced=True)
        section["requested"] = {i: {**_as_json(p), "traced": _as_json(traced[i]) if i in traced else None}
                                for i, p in prices.items() if i in also}
    missing = _missing(r) + [f"what-if {i}: not priced (no transform of it acts on this profile; fixes together: graph "
                             "fixes, or on a pipelined job graph fixes and schedule changes)" for i in also if i not in prices]
    if r.calibration is not None and not r.calibration.reached:
        missing.append(f"replay: host calibration: {r.calibration.note}")
    if r.calibration is None and notes.host_paced(untraced_ms, measured):
        host_after = tuple(i for i, p in prices.items()  # off the host wall, yet host-paced after
                           if p.wall_after == "host" and table.get(p.id, {}).get("wall") != "host")
        missing.append(notes.untraced_caveat(section["untraced_step_ms"], measured, host_after))
    return ReplayResult(section=section, prices=prices, plan=plan, missing=missing)


def _as_json(p: FixPrice) -> dict:
    """A price as the JSON holds it: its trade-off only where the fix has one."""
    return {k: v for k, v in vars(p).items() if k not in ("trade_off", "wall_after") or v is not None}


def not_replayable(inp: ReplayInputs) -> str:
    """Why a job's step cannot be replayed (its ``missing`` line), or "" where it can."""
    if not inp.step_ns or np.mean(inp.step_ns) <= 0 or not any(t.n_ops for t in inp.traces):
        return "replay: no steady step with GPU work to replay"
    if any(max(abs(t.lo), abs(t.hi), abs(t.measured_end)) + abs(t.shift_ns) > CLOCK_LIMIT_NS for t in inp.traces):
        return "replay: timestamps near the 64-bit clock's limit (a damaged export): not replayed, sums would overflow"
    return ""


def price_requests(r: Replayer | None, requests: tuple[str, ...], table: dict, traced: bool = False) -> dict:
    """{request: FixPrice} of fixes asked for as ``id[:key=value,...]`` (``fixes.requested``), priced
    on the job's replayer (``replayer_of``) as ``replay_job`` prices its chosen ones (``traced``:
    on the captured step, the profiler kept, as the gain-pair tables' traced column); absent: no
    transform, or nothing to replay (no replayer)."""
    if not requests or r is None:
        return {}
    if traced:
        return _price(r, [requested(i) for i in requests], table, r.captured, r.base, traced=True)
    return _price(r, [requested(i) for i in requests], table, r.untraced, r.untraced_out)


def replayer_of(inp: ReplayInputs | None) -> Replayer | None:
    """The job's replayer, or None where it has no replay inputs or cannot be replayed."""
    return None if inp is None or not_replayable(inp) else Replayer(inp)


def _graph_facts(r: Replayer, its: list[int]) -> dict:
    g = r.graph
    return dict(nodes=int(g.n), edges=int(len(g.esrc)), iterations=int(min(its)) if its else 0,
                matched_collective_kernels=int(r.matched), unmatched_collective_kernels=int(r.lone),
                edge_source=sorted({t.edge_source for t in r.traces}),
                unexplained_ms_per_step=round(float(np.mean([t.unexplained_ns / max(t.iterations, 1)
                                                             for t in r.traces])) / 1e6, 3))


def _price(r: Replayer, chosen: list[dict], table: dict, start: list, start_out: scenario.Outcome,
           traced: bool = False, tried: dict | None = None) -> dict:
    """Each fix's gain: the step from ``start`` (weights, replayed as ``start_out``) replayed
    with the fix's transform at its low, best and high parameters, against it; the schedule's
    fixes on the stages without the profiler, or as captured (``traced``). Without the profiler
    the range also holds the best transform on the host at each of ``Replayer.host_factors``.
    ``tried``: gets each lone graph fix's replay at its best (fix id -> (weights, outcome)), as
    the plan's first step would replay it from ``start``."""
    prices = {}
    stages = r.stages if traced else r.untraced_stages
    variants = () if traced else r.host_variants
    start_cp = cache(lambda: r.critical_path_ms(start_out, start))  # the start's path, walked once if asked
    for f in chosen:
        specs = _specs(f, table)
        if not specs or (len(specs) > 1 and not pipelined.together_priced(r, specs)):
            continue  # fixes together: graph fixes, or graph fixes and schedule changes on a pipelined job
        spec = specs[0]
        if len(specs) == 1 and r.one_stage and (one := pipeline_schedule.without_pipeline(spec)):
            specs = [spec := one]  # more micro-batches on one stage: a graph change (gradient accumulation)
        if len(specs) == 1 and spec["kind"] == pipeline_schedule.KIND:
            gains = pipeline_schedule.gains_ms(spec, stages) if r.stages is not None else None
            if gains:
                spread = [g["best"] for g in (pipeline_schedule.gains_ms(spec, st) for _, _, _, st in variants) if g]
                prices[f.get("request", f["id"])] = FixPrice(
                    f["id"], round(min(*gains.values(), *spread), 2), round(gains["best"], 2),
                    round(max(*gains.values(), *spread), 2), notes.schedule_basis(spec, stages, traced, notes.host_note(r)),
                    wall_after=critical_path.largest(critical_path.after_delta(start_cp(), gains["best"], spec["kind"])))
            continue
        gains, best = {}, {}
        for point in transforms.POINTS:
            g = _graph_gain(r, specs, point, start, start_out, stages, best if point == "best" else None)
            if g is None:
                break
            gains[point] = g
        if len(gains) < 3:
            continue
        if tried is not None and "w" in best and "parts" not in f:
            tried[f["id"]] = (best["w"], best["out"])
        spread = [g for g in (_graph_gain(r, specs, "best", w, o, st) for _, w, o, st in variants) if g is not None]
        lo, hi = min(*gains.values(), *spread), max(*gains.values(), *spread)
        basis = notes.fixes_basis(r, specs, stages, traced)
        trade = r.tokens_dropped if any(s["kind"] == "static_shapes" for s in specs) else None
        prices[f.get("request", f["id"])] = FixPrice(f["id"], round(lo, 2), round(gains["best"], 2), round(hi, 2),
                                                     basis + ("" if traced else notes.host_note(r)), trade,
                                                     pipelined.wall_after(r, specs, gains["best"], start_cp, start_out, best))
    return prices


def _specs(f: dict, table: dict) -> list[dict]:
    """The transforms of a fix asked for (of each of fixes asked for together), each with the
    change the request made where it takes it; [] where one has none."""
    specs = []
    for fid, change in f.get("parts") or [(f["id"], {})]:
        spec = table.get(fid, {}).get("transform")
        if not spec:
            return []
        specs.append({**spec, **{k: v for k, v in change.items() if k in pipeline_schedule.takes(spec)}})
    return specs


def _graph_gain(r: Replayer, specs: list[dict], point: str, start: list, start_out: scenario.Outcome,
                stages, keep: dict | None = None) -> float | None:
    """ms per step the fixes' transforms at ``point``, applied in turn, take off the step
    replayed from ``start`` (None where one has nothing to act on); together on a pipelined job,
    through its schedule (``pipelined.together_ms``). ``keep``: gets the graph's replay with the
    fixes (``w``, ``out``) where there is one."""
    if len(specs) > 1 and r.stages is not None:
        return pipelined.together_ms(r, *pipelined.graph_and_schedule(specs), point, start, start_out, stages)
    w = start
    for spec in specs:
        w = transforms.apply(spec, point, r.traces, w, r.ctx)
        if w is None:
            return None
    out = r.replay(w)
    if keep is not None:
        keep.update(w=w, out=out)
    spec = specs[0]
    if spec["kind"] == "fewer_launches" and r.stages is not None:
        # fewer micro-batches: the pipeline's bubble grows (the schedule's, not the graph's)
        return pipelined.bigger_microbatch_ms(r, spec, start_out, out, stages)
    if pipelined.takes(r, spec):  # the fill and drain move with the stages' work (the graph keeps PP waits)
        return pipelined.gain_ms(r, stages, start_out, start_out, out, weights=(start, w))
    return r.step_ms(start_out) - r.step_ms(out)


def host_range(probe_ns: float | None) -> tuple:
    """(slower, faster) factors on the host's time: the corpus's hosts at the 90th and 10th
    percentile of the probe against this capture's (``PROBE_NS_CORPUS``), and at least one
    machine's own drift either way (``HOST_SPEED``); ``HOST_SPEED`` where the probe is unread."""
    if not probe_ns:
        return HOST_SPEED
    fast, _, slow = PROBE_NS_CORPUS
    return round(max(HOST_SPEED[0], slow / probe_ns), 2), round(min(HOST_SPEED[1], fast / probe_ns), 2)


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
                    "gain_model": p.basis.split(": ", 1)[0], **({"trade_off": p.trade_off} if p.trade_off else {}),
                    **({"wall_after": p.wall_after} if p.wall_after else {})})
    out.sort(key=rank_key)
    return out
