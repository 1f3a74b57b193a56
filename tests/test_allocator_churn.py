"""Allocator churn in the replay: a cudaFree waits for the device before it frees (an implicit
device sync), so the replay holds it as a wait on the GPU's work, not as CPU time; the
memory_allocator_churn transform takes the allocator's calls away, waits included
(docs/replay.md, "Allocator churn")."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from profclass import diagnose
from profclass.replay.run import replayer_of
from profclass.replay.scenario import captured
from profclass.replay.trace import ALLOC
from profclass.replay import transforms

ROOT = Path(__file__).resolve().parents[1]


def _diagnosis(name: str):
    return diagnose(str(next((ROOT / "fixtures" / "profiles").glob(f"{name}.sqlite*"))), keep_replay=True)


@pytest.fixture(scope="module")
def churn():
    """moe_train.py's memory preset: torch.cuda.empty_cache() at the end of every step."""
    return _diagnosis("memory_1gpu")


def test_a_free_that_returned_after_the_gpu_drained_waits_for_the_latest_op(churn):
    waits = 0
    for t in churn.extra.replay_inputs.traces:
        c = t.calls
        w = np.flatnonzero((c.c_kind == ALLOC) & (c.c_target >= 0))
        waits += len(w)
        ends = t.ops.start + t.ops.dur
        for i in w:
            # the awaited op is the latest to end inside the call, and the call's own time is what it
            # took after that end, never its whole measured length
            assert t.ops.start[c.c_target[i]] < c.c_start[i] + c.c_dur[i] + c.c_wake[i]
            assert ends[c.c_target[i]] == ends[ends <= ends[c.c_target[i]]].max()
            assert c.c_dur[i] <= max(c.c_wake[i], 1)
    # one empty_cache a step: its first free drains the device (5 steps in the window)
    assert waits >= 5
    assert abs(churn.replay["error_pct"]) < 0.5
    assert churn.replay["graph"]["unexplained_ms_per_step"] < 0.05  # the free's work after the drain is its own


def test_dropping_the_allocator_calls_takes_their_waits_too(churn):
    r = replayer_of(churn.extra.replay_inputs)
    ws = [captured(t) for t in r.traces]
    out = transforms.apply({"kind": "drop_allocs"}, "best", r.traces, ws, r.ctx)
    for t, w in zip(r.traces, out):
        alloc = t.calls.c_kind == ALLOC
        assert not w.c_dur[alloc].any() and not w.c_blocks[alloc].any()
        # nothing else moves: the other calls keep their time and their waits
        base = captured(t)
        assert (w.c_dur[~alloc] == base.c_dur[~alloc]).all() and (w.c_blocks[~alloc] == base.c_blocks[~alloc]).all()
