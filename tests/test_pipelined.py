"""A graph fix on a pipelined job priced on Megatron-Core's schedule (profclass/replay/pipelined.py),
the schedule's sizes read from each stage's PP exchanges (pp_program.sizes_from_exchanges), and
recompute off leaving the pipeline's exchanges alone: on the corpus's real pipelined captures."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from profclass.analyzers import pp_program
from profclass.replay import pipeline_schedule as ps
from profclass.replay import pipelined, transforms
from profclass.replay.run import Replayer
from profclass.replay.trace import COMPUTE

# committed pipelined captures with their (VPP, micro-batches) from the workload's flags or config
SIZED = {"mcore_gb_pp4s_m8": (1, 8), "mcore_gb_pp4s_vpp2_m8": (2, 8), "mcore_wrapped_dense_tp2_pp2": (1, 4),
         "mcore_pp2_ep2_m4": (1, 4)}


@pytest.mark.parametrize("name", sorted(SIZED))
def test_the_exchanges_give_the_schedule_sizes(diagnosis, name):
    """Each stage's PP send/recv kernels per step are the program Megatron-Core runs: they give
    (VPP, m) back, with the forward passes' chunks where interleaved programs of equal chunks
    launch alike, and alone where one plain 1F1B program fits."""
    d = diagnosis(name)
    rows = d.extra.replay_inputs.pipeline.per_stage
    p = d.extra.replay_inputs.pipeline.stages
    stage, counts = [r["stage"] for r in rows], [r["sendrecv_per_step"] for r in rows]
    v, m = SIZED[name]
    assert pp_program.sizes_from_exchanges(p, stage, counts, chunks=v * m) == (v, m), counts
    if v == 1:
        assert pp_program.sizes_from_exchanges(p, stage, counts) == (1, m), counts


def test_interleaved_programs_of_equal_chunks_stay_undecided_without_the_passes():
    """PP 4: VPP 2 x 16 micro-batches and VPP 4 x 6 launch the same kernels per stage (41, 41,
    39, 37): without the forward passes' chunks no size is given."""
    counts = [pp_program.kernels_per_step(4, 2, 16, s) for s in range(4)]
    assert counts == [pp_program.kernels_per_step(4, 4, 6, s) for s in range(4)]
    assert pp_program.sizes_from_exchanges(4, [0, 1, 2, 3], counts) is None
    assert pp_program.sizes_from_exchanges(4, [0, 1, 2, 3], counts, chunks=32) == (2, 16)
    assert pp_program.sizes_from_exchanges(4, [0, 1, 2, 3], [c + 5 for c in counts]) is None  # no program
    # PP 2: VPP 2 x 4 launches 11 a stage, as 1F1B x 10 does (probe 24's flagless interleaved
    # recompute jobs, whose passes misread): the layout leaves both sizes undetermined there
    assert {(1, 10), (2, 4)} <= set(pp_program.exchange_fits(2, [0, 1], [11, 11]))
    assert pp_program.sizes_from_exchanges(2, [0, 1], [11, 11]) is None
    assert pp_program.sizes_from_exchanges(2, [0, 1], [11, 11], chunks=8) == (2, 4)


def _replayer(diagnosis, name: str) -> Replayer:
    return Replayer(diagnosis(name).extra.replay_inputs)


def test_a_saving_on_every_microbatch_saves_every_slot_of_the_pipeline(diagnosis):
    """1F1B's step is m + p - 1 slots of the busiest stage plus the rest: taking delta off every
    stage's work per micro-batch (all of it in the work) shortens the simulated step by about
    (m + p - 1) delta, where the graph, its PP waits frozen, sees m delta; all of it in the rest,
    by delta once."""
    r = _replayer(diagnosis, "mcore_gb_pp4s_m8")
    st = r.untraced_stages
    x = ps.exchange_cost(st, 0.5)
    base = ps.step_ns(st, st.v, st.m, x)
    delta = 2e6  # ns per micro-batch
    saved = np.full(st.p, delta * st.m)
    in_work = base - ps.step_ns(ps.less_time(st, saved, np.ones(st.p)), st.v, st.m, x)
    assert in_work == pytest.approx((st.m + st.p - 1) * delta, rel=0.05)
    in_rest = base - ps.step_ns(ps.less_time(st, saved / st.m, np.zeros(st.p)), st.v, st.m, x)
    assert in_rest == pytest.approx(delta, rel=0.05)


