"""Megatron-Core's pipeline programs per stage (``megatron/core/pipeline_parallel/schedules.py``,
0.19): the op order of 1F1B and of the interleaved schedule, each stage's P2P calls between its
chunks, the NCCL kernels those calls launch, and from them the P2P mode a capture ran. The
pipeline analyzer reads the mode from the captured kernels; the replay (``replay/p2p_calls``)
runs the programs.

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

# an interleaved schedule's exchanges: batched calls that wait for both neighbours
# (batch_p2p_comm), or each tensor waited for where it is used (overlap_p2p_comm)
BATCHED, OVERLAPPED = "batched", "overlapped"


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
    return sum(1 if it[0] == "X" and mode == BATCHED else len(it[1]) + len(it[2])
               for it in program(p, v, m, s, mode, group) if it[0] in "XP")


def captured_p2p(p: int, v: int, m: int, stage: list, sendrecv_per_step: list[float]) -> str:
    """How an interleaved capture's exchanges ran: the mode whose calls' kernels
    (``kernels_per_step``) come closest to the GPUs' PP send/recv kernels per step. 1F1B's
    calls are batched whatever the configuration says."""
    if v < 2:
        return BATCHED

    def off(mode: str) -> float:
        return sum(abs(kernels_per_step(p, v, m, s, mode) - n)
                   for s, n in zip(stage, sendrecv_per_step))
    return min((BATCHED, OVERLAPPED), key=off)


# the largest VPP the exchange signature tries (Megatron splits a stage's layers into v chunks)
MAX_VPP = 8


def exchange_fits(p: int, stage: list, sendrecv_per_step: list[float]) -> list[tuple[int, int]]:
    """The (VPP, micro-batches) whose Megatron-Core programs launch the PP send/recv kernels each
    stage ran per step (``kernels_per_step``, batched or overlapped), every rank within a kernel
    (a window's edge may cut one), those closest to the counts; [] where none fits. Interleaved
    programs with equal chunks launch alike (PP 4: VPP 2 x 16 and VPP 4 x 6 both 41, 41, 39, 37),
    and on PP 2 as 1F1B with more micro-batches (VPP 2 x 4 and 1F1B x 10: 11 a stage)."""
    if p < 2 or not stage or None in stage:
        return []
    fits = []
    top = int(max(sendrecv_per_step)) + 2
    for v in range(1, MAX_VPP + 1):
        for mode in ((BATCHED,) if v == 1 else (BATCHED, OVERLAPPED)):
            # a stage's kernels grow with m: bisect for stage 0's count, then try the neighbours
            lo, hi = (1 if v == 1 else p), top
            if lo > hi:
                continue
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if kernels_per_step(p, v, mid, stage[0], mode) < sendrecv_per_step[0] - 1 else (lo, mid)
            for m in range(max(lo, 1 if v == 1 else p), min(lo + 3, top) + 1):
                off = [abs(kernels_per_step(p, v, m, s, mode) - n) for s, n in zip(stage, sendrecv_per_step)]
                if max(off) <= 1.0:
                    fits.append((sum(off), v, m))
    if not fits:
        return []
    best = min(f[0] for f in fits)
    return sorted({(v, m) for off, v, m in fits if off <= best + 1e-9})


def sizes_from_exchanges(p: int, stage: list, sendrecv_per_step: list[float],
                         chunks: int | None = None) -> tuple[int, int] | None:
    """(VPP, micro-batches) from the exchanges (``exchange_fits``): the one program that fits,
    else the one with ``chunks`` (VPP x micro-batches, the forward passes per step) among those
    that fit alike; None where none fits or the passes do not choose. A stage's exchange count
    is the schedule itself: it holds under full recompute, whose re-run forwards can make the
    forward passes misread (a misread count fits no program and chooses nothing)."""
    return chosen_size(exchange_fits(p, stage, sendrecv_per_step), chunks)


def chosen_size(fits: list[tuple[int, int]], chunks: int | None) -> tuple[int, int] | None:
    """Of ``exchange_fits``'s programs: the only one, else the only one with ``chunks``."""
    if len(fits) == 1:
        return fits[0]
    agree = [vm for vm in fits if chunks and vm[0] * vm[1] == chunks]
    return agree[0] if len(agree) == 1 else None
