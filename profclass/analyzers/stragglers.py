"""Analyzer: stragglers, the ranks the others wait for.

The communication analyzer blames each matched collective's delay (last arrival minus the
median arrival) on the last arriver. A rank is a straggler when it causes most of that
delay, the delay is a sizeable share of the step and its peers really wait for it. Why it
is late (the wall it spends more time in than its peers) is classify's call; this module
words it.
"""
from __future__ import annotations

import numpy as np

from .gainmodel import Gain, gain
from .job import GpuRecord, Job, evidence_row
from .layout import Layout
from .protocol import Analyzer
from .results import RankComm

STRAGGLER_BLAME_SHARE = 0.5  # a straggler causes at least half of all blamed delay...
# ...costs at least this share of the step (corpus: balanced runs 5-10%, stragglers >= 22%)...
STRAGGLER_MIN_COST = 0.15
STRAGGLER_MIN_WAIT = 0.05  # ...and the others wait at least this share of the step for it
REASON_OF_WALL = {"compute": "imbalance", "host": "host", "memory": "memory"}


def find(recs: list[GpuRecord], comms: tuple[RankComm, ...]) -> list[dict]:
    """Blamed ranks, most blamed first: gpu (record index), blame_ms_per_step, blame_share,
    others_wait_ms_per_step. ``comms``: each GPU's ``RankComm`` (the communication stage)."""
    its = [r.iterations for r in recs]
    blame = np.array([c.blame_ns / it for c, it in zip(comms, its)], dtype=float)
    total = blame.sum()
    if total <= 0:
        return []
    steps = np.array([r.gpu.window[1] - r.gpu.window[0] for r in recs], float) / np.maximum(its, 1)
    step = np.median(steps)
    out = []
    for j in np.argsort(-blame):
        share = blame[j] / total
        others = [k for k in range(len(recs)) if k != j]
        waited = np.mean([comms[k].exposed_wait_ns / its[k] for k in others]) if others else 0
        if (share >= STRAGGLER_BLAME_SHARE and blame[j] >= STRAGGLER_MIN_COST * step
                and waited >= STRAGGLER_MIN_WAIT * step):
            out.append(dict(gpu=int(j), blame_ms_per_step=round(blame[j] / 1e6, 3),
                            blame_share=round(float(share), 3),
                            others_wait_ms_per_step=round(float(waited) / 1e6, 3)))
    return out


def straggler_rows(recs: list[GpuRecord], lay: Layout, blamed: list[dict],
                   late_walls: tuple[tuple[str, float], ...]) -> list[dict]:
    """The Diagnosis ``stragglers``; ``late_walls`` is classify's (wall, excess ns per step)
    of each blamed rank."""
    rows = []
    for s, (wall, excess) in zip(blamed, late_walls):
        g = recs[s["gpu"]].gpu
        rows.append(dict(pid=g.pid, device=g.device, rank=g.rank, reason=_reason(recs, lay, s["gpu"], wall),
                         detail=_detail(recs, s["gpu"], wall, excess),
                         cost_ms_per_step=s["blame_ms_per_step"],
                         others_wait_ms_per_step=s["others_wait_ms_per_step"],
                         blame_share=s["blame_share"]))
    return rows


def _reason(recs: list[GpuRecord], lay: Layout, j: int, wall: str) -> str:
    """The wall's reason; a compute straggler is an expert *routing* imbalance only where
    experts are split over ranks (EP > 1, or EP unknown) and most of its extra compute is
    GEMMs (the experts' work), else a slower rank ("compute": a different stage, a slower GPU)."""
    reason = REASON_OF_WALL[wall]
    if reason != "imbalance":
        return reason
    me, others = recs[j], [r for k, r in enumerate(recs) if k != j]
    extra = me.analysis.compute.compute_ns / me.iterations - \
        float(np.median([r.analysis.compute.compute_ns / r.iterations for r in others]))
    extra_gemm = me.analysis.compute.gemm_ns / me.iterations - \
        float(np.median([r.analysis.compute.gemm_ns / r.iterations for r in others]))
    in_gemms = extra <= 0 or extra_gemm >= 0.5 * extra
    return "imbalance" if _experts_split(lay) and in_gemms else "compute"


def _experts_split(lay: Layout) -> bool:
    """Whether experts may be split over ranks: EP > 1, or EP unknown."""
    ep = lay.size("ep") if lay is not None else None
    return ep is None or ep > 1


def _detail(recs: list[GpuRecord], j: int, wall: str, excess: float) -> str:
    me = recs[j]
    others = [r for k, r in enumerate(recs) if k != j]
    if wall == "compute":
        med_gemm = float(np.median([r.analysis.compute.gemm_ns / r.iterations for r in others]))
        return (f"{excess / 1e6:.1f} ms/step more compute than its peers' median, "
                f"{me.analysis.compute.gemm_ns / me.iterations / 1e6:.1f} vs {med_gemm / 1e6:.1f} ms/step "
                f"of GEMMs (expert load / routing imbalance)")
    if wall == "host":
        med_idle = float(np.median([r.analysis.idle.idle_ns / r.iterations for r in others]))
        return (f"host-bound: {excess / 1e6:.1f} ms/step more GPU idle than its peers "
                f"({me.analysis.idle.idle_ns / me.iterations / 1e6:.1f} vs {med_idle / 1e6:.1f} ms/step)")
    return f"memory: {excess / 1e6:.1f} ms/step more recompute/allocator/offload time than its peers"


# ---------------------------------------------------------------------------------------------
# job level

