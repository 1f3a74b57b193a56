"""The input pipeline's fixes on the replay's graph (the ``host_input`` transform): loader workers
take the batch's building off the training thread, pinned memory takes the blocking out of its
copies. Both act on the window's input copies (``Ops.input``: host-to-device copies that are no
offload, ``idle.copy_roles``) and the host calls around them.

With workers the batch still has to be taken off the workers' queue: by PyTorch's pin thread
where the loader pins (Megatron-LM's does), else by the training thread itself.

Where the batch is built: a loader without workers builds it on the training thread, between
the step's last CUDA call and the first copy of the batch (decoding, packing and masks are CPU
work that calls no CUDA API). So it is the CPU time before the batch's copy calls: the gap
before the call, or, where the thread had waited for the autograd thread's backward and was
woken (a hand-off, ``host_calls._thread_waits``), the hand-off's lag. The part of it beyond the
thread's typical gap (or typical hand-off lag, from hand-offs that lead to no input copy) is the
loader's work.

A pageable copy blocks: PyTorch copies a pageable tensor with cudaMemcpyAsync through the
driver's staging buffer and then synchronises the stream, so the host waits for every queued
kernel and the copy, and the GPU drains. From pinned memory with ``non_blocking=True`` the copy
is a DMA queued like a kernel: no sync, and a launch's host time.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .host_calls import LAUNCH
from .trace import PAGEABLE, PINNED, GpuTrace


def input_calls(t: GpuTrace, which: tuple = (PINNED, PAGEABLE)) -> tuple[np.ndarray, np.ndarray]:
    """(launches, syncs): per host call, whether it launched an input copy of the memory kinds
    ``which`` (``trace.PINNED``, ``trace.PAGEABLE``), and whether it blocked waiting for one."""
    if t.ops.input is None:
        n = len(t.calls.c_start)
        return np.zeros(n, bool), np.zeros(n, bool)
    return _calls_of(t, np.isin(t.ops.input, which))


def _calls_of(t: GpuTrace, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(launches, syncs) per host call: it launched an op of ``sel``, it blocked waiting for one."""
    n = len(t.calls.c_start)
    launches, syncs = np.zeros(n, bool), np.zeros(n, bool)
    at = t.ops.launch[sel]
    launches[at[at >= 0]] = True
    tg = t.calls.c_target
    syncs[tg >= 0] = sel[tg[tg >= 0]]
    return launches, syncs


def loader_work(t: GpuTrace, gap: np.ndarray, lag: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per call, per hand-off): the CPU time before the input copies' calls beyond the thread's
    typical gap, and the lag of hand-offs that lead to one beyond a wake-up: the median lag of
    the hand-offs, of any thread, that lead to none (a hand-off's lag is the woken thread's
    latency plus its own work before its next call; none where every hand-off leads to one)."""
    launches, syncs = input_calls(t)
    on_input = launches | syncs
    typical = _thread_median(t.calls.c_tid, gap, np.ones(len(gap), bool))
    extra_gap = np.where(on_input, np.clip(gap - typical, 0, None), 0).astype(np.int64)
    dst = t.edges.h_dst
    h_in = on_input[dst]
    wake = float(np.median(lag[~h_in])) if (~h_in).any() else None
    extra_lag = np.where(h_in, np.clip(lag - wake, 0, None), 0).astype(np.int64) if wake is not None \
        else np.zeros(len(lag), np.int64)
    return extra_gap, extra_lag


def apply(spec, pick, point, traces, weights, ctx):
    """``dequeue``: the loader's work (``loader_work``) leaves the training thread (workers build
    the batch during the step before) but for ``dequeue`` ns a batch: taking it from the workers
    (unpickling it, receiving each tensor's shared memory) is the pin thread's work with
    ``pin_memory=True``, the training thread's without. ``copy``: the pageable input copies come
    from pinned memory: they no longer block the host (the copy's call and the stream sync after
    it), the copy's call keeps ``staging`` of its own time beyond a launch's (the host's copy into
    pinned memory, where the training thread pins; a loader's pin thread takes it off), and the
    DMA runs at ``copy`` of its time. ``mask``: the batch's attention mask is no longer built and
    copied on the host (``_mask_on_gpu``). None where the window holds no copy the fix acts on."""
    out, hit = [], False
    for t, w in zip(traces, weights):
        if "dequeue" in spec:
            kept = pick(spec["dequeue"], point)
            gap, lag = loader_work(t, w.c_gap, w.h_lag)
            hit |= bool(gap.any() or lag.any())
            # a batch's work sits before its first copy call, the calls after it hold a few us each
            w = replace(w, c_gap=w.c_gap - np.clip(gap - kept, 0, None).astype(np.int64),
                        h_lag=w.h_lag - np.clip(lag - kept, 0, None).astype(np.int64))
        if "copy" in spec:
            w, found = _pinned(t, w, pick(spec["copy"], point), pick(spec.get("staging", 0.0), point))
            hit |= found
        if "mask" in spec:
            w, found = _mask_on_gpu(t, w, pick(spec["mask"], point))
            hit |= found
        out.append(w)
    return out if hit else None


def _pinned(t: GpuTrace, w, factor: float, staging: float):
    launches, syncs = input_calls(t, (PAGEABLE,))
    if not (launches.any() or syncs.any()):
        return w, False
    c = t.calls
    launch_ns = _thread_median(c.c_tid, w.c_dur, (c.c_kind == LAUNCH) & ~launches).astype(np.int64)
    own = np.where(launches, np.minimum(w.c_dur, launch_ns + staging * np.clip(w.c_dur - launch_ns, 0, None)), w.c_dur)
    copies = t.ops.input == PAGEABLE
    return replace(w, c_dur=np.where(syncs & ~launches, 0, own).astype(np.int64),
                   c_blocks=w.c_blocks & ~(launches | syncs),
                   op_dur=np.where(copies, (w.op_dur * factor).astype(np.int64), w.op_dur)), True


def _mask_on_gpu(t: GpuTrace, w, build: float):
    """The attention masks' copies leave: the DMA, its call's host time (a pageable copy's staging)
    and the syncs that waited for it; the attention kernel applies causality itself. Their build
    leaves too, ``build`` x the masks' share of the batch's input bytes x the loader's work before
    the batch: where the loader's work goes by the byte (packing, collating) the mask holds its
    byte share of it (``build`` 1), where the dataset caches the mask none but a collate (0)."""
    if t.ops.mask is None or not t.ops.mask.any():
        return w, False
    launches, syncs = _calls_of(t, t.ops.mask)
    gap, lag = loader_work(t, w.c_gap, w.h_lag)
    share = build * t.mask_bytes_share
    gone = launches | syncs
    return replace(w, c_gap=w.c_gap - (gap * share).astype(np.int64), h_lag=w.h_lag - (lag * share).astype(np.int64),
                   c_dur=np.where(gone, 0, w.c_dur).astype(np.int64), c_blocks=w.c_blocks & ~gone,
                   op_dur=np.where(t.ops.mask, 0, w.op_dur).astype(np.int64)), True


def _thread_median(tid: np.ndarray, values: np.ndarray, among: np.ndarray) -> np.ndarray:
    """Per call: the median of ``values`` over its thread's calls where ``among`` holds, 0 where
    the thread has none."""
    out = np.zeros(len(values))
    for one in np.unique(tid):
        mine = tid == one
        if (mine & among).any():
            out[mine] = np.median(values[mine & among])
    return out
