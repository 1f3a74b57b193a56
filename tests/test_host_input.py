"""The input pipeline's fixes on the replay's graph (``replay.host_input``), on a committed export
whose batches are built on the training thread by construction (`mcore_ep4_input_pageable`: 4
GPUs, 2 micro-batches a step, each batch's tokens, [1, 1, s, s] mask and position ids built on
the host after 3 ms of the loader's own work, then copied from pageable memory), and on its twin
whose batches are built on the GPU (`mcore_ep4_base`)."""
from __future__ import annotations

import tomllib

import numpy as np
import pytest

from conftest import ROOT
from profclass.replay import host_input as H
from profclass.replay import run as R
from profclass.replay import transforms as T
from profclass.replay.trace import COPY, PAGEABLE

NAME = "mcore_ep4_input_pageable"
MICROBATCHES = 2  # the workload's --num-microbatches: one batch loaded each
TENSORS = 3  # tokens, mask, position ids: one host-to-device copy each
PREP_NS = 3_000_000  # the workload's --input-prep-ms: a floor of each batch's build
FIXES = {f["id"]: f for f in tomllib.loads((ROOT / "profclass" / "data" / "fixes.toml").read_text())["fix"]}


@pytest.fixture(scope="module")
def replayer(diagnosis):
    return R.Replayer(diagnosis(NAME).extra.replay_inputs)


def test_every_batch_copy_is_an_input_copy_from_pageable_memory_and_none_is_offload(replayer):
    for t in replayer.traces:
        inputs = t.ops.input > 0
        assert inputs.sum() == TENSORS * MICROBATCHES * t.iterations
        assert (t.ops.kind[inputs] == COPY).all() and (t.ops.input[inputs] == PAGEABLE).all()
        assert not (t.ops.offload & inputs).any()


def test_the_loader_work_is_one_build_per_micro_batch_at_least_the_workloads_own(replayer):
    """Per GPU, the CPU time before the batches' copies beyond a typical gap (or a wake-up, where
    the training thread was woken from the backward) holds one stretch per batch loaded, each at
    least the workload's 3 ms; the input calls' remaining excess is noise (under 0.5 ms a step)."""
    for t, w in zip(replayer.traces, replayer.captured):
        gap, lag = H.loader_work(t, w.c_gap, w.h_lag)
        work = np.r_[gap, lag]
        builds = work[work >= PREP_NS]
        assert len(builds) == MICROBATCHES * t.iterations
        assert builds.max() < 4 * PREP_NS  # the build and its mask, not a step's host time
        assert work[work < PREP_NS].sum() / t.iterations < 500_000


def test_workers_take_the_build_off_and_leave_the_training_thread_its_dequeue(replayer):
    r = replayer
    spec = FIXES["host_input_workers"]["transform"]
    out = T.apply(spec, "best", r.traces, r.captured, r.ctx)
    kept = spec["dequeue"][1]
    for t, w, o in zip(r.traces, r.captured, out):
        gap, lag = H.loader_work(t, w.c_gap, w.h_lag)
        removed = (w.c_gap - o.c_gap).sum() + (w.h_lag - o.h_lag).sum()
        assert removed == np.clip(gap - kept, 0, None).sum() + np.clip(lag - kept, 0, None).sum()
        assert removed >= MICROBATCHES * t.iterations * (PREP_NS - kept)
        assert (o.c_dur == w.c_dur).all() and (o.op_dur == w.op_dur).all()


def test_pinned_copies_block_nothing_and_run_their_dma_at_the_stated_factor(replayer):
    r = replayer
    spec = FIXES["host_input_pinned"]["transform"]
    out = T.apply(spec, "best", r.traces, r.captured, r.ctx)
    for t, w, o in zip(r.traces, r.captured, out):
        launches, syncs = H.input_calls(t, (PAGEABLE,))
        assert launches.sum() == TENSORS * MICROBATCHES * t.iterations and syncs.any()
        assert w.c_blocks[syncs].all() and not o.c_blocks[launches | syncs].any()
        assert (o.c_dur[syncs & ~launches] == 0).all()
        copies = t.ops.input == PAGEABLE
        assert (o.op_dur[copies] == (w.op_dur[copies] * spec["copy"][1]).astype(np.int64)).all()
        assert (o.op_dur[~copies] == w.op_dur[~copies]).all()
    assert r.step_ms(r.replay(out)) <= r.step_ms(r.base)


