"""The step test on the runs' own timers (``diff --base-log FILE --candidate-log FILE``).

A capture holds a few steady iterations, and under the profiler: on the corpus's 27 gain pairs
with both captures, Welch's test on the windows' 2-9 iterations a side agrees with the
workloads' untraced timers on 15 (docs/diff.md, "The runs' own timers"). The job's training log
times every iteration, most of them outside the profiler. Given both runs' logs, the decision
is taken on them: each log's values outside warm-up and the profiled range (as
``diagnose --train-log`` reads them: ``train_log.untraced_step``), the candidate's per the base's
work where the pair changed the work a step, tested as the windows are (``stats.step_test``).
"""
from __future__ import annotations

import numpy as np

from ..train_log import MIN_VALUES, TrainLog, TrainLogStep, profiled_by_launch_line, untraced_step
from .stats import step_test


def _used(log: TrainLog, step: TrainLogStep) -> np.ndarray:
    """The log's values that the step uses (outside warm-up, the profiled ranges and the asked ones)."""
    return np.asarray(log.values_ms, dtype=float)[np.asarray(step.left_out, dtype=object) == ""]


def _side(step: TrainLogStep, values: np.ndarray) -> dict:
    return dict(source=step.basis, values=int(values.size),
                mean_ms=round(float(values.mean()), 3) if values.size else None,
                median_ms=round(float(np.median(values)), 3) if values.size else None,
                std_ms=round(float(values.std(ddof=1)), 3) if values.size > 1 else None,
                per_value=step.per_value)


def timer_step(logs: tuple[TrainLog, TrainLog], flags: tuple[dict, dict], work_ratio: float,
               alpha: float, min_effect: float) -> dict:
    """``step.timer``: both logs' steps outside the profiler and their test; ``work_ratio``: the
    candidate's work a step over the base's (1.0: the same work)."""
    steps = [untraced_step(log, profiled_by_launch_line(f)) for log, f in zip(logs, flags)]
    vb, vc = (_used(log, s) for log, s in zip(logs, steps))
    out = dict(base=_side(steps[0], vb), candidate=_side(steps[1], vc), work_ratio=work_ratio,
               delta_ms=None, delta_pct=None, test=None)
    if vb.size < MIN_VALUES or vc.size < MIN_VALUES:
        return out
    yc = vc / work_ratio  # the candidate's time for the base's work
    mb, mc = float(vb.mean()), float(yc.mean())
    return dict(out, delta_ms=round(mc - mb, 3), delta_pct=round(100 * (mc / mb - 1), 3),
                test=step_test(list(vb), list(yc), alpha=alpha, min_effect=min_effect))


def timer_note(timer: dict | None) -> list[str]:
    """The ``notes[]`` line where logs were given but one of them left too few values to test."""
    if timer is None or timer["test"] is not None:
        return []
    short = [f"{side}: {timer[side]['source']}" for side in ("base", "candidate")
             if timer[side]["values"] < MIN_VALUES]
    return [f"the training logs were not tested (fewer than {MIN_VALUES} values outside warm-up and the profiled "
            f"range: {'; '.join(short)}): the decision is the captured windows'"]


def read_logs(base_log, candidate_log) -> tuple[TrainLog, TrainLog] | None:
    """Both logs (paths, read in the formats profclass knows, or ``TrainLog``s: ``train_log.read``
    with a regex of one's own) read, or None where neither is given; ValueError where only one is
    (a timer on one side has nothing to be compared with)."""
    if base_log is None and candidate_log is None:
        return None
    if base_log is None or candidate_log is None:
        raise ValueError("give both runs' training logs (base_log and candidate_log), or neither")
    from ..train_log import read
    return tuple(log if isinstance(log, TrainLog) else read(log) for log in (base_log, candidate_log))


def with_timer_gains(rows: list[dict], timer: dict | None) -> list[dict]:
    """Each recognised fix's row with the gain the runs' timers realized (per the base's work
    where the pair changed it) and whether the predicted range holds it: the predicted gain is
    the replay's without the profiler, as the timers ran; the windows' ``realized_gain_ms`` ran
    under it. None for both where no logs were tested."""
    gain = None if timer is None or timer["test"] is None else -timer["delta_ms"]
    return [dict(r, realized_gain_timer_ms=gain,
                 within_range_timer=None if gain is None or r["gain_low_ms"] is None or r["gain_high_ms"] is None
                 else bool(r["gain_low_ms"] <= gain <= r["gain_high_ms"])) for r in rows]

