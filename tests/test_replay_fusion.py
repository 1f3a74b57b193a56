"""The fuse transform (compute_fusion): which kernels each fusion flag replaces, read from the
kernels' full names, and the chains it shortens, worked out by hand; then priced on a real
capture, one flag against all of them."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from profclass.analyzers.compute import FUSION_FLAGS, fusion_codes
from profclass.replay import transforms
from profclass.replay.scenario import captured
from profclass.replay.trace import COMPUTE
from test_replay_engine import _trace

MS = 1_000_000
PROFILES = Path(__file__).resolve().parents[1] / "fixtures" / "profiles"
CODE = {key: i + 1 for i, (key, _, _) in enumerate(FUSION_FLAGS)}
SPEC = {"kind": "fuse", "factor": [0.75, 0.5, 0.34], **{key: 1 for key in CODE}}
# full kernel names as nsys exports them (demangled; the short name is only "elementwise_kernel")
SILU = ("void at::native::elementwise_kernel<(int)128, (int)4, void at::native::gpu_kernel_impl_nocast<"
        "at::native::<unnamed>::silu_kernel(at::TensorIteratorBase &)::[lambda() (instance 1)]>(int, T3)")
MUL = ("void at::native::vectorized_elementwise_kernel<(int)8, at::native::BinaryFunctor<c10::BFloat16, "
       "c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float>>>(int, T2, T3)")
ADD = "void at::native::vectorized_elementwise_kernel<(int)8, at::native::CUDAFunctor_add<c10::BFloat16>>(int, T2, T3)"
MASK = ("void at::native::elementwise_kernel<(int)128, (int)2, void at::native::gpu_kernel_impl_nocast<"
        "at::native::<unnamed>::masked_fill_kernel(at::TensorIterator &, const c10::Scalar &)>(int, T3)")
LOSS = "void at::native::cunn_SoftMaxForward<(int)4, float, float, float, at::native::<unnamed>::LogSoftMaxForwardEpilogue>"
GEMM = "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN"


def test_each_kernel_is_read_by_its_full_name_into_the_flag_that_fuses_it():
    codes = fusion_codes(pd.Series([SILU, MUL, MASK, LOSS, GEMM, ADD]))
    assert codes.tolist() == [CODE["activation"], -1, CODE["softmax"], CODE["cross_entropy"], 0, -1]


def test_a_compiled_kernel_is_a_fusion_already():
    # Inductor's kernels for Megatron's compiled SwiGLU (call K's traced candidate, docs/notes.md)
    compiled = pd.Series(["triton_poi_fused_mul_silu_split_0", "triton_poi_fused_add_cat_mul_rsub_sigmoid_silu_split_1"])
    assert fusion_codes(compiled).tolist() == [0, 0]


def test_the_flag_on_with_the_activation_unfused_is_a_pitfall_and_compiled_is_not():
    from profclass import pitfalls

    flags = {"--bias-activation-fusion": ""}
    eager = pitfalls.facts(flags, {}, {}, None, 4, pd.Series([SILU, MUL, GEMM]))
    compiled = pitfalls.facts(flags, {}, {}, None, 4, pd.Series(["triton_poi_fused_mul_silu_split_0", GEMM]))
    without = pitfalls.facts({}, {}, {}, None, 4, pd.Series([SILU, MUL, GEMM]))
    found = [[p["id"] for p in pitfalls.check(f, {}, 100.0)] for f in (eager, compiled, without)]
    assert found == [["activation_fusion_not_compiled"], [], []]


def _mlp():
    """One stream, back to back: GEMM (10 ms), SiLU (2), the GLU's multiply (3), a residual add
    (1), GEMM (10), masked fill (4); the SiLU's chain is it and the multiply after it (the GEMM
    before it is no link), the masked fill's is it and the add two ops before it is not."""
    durs = [10, 2, 3, 1, 10, 4]
    starts = np.cumsum([0] + durs[:-1])
    t = _trace([(s * MS, d * MS, 0, COMPUTE, -1, 0, 0) for s, d in zip(starts, durs)], [])
    fusion = np.array([0, CODE["activation"], -1, -1, 0, CODE["softmax"]], np.int8)
    return replace(t, ops=replace(t.ops, fusion=fusion, gemm=fusion == 0))


@pytest.mark.parametrize("point,factor", [("low", 0.75), ("best", 0.5), ("high", 0.34)])
def test_a_fused_activation_shortens_its_chain_and_nothing_else(point, factor):
    t = _mlp()
    spec = {**SPEC, "softmax": 0}
    w = transforms.apply(spec, point, [t], [captured(t)], None)[0]
    expect = np.array([10, 2 * factor, 3 * factor, 1, 10, 4]) * MS
    assert np.allclose(w.op_dur, expect.astype(np.int64), atol=1)


def test_every_flag_on_shortens_both_chains_and_a_flag_with_no_kernel_prices_nothing():
    t = _mlp()
    w = transforms.apply(SPEC, "best", [t], [captured(t)], None)[0]
    assert (w.op_dur / MS).tolist() == [10, 1, 1.5, 1, 10, 2]
    only_rope = {**SPEC, **{key: 0 for key in CODE}, "rope": 1}
    assert transforms.apply(only_rope, "best", [t], [captured(t)], None) is None


def test_on_a_capture_one_flag_prices_a_part_of_all_of_them_and_no_more_than_its_chains():
    import profclass

    path = PROFILES / "mcore_gb_pp4s_m8.sqlite.xz"
    one = "compute_fusion:" + ",".join(f"{k}=0" for k in CODE if k != "activation")
    d = profclass.diagnose(str(path), keep_replay=True, price_fixes=(one, "compute_fusion"))
    req = d.replay["requested"]
    act, every = req[one], req["compute_fusion"]
    assert 0 < act["best_ms"] < every["best_ms"]
    assert act["low_ms"] <= act["best_ms"] <= act["high_ms"]
    # the activation's chains' kernel time per step bounds what fusing them can win, on each
    # slot of the pipeline's critical path once: m + p - 1 slots of a micro-batch's share of it
    # (1F1B; replay/pipelined.py), not only the stage's own m
    traces = d.extra.replay_inputs.traces
    w = transforms.apply(SPEC | {k: 0 for k in CODE if k != "activation"}, "high", list(traces),
                         [captured(t) for t in traces], None)
    saved = max((c.op_dur - x.op_dur).sum() / t.iterations for c, x, t in
                zip([captured(t) for t in traces], w, traces)) / 1e6
    pipe = d.extra.replay_inputs.pipeline
    slots = (pipe.microbatches + pipe.stages - 1) / pipe.microbatches
    assert saved < act["high_ms"] <= slots * saved + 1e-6
