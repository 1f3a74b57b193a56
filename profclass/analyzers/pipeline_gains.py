"""Gain models of the pipeline-schedule fixes: interleaving (VPP) and more micro-batches.

They price from the pipeline numbers the layout analyzer measures (``pp_bubble_ms``: time a
stage sits blocked in a PP send/recv, mean over stages; ``pp_stages``, ``pp_virtual_stages``,
``pp_microbatches``; ``stage_imbalance_ms``: the slowest stage's extra busy time), read with
``.get`` so a profile (or a build) without them gets no number rather than a guess. The
measured bubble is split three ways: the 1F1B schedule's share, (p-1)/(v m + p-1) of the step
(Narayanan et al. 2021), capped at what was measured; the stage imbalance; and the rest, the
p2p transfers and their per-message latency, which scale with the number of sends.
Models: docs/fixes.md ("Gain models").
"""
from __future__ import annotations

from .gainmodel import Gain, gain


def _theory(p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m + p - 1)


def _split(n: dict) -> tuple[float, float, float, float, int, int, int] | None:
    """(measured bubble, schedule part, imbalance, p2p part) ms/step and p, v, m; or None when
    the job is not pipelined or the layout numbers are absent."""
    bubble, p, m = n.get("pp_bubble_ms"), n.get("pp_stages"), n.get("pp_microbatches")
    if bubble is None or not p or p < 2 or not m:
        return None
    v = int(n.get("pp_virtual_stages") or 1)
    schedule = min(float(bubble), _theory(p, v, m) * n["step_ms"])
    imbalance = min(float(n.get("stage_imbalance_ms") or 0.0), float(bubble) - schedule)
    return float(bubble), schedule, imbalance, float(bubble) - schedule - imbalance, p, v, m


def _exchanges(p: int, v: int, m: int) -> float:
    """P2p exchanges per step of one stage, mean over stages, as Megatron's schedules issue them
    (schedules.py): 1F1B (v = 1) one batched exchange per micro-batch plus one per warm-up step,
    m + (p - 1 - r) on stage r; interleaved one per model-chunk step plus its longer warm-up,
    m v + 2 (p - 1 - r) + (v - 1) p."""
    if v == 1:
        return m + (p - 1) / 2.0
    return m * v + (p - 1) + (v - 1) * p


def _sync_cost(n: dict, p: int, v: int, m: int) -> tuple[float, float, float]:
    """(added device syncs, host refill ms per sync, ms/step) of going from v to 2v chunks.
    Megatron's batch_p2p_sync (default on) ends every exchange in a device sync; the share of
    exchanges that did so is read off the profile (device syncs per step / exchanges). After a
    sync the GPU runs dry until the host issues again: the refill cost per sync is the base's
    idle after syncs and for late launches over all its host syncs."""
    syncs, device = n.get("host_syncs_per_step"), n.get("device_syncs_per_step")
    if not syncs or device is None:
        return 0.0, 0.0, 0.0
    share = min(1.0, float(device) / _exchanges(p, v, m))
    added = (_exchanges(p, 2 * v, m) - _exchanges(p, v, m)) * share
    refill = (float(n.get("idle_launch_ms") or 0.0) + float(n.get("idle_sync_ms") or 0.0)) / float(syncs)
    return added, refill, added * refill


def interleave(n: dict) -> Gain | None:
    """v -> 2v virtual stages: the schedule bubble falls to the 2v share; stage imbalance stays;
    each activation crosses stages twice as often, so the p2p part doubles; the added exchanges
    each cost the host a device sync and a refill (``_sync_cost``)."""
    s = _split(n)
    if s is None:
        return None
    bubble, schedule, imbalance, p2p, p, v, m = s
    saved = schedule * (1 - _theory(p, 2 * v, m) / _theory(p, v, m))
    added, refill, sync_ms = _sync_cost(n, p, v, m)
    est = saved - p2p - sync_ms
    # low: where the GPU already waits for launches the bubble saving goes into longer waits
    # (a host-bound pipeline's bubble is its hosts' lateness): nothing saved, every cost paid
    launch = float(n.get("idle_launch_ms") or 0.0)
    return gain("pp_interleave", est, min(est - p2p - launch, -p2p - sync_ms), saved, bubble,
                f"schedule bubble {schedule:.1f} of the measured {bubble:.1f} ms/step falls by {saved:.1f} "
                f"(VPP {v}->{2 * v}, p={p}, m={m}); the p2p part {p2p:.1f} doubles; imbalance {imbalance:.1f} stays; "
                f"{added:.1f} more device syncs per step x {refill:.2f} ms host refill = {sync_ms:.1f}")


def more_microbatches(n: dict) -> Gain | None:
    """Twice the micro-batches of the same size: the fill/drain, (p-1) slots, is paid once per
    2m instead of once per m, and so are the once-per-step DP gradient reduction and optimizer
    kernels: per the base step's work they halve. The p2p part and imbalance stay.
    High end: the imbalance too, and the launch-late idle, were all the host's lateness
    once-per-step work (optimizer and schedule set-up launches), which also halves per the
    base's work; the GPU-side estimate counts none of it."""
    s = _split(n)
    if s is None:
        return None
    bubble, schedule, imbalance, p2p, p, v, m = s
    fixed = float(n.get("exposed_dp_ms") or 0.0) + float(n.get("per_step_kernel_ms") or 0.0)
    launch = float(n.get("idle_launch_ms") or 0.0)
    return gain("pp_more_microbatches", (schedule + fixed) / 2.0, schedule / 2.0,
                (schedule + imbalance + fixed + launch) / 2.0, bubble + fixed + launch,
                f"half the schedule bubble {schedule:.1f} (of the measured {bubble:.1f}) and of the once-per-step "
                f"DP reduction and optimizer kernels {fixed:.1f} ms/step, per the base step's work (p={p}, m={m} -> {2 * m})")


def bubble_growth(n: dict, k: float) -> tuple[float, str]:
    """(ms/step, basis) the schedule bubble grows by when each micro-batch grows k times at the same
    work per step: m/k micro-batches of k times the work, so each fill/drain slot, the time one
    micro-batch takes on a stage, lasts up to k times as long, and the bubble, (p-1)/v slots, up
    to k times the measured schedule share. (0, "") off a pipeline. Where the host paces a slot
    (the same launches per micro-batch, whatever its size), the slot keeps its length: the high
    end of the fix's range counts no growth."""
    s = _split(n)
    if s is None or k <= 1.0:
        return 0.0, ""
    _, schedule, _, _, p, v, m = s
    grow = (k - 1.0) * schedule
    return grow, (f"; on the pipeline (p={p}, m={m} -> {m / k:g}) each fill/drain slot is up to {k:g}x longer: "
                  f"the schedule bubble {schedule:.1f} grows by {grow:.1f} ms/step")


def pipelined(n: dict) -> bool:
    """Whether the pipeline numbers are there for a pipelined job (the fixes' fact)."""
    return n.get("pp_bubble_ms") is not None and (n.get("pp_stages") or 1) > 1


PP_GAINS = {"pp_interleave": interleave, "pp_more_microbatches": more_microbatches}
