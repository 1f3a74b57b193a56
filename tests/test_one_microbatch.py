"""One micro-batch a step (probe 18, a flagless TP 2 + SP x PP 2 x EP 2 job, read and not kept:
fixtures/ is at its size limit): its forward passes are counted whole where the step's edge cuts
one, and the pipeline schedule, which cannot split the first stage's work from its rest there,
is left unsimulated instead of dividing by zero."""
from __future__ import annotations

import numpy as np
import pandas as pd

from profclass.analyzers.recompute import forward_passes
from profclass.analyzers.results import PipelineResult
from profclass.replay import pipeline_schedule


def _ops(sides: list[str]) -> pd.DataFrame:
    return pd.DataFrame({"start": np.arange(len(sides), dtype=np.int64) * 10, "side": sides})


def test_a_forward_the_steps_edge_cuts_is_one_pass():
    # F(19) B(10) a step, the step's edge 14 kernels into each forward (as probe 18's last stage)
    sides = (["fwd"] * 14 + ["bwd"] * 10 + ["fwd"] * 5) * 4 + ["fwd"] * 14
    ops = _ops(sides)
    starts = ops["start"].to_numpy()[[29 * (k + 1) for k in range(4)]]  # each step starts 5 kernels into a forward
    passes, _ = forward_passes(ops, starts)
    assert round(passes) == 1, passes


def test_two_forwards_a_step_still_read_two():
    sides = (["fwd"] * 10 + ["bwd"] * 8) * 12
    ops = _ops(sides)
    starts = ops["start"].to_numpy()[[36 * k for k in range(6)]]
    passes, _ = forward_passes(ops, starts)
    assert round(passes) == 2, passes


def test_one_microbatch_leaves_the_schedule_unsimulated():
    pipe = PipelineResult(stages=2, virtual_stages=1, microbatches=1,
                          per_stage=[{"rank": 0, "stage": 0}, {"rank": 1, "stage": 1}])
    st, why = pipeline_schedule.from_job([], [], [0, 1], pipe, [1.0, 1.0])
    assert st is None and "one micro-batch" in why
