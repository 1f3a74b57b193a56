"""The job's own step without the profiler, read from its training log (``diagnose --train-log``).

The replay's host is calibrated to the step the job runs at without the profiler
(``replay.calibrate``); the post-job hook has the job's log at hand, so it can pass the log
instead of a number. Read here: the log's format, the time of each logged iteration (or interval
of iterations), which of them are left out and why, and the median of the rest.

Formats, tried in this order (the first one with a matching line is the log's):

- Megatron-LM's ``training_log`` line (megatron/training/training.py, ``training_log``:
  ``' iteration {:8d}/{:8d} |'`` ... ``' elapsed time per iteration (ms): {:.1f} |'``): the mean
  over the iterations since the last log line (``--log-interval``);
- NeMo's ``ProgressPrinter`` line (nemo/lightning/pytorch/callbacks/progress_printer.py:
  ``Training epoch E, iteration N/T | ... | train_step_timing in s: X``): a mean over its log
  interval too, in seconds; N counts within the epoch (a pre-training run is one epoch);
- this repository's workloads' ``STEP_MS it=N ms=X`` (workloads/megatron_layouts.py),
  one line per iteration, and its ``mean step over iters A..B`` line naming the captured steps;
- anything else: ``--train-log-regex`` with one named group ``ms`` (or ``s``) and optionally
  ``it`` (without it the matches are iterations 1, 2, ... in order).

Which values count (each value covers the iterations since the last logged one: the most common
step between logged iterations, ``per_value``):

- warm-up: every value whose iterations hold the log's first logged iteration: the process's
  start (CUDA context, NCCL communicators, compilation, the allocator's first growth: 1095 ms
  against ~465 steady on this repository's dense capture run, timers/s33/ba_ba_dense.log).
  Megatron-LM's line after the first iteration does not reset its interval timer
  (``is_first_iteration``), so its next value holds iteration 1 as well and is left out too.
  Later warm-up iterations are outvoted by the median, or left out with ``--train-log-skip``;
- profiled: every value whose iterations meet a profiled range (an interval mean is left out
  whole): the log's own (the workloads' ``mean step over iters A..B``, widened by one step each
  side: the steps that start and stop the profiler pay for it, 2.2 and 3.0 s on
  timers/mcore_1gpu_dense_small.log) and Megatron-LM's ``--profile-step-start/-end`` on the
  profile's launch line (``profiled_by_launch_line``); where neither is known, none is left out;
- asked: ``--train-log-skip A..B``.

The median of the rest is the step; fewer than ``MIN_VALUES`` left: none (a ``missing[]`` line,
the host not calibrated). A file that cannot be read, or holds no line of the format, is bad
input (``ProfileError``).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from .errors import ProfileError

NUMBER = r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?"
# fewer values than this left after the exclusions: no step (one value is one interval's mean,
# with nothing to tell a stall from the steady step)
MIN_VALUES = 2
# Megatron-LM's defaults of --profile-step-start / --profile-step-end
# (megatron/training/config/common_config.py)
MEGATRON_PROFILE_STEPS = (10, 12)
GIVEN_SOURCE = "--untraced-step-ms (untraced_step_ms= in Python)"


@dataclass(frozen=True)
class LogFormat:
    name: str
    pattern: re.Pattern  # named groups: ms or s, and optionally it
    # the steps the log says were captured (groups: first, last), for the profiled range
    captured: re.Pattern | None = None


MEGATRON_LM = LogFormat("Megatron-LM 'elapsed time per iteration'", re.compile(
    rf"\biteration\s+(?P<it>\d+)\s*/\s*\d+\s*\|[^\n]*?elapsed time per iteration \(ms\):\s*(?P<ms>{NUMBER})"))
NEMO = LogFormat("NeMo 'train_step_timing in s'", re.compile(
    rf"\bTraining epoch \d+, iteration (?P<it>\d+)/\d+[^\n]*?\|\s*train_step_timing in s:\s*(?P<s>{NUMBER})"))
STEP_MS = LogFormat("the workloads' 'STEP_MS'", re.compile(rf"\bSTEP_MS it=(?P<it>\d+) ms=(?P<ms>{NUMBER})"),
                    re.compile(r"mean step over iters (\d+)\.\.(\d+)"))
FORMATS = (MEGATRON_LM, NEMO, STEP_MS)


@dataclass(frozen=True)
class ProfiledRange:
    first: int  # logged iterations whose time the profiler touched, inclusive
    last: int
    source: str  # where the range came from, in words


@dataclass(frozen=True)
class TrainLog:
    """A training log as read: one value per matched line, in log order."""

    path: str
    format: str  # LogFormat.name, or the --train-log-regex
    iterations: tuple[int, ...]  # the logged iteration of each value
    values_ms: tuple[float, ...]  # each value, ms (a mean over ``per_value`` iterations)
    per_value: int  # iterations each value covers: the most common step between logged iterations
    captured: tuple[int, int] | None = None  # the steps the log says were captured (first, last), as it says them
    skip: tuple[tuple[int, int], ...] = ()  # logged iterations asked to be left out (--train-log-skip)

    @property
    def marked(self) -> tuple[ProfiledRange, ...]:
        """The profiled range the log itself names: its captured steps and the step either side
        (the workloads time each step start to start, so the step before the capture holds the
        profiler's start and the one after its stop: workloads/megatron_layouts.py)."""
        if self.captured is None:
            return ()
        a, b = self.captured
        return (ProfiledRange(a - 1, b + 1, f"the log's 'mean step over iters {a}..{b}', and the step either "
                                            f"side, which starts or stops the profiler"),)


@dataclass(frozen=True)
class TrainLogStep:
    """The job's untraced step as its log gives it, and what was used."""

    path: str
    format: str
    step_ms: float | None  # the median of the values used; None where fewer than MIN_VALUES are left
    iterations: tuple[int, ...]  # every value's logged iteration, in log order
    left_out: tuple[str, ...]  # per value: why it was left out (warm-up, profiled, asked), "" where used
    per_value: int  # iterations each value covers
    profiled: tuple[ProfiledRange, ...]  # the profiled ranges applied

    @property
    def iterations_used(self) -> tuple[int, ...]:
        return tuple(it for it, why in zip(self.iterations, self.left_out) if not why)

    @property
    def iterations_skipped(self) -> tuple[tuple[int, str], ...]:
        """(logged iteration, why) of each value left out."""
        return tuple((it, why) for it, why in zip(self.iterations, self.left_out) if why)

    @property
    def basis(self) -> str:
        """Where the step came from, for the report (``replay.host_calibration.source``)."""
        runs = _runs(self.iterations, self.left_out)
        used = ", ".join(span for span, why in runs if not why)
        each = f", each the mean of {self.per_value} iterations" if self.per_value > 1 else ""
        n = len(self.iterations_used)
        text = (f"train log {self.path}: {self.format}, {used} ({n} log line{'s' * (n != 1)}{each})"
                if used else f"train log {self.path}: {self.format}, no log line left")
        if self.step_ms is not None:
            text += f", median {self.step_ms:.1f} ms"
        skipped = [(span, why) for span, why in runs if why]
        if skipped:
            # the profiled ranges' sources once, after the last profiled run
            last = max((i for i, (_, why) in enumerate(skipped) if why == "profiled"), default=-1)
            sources = "; ".join(r.source for r in self.profiled)
            text += "; left out: " + ", ".join(f"{span} {why}" + (f" ({sources})" if i == last else "")
                                               for i, (span, why) in enumerate(skipped))
        return text

    @property
    def missing(self) -> str | None:
        """The ``missing[]`` line where the log gave no step."""
        if self.step_ms is not None:
            return None
        return (f"{self.basis}; fewer than {MIN_VALUES} values left: no step without the profiler, the host is "
                f"not calibrated (a log with more iterations outside the capture, or --untraced-step-ms)")


def _runs(iterations, labels) -> list[tuple[str, str]]:
    """Neighbouring values (in log order) with one label, as ("iterations a-b", label)."""
    runs: list[tuple[list[int], str]] = []
    for it, label in zip(iterations, labels):
        if runs and runs[-1][1] == label:
            runs[-1][0].append(it)
        else:
            runs.append(([it], label))
    return [(f"iteration {its[0]}" if its[0] == its[-1] else f"iterations {its[0]}-{its[-1]}", label)
            for its, label in runs]


def user_format(regex: str) -> LogFormat:
    """``--train-log-regex``: one named group ``ms`` or ``s``, optionally ``it``."""
    try:
        pattern = re.compile(regex)
    except re.error as exc:
        raise ProfileError("--train-log-regex", f"not a valid regular expression ({exc})") from None
    units = [g for g in ("ms", "s") if g in pattern.groupindex]
    if len(units) != 1:
        raise ProfileError("--train-log-regex", "needs one named group (?P<ms>...) or (?P<s>...) for the "
                                                "iteration time, and optionally (?P<it>...) for its iteration")
    return LogFormat(f"--train-log-regex {regex!r}", pattern)


def skip_range(text: str) -> tuple[int, int]:
    """``A..B`` (inclusive) or ``N`` -> (A, B); ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:\.\.\s*(\d+)\s*)?", text)
    if not m or int(m.group(2) or m.group(1)) < int(m.group(1)):
        raise ValueError(f"{text}: not an iteration range A..B (or one iteration N)")
    return int(m.group(1)), int(m.group(2) or m.group(1))


def read(path, regex: str | None = None, skip=()) -> TrainLog:
    """The log at ``path`` in the first format with a matching line (``regex``: that format
    only); ``skip``: (first, last) logged iterations to leave out. ProfileError where the file
    cannot be read or no line matches."""
    path = os.fspath(path)
    return parse(_text(path), path, regex, skip)


def parse(text: str, path: str, regex: str | None = None, skip=(), formats=FORMATS) -> TrainLog:
    """``read`` of a log's text (``path``: its name, for messages), in the first of ``formats``
    with a matching line."""
    for fmt in (user_format(regex),) if regex else formats:
        found = _values(fmt, text)
        if found is not None:
            its, values = found
            captured = fmt.captured.search(text) if fmt.captured else None
            return TrainLog(path, fmt.name, tuple(int(i) for i in its), tuple(float(v) for v in values),
                            _per_value(its), (int(captured.group(1)), int(captured.group(2))) if captured else None,
                            tuple(skip))
    known = "a line matching --train-log-regex" if regex else \
        "Megatron-LM's 'elapsed time per iteration (ms)', NeMo's 'train_step_timing in s' or 'STEP_MS it=N ms=X'"
    raise ProfileError(path, f"no iteration times in the training log (no line holds {known}"
                             + ("" if regex else "; give --train-log-regex for another format") + ")")


def _text(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except IsADirectoryError:
        raise ProfileError(path, "cannot read the training log (is a directory)") from None
    except OSError as exc:
        raise ProfileError(path, f"cannot read the training log ({exc.strerror or exc})") from None
    return raw.decode("utf-8", errors="replace")  # progress bars and the like need not be UTF-8


def _values(fmt: LogFormat, text: str):
    """(logged iterations, values in ms) of every match, positive values only; None without one."""
    rows = fmt.pattern.findall(text)
    if not rows:
        return None
    table = np.array(rows, dtype=str).reshape(len(rows), -1)  # one column per group
    groups = fmt.pattern.groupindex
    unit = "ms" if "ms" in groups else "s"
    try:
        values = table[:, groups[unit] - 1].astype(float) * (1.0 if unit == "ms" else 1e3)
        its = table[:, groups["it"] - 1].astype(np.int64) if "it" in groups else np.arange(1, len(rows) + 1)
    except ValueError as exc:
        raise ProfileError("--train-log-regex", f"a group matched what is not a number ({exc})") from None
    keep = np.isfinite(values) & (values > 0)
    return (its[keep], values[keep]) if keep.any() else None


def _per_value(its: np.ndarray) -> int:
    steps = np.diff(its)
    steps = steps[steps > 0]
    if not steps.size:
        return 1
    size, count = np.unique(steps, return_counts=True)
    return int(size[np.argmax(count)])


def profiled_by_launch_line(flags: dict) -> tuple[ProfiledRange, ...]:
    """Megatron-LM's ``--profile`` range as the logged iterations it touched. Megatron-LM
    (megatron/training/training.py, ``train``) calls cudaProfilerStart at the top of the loop
    when ``iteration`` (the steps done) equals ``--profile-step-start`` S, and cudaProfilerStop
    after the log line of the step that makes it ``--profile-step-end`` E: the steps logged as
    S+1..E run traced, and the profiler's stop lands in the interval of E+1."""
    if "--profile" not in flags:
        return ()
    start, end = (flags.get(f, str(d)) for f, d in zip(("--profile-step-start", "--profile-step-end"),
                                                       MEGATRON_PROFILE_STEPS))
    if not (isinstance(start, str) and isinstance(end, str) and start.isdigit() and end.isdigit()):
        return ()
    s, e = int(start), int(end)
    return (ProfiledRange(s + 1, e + 1, f"--profile-step-start {s} --profile-step-end {e} on the launch line: "
                                        f"Megatron-LM traces the steps logged {s + 1}..{e} and stops after {e}'s line"),)


def untraced_step(log: TrainLog, profiled=()) -> TrainLogStep:
    """The median of ``log``'s values outside warm-up, the profiled ranges (the log's own and
    ``profiled``) and the asked ones (module docstring)."""
    its, values = np.asarray(log.iterations, dtype=np.int64), np.asarray(log.values_ms, dtype=float)
    first = its - log.per_value + 1  # the first iteration each value covers
    why = np.full(its.size, "", dtype=object)

    def leave_out(lo: int, hi: int, reason: str) -> None:
        why[(why == "") & (first <= hi) & (its >= lo)] = reason

    if its.size:
        leave_out(int(its[0]), int(its[0]), "warm-up")
    ranges = (*log.marked, *profiled)
    for r in ranges:
        leave_out(r.first, r.last, "profiled")
    for lo, hi in log.skip:
        leave_out(lo, hi, "asked (--train-log-skip)")
    used = why == ""
    step = float(np.median(values[used])) if used.sum() >= MIN_VALUES else None
    return TrainLogStep(log.path, log.format, step, tuple(int(i) for i in its), tuple(str(w) for w in why),
                        log.per_value, ranges)


def read_untraced_step(path, profiled=(), skip=(), regex: str | None = None) -> TrainLogStep:
    """The job's step without the profiler from its training log at ``path``: ``read`` then
    ``untraced_step``. ``profiled``: ``ProfiledRange``s the log does not name (the profile's
    launch line: ``profiled_by_launch_line``); ``skip``: (first, last) logged iterations to
    leave out; ``regex``: a format of one's own (``user_format``)."""
    return untraced_step(read(path, regex=regex, skip=skip), profiled)


@dataclass(frozen=True)
class GivenStep:
    """The untraced step handed to the replay's calibration, and where it came from."""

    step_ms: float | None
    source: str  # replay.host_calibration.source
    missing: tuple[str, ...] = ()  # where a log gave none


def given_step(untraced, flags: dict) -> GivenStep:
    """``untraced`` (a number of ms, a ``TrainLog`` or None) as the replay takes it, with the
    launch line's ``flags`` naming the profiled range of a log."""
    if isinstance(untraced, TrainLog):
        step = untraced_step(untraced, profiled_by_launch_line(flags))
        return GivenStep(step.step_ms, step.basis, (step.missing,) if step.missing else ())
    return GivenStep(untraced, GIVEN_SOURCE if untraced is not None else "")
