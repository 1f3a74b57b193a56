"""Megatron-Core's pipeline schedules simulated call by call: each stage runs its program
(``analyzers/pp_program``: its chunks' compute and its P2P calls in Megatron's order) and a
call waits for the peers Megatron's NCCL calls wait for."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..analyzers.pp_program import program


@dataclass(frozen=True)
class Schedule:
    start: np.ndarray  # per stage: its first slot's start
    end: np.ndarray  # per stage: its last slot's end (its rest's, with a rest)
    busy: np.ndarray  # per stage: its slots' time
    first: np.ndarray  # per stage and step: the step's first slot's start


def simulate(p: int, v: int, m: int, f_comp, b_comp, x: float, floor: float = 0.0, mode: str = "batched",
             group: int | None = None, pre=None, post=None, meet: bool = False, steps: int = 1) -> Schedule:
    """``steps`` back-to-back steps: ``f_comp`` / ``b_comp`` per stage, one chunk's compute;
    ``x`` (per stage, or one for all) a blocking exchange once its peers are there. A blocking
    call is posted when its stage is free and ends ``x`` after the last of it and its peers'
    matching calls is posted; a posted call costs its GPU nothing (the host is ahead: nothing
    synchronizes it) and does not wait; a wait for a tensor ends ``floor`` (the transfer) after
    its sender's call was posted. After its last item a stage runs its rest (``pre`` + ``post``);
    with ``meet`` the stages meet between them (the PP group's all-reduce: each waits for every
    stage's ``pre``)."""
    one = [program(p, v, m, s, mode, group) for s in range(p)]
    x = np.broadcast_to(np.asarray(x, float), (p,))
    rest = (np.zeros(p) if pre is None else pre, np.zeros(p) if post is None else post)
    items = [[(k, it) for k in range(steps) for it in one[s] + [("pre",), ("post",)]] for s in range(p)]
    sender, receiver = {}, {}  # (step, tensor) -> (stage, item index) of the call sending / receiving it
    for s in range(p):
        for i, (k, it) in enumerate(items[s]):
            if it[0] in "XP":
                sender.update({(k, t): (s, i) for t in it[1]})
                receiver.update({(k, t): (s, i) for t in it[2]})
    state = dict(posted={}, ready={}, first=np.full((p, steps), np.nan), free=[0.0] * p, busy=np.zeros(p))
    pos = [0] * p
    left = sum(len(o) for o in items)
    while left:
        moved = False
        for s in range(p):
            while pos[s] < len(items[s]) and _advance(s, pos[s], items[s][pos[s]], state, sender, receiver,
                                                     rest, meet, p, x, floor, f_comp, b_comp):
                pos[s] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError(f"schedule deadlock at p={p}, v={v}, m={m}")
    first, free, busy = state["first"], state["free"], state["busy"]
    return Schedule(start=first[:, 0], end=np.array(free), busy=busy, first=first)


def _advance(s: int, i: int, item: tuple, state: dict, sender: dict, receiver: dict, rest, meet: bool,
             p: int, x: float, floor: float, f_comp, b_comp) -> bool:
    """Run stage ``s``'s item ``i`` if it can run now; False where it waits for another stage."""
    k, it = item
    kind, posted, free = it[0], state["posted"], state["free"]
    if kind == "pre":
        state["ready"][(s, k)] = free[s] = free[s] + float(rest[0][s])
    elif kind == "post":
        ready = state["ready"]
        if meet and any((r, k) not in ready for r in range(p)):
            return False
        free[s] = max([free[s]] + ([ready[(r, k)] for r in range(p)] if meet else [])) + float(rest[1][s])
    elif kind == "X":
        posted[(s, i)] = free[s]
        peers = [receiver[(k, t)] for t in it[1]] + [sender[(k, t)] for t in it[2]]
        if any(q not in posted for q in peers):
            return False
        free[s] = max([free[s]] + [posted[q] for q in peers]) + float(x[s])
    elif kind == "P":
        posted[(s, i)] = free[s]
    elif kind == "W":
        q = sender[(k, it[1])]
        if q not in posted:
            return False
        free[s] = max(free[s], posted[q] + floor)
    else:
        if np.isnan(state["first"][s, k]):
            state["first"][s, k] = free[s]
        dur = float(b_comp[s] if it[1][0] else f_comp[s])
        free[s] += dur
        state["busy"][s] += dur
    return True