def test_a_compute_fix_on_a_pipeline_is_priced_on_the_schedule(diagnosis):
    """FP8's GEMMs on the GPU-bound PP 4 x 8 micro-batches job: the price is the schedule's (its
    basis says so), above the graph's own step change by the fill and drain (the stages'
    savings are work: between their exchanges)."""
    d = diagnosis("mcore_gb_pp4s_m8")
    r = Replayer(d.extra.replay_inputs)
    spec = {"kind": "scale", "ops": "gemm", "factor": 0.704}
    w = transforms.apply(spec, "best", r.traces, r.untraced, r.ctx)
    out = r.replay(w)
    graph = r.step_ms(r.untraced_out) - r.step_ms(out)
    share = pipelined.work_share(r, r.untraced_out, out)
    assert (share > 0.9).all(), share
    sched = pipelined.gain_ms(r, r.untraced_stages, r.untraced_out, r.untraced_out, out)
    assert graph * 1.2 < sched < graph * 1.6, (graph, sched)
    import profclass
    priced = profclass.diagnose(d.inputs[0], price_fixes=("compute_fp8",)).replay["requested"]["compute_fp8"]
    assert priced["best_ms"] == pytest.approx(sched, abs=0.01)
    assert "fill and drain" in priced["basis"]


def test_recompute_off_leaves_the_pipeline_exchanges(diagnosis):
    """A stretch of a real PP capture marked as a recomputed forward, a PP send/recv inside it:
    dropping the recompute zeroes the stretch's compute kernels and keeps the exchange's time."""
    r = _replayer(diagnosis, "mcore_gb_pp4s_m8")
    gi = 1
    t = r.traces[gi]
    pp = np.flatnonzero(r.ctx.op_groups[gi] == "PP")
    mid = pp[len(pp) // 2]
    span = np.zeros(t.n_ops, bool)
    span[max(mid - 40, 0):mid + 40] = True
    traces = list(r.traces)
    traces[gi] = replace(t, ops=replace(t.ops, recomputed=span))
    w = transforms.apply({"kind": "drop_recomputed", "keep": 0.0}, "best", traces, r.untraced, r.ctx)
    compute = span & (t.ops.kind == COMPUTE)
    assert (w[gi].op_dur[compute] == 0).all() and compute.any()
    assert w[gi].op_dur[mid] == r.untraced[gi].op_dur[mid] > 0


def test_a_flagless_recompute_pipeline_reads_its_microbatches(diagnosis):
    """Dense PP 2, two layers a stage, 2 micro-batches, full recompute from a config file (no
    Megatron flag): read as 1 micro-batch before (every forward taken for a recomputed layer,
    the optimizer's stretch outnumbering a two-layer forward). Now the layout gives the config's
    sizes, the last stage runs m forward passes a step and re-runs each of its 2 layers once per
    micro-batch (the workload's recompute: one layer per checkpoint)."""
    d = diagnosis("mcore_wrapped_pp2_rc_m2")
    lay = d.extra.replay_inputs.pipeline
    assert (lay.stages, lay.virtual_stages, lay.microbatches) == (2, 1, 2)
    r = Replayer(d.extra.replay_inputs)
    last = [gi for gi, s in enumerate(r.stages.gpu_stage) if s == 1][0]
    t = r.traces[last]
    runs = int(np.sum(np.diff(np.r_[0, t.ops.recomputed.astype(np.int8)]) == 1))  # recomputed spans
    assert runs == 2 * 2 * t.iterations


def test_recompute_off_on_a_real_pipeline_drops_reruns_not_exchanges(diagnosis):
    """On the same capture the first stage's recomputed spans hold no PP send/recv: by the
    launching thread they are its 2 x 2 re-run layers a step (the size rule had read 28 ms/step
    of its exchanges as re-runs: tests/test_recompute_threads.py). Priced off, every exchange
    keeps its time, and the first stage saves no more per micro-batch than the last (their
    layers are alike)."""
    r = _replayer(diagnosis, "mcore_wrapped_pp2_rc_m2")
    first = [gi for gi, s in enumerate(r.stages.gpu_stage) if s == 0][0]
    t = r.traces[first]
    pp = r.ctx.op_groups[first] == "PP"
    assert pp.any() and not (t.ops.recomputed & pp).any()
    runs = int(np.sum(np.diff(np.r_[0, t.ops.recomputed.astype(np.int8)]) == 1))
    assert runs == 2 * 2 * t.iterations
    w = transforms.apply({"kind": "drop_recomputed", "keep": 0.0}, "best", r.traces, r.untraced, r.ctx)
    assert (w[first].op_dur[pp] == r.untraced[first].op_dur[pp]).all()
    saved = pipelined.stage_saving(r, r.untraced_out, r.replay(w))
    assert saved[0] <= 1.1 * saved[1], saved


def test_a_fixs_kernel_saving_leaves_the_stages_busy_time(diagnosis):
    """Recompute off on the flagless PP 2 job with full recompute: the stages' busy time falls by
    the compute kernels' time the transform took away, per micro-batch (a layer moved between
    stages after the fix costs what the fix left of it); a host-only fix (CUDA graphs) leaves it."""
    r = _replayer(diagnosis, "mcore_wrapped_pp2_rc_m2")
    st = r.untraced_stages
    w = transforms.apply({"kind": "drop_recomputed", "keep": 0.0}, "best", r.traces, r.untraced, r.ctx)
    lean = pipelined.lean_stages(r, st, r.untraced_out, r.replay(w), w)
    dropped = np.zeros(st.p)
    for gi, (t, s) in enumerate(zip(r.traces, st.gpu_stage)):
        comp = t.ops.kind == COMPUTE
        dropped[s] += float((r.untraced[gi].op_dur - w[gi].op_dur)[comp].sum()) / t.iterations / st.m
    dropped /= np.bincount(np.asarray(st.gpu_stage), minlength=st.p)
    assert (dropped > 0.1 * st.busy).all(), (dropped, st.busy)
    assert lean.busy == pytest.approx(st.busy - dropped, rel=1e-9)
    assert pipelined.lean_stages(r, st, r.untraced_out, r.replay(w)).busy is st.busy  # without weights: as measured
    g = transforms.apply({"kind": "cuda_graphs", "node_gap_ns": 1500, "expert_phase": 0}, "best", r.traces,
                         r.untraced, r.ctx)
    assert pipelined.busy_saved(r, g) == pytest.approx(np.zeros(st.p), abs=1.0)


def test_a_stage_split_after_a_fix_moves_layers_at_their_cost_after_it():
    """Layers 3 + 1 (the first stage's busy time 3 layers of 44 ms, the last's one layer and a
    9 ms output layer): balanced to 2 + 2 a layer moves at the least busy time per layer. After a
    fix that takes 11 ms off each layer, a layer moves at 33 ms, not 44: the busiest stage after
    the split is 2 x 33 + 9 = 75 ms, where the measured busy time would leave it at 86."""
    st = ps.Stages(p=2, v=1, m=4, work=np.array([132e6, 53e6]), rest=np.zeros(2), floor=0.0,
                   gaps=np.array([0.0]), measured_step=0.0, busy=np.array([132e6, 53e6]), layers=np.array([3, 1]))
    assert ps.balanced_work(st) == pytest.approx([88e6, 97e6])
    lean = replace(st, work=st.work - np.array([33e6, 11e6]), busy=st.busy - np.array([33e6, 11e6]))
    assert ps.balanced_work(lean) == pytest.approx([66e6, 75e6])
    stale = replace(lean, busy=st.busy)  # the busy time as measured before the fix
    assert ps.balanced_work(stale) == pytest.approx([55e6, 86e6])


def test_the_refill_and_the_exchange_gap_move_with_the_host(diagnosis):
    """The idle after a batched exchange's device sync (the host refilling the queue) and the
    host's gap after an exchange are host time: without the profiler, and on each end of the
    host's range, they take the host's ratio to the captured host (every call's own time and the
    CPU time before it), so a schedule change that adds or removes exchanges prices their refill
    on the host that banks the gain. On the host-paced PP 4 capture the profiler's per-call cost
    is 10-20% of the host's time."""
    r = _replayer(diagnosis, "mcore_pp4_m8")
    ratio = pipelined.host_ratio(r, r.untraced)
    assert ((ratio > 0.75) & (ratio < 0.95)).all(), ratio
    assert np.allclose(r.untraced_stages.sync_idle, r.stages.sync_idle * ratio)
    assert np.median(r.untraced_stages.gaps) == pytest.approx(np.median(r.stages.gaps) * ratio.mean())
    (slow, *_), (fast, *_) = max(r.host_variants, key=lambda v: v[0]), min(r.host_variants, key=lambda v: v[0])
    refill = {f: st.sync_idle for f, _, _, st in r.host_variants}
    assert np.allclose(refill[slow] / refill[fast], slow / fast, rtol=1e-3)
    # the captured sizes' own step barely moves: the base's calls' refill leaves its work as it enters its calls
    st, x = r.untraced_stages, ps.exchange_cost(r.untraced_stages, 0.5)
    kept = replace(st, sync_idle=r.stages.sync_idle, gaps=r.stages.gaps)
    assert ps.step_ns(st, 1, 8, x) == pytest.approx(ps.step_ns(kept, 1, 8, ps.exchange_cost(kept, 0.5)), rel=0.01)