def test_the_input_fixes_are_replay_prices_inside_what_the_loader_and_copies_hold(diagnosis):
    """Both fixes are priced by their replay, not the share model; the workers' best is at most
    the slowest GPU's loader work a step (a removed stretch saves at most itself)."""
    d = diagnosis(NAME)
    fixes = {f["id"]: f for f in d.fixes}
    r = R.Replayer(d.extra.replay_inputs)
    loader = max(sum(x.sum() for x in H.loader_work(t, w.c_gap, w.h_lag)) / t.iterations
                 for t, w in zip(r.traces, r.captured)) / 1e6
    for fid in ("host_input_workers", "host_input_pinned"):
        assert fixes[fid]["gain_basis"].startswith("replay:host_input"), fid
    assert 0 < fixes["host_input_workers"]["expected_gain_ms"] <= loader
    assert 0 <= fixes["host_input_pinned"]["expected_gain_ms"] < fixes["host_input_workers"]["expected_gain_ms"]


def test_a_job_whose_batches_are_built_on_the_gpu_gives_the_transform_nothing(diagnosis):
    r = R.Replayer(diagnosis("mcore_ep4_base").extra.replay_inputs)
    assert not any((t.ops.input > 0).any() for t in r.traces)
    for fid in ("host_input_workers", "host_input_pinned"):
        assert T.apply(FIXES[fid]["transform"], "best", r.traces, r.captured, r.ctx) is None


def test_diff_reads_the_batches_moving_to_the_gpu_off_the_copies(diagnosis):
    """`mcore_ep4_base` is the same job with its batches built on the GPU: ``diff`` recognises
    ``host_input_on_gpu`` from the copies alone (no flag says it), and nothing the other way."""
    from profclass.diff import diff

    b, c = diagnosis(NAME), diagnosis("mcore_ep4_base")
    rows = diff(b, c).fix_gains
    assert [(f["fix"], f["detected_by"]) for f in rows] == [("host_input_on_gpu", "inputs:gpu")]
    assert rows[0]["predicted_gain_ms"] > 0
    assert not [f for f in diff(c, b).fix_gains if f["fix"].startswith("host_input")]


@pytest.mark.parametrize("base, cand, pinned", [
    (dict(inputs=True, pageable=True), dict(inputs=True, pageable=False), True),
    (dict(inputs=True, pageable=True), dict(inputs=True, pageable=True), False),  # still pageable
    (dict(inputs=True, pageable=True), dict(inputs=False, pageable=False), False),  # built on the GPU instead
    (dict(inputs=True, pageable=False), dict(inputs=True, pageable=False), False)])  # pinned on both
def test_pinned_copies_are_recognised_only_where_every_pageable_copy_became_pinned(base, cand, pinned):
    from profclass.diff.fix_gains import _applied

    signs = dict(fp8=False, libraries=set(), graphs=False)
    assert _applied("inputs:pinned", {}, {}, {**signs, **base}, {**signs, **cand})[0] is pinned


MASK_BYTES = 2048 * 2048  # the workload's [1, 1, s, s] bool mask at s = 2048


def test_each_batch_mask_is_told_from_its_token_tensors_by_size(replayer):
    """One mask copy per micro-batch, the batch's largest; the tokens ([2, 2049] int64) and
    position ids ([2, 2048]) are not masks; the masks' byte share is the window's own."""
    for t in replayer.traces:
        assert t.ops.mask.sum() == MICROBATCHES * t.iterations
        assert (t.ops.input[t.ops.mask] == PAGEABLE).all()
        tokens = 2 * 8 * (2049 + 2048)
        assert t.mask_bytes_share == pytest.approx(MASK_BYTES / (MASK_BYTES + tokens))


@pytest.mark.parametrize("sizes, masks", [
    ([8 * 4 * 4096, 8 * 4 * 4096, 4 * 4 * 4096, 4 * 4096 * 4096], [False, False, False, True]),  # [4, 1, s, s]
    ([8 * 1 * 8192, 4 * 8192, 8192 * 8192], [False, False, True]),  # [1, 1, 8192, 8192] beside [1, 8192]
    ([8 * 4 * 128, 128 * 128], [False, True]),  # micro-batch 4 of 128 tokens, the mask broadcast
    ([8 * 16 * 128, 128 * 128], [False, False]),  # s = 8 b: the mask no larger than the tokens, not told apart
    ([8 * 2 * 4097, 8 * 2 * 4096, 4 * 2 * 4096], [False, False, False]),  # no mask: a float loss mask is not one
    ([8 * 3 * 4096, 2 * 4096 * 4096], [False, False]),  # [2, 1, s, s] beside a batch of 3: not one batch
    ([256 * 256], [False]),  # a square size alone: no token tensor beside it
    ([], [])])