# fix gain ceilings (ms per step) from the job numbers; see docs/fixes.md
def _balance(n: dict) -> Gain:
    """Routing balance spreads the straggler's excess E over all n ranks: the others each waited
    E (the sum of waits is (n-1)E), the step shrinks by E - E/n = sum/n."""
    w, k = n["straggler_wait_ms"], max(n["gpus"], 2)
    # low: half, or nothing where the profile calls the straggler host-bound (routing may not be why)
    low = w / (2 * k) if n["straggler_reason"] == "imbalance" else 0.0
    if n["straggler_reason"] is None:
        # no rank is late step after step, but learned routing can overload a different rank in
        # each layer: every EP sync then waits for that layer's busiest rank. Balanced routing
        # brings each segment's work to the members' mean, saving the measured spread; the
        # ranks' EP waiting (jitter included) bounds it from above
        spread, waited = n.get("ep_work_imbalance_ms") or 0.0, n.get("ep_wait_ms") or 0.0
        return gain("straggler_balance", spread, spread / 2, max(waited, spread), max(waited, spread),
                    f"no rank late step after step; the busiest EP rank's compute over the mean between "
                    f"EP syncs, {spread:.1f} ms/step (a moving routing imbalance); up to the "
                    f"{waited:.1f} ms/step the ranks wait for their EP peers")
    # high: up to all the ranks' waiting for their EP peers, as above. A straggler that the traced
    # window calls host-late can be host-late only under tracing (it slows the host 5-20%); without
    # the profiler the same waits follow routing (docs/notes.md: mcore_ep4_unbalanced realized
    # 76 ms/step untraced against 30 traced)
    host_late = n["straggler_reason"] == "host"
    waited = (n.get("ep_wait_ms") or 0.0) if host_late else 0.0
    high = max(w / (k - 1), waited)
    return gain("straggler_balance", w / k, low, high, max(w, high),
                f"others' summed wait {w:.1f} ms/step / {k} ranks (the excess spread over all)"
                + (f"; up to the {waited:.1f} ms/step the ranks wait for their EP peers (a host-late "
                   f"straggler may be late only under tracing)" if host_late else ""))


def _host(n: dict) -> Gain:
    """A host stall is removed, not spread: the step shrinks by the straggler's lateness."""
    w, k = n["straggler_wait_ms"], max(n["gpus"], 2)
    return gain("straggler_host", w / (k - 1), w / k, w / (k - 1), w,
                f"others' summed wait {w:.1f} ms/step / {k - 1} waiting ranks (its lateness)")


GAINS = {"straggler_balance": _balance, "straggler_host": _host}

def numbers(job: Job) -> dict:
    return dict(straggler_wait_ms=sum(s["others_wait_ms_per_step"] for s in job.stragglers), gpus=len(job.records),
                straggler_reason=job.stragglers[0]["reason"] if job.stragglers else None)


# a moving routing imbalance worth a fix: the EP work spread (matching.work_imbalance_ms)
# above this share of the step; balanced-routing runs measure 0.1-0.2% (docs/fixes.md)
ROUTING_IMBALANCE_MIN = 0.01


EP_IMBALANCE = "EP work imbalance"  # the evidence row of the EP work spread (``diff`` reads it back)


# a routing load balanced between two runs: the EP work spread (a share of the step) fell by at
# least this factor, to under ROUTING_IMBALANCE_MIN. Basis: balancing takes the routing part away
# and leaves the jitter (the corpus's force-balanced pairs fell x10-x25), while learned routing
# moves with the captured steps (one job's two captures, 1.19% and 0.52%: x2.3; docs/diff.md)
ROUTING_BALANCED_FALL = 4.0


def routing_balanced(before: float, after: float, reason_after: str | None) -> bool:
    """Whether a run balanced the routing load of another: its EP work spread ``after`` (a share
    of its step) is under ROUTING_IMBALANCE_MIN and at most 1/ROUTING_BALANCED_FALL of the
    other's ``before``, and none of its ranks is late for its token load."""
    return (reason_after != "imbalance" and after < ROUTING_IMBALANCE_MIN
            and after * ROUTING_BALANCED_FALL <= before)


def routing_uneven(reason: str | None, spread_ms: float, step_ms: float) -> bool:
    """Whether the routing load is measurably uneven: a rank late step after step for its token
    load (``reason`` "imbalance"), or an EP work spread of at least ROUTING_IMBALANCE_MIN of the
    step (``diff``'s ``balance:ep`` asks this of both sides, whatever else makes a rank late)."""
    return reason == "imbalance" or spread_ms >= ROUTING_IMBALANCE_MIN * step_ms


def facts(job: Job, numbers: dict) -> dict:
    reason = numbers["straggler_reason"]
    uneven = routing_uneven(reason, numbers.get("ep_work_imbalance_ms", 0.0), job.step_ms)
    # routing holds the step back where it is uneven and no rank is late for another reason
    # (a host-late straggler's waits are the host's: straggler_reason "host")
    moving = reason is None and _experts_split(job.layout)
    return dict(straggler_reason=reason, routing_imbalanced=uneven and (reason == "imbalance" or moving))


def evidence(job: Job, numbers: dict) -> list[dict]:
    spread = numbers.get("ep_work_imbalance_ms", 0.0)
    if not spread:
        return []
    return [evidence_row("compute", EP_IMBALANCE, spread, "ms/step",
                         "the busiest EP rank's compute over the mean between EP collectives (routing load)")]


ANALYZER = Analyzer(name="stragglers", about="the ranks the others wait for, and why they are late",
                    numbers=numbers, facts=facts, evidence=evidence, section="stragglers",
                    report=lambda job, numbers: job.stragglers, gains=GAINS)
