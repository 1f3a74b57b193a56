"""One steady window per job (issue 14): ranks of a synchronous job share one step.

On real captures: a PP job whose ranks each see a different sub-period, a no-NVTX whole run
with Megatron start-up, per-rank exports, a real export with one GPU made aperiodic, and
megatron.core's step range (with and without emit_nvtx op ranges)."""
from __future__ import annotations

import shutil
import sqlite3
import time

import numpy as np
import pandas as pd
import pytest

from conftest import PROFILES, profile_path
from profclass.analyzers import iterations
from profclass.inputs import resolve
from profclass.load import load
from profclass.timeline import build_ops, iter_gpus


def _steps(d) -> dict[int, float]:
    return {dv["rank"]: dv["step_ms"] for dv in d.devices}


def test_pp4_m16_takes_the_whole_step_not_a_sub_period(diagnosis):
    """16 micro-batches: ranks 0 and 2 alone find a ~440 ms repeat inside the 743 ms step."""
    d = diagnosis("mcore_pp4_m16")
    timer = PROFILES["mcore_pp4_m16"]["workload_step_ms"]
    assert d.window["step_ms"]["mean"] == pytest.approx(timer, rel=0.05)
    assert all(s == pytest.approx(timer, rel=0.05) for s in _steps(d).values())
    assert set(d.window["sources"].values()) <= {"periodicity", "job"}
    assert d.window["source"] == "periodicity"
    took = [g for g, s in d.window["sources"].items() if s == "job"]
    assert took and any(all(g in m for g in took) for m in d.missing)


def test_no_nvtx_whole_run_with_startup(diagnosis):
    """No NVTX, the whole run with Megatron start-up captured: every GPU finds the step."""
    d = diagnosis("mcore_ep4_nonvtx_whole")
    timer = PROFILES["mcore_ep4_nonvtx_whole"]["workload_step_ms"]
    assert set(d.window["sources"].values()) == {"periodicity"}
    assert all(s == pytest.approx(timer, rel=0.05) for s in _steps(d).values())
    assert d.window["iterations"] >= 3


def test_per_rank_exports_share_one_step(diagnosis):
    d = diagnosis("mcore_pp4_m4_perrank")
    steps = np.array(list(_steps(d).values()))
    assert steps.max() / steps.min() - 1 <= iterations.PERIOD_TOL
    assert np.median(steps) == pytest.approx(PROFILES["mcore_pp4_m4_perrank"]["workload_step_ms"], rel=0.1)
    assert "whole" not in d.window["sources"].values()


@pytest.fixture(scope="module")
def one_gpu_aperiodic(tmp_path_factory):
    """mcore_alltoall_4gpu (no NVTX) where GPU 1 keeps only its first 1.9 steps of kernels
    (a rank whose capture stopped early): too few repeats to find the step on its own, and one
    whole step between the other GPUs' marks (71 and 158 ms after its first kernel; the
    stretches before and after hold part of a step's kernels, so they are not steps)."""
    out = tmp_path_factory.mktemp("degraded") / "one_gpu_aperiodic.sqlite"
    with resolve([str(profile_path("mcore_alltoall_4gpu"))]) as files:
        shutil.copy(files[0].sqlite, out)
    step_ns = PROFILES["mcore_alltoall_4gpu"]["workload_step_ms"] * 1e6
    con = sqlite3.connect(out)
    dev = con.execute("SELECT DISTINCT deviceId FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY 1").fetchall()[1][0]
    t0 = con.execute("SELECT MIN(start) FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE deviceId=?", (dev,)).fetchone()[0]
    con.execute("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE deviceId=? AND start > ?",
                (dev, int(t0 + 1.9 * step_ns)))
    con.commit()
    con.close()
    return out, dev


def test_a_gpu_without_its_own_step_takes_the_jobs(one_gpu_aperiodic):
    import profclass
    path, dev = one_gpu_aperiodic
    prof = load(str(path))
    alone = {g.device: g for g in iter_gpus(prof, 0, build_ops(prof))}
    iterations.detect_iterations(alone[dev], None)
    assert alone[dev].window_source == "whole"  # the failure: on its own it has no step
    d = profclass.diagnose(str(path))
    by_dev = {dv["device"]: dv for dv in d.devices}
    assert by_dev[dev]["window_source"] == "job"
    assert "whole" not in d.window["sources"].values()  # never mixed with iterated GPUs
    others = [dv["step_ms"] for k, dv in by_dev.items() if k != dev]
    assert by_dev[dev]["step_ms"] == pytest.approx(np.median(others), rel=iterations.PERIOD_TOL)
    assert any("not found on that GPU alone" in m for m in d.missing)


