"""Megatron-Core's pipeline schedules simulated call by call: each stage runs its chunks'
compute and its P2P calls in the order of ``megatron/core/pipeline_parallel/schedules.py``
(0.19), and a call waits for the peers Megatron's NCCL calls wait for.

- **1F1B** (``forward_backward_pipelining_without_interleaving``) and the **interleaved schedule
  with batched exchanges** (``batch_p2p_comm``, Megatron-Core's ModelParallelConfig default):
  each call is one ``batch_isend_irecv``, one NCCL group whose kernel ends only when every peer
  it sends to or receives from has posted its matching call. The interleaved steady phase runs a
  chunk-forward and a chunk-backward, then one call that sends both outputs and receives both
  next inputs (``send_forward_backward_recv_forward_backward``): a stage waits for both
  neighbours before its next forward, even where that forward's input was ready long before.
- **The interleaved schedule with overlapped exchanges** (``overlap_p2p_comm``, Megatron-LM's
  and Megatron Bridge's default with VPP): in the steady phase each chunk posts its send and
  the next one's receive without waiting and waits for its own input right before it runs;
  warm-up and cool-down calls block as above. (The wait for the previous send to finish, which
  Megatron adds after each post, is left out: the peer's matching receive is posted by then
  unless the peer is a whole chunk behind.)

Per stage, the call count is one NCCL kernel per call: on the corpus's captures it matches the
PP send/recv kernels per step (1F1B: 11, 21, 19, 9 on PP 4 x 8 micro-batches; batched VPP 2: 25,
25, 23, 21). A tensor is sent where it has a consumer: a chunk's forward output to the next
stage (the last stage's to the first, one chunk on), a backward's input gradient to the stage
before.
"""
from __future__ import annotations

import numpy as np

from .schedule_order import Schedule, order, warmup


def _input(s: int, slot: tuple, p: int, v: int):
    """The tensor ``slot`` on stage ``s`` receives: (kind, producer stage, chunk, micro-batch)."""
    back, c, mb = slot
    if not back:
        if s > 0:
            return ("f", s - 1, c, mb)
        return ("f", p - 1, c - 1, mb) if c > 0 else None
    if s < p - 1:
        return ("b", s + 1, c, mb)
    return ("b", 0, c + 1, mb) if c < v - 1 else None


def _output(s: int, slot: tuple, p: int, v: int):
    """The tensor ``slot`` on stage ``s`` sends, None where nothing consumes it."""
    back, c, mb = slot
    if not back:
        return None if (s == p - 1 and c == v - 1) else ("f", s, c, mb)
    return None if (s == 0 and c == 0) else ("b", s, c, mb)


def program(p: int, v: int, m: int, s: int, mode: str = "batched", group: int | None = None) -> list[tuple]:
    """Stage ``s``'s items in Megatron-Core's order: ("C", slot) a chunk's compute; ("X", sends,
    recvs) a blocking batched call; ("P", sends, recvs) a call posted without waiting
    (overlapped isend/irecv); ("W", tensor) a wait for a tensor posted that way. Tensors are
    keys (kind, producer stage, chunk, micro-batch); calls with nothing to move are dropped, as
    Megatron's ``_communicate`` launches nothing for them."""
    slots = order(p, v, m, s, group)
    fwd = [sl for sl in slots if not sl[0]]
    bwd = [sl for sl in slots if sl[0]]
    inn = lambda sl: _input(s, sl, p, v)  # noqa: E731
    out = lambda sl: _output(s, sl, p, v)  # noqa: E731
    items = _one_f_one_b(fwd, bwd, warmup(p, v, m, s, group), inn, out) if v == 1 else \
        _interleaved(fwd, bwd, warmup(p, v, m, s, group), inn, out, overlap=mode != "batched")
    cleaned = []
    for it in items:
        if it[0] in "XP":
            sends, recvs = tuple(t for t in it[1] if t), tuple(t for t in it[2] if t)
            if sends or recvs:
                cleaned.append((it[0], sends, recvs))
        elif it[0] != "W" or it[1]:
            cleaned.append(it)
    return cleaned


