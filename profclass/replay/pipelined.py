"""A graph fix on a pipelined job, priced on the pipeline's critical path.

The graph replay keeps PP send/recv at their captured times (their peers are taken to move as
the rank does): a fix that shortens every stage's micro-batches shortens each stage's own
timeline by its own saving, but the fill and drain, where a stage waits for its neighbours' work,
stay as captured. On Megatron's schedule those waits are the other stages' micro-batch slots:
the step is about m + p - 1 slots of the busiest stage plus the once-per-step rest, so a saving
s on every micro-batch of every stage saves about (m + p - 1) s, not m s (11/8 of the graph's on
PP 4 with 8 micro-batches). So on a job whose schedule is simulated, a graph fix's saving is fed to
that simulation: each stage's saving per step (the graph replay's, its window's end moved), split
by where the stage's timeline contracted, inside the micro-batches' slots (between PP exchanges:
the work U, per micro-batch) or in the once-per-step stretch (the rest R), and the step simulated
with it against the step simulated without.

Not the collectors' pauses (``remove_gc``): they are neither work nor rest but the schedule's own
term (``Stages.pause``), and stay priced on the graph, as the registered manual-GC pairs were;
nor a larger micro-batch (``fewer_launches``), which changes the schedule's sizes itself.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import critical_path, pipeline_schedule, scenario, transforms
from .schedule_inputs import Stages
from .trace import COMPUTE

# graph transforms priced on the graph alone on a pipelined job (see above)
GRAPH_ONLY = ("remove_gc", "fewer_launches", pipeline_schedule.KIND)


def takes(r, spec: dict) -> bool:
    """Whether the fix ``spec``'s graph saving is priced through the schedule on this job."""
    return r.stages is not None and spec.get("kind") not in GRAPH_ONLY


def _stage_mean(r, per_gpu) -> np.ndarray:
    """Per pipeline stage, the mean of a value over its GPUs (``per_gpu``: one per replayed GPU)."""
    st = r.stages
    stage = np.asarray(st.gpu_stage, np.int64)
    total = np.bincount(stage, weights=np.asarray(per_gpu, float), minlength=st.p)
    return total / np.maximum(np.bincount(stage, minlength=st.p), 1)


def stage_saving(r, before: scenario.Outcome, after: scenario.Outcome) -> np.ndarray:
    """Per pipeline stage (the mean of its GPUs): ns per step the replay from ``before`` to
    ``after`` took off the stage's time."""
    return _stage_mean(r, [(before.ends[gi] - after.ends[gi]) / max(t.iterations, 1) for gi, t in enumerate(r.traces)])


def host_ratio(r, weights) -> np.ndarray:
    """Per stage (the mean of its GPUs), the host's time in ``weights`` (every call's own time
    and the CPU time before it) over the captured host's."""
    return _stage_mean(r, [float(w.c_dur.sum() + w.c_gap.sum()) / max(float(c.c_dur.sum() + c.c_gap.sum()), 1.0)
                           for w, c in zip(weights, r.captured)])


def work_share(r, before: scenario.Outcome, after: scenario.Outcome) -> np.ndarray:
    """Per stage (the mean of its GPUs), the share of its timeline's contraction from ``before``
    to ``after`` that fell inside the micro-batches' slots rather than in the rest: each stretch
    around a PP exchange shrank by its end's shift less its start's (a PP op keeps its captured
    duration in the graph, so its end moves with its start); the window's start does not move.
    1 where the stage did not contract."""
    st = r.stages
    share = []
    for gi, (s, pp, rest) in enumerate(zip(st.gpu_stage, st.pp_ops, st.rest_mask)):
        nodes = r.graph.op_node[gi][pp]
        shift = np.concatenate([[0], after.t[nodes] - before.t[nodes], [after.ends[gi] - before.ends[gi]]])
        shrank = shift[:-1] - shift[1:]  # per stretch, ns taken off
        total, in_rest = float(shrank.sum()), float(shrank[rest].sum())
        if s == 0:  # the first stage's rest stretch also holds 1/v of a micro-batch's work (its
            # last backward and the next step's first forward, as ``measure`` counts it): as
            # much as the other stretches' saving per that much work is work
            in_rest -= min(max(in_rest, 0.0), max(total - in_rest, 0.0) / max(st.v * st.m - 1.0, 1.0))
        share.append(1.0 if total <= 0 else float(np.clip(1.0 - in_rest / total, 0.0, 1.0)))
    return _stage_mean(r, share)


def busy_saved(r, weights) -> np.ndarray:
    """Per stage (the mean of its GPUs), ns per micro-batch of compute kernels' time ``weights``
    take off the job's own (``r.untraced``, whose kernels are the captured ones)."""
    return _stage_mean(r, [float((w0.op_dur - w.op_dur)[t.ops.kind == COMPUTE].sum()) / max(t.iterations, 1)
                           / r.stages.m for t, w0, w in zip(r.traces, r.untraced, weights)])


