"""The replay section's notes in words: where the verdict's wall is not the one whose removal
gains most, what the step without the profiler leaves out on a host-paced job, and each price's
basis."""
from __future__ import annotations

from . import pipeline_schedule, pipelined
from .constants import UNTRACED_CAVEAT_SHARE


UNTRACED_CAVEAT = "replay: untraced_step_ms takes only CUDA tracing's per-call cost off this host-paced step"


def untraced_caveat(untraced: float, measured: float, host_after: tuple[str, ...] = ()) -> str:
    """What the step without the profiler leaves out where CUDA tracing's per-call cost moved the
    step (``constants.UNTRACED_CAVEAT_SHARE``; measured: docs/replay.md, "On the capture's own
    machine"). ``host_after``: fixes off the host wall whose replayed step is host-paced after
    them: on a host faster than the replay's they gain more (docs/notes.md, call ME; the example the
    line gave, call ME's dense stage, was short for another cause, call MI: a sync the transform kept)."""
    line = (f"{UNTRACED_CAVEAT} ({100 * (1 - untraced / measured):.0f}%); where it took 2% or more, jobs run again untraced on "
            f"their capture's machine ran a median 11% faster than that (26 of 37 over 5% faster; on the later "
            f"calls' 26, held out, a median 2%: 11 over 5% faster, 4 over 5% slower), so the step without the "
            f"profiler is often shorter than untraced_step_ms, and host-side prices larger than "
            f"the job banks (give the job's own step, --untraced-step-ms or --train-log, to calibrate the host)")
    if host_after:
        line += (f"; after {', '.join(host_after)} the replayed step is paced by that slower host, so where the "
                 f"job's own host keeps ahead of the GPU they gain more than priced")
    return line


def untraced_bound(calibration, untraced_ms: float, measured_ms: float, run_start: bool = False) -> str:
    """How far ``untraced_step_ms`` holds: "calibrated" to a step the job gave; "upper" where an
    uncalibrated step is host-paced (``host_paced``: on the captures' own machines such steps ran
    faster untraced than the replay says, docs/replay.md, "On the capture's own machine") or is
    the window of a capture from the process's start (``run_start``: on 7 of call LB's 8 runs the
    later step was 1.24-1.54x shorter, docs/notes.md); "estimate" otherwise."""
    if calibration is not None:
        return "calibrated" if calibration.reached else "estimate"
    return "upper" if run_start or host_paced(untraced_ms, measured_ms) else "estimate"


def host_paced(untraced_ms: float, measured_ms: float) -> bool:
    """CUDA tracing's per-call cost took ``UNTRACED_CAVEAT_SHARE`` or more off the step."""
    return untraced_ms <= (1 - UNTRACED_CAVEAT_SHARE) * measured_ms


def disagreement(verdict: str, largest: str, without: dict, measured: float) -> str:
    gain_v = measured - without.get(verdict, measured)
    gain_l = measured - without[largest]
    return (f"the verdict is the {verdict} wall (the largest share of the step), but removing the {largest} "
            f"wall shortens the replayed step most ({gain_l:.1f} vs {gain_v:.1f} ms/step): the {verdict} "
            f"time is partly hidden behind other work, so the step does not fall by its share")


def schedule_basis(spec: dict, stages, traced: bool, host_text: str) -> str:
    return (f"replay:{spec['kind']}: Megatron-Core's schedule simulated with each stage's measured "
            f"per-micro-batch work, rest, exchange cost and sync refill ({describe({k: v for k, v in spec.items() if k != 'one_stage'})}"
            + (f"; {pipeline_schedule.balance_note(stages)}" if spec.get("balance") else "")
            + pipeline_schedule.overlap_note(spec, stages)
            + "), against the schedule "
            f"simulated at the captured (p, v, m); " + ("both as traced (the profiler kept)" if traced else
            "both without the profiler (each stage's host time less what the graph replay says CUDA "
            "tracing added to it)" + host_text))


def graph_basis(r, spec: dict, traced: bool) -> str:
    basis = (f"replay:{spec['kind']}: the captured step replayed with the fix's transform "
             f"({describe(spec) or 'no parameter'}), against the step replayed as captured, both "
             + ("with the profiler kept" if traced else "without the profiler's cost"))
    if spec["kind"] == "fewer_launches" and r.stages is not None:
        basis += ("; on this pipelined job each stage's host time saved per step is fed to Megatron-Core's "
                  "schedule simulated with micro_batch_factor times fewer, larger micro-batches (the bubble "
                  "grows), against the schedule at the captured count")
    elif pipelined.takes(r, spec):
        basis += ("; on this pipelined job each stage's saving per step, split between its micro-batches' work "
                  "and its once-per-step rest by where its timeline shrank, is fed to Megatron-Core's schedule "
                  "simulated at the captured (p, v, m): the fill and drain shrink with the stages' work")
    return basis


def describe(spec: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("kind", "basis"))


def fixes_basis(r, specs: list[dict], stages, traced: bool) -> str:
    """A price's basis: one fix's, or fixes' together (the plan's arithmetic)."""
    if len(specs) == 1:
        return graph_basis(r, specs[0], traced)
    parts = " + ".join(schedule_basis(s, stages, traced, "") if s["kind"] == pipeline_schedule.KIND
                       else graph_basis(r, s, traced) for s in specs)
    if r.stages is not None:
        return ("together on this pipelined job: the graph fixes' transforms applied in turn, each stage's saving "
                "taken off its micro-batches' work and rest, and the schedule changes simulated on those leaner "
                "stages against the captured schedule, at the same point of each range (their gains do not add: "
                "a shorter micro-batch leaves a smaller bubble): " + parts)
    return ("together, each transform applied to the weights the one before it left, at the same "
            "point of each range (the plan's arithmetic): " + parts)


def host_note(r) -> str:
    """What a fix's range holds beside its transform's parameters: the host's time at each end
    (``Replayer.host_factors``) and why."""
    slow, fast = r.host_factors
    why = ("HOST_SPEED: one machine's drift; no host probe read" if not r.inp.host_probe_ns else
           f"the corpus's hosts at the 10th and 90th percentile of the host probe against this one's "
           f"{r.inp.host_probe_ns:.0f} ns, at least HOST_SPEED either way")
    return (f"; the range also holds it with the host's time x{fast:g} and x{slow:g} (the host that banks "
            f"the gain is not the captured one: {why})")
