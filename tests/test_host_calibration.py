"""``profclass diagnose --untraced-step-ms``: the replay's host calibrated to the job's own step
without the profiler before any fix is priced (profclass/replay/calibrate.py): on a host-paced
capture the calibrated step meets the given one and the host-side prices shrink with the host;
on a GPU-bound capture no host speed reaches a shorter step, and the report says so; the JSON
holds ``replay.host_calibration`` (valid against the schema) and the reports say it."""
from __future__ import annotations

import html
import json

import pytest
from click.testing import CliRunner
from conftest import profile_path
from test_contract import _validate

import profclass
from profclass.cli import main
from profclass.replay import calibrate

HOST_PACED = "mcore_1gpu_dense_small"  # Megatron-Core, one GPU, host wall (snapshot: 34.0 ms, 31.1 untraced)
GPU_BOUND = "fp8_base_1gpu"  # compute wall: its step barely moves with the host
BIGGER = "host_bigger_launches"


@pytest.fixture(scope="module")
def host_paced():
    path = str(profile_path(HOST_PACED))
    plain = profclass.diagnose(path, price_fixes=(BIGGER,))
    given = round(0.85 * plain.replay["untraced_step_ms"], 1)
    return plain, profclass.diagnose(path, price_fixes=(BIGGER,), untraced_step_ms=given), given


def test_a_host_paced_step_is_met_by_a_faster_host(host_paced):
    plain, cal, given = host_paced
    hc = cal.replay["host_calibration"]
    assert hc["given_step_ms"] == given
    assert hc["replayed_step_ms"] == pytest.approx(plain.replay["untraced_step_ms"], abs=1e-3)
    assert 0.5 < hc["host_factor"] < 1.0
    assert cal.replay["untraced_step_ms"] == pytest.approx(given, rel=1e-3)
    assert hc["reached_step_ms"] == pytest.approx(given, rel=1e-3)
    assert "host_calibration" not in plain.replay
    assert not any("host calibration" in m for m in cal.missing)
    # uncalibrated, this launch-bound step is an upper bound; met, the given step is the job's own
    assert (plain.replay["untraced_step_bound"], cal.replay["untraced_step_bound"]) == ("upper", "calibrated")
    assert not any(m.startswith("replay: untraced_step_ms takes only") for m in cal.missing)


def test_host_side_prices_shrink_with_the_host_and_the_plan_starts_from_the_given_step(host_paced):
    plain, cal, _ = host_paced
    before = plain.replay["requested"][BIGGER]["best_ms"]
    after = cal.replay["requested"][BIGGER]["best_ms"]
    # a larger micro-batch removes host time: on a host x f as fast it saves about f as much, and
    # never more than the uncalibrated price
    assert 0 < after < before
    assert after == pytest.approx(before * cal.replay["host_calibration"]["host_factor"], rel=0.25)
    if cal.plan:
        assert cal.plan[0]["step_ms_after"] == pytest.approx(
            cal.replay["untraced_step_ms"] - cal.plan[0]["gain_ms"], abs=0.05)


def test_a_gpu_bound_step_out_of_the_hosts_reach_leaves_the_host_and_says_so():
    path = str(profile_path(GPU_BOUND))
    plain = profclass.diagnose(path)
    given = round(0.8 * plain.replay["untraced_step_ms"], 1)
    cal = profclass.diagnose(path, untraced_step_ms=given)
    hc = cal.replay["host_calibration"]
    assert hc["host_factor"] == 1.0
    assert cal.replay["untraced_step_ms"] == pytest.approx(plain.replay["untraced_step_ms"], abs=1e-3)
    assert [f["expected_gain_ms"] for f in cal.fixes] == [f["expected_gain_ms"] for f in plain.fixes]
    assert any(m.startswith("replay: host calibration: the given step") and "out of the host's reach" in m
               for m in cal.missing)
    assert cal.replay["untraced_step_bound"] == "estimate"  # not met: the replay's own step stands


def test_a_given_step_within_two_percent_leaves_the_host_as_replayed():
    path = str(profile_path(HOST_PACED))
    plain = profclass.diagnose(path)
    cal = profclass.diagnose(path, untraced_step_ms=1.01 * plain.replay["untraced_step_ms"])
    assert cal.replay["host_calibration"]["host_factor"] == 1.0
    assert cal.replay["untraced_step_ms"] == plain.replay["untraced_step_ms"]
    assert not any("host calibration" in m for m in cal.missing)