def test_attention_masks_need_the_shape_of_a_mask_beside_a_token_tensor(sizes, masks):
    from profclass.analyzers.idle import attention_masks

    assert attention_masks(np.array(sizes, np.int64)).tolist() == masks


@pytest.mark.parametrize("point", ["low", "best", "high"])
def test_the_mask_on_the_gpu_takes_its_copies_syncs_and_byte_share_of_the_build(replayer, point):
    """The masks' DMA, their calls and the syncs that waited for them go; of the loader's work
    before each batch the mask's byte share times the point's factor; nothing else moves."""
    r = replayer
    spec = FIXES["host_input_on_gpu"]["transform"]
    out = T.apply(spec, point, r.traces, r.captured, r.ctx)
    build = dict(zip(("low", "best", "high"), spec["mask"]))[point]
    for t, w, o in zip(r.traces, r.captured, out):
        launches, syncs = H._calls_of(t, t.ops.mask)
        assert launches.sum() == t.ops.mask.sum() and syncs.any()
        assert (o.op_dur[t.ops.mask] == 0).all() and (o.op_dur[~t.ops.mask] == w.op_dur[~t.ops.mask]).all()
        gone = launches | syncs
        assert (o.c_dur[gone] == 0).all() and (o.c_dur[~gone] == w.c_dur[~gone]).all()
        assert not o.c_blocks[gone].any()
        gap, lag = H.loader_work(t, w.c_gap, w.h_lag)
        removed = (w.c_gap - o.c_gap).sum() + (w.h_lag - o.h_lag).sum()
        assert removed == pytest.approx(build * t.mask_bytes_share * (gap.sum() + lag.sum()), abs=len(gap) + len(lag))
    assert r.step_ms(r.replay(out)) < r.step_ms(r.base)


def test_the_mask_on_the_gpu_is_a_replay_price_and_nothing_where_no_mask_is_copied(diagnosis):
    d = diagnosis(NAME)
    f = next(f for f in d.fixes if f["id"] == "host_input_on_gpu")
    assert f["gain_basis"].startswith("replay:host_input")
    assert f["gain_low_ms"] < f["expected_gain_ms"] < f["gain_high_ms"]
    r = R.Replayer(diagnosis("mcore_ep4_base").extra.replay_inputs)
    assert not any(t.ops.mask.any() for t in r.traces)
    assert T.apply(FIXES["host_input_on_gpu"]["transform"], "best", r.traces, r.captured, r.ctx) is None


@pytest.mark.parametrize("base, cand, on_gpu", [
    (dict(inputs=True, masks=True), dict(inputs=False, masks=False), True),  # every batch built on the GPU
    (dict(inputs=True, masks=True), dict(inputs=True, masks=False), True),  # the mask alone
    (dict(inputs=True, masks=False), dict(inputs=True, masks=False), False),  # no mask to move
    (dict(inputs=True, masks=True), dict(inputs=True, masks=True), False),
    (dict(inputs=False, masks=False), dict(inputs=False, masks=False), False)])
def test_the_batches_or_their_mask_moving_to_the_gpu_is_recognised(base, cand, on_gpu):
    from profclass.diff.fix_gains import _applied

    signs = dict(fp8=False, libraries=set(), graphs=False, pageable=False)
    assert _applied("inputs:gpu", {}, {}, {**signs, **base}, {**signs, **cand})[0] is on_gpu


def test_the_idle_analyzer_counts_the_masks_bytes(diagnosis):
    d = diagnosis(NAME)
    for dev in d.devices:
        f = dev["features"]
        assert f["input_mask_bytes"] % MASK_BYTES == 0 and f["input_mask_bytes"] > 0
        assert f["input_mask_bytes"] / f["input_bytes"] == pytest.approx(MASK_BYTES / (MASK_BYTES + 2 * 8 * (2049 + 2048)))
    assert all(dev["features"]["input_mask_bytes"] == 0 for dev in diagnosis("mcore_ep4_base").devices)


@pytest.mark.parametrize("mask, offered", [(True, True), (False, False)])
def test_the_mask_fix_is_offered_only_where_the_batches_carry_a_mask(mask, offered):
    """A loader whose batches carry no mask (--no-create-attention-mask-in-dataloader already)
    is still an input pipeline for the workers' fix, but has nothing for host_input_on_gpu."""
    from profclass.fixes import _applies

    ctx = dict(input_pipeline=True, input_pageable=True, input_mask=mask, scope="training")
    assert _applies(FIXES["host_input_on_gpu"], ctx, {}) is offered
    assert _applies(FIXES["host_input_workers"], ctx, {})
