"""The pipeline-schedule replay's inputs, measured on the capture (``measure``): per stage
of a pipelined job, its work per micro-batch, its once-per-step rest, the exchange's cost and the
idle its P2P device syncs leave (``Stages``); ``pipeline_schedule`` simulates Megatron-Core's
schedules from them. Per stage (mean over its ranks):

- U, its per-micro-batch work: the stage's busy time (compute and non-PP collectives) and its
  idle time (host gaps) per step, less its once-per-step rest and its host's pauses, over m.
  Idle inside a forward or backward is host pacing of that work: it stays with it;
- R, its once-per-step rest (optimizer, gradient reduction, embedding sync, data): the stretches
  between PP-group ops that hold the optimizer's kernels (``OPTIMIZER_KERNEL``), split at the
  step's PP all-reduce where there is one (the gradient norm's: every stage waits there for the
  others) into the part before and after it (on the first stage that rest also holds the step's
  last backward slot and the next step's first forward);
- x, the cost of one exchange: the PP send/recv kernel's floor (its 10th-percentile duration:
  the transfer when the peer is ready) plus the host's time from an exchange's end to the next
  compute kernel (a quantile of the measured gaps: ``exchange_quantile``);
- the collectors' pauses (``pause``): every GPU's, added, since each stalls the pipeline at its
  own moment (the two interleaved GPU-bound captures with a pause on two stages simulated 5%
  short with the pauses overlapped at the stages' meeting point, within 1% added);
- the P2P mode (batched, or overlapped: the pipeline analyzer's, ``pp_program.captured_p2p``)
  and the idle after the PP calls' device syncs (``sync_idle``), which an overlapped schedule
  does not have; its busy part of U (``busy``: overlapped kernels share the SMs with it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..analyzers.pp_program import BATCHED
from ..kernels import OPTIMIZER_KERNEL
from .trace import COMM, SYNC, GpuTrace

FLOOR_QUANTILE = 0.10  # the PP kernel's floor: the transfer when the peer is ready (as trace.TYPICAL_QUANTILE)
FB_RATIO = 2.0  # a backward's time over its forward's: twice the FLOPs (input and weight gradients)


@dataclass(frozen=True)
class Stages:
    """A pipelined job's measured schedule inputs, per stage (ns per step or per micro-batch)."""

    p: int
    v: int
    m: int
    work: np.ndarray  # U: per micro-batch, all chunks, the base's exchanges included
    rest: np.ndarray  # R: once per step
    floor: float  # the PP kernel's floor duration
    gaps: np.ndarray  # host time from a PP exchange's end to the next compute kernel (all stages)
    measured_step: float  # the job's measured step (mean over GPUs)
    gpu_stage: tuple = ()  # per GPU of the replay: its stage
    meet: bool = True  # the PP group all-reduces once a step: every stage waits there for the others
    rest_before_meet: np.ndarray | None = None  # per stage: the part of R before that all-reduce
    p2p: str = BATCHED  # how the capture's interleaved exchanges ran (1F1B's: BATCHED)
    sync_idle: np.ndarray | None = None  # per stage, ns per step: idle after P2P device syncs (not an overlapped job's)
    busy: np.ndarray | None = None  # per stage, ns per micro-batch: U's busy part (compute, non-PP collectives)
    layers: np.ndarray | None = None  # per stage: transformer layers per micro-batch (None: a count unknown)
    # ns per step, every GPU's collector pauses added: each stalls the whole coupled pipeline at
    # its own moment (the others wait for it at their next exchange or collective)
    pause: float = 0.0
    # per GPU of the replay: its PP-group ops (trace indices), and which stretches around them are
    # the rest (``rest_stretches``): where a graph fix's saving falls (``pipelined``)
    pp_ops: tuple = ()
    rest_mask: tuple = ()