@pytest.mark.parametrize("name", ["mcore_bridge_pp2_ep2", "mcore_bridge_pp2_ep2_emitnvtx"])
def test_megatron_nvtx_decorator_step_is_the_iteration(name, diagnosis):
    d = diagnosis(name)
    assert d.window["source"] == "nvtx"
    assert d.window["step_ms"]["median"] == pytest.approx(PROFILES[name]["workload_step_ms"], rel=0.05)


def test_emit_nvtx_op_ranges_cost_little():
    """~70k emit_nvtx op ranges (each text distinct: shapes, seq ids) do not trip the search
    for iteration ranges, and it stays fast."""
    with resolve([str(profile_path("mcore_bridge_pp2_ep2_emitnvtx"))]) as files:
        prof = load(files[0].sqlite)
    g = next(iter_gpus(prof, 0, build_ops(prof)))
    assert len(g.nvtx) > 50_000
    t0 = time.perf_counter()
    its = iterations.nvtx_iterations(g, iterations.DEFAULT_ITERATION_REGEX)
    assert time.perf_counter() - t0 < 2.0
    assert set(its["label"]) == {"__main__.train_step"}


@pytest.mark.parametrize("text,hit", [("megatron.training.training.train_step", True),
                                      ("__main__.train_step", True), ("iteration 12", True),
                                      ("megatron.core.transformer.mlp.forward.linear_fc1", False),
                                      ("aten::mm, seq = 12, op_id = 3", False),
                                      ("Optimizer.step#Adam.step", False), ("train_step_helper", False)])
def test_iteration_regex(text, hit):
    import re
    assert (re.search(iterations.DEFAULT_ITERATION_REGEX, text, re.I) is not None) == hit


def test_a_slow_last_step_is_judged_against_the_others():
    """The capture's last step can carry cudaProfilerStop's flush: 1.33x the others is not
    steady, even when it would pull a median that holds it past the warm-up factor."""
    import pandas as pd

    def steady(ms):
        edges = np.cumsum([0, *ms]) * 1_000_000
        return iterations.mark_steady(pd.DataFrame({"start": edges[:-1], "end": edges[1:]}))["steady"].tolist()

    assert steady([512, 518, 686]) == [True, True, False]
    assert steady([512, 518, 520]) == [True, True, True]  # a last step like the others stays


def test_gpu_bound_capture_drops_its_flushed_last_step(diagnosis):
    """mcore_gb_ep4_dpoverlap: its third captured step spans the profiler's stop (the timer's
    iteration 9 took 713 ms against 507-519 for 6-8); the window keeps the other two."""
    d = diagnosis("mcore_gb_ep4_dpoverlap")
    timer = PROFILES["mcore_gb_ep4_dpoverlap"]["workload_step_ms"]
    assert d.window["step_ms"]["mean"] == pytest.approx(timer, rel=0.03)
    assert max(d.window["step_ms"]["per_iteration"]) < 1.1 * timer


def test_step_spans_stay_exact_integers_near_the_int64_limit():
    """Step ends are the next step's start, in int64: through float64 (a pandas shift) they
    lost nanoseconds past 2**53 and overflowed, with a RuntimeWarning, near 2**63."""
    import warnings

    big = 2**62
    its = pd.DataFrame({"start": [big + 2, big, 2**63 - 900], "end": [big + 3, big + 1, 2**63 - 1],
                        "label": ["b", "a", "c"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = iterations.mark_steady(its)
    assert out["step_end"].tolist() == [big + 2, 2**63 - 900, 2**63 - 1]
    assert out["step_end"].dtype == np.int64


def _captured_from_process_start(command: str) -> bool:
    """The construction's answer: nsys traced from the launch unless the command (or, for
    capture_layouts.sh, every set but whole_small: its $PROF) gives a capture range."""
    if "capture_layouts.sh" in command:
        return "whole_small" in command
    return "--capture-range" not in command


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_capture_start_read_as_the_capture_was_made(name, diagnosis):
    """``window.capture_start`` from each process's first CUDA call, against the command that
    made the capture (corpus.toml); a capture from the process's start says in missing[] that
    the window is the run's first steps, a capture range does not."""
    d = diagnosis(name)
    process = _captured_from_process_start(PROFILES[name]["command"])
    assert d.window["capture_start"] == ("process" if process else "range")
    said = any(m.startswith("the run's later steps") for m in d.missing)
    assert said == process
    assert 0 <= d.window["iterations_before"]