def _one_f_one_b(fwd, bwd, warm, inn, out) -> list[tuple]:
    """``forward_backward_pipelining_without_interleaving``: recv_forward, forward, send_forward
    per warm-up micro-batch; recv_forward; per steady one, forward, send_forward_recv_backward,
    backward, send_backward_recv_forward (send_backward at the last); per cool-down one,
    recv_backward, backward, send_backward."""
    m = len(fwd)
    items: list[tuple] = []
    for i in range(warm):
        items += [("X", (), (inn(fwd[i]),)), ("C", fwd[i]), ("X", (out(fwd[i]),), ())]
    if warm < m:
        items.append(("X", (), (inn(fwd[warm]),)))
    for i in range(m - warm):
        last = i == m - warm - 1
        items += [("C", fwd[warm + i]), ("X", (out(fwd[warm + i]),), (inn(bwd[i]),)), ("C", bwd[i]),
                  ("X", (out(bwd[i]),), () if last else (inn(fwd[warm + i + 1]),))]
    for i in range(m - warm, m):
        items += [("X", (), (inn(bwd[i]),)), ("C", bwd[i]), ("X", (out(bwd[i]),), ())]
    return items


def _interleaved(fwd, bwd, warm, inn, out, overlap: bool) -> list[tuple]:
    """``forward_backward_pipelining_with_interleaving``: recv_forward; per warm-up
    chunk-forward, send_forward_recv_forward (the last also receives the first backward's
    gradient: in the same call when batched, posted on its own when overlapped); per steady
    pair, batched: forward, backward, send_forward_backward_recv_forward_backward; overlapped:
    each waits for its input, runs, and posts its send with the next one's receive; per
    cool-down backward, send_backward_recv_backward."""
    total = len(fwd)
    items: list[tuple] = [("X", (), (inn(fwd[0]),))]
    for k in range(warm):
        recvs = [inn(fwd[k + 1])] if k + 1 < total else []
        if k == warm - 1 and warm < total and not overlap:
            recvs.append(inn(bwd[0]))
        items += [("C", fwd[k]), ("X", (out(fwd[k]),), tuple(recvs))]
        if k == warm - 1 and warm < total and overlap:
            items.append(("P", (), (inn(bwd[0]),)))
    for k in range(total - warm):
        nf = (inn(fwd[warm + k + 1]),) if warm + k + 1 < total else ()
        if overlap:
            items += [("W", inn(fwd[warm + k])), ("C", fwd[warm + k]), ("P", (out(fwd[warm + k]),), nf),
                      ("W", inn(bwd[k])), ("C", bwd[k]), ("P", (out(bwd[k]),), (inn(bwd[k + 1]),))]
        else:
            items += [("C", fwd[warm + k]), ("C", bwd[k]),
                      ("X", (out(fwd[warm + k]), out(bwd[k])), nf + (inn(bwd[k + 1]),))]
    if warm == total:
        items.append(("X", (), (inn(bwd[0]),)))
    for k in range(total - warm, total):
        if overlap:
            items.append(("W", inn(bwd[k])))
        items += [("C", bwd[k]), ("X", (out(bwd[k]),), (inn(bwd[k + 1]),) if k + 1 < total else ())]
    return items


def calls_per_microbatch(p: int, v: int, m: int, s: int, mode: str = "batched", group: int | None = None) -> float:
    """The exchange calls stage ``s`` makes per micro-batch."""
    return sum(it[0] in "XP" for it in program(p, v, m, s, mode, group)) / m


def kernels_per_step(p: int, v: int, m: int, s: int, mode: str = "batched", group: int | None = None) -> int:
    """The NCCL kernels stage ``s``'s calls launch per step: one per batched call; without
    batching (the overlapped mode, blocking calls too) one per tensor, as Megatron's
    ``_p2p_ops`` issues each isend and irecv on its own."""
    return sum(1 if it[0] == "X" and mode == "batched" else len(it[1]) + len(it[2])
               for it in program(p, v, m, s, mode, group) if it[0] in "XP")


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
