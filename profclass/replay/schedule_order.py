"""Megatron-Core's pipeline op order per stage, and a simulated schedule's result (shared by
pipeline_schedule and the call-by-call simulation, p2p_calls)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def warmup(p: int, v: int, m: int, rank: int, group: int | None = None) -> int:
    """Stage ``rank``'s warm-up (chunk-)forwards, before its first backward."""
    if v == 1:
        return min(p - rank - 1, m)
    return min((p - rank - 1) * 2 + (v - 1) * (p if group is None else group), m * v)


def order(p: int, v: int, m: int, rank: int, group: int | None = None) -> list[tuple[bool, int, int]]:
    """Stage ``rank``'s slots in Megatron-Core's order: (is backward, model chunk, micro-batch)."""
    g = p if group is None else group
    warm = warmup(p, v, m, rank, group)
    if v == 1:
        fwd = [(False, 0, i) for i in range(m)]
        bwd = [(True, 0, i) for i in range(m)]
    else:
        table = []
        for lo in range(0, m, g):
            hi = m if lo + g >= m else lo + g
            table += [(mb, c) for c in range(v) for mb in range(lo, hi)]
        fwd = [(False, c, mb) for mb, c in table]
        bwd = [(True, v - 1 - c, mb) for mb, c in table]
    out = fwd[:warm]
    for k in range(len(fwd) - warm):
        out += [fwd[warm + k], bwd[k]]
    return out + bwd[len(fwd) - warm:]


@dataclass(frozen=True)
class Schedule:
    start: np.ndarray  # per stage: its first slot's start
    end: np.ndarray  # per stage: its last slot's end (its rest's, with a rest)
    busy: np.ndarray  # per stage: its slots' time
    first: np.ndarray  # per stage and step: the step's first slot's start
