"""One micro-batch a step (probe 18, a flagless TP 2 + SP x PP 2 x EP 2 job, read and not kept:
fixtures/ is at its size limit): the pipeline schedule, which cannot split the first stage's
work from its rest there, is left unsimulated instead of dividing by zero."""
from __future__ import annotations

from profclass.analyzers.results import PipelineResult
from profclass.replay import pipeline_schedule


def test_one_microbatch_leaves_the_schedule_unsimulated():
    pipe = PipelineResult(stages=2, virtual_stages=1, microbatches=1,
                          per_stage=[{"rank": 0, "stage": 0}, {"rank": 1, "stage": 1}])
    st, why = pipeline_schedule.from_job([], [], [0, 1], pipe, [1.0, 1.0])
    assert st is None and "one micro-batch" in why
