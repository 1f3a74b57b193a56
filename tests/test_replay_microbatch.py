"""A larger micro-batch on the replay's graph (``replay.microbatch``), on a committed
export (`mcore_1gpu_dense_small`: one GPU, 2 micro-batches a step, Megatron DDP's fp32 main_grad
accumulated by separate add kernels): the host work done once a step stays, the host work of the
micro-batches and the weight-sized accumulation fall by the factor."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from profclass.replay import run as R
from profclass.replay import microbatch as M
from profclass.replay import transforms as T
from profclass.replay.trace import BWD, FWD

SPEC = {"kind": "fewer_launches", "microbatch_factor": 2, "recovered": [0.75, 1.0, 1.0],
        "per_microbatch": "name:CUDAFunctor_add<float>"}


@pytest.fixture(scope="module")
def replayer(diagnosis):
    return R.Replayer(diagnosis("mcore_1gpu_dense_small").extra.replay_inputs)


def _names(t) -> np.ndarray:
    return np.array(t.names + ("",))[t.ops.name].astype(str)


@pytest.mark.parametrize("name", ["mcore_1gpu_dense_small", "mcore_moe1_dropless"])
def test_the_once_a_step_host_work_launches_the_optimizer_and_no_forward(diagnosis, name):
    """Every kernel of the optimizer (multi_tensor_apply: Adam, the norms) is launched by a call
    ``per_step_calls`` marks; no forward-only or backward-only pair kernel is; those calls are a
    minority of the host's. The MoE stage's window is a periodicity window that opens between
    its micro-batches, not at the step's turn: the marks once took the stretch from one
    iteration's last backward to the next one's first forward, a whole micro-batch with it (56
    of its 112 pair kernels)."""
    t = R.Replayer(diagnosis(name).extra.replay_inputs).traces[0]
    per_step = M.per_step_calls(t)
    launched = t.ops.launch >= 0
    optimizer = launched & (np.char.find(_names(t), "multi_tensor_apply") >= 0)
    pairs = launched & np.isin(t.ops.side, [FWD, BWD])
    assert optimizer.sum() >= 10 and pairs.sum() >= 10
    assert per_step[t.ops.launch[optimizer]].all()
    assert not per_step[t.ops.launch[pairs]].any()
    assert 0.05 < per_step.mean() < 0.5
    # the iterations' phase is the window's, not the step's: moving it moves no mark
    shifted = replace(t, iteration_starts=tuple(np.asarray(t.iteration_starts) + int(np.diff(t.iteration_starts).mean() // 2)))
    assert np.array_equal(M.per_step_calls(shifted), per_step)


def test_a_trace_without_pair_kernels_marks_no_call_once_a_step(replayer):
    t = replayer.traces[0]
    blind = replace(t, ops=replace(t.ops, side=np.zeros(t.n_ops, np.int8)))
    assert not M.per_step_calls(blind).any()
    assert not M.per_step_calls(replace(t, ops=replace(t.ops, side=None))).any()


@pytest.mark.parametrize("k", [2.0, 0.5, 4.0])
def test_the_accumulation_runs_k_times_less_and_the_micro_batches_host_work_by_k(replayer, k):
    """At k: each main_grad add kernel's time / k (k times fewer of the same size), every other
    op's time kept; the calls once a step keep their time, the others' falls by k (``recovered``
    at its best, 1)."""
    r = replayer
    t, w = r.traces[0], r.captured[0]
    (out,) = T.apply({**SPEC, "microbatch_factor": k}, "best", r.traces, r.captured, r.ctx)
    acc = np.char.find(_names(t), "CUDAFunctor_add<float>") >= 0
    assert acc.sum() >= 2 * t.iterations
    assert np.array_equal(out.op_dur[acc], (w.op_dur[acc] / k).astype(np.int64))
    assert np.array_equal(out.op_dur[~acc], w.op_dur[~acc])
    per_step = M.per_step_calls(t)
    assert np.array_equal(out.c_gap[per_step], w.c_gap[per_step])
    assert np.array_equal(out.c_dur[per_step], w.c_dur[per_step])
    assert np.array_equal(out.c_gap[~per_step], (w.c_gap[~per_step] / k).astype(np.int64))
    # without the selector the kernels keep their time, as before
    (plain,) = T.apply({**SPEC, "microbatch_factor": k, "per_microbatch": ""}, "best", r.traces, r.captured, r.ctx)
    assert np.array_equal(plain.op_dur, w.op_dur)


ACCUMULATE = {"kind": "accumulate", "once": [0.5, 1.0, 1.0], "per_microbatch": "name:CUDAFunctor_add<float>"}


@pytest.mark.parametrize("whole, n, k, want", [
    ([True, True], 2, 2, [1, 0]), ([True, True], 2, 4, [1, 0.5]), ([True, True], 2, 3, [1, 1 / 3]),
    ([True] * 4, 4, 2, [1, 0, 1, 0]), ([False, True, True, False], 3, 2, [0.25, 1, 0.25, 0.25]),
    ([False, True, True, False], 3, 4, [0.25, 1, 1, 0.25]), ([True], 1, 2, [0.5]), ([False, False], 1, 2, [0.5, 0.5])])
def test_whole_turns_are_dropped_evenly_and_what_they_cannot_reach_is_shared(whole, n, k, want):
    """Of a window's n steps of once-a-step work, k times the micro-batches run n/k: as many whole
    turns as fit in n (1 - 1/k) are dropped, every other one (n = 4, k = 2: the second and the
    fourth kept, so each candidate step has its k m micro-batches), and the rest of the removal is a
    share of the turns left (cut turns, or n (1 - 1/k) not whole)."""
    assert M.dropped_turns(np.array(whole), n, k) == pytest.approx(want)


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_drops_whole_turns_of_once_a_step_work(replayer, k):
    """More micro-batches of one size, per the base's work, on a window of three steps that holds
    two turns whole and cuts two: a dropped turn's kernels (the optimizer's) run no more, but for
    GEMMs and the main_grad accumulation (a micro-batch's), its calls keep only the share that is the
    next batch's loading (none at the best point, half at the low one), and its syncs wait for
    nothing; the other turns' kernels and calls lose the share the drops cannot reach; every op and
    call outside a turn as captured."""
    r = replayer
    t, w = r.traces[0], r.captured[0]
    turn, whole = M.step_turns(t)
    assert whole.tolist() == [False, True, True, False] and t.iterations == 3
    share = np.append(M.dropped_turns(whole, t.iterations, k), 0.0)
    op_turn = np.append(turn, -1)[t.ops.launch]
    names = _names(t)
    tail = t.ops.gemm | (np.char.find(names, "CUDAFunctor_add<float>") >= 0)
    gone = (share[op_turn] == 1) & ~tail
    part = (op_turn >= 0) & (share[op_turn] < 1) & ~tail
    dropped_calls = share[turn] == 1
    blocks = t.calls.c_target >= 0
    assert (np.char.find(names[gone], "multi_tensor_apply") >= 0).any()  # the optimizer is once a step
    assert part.any() and (blocks & dropped_calls).any()
    for point, once in (("best", 1.0), ("low", 0.5)):
        (out,) = T.apply({**ACCUMULATE, "microbatches": k}, point, r.traces, r.captured, r.ctx)
        assert (out.op_dur[gone] == 0).all()
        assert np.array_equal(out.op_dur[part], (w.op_dur[part] * (1 - share[op_turn[part]])).astype(np.int64))
        assert np.array_equal(out.op_dur[~gone & ~part], w.op_dur[~gone & ~part])
        assert np.array_equal(out.c_dur, (w.c_dur * (1 - once * share[turn])).astype(np.int64))
        assert not out.c_blocks[dropped_calls].any()
        assert np.array_equal(out.c_blocks[~dropped_calls], blocks[~dropped_calls])


def test_a_dropped_turns_syncs_no_longer_hold_the_host_back(replayer):
    """A step of k m micro-batches has no gradient-norm or loss sync between its micro-batches: with
    the dropped turn's syncs still waiting, the host cannot run ahead into the next forward and the
    step replays longer (on call MI's dense stage, not committed, 4.9 ms a step of price instead of
    7.9 against 8.9 realized; on this window the effect is small, 18 us a step)."""
    r = replayer
    (out,) = T.apply({**ACCUMULATE, "microbatches": 2}, "best", r.traces, r.untraced, r.ctx)
    held = replace(out, c_blocks=r.untraced[0].c_blocks)
    assert r.step_ms(r.replay([out])) < r.step_ms(r.replay([held])) < r.step_ms(r.replay(r.untraced))


def _price(diagnosis, name: str, k: int):
    import profclass
    from conftest import profile_path
    req = f"pp_microbatches:microbatches={k}"
    d = profclass.diagnose(str(profile_path(name)), price_fixes=(req,))
    return d, d.replay["requested"][req]


def test_more_micro_batches_on_one_stage_are_priced_as_accumulation(diagnosis):
    """On a job without a pipeline the pipeline fix's request prices gradient accumulation on the
    graph (a one-stage job has no bubble to share); a longer accumulation wins more, and per the
    base's work never more than the step's share k micro-batches split (1 - 1/k)."""
    d, p2 = _price(diagnosis, "mcore_moe1_dropless", 2)
    _, p4 = _price(diagnosis, "mcore_moe1_dropless", 4)
    step = d.replay["untraced_step_ms"]
    assert p2["basis"].startswith("replay:accumulate")
    assert 0 < p2["low_ms"] <= p2["best_ms"] <= p2["high_ms"]
    assert p2["best_ms"] < p4["best_ms"] < step * 3 / 4 and p2["best_ms"] < step / 2


def test_a_pipelined_job_keeps_the_schedule_price(diagnosis):
    _, p = _price(diagnosis, "mcore_gb_pp4_m4", 2)
    assert p["basis"].startswith("replay:pp_schedule")
