"""The fix plan (issue 30): apply the best fix, replay, classify again, repeat. Takes the job's
replayer (``r``: a ``replay.run.Replayer``, which imports this module, so it is not named in the
annotations) with each fix's price; gives ``plan[]`` rows (id, gain, step after, wall after)."""
from __future__ import annotations

from . import critical_path, pipeline_schedule, pipelined, scenario, transforms

PLAN_STEPS = 4
# a plan step must shorten the replayed step by this share of it: less is inside the replay's own
# latency model and the run-to-run noise of a timer (5-10% of a step, docs/fixes.md)
PLAN_MIN_GAIN_SHARE = 0.005
# how a schedule step's gain was taken (``plan[].applied_as``): a PP schedule change, a larger micro-batch
SCHEDULE_STEP = ("step delta: the pipeline schedule simulated with this change on top of the plan's schedule changes "
                 "before it, run by the stages less the graph fixes' savings before it")
MICROBATCH_STEP = ("step delta: its host saving replayed on top of the graph's steps before it, priced by the pipeline "
                   "schedule simulated with fewer, larger micro-batches")


def plan_pool(chosen: list[dict], plan_walls: dict, quiet: tuple[str, ...], seed_wall: str | None) -> list[dict]:
    """The fixes the plan starts from: the chosen ones, then any wall's fix that undoes a pitfall
    the profile shows (``quiet``), then ``seed_wall``'s (the largest removal, where the chosen
    fixes' walls do not cover it), each once."""
    every = [f for fs in plan_walls.values() for f in fs]
    more = [f for f in every if f["id"] in quiet] + (plan_walls.get(seed_wall, []) if seed_wall else [])
    have = {f["id"] for f in chosen}
    return chosen + list({f["id"]: f for f in more if f["id"] not in have}.values())


def fix_plan(r, chosen, table, prices, start, step, measured, walls: dict | None = None,
             covered: frozenset = frozenset(), tried: dict | None = None) -> list[dict]:
    """Apply the best fix, replay, take the next on top of it (up to PLAN_STEPS), from
    ``start``: (weights, replayed step ms) of the step without the profiler. Each step takes
    the larger of the best graph fix (replayed on the graph's steps before it; on a pipelined job
    its saving priced on the schedule with the plan's schedule changes so far, ``pipelined``) and
    the best schedule change (a PP fix, or a larger micro-batch on a pipeline: a step delta on
    top of the schedule changes before it, so two that shrink one bubble do not both claim it,
    run by the stages the graph fixes so far left, ``pipelined.lean_stages``: a shorter
    micro-batch leaves a smaller bubble). A larger micro-batch's host saving is priced on the
    captured stages. A step's wall after is the critical path's so far (``_Path``).

    The pool starts as ``chosen`` (the verdict's and runner-up's fixes, a pitfall's that
    applies, and those of the wall whose removal shortens the replayed step most, ``run.replay_job``)
    and grows as the walls move: where a step leaves a wall the largest whose fixes are
    not in it, that wall's applicable fixes (``walls``: wall -> ``fixes.select`` rows) join it,
    so the fix after "then the X wall" can be an X fix (the plan classifies again). ``covered``:
    the walls whose fixes ``chosen`` already holds (the verdict's, the runner-up's and the largest
    removal's; a pitfall's fix alone does not cover its wall). ``tried``: the prices' replays of graph fixes from
    ``start`` at their best (fix id -> (weights, outcome)), taken as they are there."""
    pool = _Pool(r, table, walls or {})
    pool.add([f for f in chosen if f["id"] in prices and (prices[f["id"]].best_ms > 0 or _reschedules(r, table[f["id"]]["transform"]))])
    pool.covered |= set(covered)
    weights, now = start
    seeds = tried if tried is not None else {}  # emptied at the first graph step: its replays are freed
    applied, wall, plan, path = [], None, [], _Path(r)
    weights_out, rescheduled = r.untraced_out, {}  # the graph's current outcome; larger micro-batch gains on it
    trials, graph_moved = [], True  # the graph trials' replays hold until a graph step (or the pool) moves
    while (pool.graph or pool.sched) and len(plan) < PLAN_STEPS:
        if graph_moved:  # from the start, a fix the prices replayed is not replayed again
            trials, graph_moved = _graph_trials(r, pool.graph, table, weights, seeds), False
        g = _best_graph_trial(r, trials, applied, weights, weights_out)
        s = _best_schedule_trial(r, pool.sched, table, applied, weights, weights_out, rescheduled)
        gain_g = min(g[0], now) if g else float("-inf")
        gain_s = min(s[0], now) if s else float("-inf")
        if max(gain_g, gain_s) < PLAN_MIN_GAIN_SHARE * step:
            break
        if gain_g >= gain_s:
            before_out = weights_out
            _, f, weights, weights_out = g
            rescheduled, graph_moved = {}, True  # a larger micro-batch's saving is replayed again
            seeds.clear()  # off the start: the prices' replays no longer apply
            wall = path.after_graph(table[f["id"]]["transform"], g[0], before_out, weights_out, weights)
            now -= gain_g
            plan.append(dict(id=f["id"], gain_ms=round(gain_g, 2), step_ms_after=round(now - step + measured, 2),
                             wall_after=wall))
            pool.graph = [x for x in pool.graph if x is not f]
        else:
            _, f, spec = s
            wall = path.after_schedule(gain_s, spec["kind"], weights_out, weights)
            now -= gain_s
            applied.append(spec)
            plan.append(dict(id=f["id"], gain_ms=round(gain_s, 2), step_ms_after=round(now - step + measured, 2),
                             wall_after=wall, applied_as=SCHEDULE_STEP if spec["kind"] == pipeline_schedule.KIND
                             else MICROBATCH_STEP))
            pool.sched = [x for x in pool.sched if x is not f]
        graph_moved |= pool.take_wall(wall)
        # more micro-batches and fewer, larger ones are opposite changes: one of them is taken
        pool.sched = [x for x in pool.sched if not any(_opposite(table[x["id"]]["transform"], a) for a in applied)]
    return plan


