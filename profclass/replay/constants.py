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
# A host thread idle this long while another thread's call ended was waiting for that thread
# (the autograd engine's device thread for the main thread's backward(), and back): longer
# than the CPU time between two launches of one thread (median 10-40 us in the corpus's
# host-bound captures), shorter than a layer's Python
THREAD_WAIT_NS = 200_000
# What CUDA tracing (CUPTI's callbacks and activity records under nsys 2024.2.3 -t cuda) adds
# to each traced API call on the host, ns (low, best, high). It depends on the host: per host, the
# traced minus untraced median per call, from fixtures/workloads/cupti_cost.py (loops of 20,000
# calls), gap_cost.py (3,000 launches with and without host work between) and sync_cost.py (the
# launch after a sync); raw lines in fixtures/timers.tar.xz. A kernel launch ("launch": any call
# that puts work on the GPU): an H100 host +2.0 / +3.0 us (cupti_cost, two runs: 2.5); an H200
# host +3.9 (cupti_cost) and +6.5 (gap_cost), 5.2; another H200 host +7.1 (sync_cost's next
# launch). Best: the median host, 5.2 us; low and high the hosts' extremes. An event record or
# stream wait ("other"): the H100 host +1.05 to +1.48 us (1.26), the H200 host +2.0 to +2.2
# (2.1); best their mean. The export does not say which host it ran on (a VM's CPU reads the
# same everywhere), so the untraced step takes the best value off each call; the low and high
# bound its range.
TRACED_CALL_NS = {"launch": (1_970, 5_200, 7_100), "other": (1_050, 1_700, 2_200)}