@pytest.mark.parametrize("shape, given, factor", [
    ("linear", 80.0, 0.8), ("linear", 150.0, 1.5),  # the step moves with the host: solved
    ("floor", 80.0, 1.0), ("linear", 300.0, 1.0)])  # a GPU floor above it / past twice as slow: left
def test_the_solver_meets_what_the_host_can_reach_and_nothing_else(shape, given, factor):
    step = (lambda f: 100.0 * f) if shape == "linear" else (lambda f: max(95.0, 100.0 * f))
    c = calibrate.solve(step, given)
    assert c.host_factor == pytest.approx(factor, abs=1e-3)
    assert c.reached == (factor != 1.0)
    assert c.reached_step_ms == pytest.approx(step(c.host_factor))


def test_out_of_reach_says_whether_a_gpu_floor_or_the_range_stops_it():
    """A given step a faster host than the range's cannot meet: one replay at BEYOND tells a GPU
    floor (no host meets it) from a host tracing slowed more than the range allows (call MG's dense
    stage, whose own log needed x0.44); either way the host is left as replayed."""
    floor = calibrate.solve(lambda f: max(95.0, 100.0 * f), 80.0)
    assert (floor.host_factor, floor.reached) == (1.0, False)
    assert "10x faster 95.0: the GPU's own time sets the step there" in floor.note
    short = calibrate.solve(lambda f: 100.0 * f, 37.0)
    assert (short.host_factor, short.reached) == (1.0, False)
    assert "10x faster 10.0: a host between those would meet it" in short.note
    assert "the host is left as replayed (100.0 ms)" in short.note


def test_cli_writes_the_calibration_into_the_json_and_the_reports():
    path = str(profile_path(HOST_PACED))
    run = CliRunner().invoke(main, ["diagnose", "-q", "--format", "json", path, "--untraced-step-ms", "26"])
    assert run.exit_code == 0, run.output
    d = json.loads(run.output)
    _validate("diagnose", d)  # closed: the schema describes replay.host_calibration
    assert d["replay"]["host_calibration"]["given_step_ms"] == 26.0
    for fmt, text in (("text", "the host x"), ("markdown", "Host calibrated to the job's own step"),
                      ("html", "Host calibrated to the job's own step")):
        out = CliRunner().invoke(main, ["diagnose", "-q", "--format", fmt, path, "--untraced-step-ms", "26"])
        assert out.exit_code == 0 and text in " ".join(html.unescape(out.output).split()), fmt


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan", "fast"])
def test_a_step_that_is_not_a_positive_number_is_a_usage_error(value):
    run = CliRunner().invoke(main, ["diagnose", "-q", str(profile_path(HOST_PACED)), "--untraced-step-ms", value])
    assert run.exit_code == 2
    assert "--untraced-step-ms" in run.output


def test_the_hook_passes_the_jobs_own_step_to_the_replay(tmp_path):
    """``profclass hook --untraced-step-ms``: the post-job hook, where the job's own timer is at
    hand, writes the calibration into its record."""
    run = CliRunner().invoke(main, ["hook", str(profile_path(HOST_PACED)), "--out", str(tmp_path),
                                    "--untraced-step-ms", "26"])
    assert run.exit_code == 0, run.output
    (record,) = tmp_path.glob("*.profclass.json")
    hc = json.loads(record.read_text())["diagnosis"]["replay"]["host_calibration"]
    assert hc["given_step_ms"] == 26.0 and hc["host_factor"] < 1.0


def test_a_given_step_longer_than_the_traced_one_is_not_this_jobs_and_is_set_aside():
    """Tracing only adds work: a step without the profiler longer than the captured step with it
    (a log's warm-up iterations, another configuration's number) leaves the host as replayed."""
    path = str(profile_path(HOST_PACED))
    plain = profclass.diagnose(path)
    cal = profclass.diagnose(path, untraced_step_ms=1.2 * plain.replay["measured_step_ms"])
    assert cal.replay["host_calibration"]["host_factor"] == 1.0
    assert cal.replay["untraced_step_ms"] == plain.replay["untraced_step_ms"]
    assert any("longer than the captured step with the profiler" in m for m in cal.missing)
    c = calibrate.solve(lambda f: 100.0 * f, 130.0, traced_ms=120.0)
    assert (c.host_factor, c.reached) == (1.0, False)
    assert calibrate.solve(lambda f: 100.0 * f, 118.0, traced_ms=120.0).host_factor == pytest.approx(1.18, abs=1e-3)