def lean_stages(r, st: Stages, base_out: scenario.Outcome, out: scenario.Outcome, weights=None) -> Stages:
    """The stages ``st`` (measured on ``base_out``) with the graph's savings from ``base_out``
    to ``out`` taken off their micro-batches' work and their rest, where each stage's timeline
    shrank; with the ``weights`` replayed as ``out``, their busy time less the kernels' time those
    took away (a layer moved between stages after a fix costs what the fix left of it:
    ``balanced_work``, and the overlapped exchanges' slowdown is of that busy time), else as
    measured."""
    lean = pipeline_schedule.less_time(st, stage_saving(r, base_out, out), work_share(r, base_out, out))
    if weights is None or lean.busy is None:
        return lean
    return replace(lean, busy=np.clip(lean.busy - busy_saved(r, weights), 0, None))


def gain_ms(r, st: Stages, base_out: scenario.Outcome, before: scenario.Outcome, after: scenario.Outcome,
            applied: tuple | list = (), weights: tuple = (None, None)) -> float | None:
    """ms per step the graph's change from ``before`` to ``after`` saves on the schedule of ``st``
    (measured on ``base_out``) with the schedule changes ``applied`` (the plan's so far), both run
    by the stages less the graph's savings (``lean_stages``; ``weights``: the two outcomes'
    weights, where known), the exchange at the gaps' median; None where the schedule cannot run
    ``applied``."""
    a = pipeline_schedule.combined_ms(list(applied), lean_stages(r, st, base_out, before, weights[0]))
    b = pipeline_schedule.combined_ms(list(applied), lean_stages(r, st, base_out, after, weights[1]))
    return None if a is None or b is None else a - b


def graph_and_schedule(specs: list[dict]) -> tuple[list[dict], list[dict]]:
    """Fixes asked for together: (graph transforms, schedule changes), each in the order asked."""
    return ([s for s in specs if s["kind"] != pipeline_schedule.KIND],
            [s for s in specs if s["kind"] == pipeline_schedule.KIND])


def together_priced(r, specs: list[dict]) -> bool:
    """Whether fixes asked for together are priced: graph fixes on a job without a simulated
    schedule; on a pipelined one, graph fixes whose savings the schedule takes (not a larger
    micro-batch, which resizes it, nor the collectors' pauses) and schedule changes."""
    graph, schedule = graph_and_schedule(specs)
    if r.stages is None:
        return not schedule
    return all(takes(r, s) for s in graph)


def together_ms(r, graph: list[dict], schedule: list[dict], point: str, start, start_out: scenario.Outcome,
                st: Stages) -> float | None:
    """ms per step graph fixes and schedule changes asked for together save on a pipelined job
    (``st``: its stages, measured on ``start_out``): the graph transforms at ``point`` applied in
    turn and replayed, each stage's saving taken off its micro-batches' work and rest as a graph
    fix alone is priced (``gain_ms``), and the schedule changes simulated on those leaner stages,
    against the schedule simulated at the captured sizes. Their gains do not add: a fix that
    shortens every micro-batch shrinks the bubble interleaving or more micro-batches remove."""
    w = start
    for spec in graph:
        w = transforms.apply(spec, point, r.traces, w, r.ctx)
        if w is None:
            return None
    lean = lean_stages(r, st, start_out, r.replay(w), w) if graph else st
    return pipeline_schedule.gain_at(schedule, st, point, lean)


def bigger_microbatch_on(r, spec: dict, weights, weights_out: scenario.Outcome) -> float | None:
    """A larger micro-batch's gain on a pipelined job from ``weights`` (replayed as ``weights_out``)."""
    w = transforms.apply(spec, "best", r.traces, weights, r.ctx)
    return None if w is None else bigger_microbatch_ms(r, spec, weights_out, r.replay(w), r.untraced_stages)


def bigger_microbatch_ms(r, spec: dict, start_out: scenario.Outcome, out: scenario.Outcome,
                         stages) -> float | None:
    """A larger micro-batch on a pipelined job: the graph replay's host time saved per step,
    per stage, priced by the schedule (``stages``) with m / k micro-batches."""
    return pipeline_schedule.bigger_microbatch_ms(stages, float(spec.get("microbatch_factor", 2.0)),
                                                  stage_saving(r, start_out, out))


def wall_after(r, specs: list[dict], gain_ms: float, start_cp, start_out: scenario.Outcome, best: dict) -> str:
    """The largest wall on the critical path once fixes priced at ``gain_ms`` are made (``best``:
    the graph's replay with them, ``w`` and ``out``; empty where there is none; ``start_cp()``:
    the path of the step priced from). The graph keeps the PP waits as captured: where the
    schedule prices a graph fix, the step falls by the schedule's gain, and what that differs
    from the graph's own change comes off (or onto) the bubble, communication on the path. A
    larger micro-batch on a pipeline, and fixes together there, are a step delta off the start's
    path (``critical_path.after_delta``), as the plan takes them."""
    kind = specs[0]["kind"]
    if r.stages is not None and (kind == "fewer_launches" or not best):
        delta = kind if kind == "fewer_launches" else pipeline_schedule.KIND
        return critical_path.largest(critical_path.after_delta(start_cp(), gain_ms, delta))
    cp = r.critical_path_ms(best["out"], best["w"])
    if len(specs) == 1 and takes(r, specs[0]):
        graph_ms = r.step_ms(start_out) - r.step_ms(best["out"])
        cp = critical_path.after_delta(cp, gain_ms - graph_ms, pipeline_schedule.KIND)
    return critical_path.largest(cp)