class _Path:
    """The critical path's walls as the plan goes: the graph's replayed path after its graph steps,
    less the step deltas the graph does not hold (``deltas``: the schedule steps, and what a graph
    step priced through the schedule gained past the graph's own change: the bubble), each off
    the wall it shortens (``critical_path.after_delta``)."""

    def __init__(self, r):
        self.r, self.cp, self.deltas = r, None, []

    def after_graph(self, spec: dict, gain: float, before_out, out, weights) -> str:
        if pipelined.takes(self.r, spec):
            self.deltas.append((gain - (self.r.step_ms(before_out) - self.r.step_ms(out)), pipeline_schedule.KIND))
        self.cp = self.r.critical_path_ms(out, weights)
        for g, kind in self.deltas:
            self.cp = critical_path.after_delta(self.cp, g, kind)
        return critical_path.largest(self.cp)

    def after_schedule(self, gain: float, kind: str, out, weights) -> str:
        if self.cp is None:  # no graph step before: the path of the step the plan starts from
            self.cp = self.r.critical_path_ms(out, weights)
        self.cp = critical_path.after_delta(self.cp, gain, kind)
        self.deltas.append((gain, kind))
        return critical_path.largest(self.cp)


class _Pool:
    """The plan's fixes not taken yet: graph fixes and schedule changes, and the walls whose
    fixes are in (``covered``)."""

    def __init__(self, r, table: dict, walls: dict):
        self.r, self.table, self.walls = r, table, walls
        self.graph, self.sched, self.seen, self.covered = [], [], set(), set()

    def add(self, rows) -> bool:
        """Add fixes with a transform not seen before; whether a graph fix came in."""
        new = [f for f in rows if f["id"] not in self.seen and (self.table.get(f["id"]) or {}).get("transform")]
        self.seen |= {f["id"] for f in new}
        moved = [f for f in new if not _reschedules(self.r, self.table[f["id"]]["transform"])]
        self.graph += moved
        # a schedule change needs the schedule's inputs (a one-stage job prices more micro-batches
        # on the graph for a request, not in the plan)
        self.sched += [f for f in new if f not in moved and self.r.stages is not None]
        return bool(moved)

    def take_wall(self, wall: str | None) -> bool:
        """The fixes of ``wall`` join once it is the largest; whether a graph fix came in."""
        if wall is None or wall in self.covered:
            return False
        self.covered.add(wall)
        return self.add(self.walls.get(wall, ()))


