"""diff's verdict: the sentence that says what changed, by how much, on what test, and the wall
(and inside it the component and kernel) that explains it; a recognised configuration change
leads it."""
from __future__ import annotations

from ..classify import WALLS
from ..formatting import p_value, shorten, signed_ms


def judged_of(step: dict) -> dict:
    """The step comparison the decision reads (``DiffResult.judged_step``)."""
    timer = step.get("timer")
    return timer if timer and timer["test"] else step.get("work") or step


def _head(step: dict, judged: dict) -> str:
    """The measured change the verdict's sentence opens with."""
    t = judged["test"]
    test_txt = f"Welch {p_value(t['p_value'])}" if t["p_value"] is not None else t["method"]
    work = step.get("work")
    if judged is step.get("timer"):
        per = "" if judged["work_ratio"] == 1.0 else f" per the base's work (x{judged['work_ratio']:g} the work a step)"
        return (f"the runs' own timers (training logs, outside the profiler) {judged['base']['mean_ms']:.1f} -> "
                f"{judged['base']['mean_ms'] + judged['delta_ms']:.1f} ms{per} ({judged['delta_pct']:+.1f}%; {test_txt}; "
                f"{judged['base']['values']} and {judged['candidate']['values']} values); the captured windows "
                f"{step['base_ms']:.1f} -> {step['candidate_ms']:.1f} ms")
    if work is not None:
        return (f"step {step['base_ms']:.1f} -> {step['candidate_ms']:.1f} ms for x{work['ratio']:g} the work a "
                f"step, {work['candidate_ms_per_base_work']:.1f} ms per the base's work "
                f"({work['delta_pct']:+.1f}%; {test_txt})")
    return (f"step {step['base_ms']:.1f} -> {step['candidate_ms']:.1f} ms "
            f"({100 * (step['ratio'] - 1):+.1f}%, x{step['ratio']:.3f}; {test_txt})")


def _top_kernel(wall: str, kernels: list[dict], sign: float, unit: str) -> str:
    """The kernel that moved most in the change's direction, for a compute or communication wall."""
    if wall not in ("compute", "communication"):
        return ""
    mine = [k for k in kernels if (k["is_comm"] == (wall == "communication")) and k["op"] == "kernel"
            and k["delta_ms_per_step"] * sign > 0]
    if not mine:
        return ""
    k = mine[0]  # kernels are sorted by |delta|
    return f"; top kernel {shorten(k['name'], 60)} {signed_ms(k['delta_ms_per_step'])} {unit}"


def verdict_of(step: dict, significant: bool, change: str, walls_delta: dict, components: list[dict],
               kernels: list[dict]) -> dict:
    judged = judged_of(step)
    delta = judged["delta_ms"]
    head = _head(step, judged)
    unit = "ms/step" if step.get("work") is None else "ms per the base's work"
    sign = 1.0 if delta >= 0 else -1.0
    moves = {w: walls_delta[w] for w in WALLS}
    same_dir = {w: v for w, v in moves.items() if v * sign > 0}
    wall = max(same_dir, key=lambda w: abs(same_dir[w])) if same_dir and delta != 0 else None
    if not significant:
        largest = max(moves, key=lambda w: abs(moves[w]))
        tail = (f"; the largest wall move is {largest} {signed_ms(moves[largest])} {unit}"
                if abs(moves[largest]) >= 0.05 else "")
        return dict(kind="no significant change", wall=None,
                    summary=f"No significant change: {head}{tail}.")
    word = "Regression" if change == "regression" else "Improvement"
    if wall is None:  # every wall moved against the step (cannot happen with consistent walls)
        return dict(kind=change, wall=None, summary=f"{word}: {head}; no wall moved in its direction.")
    chief = [c for c in components if c["wall"] == wall and c["unit"] == "ms/step" and c["delta"] * sign > 0]
    chief_txt = ""
    if chief:
        top = max(chief, key=lambda c: abs(c["delta"]))
        chief_txt = f", chiefly {top['metric']} ({signed_ms(top['delta'])} {unit})"
    kern_txt = _top_kernel(wall, kernels, sign, unit)
    # the walls are the captured windows': their share of the windows' change, where the timers decided
    windows = step.get("work") or step
    of = f"the captured windows' {signed_ms(windows['delta_ms'])}" if judged is step.get("timer") else signed_ms(delta)
    summary = (f"{word}: {head}; the {wall} wall explains most of it "
               f"({signed_ms(walls_delta[wall])} of {of} {unit}){chief_txt}{kern_txt}.")
    return dict(kind=change, wall=wall, summary=summary)


def lead_with_fix(verdict: dict, applied: list[dict], significant: bool, change: str, one_stage: bool,
                  table: dict) -> dict:
    """A recognised configuration change (a fix of data/fixes.toml the candidate applies) leads
    the verdict with its measured effect, charged to the fix's wall (``table``: the fixes by id)
    as the seeds do (turning recompute off is the memory wall's lever, whichever walls its time
    ran in). On a base without a pipeline (``one_stage``) a schedule fix's lever is no bubble (its
    ``one_stage`` transform prices the work a step does once): charged to the wall the change
    moved most."""
    if not applied or not significant:
        return verdict
    first = applied[0]
    row = table.get(first["fix"], {})
    no_bubble = one_stage and (row.get("transform") or {}).get("one_stage")
    wall = verdict["wall"] if no_bubble else row.get("wall", verdict["wall"])
    pred = ("" if first["predicted_gain_ms"] is None else
            f", predicted {first['predicted_gain_ms']:.1f} [{first['gain_low_ms']:.1f}, {first['gain_high_ms']:.1f}]")
    word = "Regression" if change == "regression" else "Improvement"
    gain, per = first["realized_gain_ms"], " per the base's work" if first["realized_per"] == "base work" else ""
    if first.get("realized_gain_timer_ms") is not None:  # the runs' timers decided: their gain leads
        gain = first["realized_gain_timer_ms"]
        per += " by the runs' timers"
    lead = (f"{word} from a recognised change: {first['title']} ({first['detected_by']}) "
            f"{'saved' if gain >= 0 else 'cost'} {abs(gain):.1f} ms/step{per}{pred}, charged to the {wall} wall")
    rest = verdict["summary"].split(": ", 1)[1] if ": " in verdict["summary"] else verdict["summary"]
    return dict(verdict, wall=wall, summary=f"{lead}. Measured: {rest}")
