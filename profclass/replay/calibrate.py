"""The untraced host calibrated to the job's own step: where the user gives the step the job runs
at without the profiler (its training log's iteration time, from iterations the capture does
not hold), the replay's host is made that much faster or slower before any fix is priced.

Why: the replay takes CUDA tracing's measured per-call cost off each call (``untraced``), but on
a host-paced job tracing also slows the CPU time between calls (the profiler's threads share the
cores), so the step without the profiler is shorter than the replay's and every host-side price,
a difference of two replays of that host, runs large by about the same factor (docs/notes.md,
call BB: the replayed untraced steps 19-24% above the capture run's own, the launch-removing
fixes' relative step changes within a few points). One factor on every host call's own time and
the CPU time before it (``transforms.host_speed``) is solved so that the replayed untraced step
meets the given one; the GPU's work is not touched, so a GPU-bound job's step hardly moves with
it and its prices stay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# The factor's search range (faster, slower), on the host's time in the replay without the
# profiler. Basis: tracing slowed three host-paced Megatron configs 13-37% on one machine (docs/
# replay.md, "The profiler's cost inside a Megatron job") and the same job's host differed by up
# to 1.4x between an H100 host and an H200 one ("The host's speed"); half or twice the replay's
# host lies beyond both. A given step outside what the range reaches leaves the host as replayed
# (no factor explains it: the GPU's own time sets the step, or the step is another job's), and
# says so.
FACTOR_RANGE = (0.5, 2.0)
# Where a given step needs a host faster than the range, one replay this much faster says whether
# any host could meet it (a GPU floor) or the range stops short (the report says which); on call
# MG's dense stage the step at x0.2 is within 1% of the GPU-only floor (x0.1), so x0.1 is the floor
BEYOND = 0.1
# A given step this close to the replay's own (a share of it) leaves the host as replayed: a
# training log's iteration times of one configuration scatter about as much run to run (call
# BB's dense stage's untraced steps before tracing: 450-520 ms; AW's dense stage held within
# 0.3%), so a smaller difference is no evidence about the host.
AGREE_SHARE = 0.02
# The solve stops within this share of the given step (0.05%: ~1 ms on a 2.5 s step, far inside
# a training log's run-to-run scatter) or after MAX_STEPS replays
STEP_TOL = 5e-4
MAX_STEPS = 40


@dataclass(frozen=True)
class HostCalibration:
    given_step_ms: float  # the job's own step without the profiler, as given
    replayed_step_ms: float  # the replay's untraced step before calibration
    host_factor: float  # on the untraced host's time (1.0: left as replayed)
    reached_step_ms: float  # the replay's untraced step with the factor
    note: str  # what was done, and why, for the report and ``missing``
    reached: bool  # False where no factor in range meets the given step (the host is then left as replayed)
    source: str = ""  # where the given step came from (--untraced-step-ms, or a train log and what it used)

    def section(self) -> dict:
        return dict(given_step_ms=round(self.given_step_ms, 3), source=self.source,
                    replayed_step_ms=round(self.replayed_step_ms, 3),
                    host_factor=round(self.host_factor, 4), reached_step_ms=round(self.reached_step_ms, 3),
                    note=self.note)


def solve(step_at: Callable[[float], float], given_ms: float, traced_ms: float | None = None,
          source: str = "") -> HostCalibration:
    """The factor on the untraced host's time whose replayed step meets ``given_ms``;
    ``step_at(f)``: the untraced step (ms) replayed with the host's time times ``f``, which never
    falls as ``f`` grows (a slower host never shortens the step); ``traced_ms``: the captured
    step, with the profiler; ``source``: where ``given_ms`` came from, for the report."""
    own = step_at(1.0)

    def left(note: str, reached: bool) -> HostCalibration:  # the host as replayed
        return HostCalibration(given_ms, own, 1.0, own, note, reached, source)

    if traced_ms and given_ms > (1 + AGREE_SHARE) * traced_ms:
        # tracing only adds work: a step without the profiler longer than the captured one is not
        # this job's steady step (warm-up iterations, another configuration)
        return left(f"the given step ({given_ms:.1f} ms) is longer than the captured step with the profiler "
                    f"({traced_ms:.1f}): tracing never makes a job faster, so it is not this job's steady step "
                    f"without the profiler (warm-up iterations? another configuration?); the host is left as "
                    f"replayed", False)
    if abs(own - given_ms) <= AGREE_SHARE * given_ms:
        return left(f"the given step ({given_ms:.1f} ms) is within {100 * AGREE_SHARE:g}% of the replay's own "
                    f"without the profiler ({own:.1f}): the host is left as replayed", True)
    faster = own > given_ms  # the host must run faster than replayed to meet it
    far = FACTOR_RANGE[0] if faster else FACTOR_RANGE[1]
    end = step_at(far)
    if (end > given_ms) if faster else (end < given_ms):
        return left(_out_of_reach(step_at, given_ms, own, far, end), False)
    f, s_f = _solve_bracketed(step_at, given_ms, min(far, 1.0), max(far, 1.0), own, end)
    return HostCalibration(given_ms, own, f, s_f, (
        f"the host's time without the profiler x{f:.3f}, so that the replayed step meets the given "
        f"{given_ms:.1f} ms (the replay's own: {own:.1f}); every fix is priced on that host"), True, source)


def _out_of_reach(step_at, given_ms: float, own: float, far: float, end: float) -> str:
    """Why no factor in range meets the given step. Where it needs a faster host, one replay at
    ``BEYOND`` tells a GPU floor (the step cannot get there) from a host that tracing slowed more
    than the range allows (call MG's dense stage: its own log's step needed x0.44)."""
    faster = far < 1.0
    head = (f"the given step ({given_ms:.1f} ms) is out of the host's reach: with the host {max(far, 1 / far):g}x "
            f"{'faster' if faster else 'slower'} the replay without the profiler runs {end:.1f} ms")
    tail = f"; the host is left as replayed ({own:.1f} ms)"
    if not faster:
        return head + " (the given step is another job's?)" + tail
    beyond = step_at(BEYOND)
    if beyond > given_ms:
        return head + f" and {1 / BEYOND:g}x faster {beyond:.1f}: the GPU's own time sets the step there" + tail
    return (head + f", {1 / BEYOND:g}x faster {beyond:.1f}: a host between those would meet it, so tracing slowed "
            f"this host more than the range searched allows (docs/replay.md, \"Calibrated to the job's own step\")"
            + tail)


def _solve_bracketed(step_at, given_ms: float, lo: float, hi: float, s_own: float, s_end: float):
    """(f, step_at(f)) with step_at(f) within ``STEP_TOL`` of ``given_ms``, f in [lo, hi], which
    bracket it (one end is 1.0, where the step is ``s_own``; the other gives ``s_end``). Regula
    falsi with the Illinois halving: a host-paced step is nearly linear in the host's speed, so a
    few replays do (bisection took 16), and the bracket keeps a GPU floor's kink safe."""
    f_lo, f_hi = lo, hi
    s_lo, s_hi = (s_end, s_own) if lo < 1.0 else (s_own, s_end)
    g_lo, g_hi = s_lo - given_ms, s_hi - given_ms
    side = 0
    f, s_f = (f_lo, s_lo) if abs(g_lo) < abs(g_hi) else (f_hi, s_hi)
    for _ in range(MAX_STEPS):
        if abs(s_f - given_ms) <= STEP_TOL * given_ms:
            break
        f = f_hi - g_hi * (f_hi - f_lo) / (g_hi - g_lo) if g_hi != g_lo else 0.5 * (f_lo + f_hi)
        s_f = step_at(f)
        g = s_f - given_ms
        if g > 0:  # the step is too long: the root is below f
            f_hi, g_hi = f, g
            if side == 1:
                g_lo *= 0.5
            side = 1
        else:
            f_lo, g_lo = f, g
            if side == -1:
                g_hi *= 0.5
            side = -1
    return f, s_f