def _graph_trials(r, left: list, table: dict, weights, tried: dict) -> list:
    """Each graph fix of ``left`` applied on ``weights`` and replayed: (fix, spec, weights after,
    outcome); a fix with nothing to act on is left out. In the fixes table's order (the order to
    try them), so that of two fixes with one transform (a specific one and its general form) the
    plan takes the first: the best trial is the first of equal gains. ``tried``: those already
    replayed on ``weights`` (fix id -> (weights after, outcome))."""
    order = {fid: i for i, fid in enumerate(table)}
    trials = []
    for f in sorted(left, key=lambda f: order.get(f["id"], len(order))):
        spec = table[f["id"]]["transform"]
        if f["id"] in tried:
            trials.append((f, spec, *tried[f["id"]]))
            continue
        w = transforms.apply(spec, "best", r.traces, weights, r.ctx)
        if w is not None:
            trials.append((f, spec, w, r.replay(w)))
    return trials


def _best_graph_trial(r, trials: list, applied: list, weights, weights_out: scenario.Outcome):
    """The graph fix that shortens the step most from the graph's current outcome
    ``weights_out`` (of ``weights``): (gain ms, fix, weights after, outcome), or None. On a
    pipelined job the gain is the schedule's with the plan's schedule changes ``applied``
    (``pipelined``), as the fix was priced where none is."""
    best = None
    for f, spec, w, out in trials:
        gain = (pipelined.gain_ms(r, r.untraced_stages, r.untraced_out, weights_out, out, applied, (weights, w))
                if pipelined.takes(r, spec)
                else r.step_ms(weights_out) - r.step_ms(out))
        if gain is not None and (best is None or gain > best[0]):
            best = (gain, f, w, out)
    return best


def _best_schedule_trial(r, left: list, table: dict, applied: list, weights, weights_out, memo: dict):
    """The schedule change that shortens the simulated step most on top of ``applied``, run by
    the stages less the graph's savings so far (``weights_out``): (gain ms, fix, its transform),
    or None. A larger micro-batch (fewer of them): its host saving
    replayed on ``weights`` (the graph's steps so far), priced by the schedule at m / k; the
    changes after it are simulated on its m / k micro-batches (without its saving, which the
    simulation's inputs do not hold). ``memo``: those gains on the current ``weights`` by fix id
    (they do not depend on the schedule changes applied)."""
    if not left:
        return None
    lean = pipelined.lean_stages(r, r.untraced_stages, r.untraced_out, weights_out, weights)
    before = pipeline_schedule.combined_ms(applied, lean)
    trial = []
    for f in left:
        spec = table[f["id"]]["transform"]
        after = pipeline_schedule.combined_ms(applied + [spec], lean)
        if after is None:
            continue
        if spec["kind"] == pipeline_schedule.KIND:
            trial.append((before - after, f, spec))
        else:
            if f["id"] not in memo:
                memo[f["id"]] = pipelined.bigger_microbatch_on(r, spec, weights, weights_out)
            if memo[f["id"]] is not None:
                trial.append((memo[f["id"]], f, spec))
    return max(trial, key=lambda t: t[0]) if trial else None


def _opposite(a: dict, b: dict) -> bool:
    return (_more_microbatches(a) and _fewer_microbatches(b)) or (_fewer_microbatches(a) and _more_microbatches(b))


def _reschedules(r, spec: dict) -> bool:
    """A schedule change: a PP fix, or a larger micro-batch on a pipelined job (fewer micro-batches)."""
    return spec.get("kind") == pipeline_schedule.KIND or (_fewer_microbatches(spec) and r.stages is not None)


def _more_microbatches(spec: dict) -> bool:
    return spec.get("kind") == pipeline_schedule.KIND and int(spec.get("microbatches", 1)) > 1


def _fewer_microbatches(spec: dict) -> bool:
    return spec.get("kind") == "fewer_launches"
