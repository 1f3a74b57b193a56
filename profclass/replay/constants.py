"""The replay's constants, each with its basis (docs/replay.md repeats them)."""
from __future__ import annotations

# A replayed window holds the first steady iterations up to this many ops per GPU: a long
# capture's step is the same step again, and the replay's cost grows with its ops
# (bench/RESULTS.md, replay). 200k ops is 2-40 steps of the corpus's Megatron jobs.
MAX_TRACE_OPS = 200_000
# ... and at most this many iterations: the step repeats, so more iterations add cost, not
# fidelity; five keep the step-to-step variation a window shows (the corpus's windows hold 2-11)
MAX_TRACE_ITERATIONS = 5
# The GPU's typical launch latency and back-to-back stream gap: this low quantile of the
# measured values (the floor the hardware and driver reach when nothing else holds an op back);
# the balance transform takes the same quantile of an EP collective type's captured transfers as
# its latency floor (the time with next to nothing to move)
TYPICAL_QUANTILE = 0.10
# The binding edge of an op keeps its measured latency above the typical one up to these caps
# (ns); beyond them the op waited for something the graph does not hold (an untraced
# dependency), which the replay reports as unexplained instead of keeping it. Basis: on
# Hopper with CUPTI tracing, a kernel starts 3-30 us after its launch call begins when the
# queue is empty; back-to-back kernels on a stream start 1-5 us apart; an event-released op
# starts within a few us of the event; a blocking sync returns 5-50 us after its work ends
# (the host thread is woken); the corpus's distributions: docs/replay.md.
LATENCY_CAPS = {"launch": 50_000, "stream": 10_000, "event": 10_000, "wake": 50_000}
# A launch call blocks while the GPU's queue of launched, unfinished work is full, and returns
# when an op ends and frees a slot: that time is a wait on the GPU, not host work. A launch is
# taken as blocked there when, at its start, the GPU's pending ops (launched, not ended) were at
# least this share of the window's most, that most was at least QUEUE_MIN_DEPTH, and an op ended
# inside the call. Basis: on the lent H200s (driver 580) a GPU-bound stage's launches that took
# over 100 us all began with 1,015-1,022 ops pending (the window's most), and returned a median
# 7 us after an op's end (p95 13 us; call AT's captures, docs/notes.md); the queue holds about a
# thousand ops, so a window that never had half of that pending never filled it.
QUEUE_FULL_SHARE = 0.95
QUEUE_MIN_DEPTH = 512
# A host thread idle this long while another thread's call ended was waiting for that thread
# (the autograd engine's device thread for the main thread's backward(), and back): longer
# than the CPU time between two launches of one thread (median 10-40 us in the corpus's
# host-bound captures), shorter than a layer's Python
THREAD_WAIT_NS = 200_000
# What CUDA tracing (CUPTI's callbacks and activity records under nsys 2024.2.3 -t cuda) adds
# to each traced API call on the host, ns (low, best, high). It depends on the host. Per host and
# probe, the median of the traced runs' per-call medians less the untraced runs' (raw lines packed
# in fixtures/timers.tar.xz; tests/test_tracing_cost.py derives this line from them). "launch"
# (any call that puts work on the GPU): an H100 host 2.59 us (cupti_cost.py: a launch 2.47, a
# copy 2.71); an H200 host 5.24 (cupti_cost.py 3.93 and 5.24, gap_cost.py's bare launch 6.50);
# another H200 host 7.18 (sync_cost.py's launch after a sync). "other" (an event record, a
# stream wait): the H100 host 1.26, the H200 host 2.11. The export does not say which host it
# ran on (a VM's CPU reads the same on every lent machine): best is the median host (launch) or
# the hosts' mean (other), low and high the hosts' extremes, to 0.1 us; the untraced step takes
# the best value off each call.
TRACED_CALL_NS = {"launch": (2_600, 5_200, 7_200), "other": (1_300, 1_700, 2_100)}
# What CUDA tracing adds to the GPU's own time on a job the GPU paces, as a share of each compute
# kernel's traced duration (low, best, high). Inside one process, the traced steps of a job whose
# replayed step the host's per-call cost does not move (under 0.5%) ran 0.97-2.90% longer than its
# untraced steps before the capture range (nine two- and one-GPU Megatron-Core captures of
# calls AT, AV, BD and BH: dense PP 2, VPP 2 batched and overlapped, TP 2 + SP, DP 2, EP 2 MoE and
# three one-GPU stages; tests/test_tracing_cost.py derives this line from their packed logs).
# Per kernel that is 1.4-4.5 us, and it grows with the kernels' mean length (longer kernels, a
# longer last wave that the next kernel no longer starts under while CUPTI timestamps each one):
# a share fits the nine closer than a per-kernel cost. best is their median, low and high their
# extremes; the untraced step takes the best share off every compute kernel.
GPU_TRACED_SHARE = (0.0097, 0.0127, 0.029)
# Where CUDA tracing's per-call cost (with its GPU share) took at least this share off the traced
# step, the replay's untraced step is taken for an upper bound and the report says so. Basis: the
# same-machine calls' bases, replayed untraced when priced and run untraced on that machine in the
# same lease (workloads/untraced_same_machine.py): of the 30 bases the per-call cost moved by less
# than 2%, 29 replayed within 5% of their timer (median timer/replay 1.00); of the 37 it moved by 2%
# or more, 8 did and 26 ran over 5% faster (median 0.89): tracing slows such a host by more than its
# per-call cost, and by no constant (tests/test_untraced_same_machine.py derives both counts). Held
# out (calls LA-MK, made after this was set): of 26 such bases 11 ran over 5% faster, 11 within, 4
# over 5% slower (median 0.98; docs/replay.md, "Held out"): the direction holds, the size does not.
UNTRACED_CAVEAT_SHARE = 0.02
# How much slower (or faster) the host that banks a fix's gain may run than the captured one
# replayed without the profiler, as a factor on every host call's and CPU gap's time (slow, fast):
# a fix's range holds its best transform at both ends. The job that banks the gain runs on
# another machine, or on the same one minutes later, and a host-paced job's step moves with its
# host. Basis: the profiler probe (timers/profcost: three host-paced Megatron configs of the
# corpus, each run untraced twice on one 4x H100 machine minutes apart): their steps differed by
# up to 1.30x (`pp4_m8`, iterations 5..9: 418.8 and 543.1 ms); the range is its square root either
# way, to 0.01 (tests/test_tracing_cost.py derives it from the logs). On a GPU-paced job the factor
# moves nothing. Where the capture's host probe is read the range reaches the corpus's hosts
# (run.host_range), never narrower than this.
HOST_SPEED = (1.14, 0.88)