def measure(traces: list[GpuTrace], pp_ops: list[np.ndarray], stage: list, p: int, v: int, m: int,
            busy_idle_ns: list[float], step_ns: list[float], meets: list[np.ndarray] | None = None,
            pause_ns: list[float] | None = None, p2p: str = BATCHED,
            busy_ns: list[float] | None = None) -> Stages | None:
    """Per stage U and R (mean over its ranks; R split at the stages' meeting point), the
    exchange's floor and the host gaps after exchanges. ``pp_ops``: per GPU, its PP-group ops
    (trace indices); ``meets``: per GPU, which of them are the step's PP all-reduce (None: no
    meeting); ``busy_idle_ns``: per GPU, its busy plus idle time per step (the pipeline
    analyzer's, no PP blocking in it); ``pause_ns``: per GPU, its host's pauses per step (the
    collector's: not work of every micro-batch: they leave U, added over the GPUs into
    ``pause``); ``busy_ns``: per GPU, its busy time per step."""
    if not p or p < 2 or not m or any(s is None for s in stage):
        return None
    work, pre, post, busy = np.zeros(p), np.zeros(p), np.zeros(p), np.zeros(p)
    n = np.zeros(p)
    floors, gaps = [], []
    pauses = pause_ns if pause_ns is not None else [0.0] * len(traces)
    refill = np.zeros(p)
    pause = 0.0
    masks = []
    for gi, (t, pp, s, bi, pz) in enumerate(zip(traces, pp_ops, stage, busy_idle_ns, pauses)):
        if len(pp) < 2 or t.iterations < 1:
            return None
        meet = meets[gi] if meets is not None else np.zeros(len(pp), bool)
        r_pre, r_post = _rest_gap(t, pp, meet)
        masks.append(rest_stretches(t, pp))
        pz = min(float(pz), max(bi - r_pre - r_post, 0.0))
        if s == 0:  # its rest stretch also holds the step's last backward slot and the next one's first forward
            u = (bi - pz - r_pre - r_post) / (m - 1.0 / v)
            f = u / (v * (1 + FB_RATIO))  # one chunk's forward (its share of the exchange cost aside)
            r_pre, r_post = (r_pre - FB_RATIO * f, r_post - f) if r_pre > 0 else (0.0, r_post - (1 + FB_RATIO) * f)
        else:
            u = (bi - pz - r_pre - r_post) / m
        pause += pz
        work[s] += u
        busy[s] += (busy_ns[gi] / m) if busy_ns is not None else 0.0
        pre[s] += r_pre
        post[s] += r_post
        n[s] += 1
        floors.append(t.ops.dur[pp])
        gaps.append(_gaps_after(t, pp))
        if p2p == BATCHED or v == 1:
            # a host ahead would not leave it, but a host slower than its GPU leaves its lag
            # anyway: no more than the stage's time above its host's own CPU time per step, all
            # its launching threads together (PyTorch's autograd thread issues the backward while
            # the main thread waits in backward(): they take turns)
            host = float(t.calls.c_gap.sum() + t.calls.c_dur.sum()) / t.iterations
            # (a collector's pause is a one-off stall the median sync leaves out: not subtracted
            # again, which zeroed the refill of every stage whose window held one)
            refill[s] += min(_idle_after_syncs(t, pp[~meet]), max(bi - host, 0.0))
    if (n == 0).any():
        return None
    sync_idle = refill / n
    pre, post = np.clip(pre / n, 0, None), np.clip(post / n, 0, None)
    return Stages(p=p, v=v, m=m, work=work / n, rest=pre + post,
                  floor=float(np.quantile(np.concatenate(floors), FLOOR_QUANTILE)),
                  gaps=np.concatenate(gaps), measured_step=float(np.mean(step_ns)), gpu_stage=tuple(stage),
                  meet=meets is not None, rest_before_meet=pre, p2p=p2p, busy=busy / n if busy_ns is not None else None,
                  sync_idle=sync_idle if p2p == BATCHED or v == 1 else None, pause=pause,
                  pp_ops=tuple(pp_ops), rest_mask=tuple(masks))


def _rest_gap(t: GpuTrace, pp: np.ndarray, meet: np.ndarray) -> tuple[float, float]:
    """ns per step with no PP exchange around the optimizer, (before, after) the stages' meeting
    point: the stretches between consecutive PP-group ops that hold an optimizer-step kernel
    (``OPTIMIZER_KERNEL``), over the steps they span; a stretch that ends at the step's PP
    all-reduce (``meet``: the gradient norm's, which every stage waits in) is before it. (The
    longest stretches are not the rest: on the last stage a micro-batch's forward and backward,
    on the first a backward and the next forward, run with no exchange between them and can
    outlast the optimizer's; nor are the window's head and tail: the window starts at an
    iteration mark, which can be any kernel of the step.) Without an optimizer kernel between
    two PP ops: the head and tail and the iterations - 1 longest stretches, all after."""
    s, ce, between, inner = _stretches(t, pp)
    if inner is not None:
        period = (t.hi - t.lo) / t.iterations

        def per_step(idx: np.ndarray) -> float:  # the stretches over the steps they span
            if not len(idx):
                return 0.0
            steps = int(round(float(ce[idx].max() - ce[idx].min()) / period)) + 1
            return float(between[idx].clip(0).sum()) / steps
        before = meet[inner + 1]
        return per_step(inner[before]), per_step(inner[~before])
    longest = np.sort(between)[::-1][:t.iterations - 1].clip(0).sum()
    return 0.0, float((s[0] - t.lo) + max(t.hi - ce[-1], 0) + longest) / t.iterations


