"""Gain models of the pipeline-schedule fixes: interleaving (VPP) and more micro-batches.

They price from the pipeline numbers the layout analyzer measures (``pp_bubble_ms``,
``pp_stages``, ``pp_virtual_stages``, ``pp_microbatches``, ``exposed_pp_ms``,
``stage_imbalance_ms``); read with ``.get`` so a profile (or a build) without them gets no
number rather than a guess. Models: docs/fixes.md ("Gain models").
"""
from __future__ import annotations

from .gainmodel import Gain, gain


def _bubble(n: dict) -> tuple[float, float, float, int] | None:
    """(bubble, stage imbalance, exposed p2p) ms/step and the virtual stages, or None."""
    bubble, v = n.get("pp_bubble_ms"), n.get("pp_virtual_stages")
    if bubble is None or not n.get("pp_stages") or n["pp_stages"] < 2:
        return None
    return float(bubble), float(n.get("stage_imbalance_ms") or 0.0), float(n.get("exposed_pp_ms") or 0.0), int(v or 1)


def interleave(n: dict) -> Gain | None:
    """Doubling the virtual stages (v -> 2v) divides the schedule bubble by 2, but not the part
    that is stage imbalance, and sends each activation 2x as often (the exposed p2p doubles)."""
    b = _bubble(n)
    if b is None:
        return None
    bubble, imbalance, p2p, v = b
    schedule = max(bubble - imbalance, 0.0)
    est = schedule / 2.0 - p2p
    # low: the extra p2p fully exposed on top (host-bound jobs also launch 2x the p2p calls)
    return gain("pp_interleave", est, est - p2p, bubble / 2.0, bubble,
                f"bubble {bubble:.1f} minus stage imbalance {imbalance:.1f}, halved for VPP {v}->{2 * v}, "
                f"minus the added p2p {p2p:.1f} ms/step")


def more_microbatches(n: dict) -> Gain | None:
    """Twice the micro-batches (the same work per micro-batch): the bubble, (p-1) micro-batch
    slots, is paid once per 2m instead of once per m; per the base step's work it halves."""
    b = _bubble(n)
    if b is None:
        return None
    bubble, imbalance, _, _ = b
    schedule = max(bubble - imbalance, 0.0)
    return gain("pp_more_microbatches", schedule / 2.0, schedule / 2.0, bubble / 2.0, bubble,
                f"half the bubble {bubble:.1f} ms per base step's work (stage imbalance {imbalance:.1f} stays)")


PP_GAINS = {"pp_interleave": interleave, "pp_more_microbatches": more_microbatches}
