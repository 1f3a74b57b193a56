"""A larger micro-batch on the replay's graph (``replay.microbatch``), on a committed
export (`mcore_1gpu_dense_small`: one GPU, 2 micro-batches a step, Megatron DDP's fp32 main_grad
accumulated by separate add kernels): the host work done once a step stays, the host work of the
micro-batches and the weight-sized accumulation fall by the factor."""
from __future__ import annotations

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


def test_the_once_a_step_host_work_launches_the_optimizer_and_no_forward(replayer):
    """Every kernel of the optimizer (multi_tensor_apply: Adam, the norms) is launched by a call
    ``per_step_calls`` marks; no forward-only or backward-only pair kernel is; those calls are a
    minority of the host's."""
    t = replayer.traces[0]
    per_step = M.per_step_calls(t)
    launched = t.ops.launch >= 0
    optimizer = launched & (np.char.find(_names(t), "multi_tensor_apply") >= 0)
    pairs = launched & np.isin(t.ops.side, [FWD, BWD])
    assert optimizer.sum() >= 10 and pairs.sum() >= 10
    assert per_step[t.ops.launch[optimizer]].all()
    assert not per_step[t.ops.launch[pairs]].any()
    assert 0.05 < per_step.mean() < 0.5


def test_a_trace_without_pair_kernels_marks_no_call_once_a_step(replayer):
    from dataclasses import replace

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