def rest_stretches(t: GpuTrace, pp: np.ndarray) -> np.ndarray:
    """Which stretches around the PP-group ops ``pp`` are the rest that ``_rest_gap`` measures
    (bool, len(pp) + 1: before the first op, after op i - 1 up to op i, after the last)."""
    _, _, between, inner = _stretches(t, pp)
    mask = np.zeros(len(pp) + 1, bool)
    if inner is not None:
        mask[inner + 1] = True
    else:
        mask[0] = mask[-1] = True
        mask[np.argsort(between)[::-1][:t.iterations - 1] + 1] = True
    return mask


def _stretches(t: GpuTrace, pp: np.ndarray):
    """(PP op starts, their running end, the stretch after each op up to the next, the indices of
    those stretches that hold an optimizer kernel or None where none does)."""
    s = t.ops.start[pp]
    ce = np.maximum.accumulate(s + t.ops.dur[pp])
    between = s[1:] - ce[:-1]
    at = np.searchsorted(s, t.ops.start[_optimizer_ops(t)], side="right")
    inner = np.unique(at[(at > 0) & (at < len(pp))]) - 1  # stretch i: after PP op i
    return s, ce, between, (inner if len(inner) else None)




def _optimizer_ops(t: GpuTrace) -> np.ndarray:
    return t.ops_named(lambda n: any(k in n for k in OPTIMIZER_KERNEL))


def _idle_after_syncs(t: GpuTrace, pp: np.ndarray) -> float:
    """GPU idle per step after the host's device syncs on PP exchanges, as the median sync's
    idle times the syncs per step (a stall in one step is not a refill every sync pays):
    each stretch with no op on the GPU whose next op the host had not yet launched is put down
    to the last host sync that returned before it began; those whose sync waited for a PP
    send/recv count. (Megatron ends each batched
    P2P call with ``torch.cuda.synchronize()``: the GPU drains, and runs dry until the host
    has issued enough again.)"""
    c = t.calls
    sync = np.flatnonzero((c.c_kind == SYNC) & (c.c_target >= 0))
    if not len(sync) or t.iterations < 1:
        return 0.0
    ret = t.ops.start[c.c_target[sync]] + t.ops.dur[c.c_target[sync]] + c.c_wake[sync]
    on_pp = np.isin(c.c_target[sync], pp)
    order_ = np.argsort(ret, kind="stable")
    ret, on_pp = ret[order_], on_pp[order_]
    s = t.ops.start
    ce = np.maximum.accumulate(s + t.ops.dur)
    idle_from, idle_to = ce[:-1], s[1:]  # ops are sorted by start
    # a refill stretch ends at an op the host had not launched when the GPU ran dry; where the op
    # was already queued, the GPU waited for something else (probes 25 and 25b, docs/notes.md: 510 us
    # after every softmax backward, alike batched and overlapped, its next kernel queued 4 and 68 ms
    # ahead), which the syncs do not cause. Ops with no launch call in the window count as refill
    li = t.ops.launch[1:]
    known = li >= 0
    launched = np.full(len(li), np.iinfo(np.int64).max)
    launched[known] = c.c_start[li[known]] + c.c_dur[li[known]]
    keep = (idle_to > idle_from) & (launched > idle_from)
    idle_from, idle_to = idle_from[keep], idle_to[keep]
    last = np.searchsorted(ret, idle_from, side="right") - 1
    after_pp = (last >= 0) & on_pp[np.maximum(last, 0)]
    per_sync = np.bincount(last[after_pp], weights=(idle_to - idle_from)[after_pp], minlength=len(ret))[on_pp]
    if not len(per_sync):  # no sync waited for a PP send/recv: no refill (the median of none is NaN)
        return 0.0
    return float(np.median(per_sync)) * len(per_sync) / t.iterations


def _gaps_after(t: GpuTrace, pp: np.ndarray) -> np.ndarray:
    """Per exchange: from its end to the next compute kernel's start on the GPU (ns)."""
    comp = np.flatnonzero(t.ops.kind != COMM)
    cs = t.ops.start[comp]
    e = t.ops.start[pp] + t.ops.dur[pp]
    at = np.searchsorted(cs, e)
    ok = at < len(cs)
    return (cs[at[ok]] - e[ok]).astype(np.float64)
