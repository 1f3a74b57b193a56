"""``--train-log``: the job's own step without the profiler read from its training log
(profclass/train_log.py) and passed to the replay's calibration as ``--untraced-step-ms`` would
be. Real logs only: this repository's workload logs (fixtures/timers.tar.xz) and excerpts of
Megatron-LM and NeMo logs quoted in public issues (tests/data/train_logs, README there). Every
expected number is worked out here from the log's text by the test's own regex and selection."""
from __future__ import annotations

import importlib.util
import json
import re
import statistics
import tarfile

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import PROFILES, ROOT, profile_path
from test_bad_input import assert_bad_input
from test_contract import _validate
from test_host_calibration import HOST_PACED

import profclass
from profclass import train_log
from profclass.cli import main
from profclass.errors import ProfileError

LOGS = ROOT / "tests" / "data" / "train_logs"
TIMERS = ROOT / "fixtures" / "timers.tar.xz"
DENSE = "s33/ba_ba_dense.log"  # a capture run: 24 steps, traced at 18..20, untraced after
HOST_PACED_LOG = "mcore_1gpu_dense_small.log"  # HOST_PACED's own capture run: 8 steps, traced at 5..7


@pytest.fixture(scope="module")
def workload_log(tmp_path_factory):
    """A workload's timer log from the packed timers, written out as a file: name -> path."""
    out = tmp_path_factory.mktemp("timers")

    def get(name: str):
        path = out / name.replace("/", "_")
        if not path.exists():
            with tarfile.open(TIMERS, "r:xz") as tar:
                path.write_bytes(tar.extractfile(f"fixtures/timers/{name}").read())
        return path
    return get


def _step_ms(text: str) -> dict[int, float]:
    return {int(i): float(ms) for i, ms in re.findall(r"STEP_MS it=(\d+) ms=(\S+)", text)}


def _captured(text: str) -> tuple[int, int]:
    a, b = re.search(r"mean step over iters (\d+)\.\.(\d+)", text).groups()
    return int(a), int(b)


def test_a_workload_log_leaves_out_warm_up_and_the_captured_steps_with_the_step_either_side(workload_log):
    path = workload_log(DENSE)
    steps, (a, b) = _step_ms(path.read_text()), _captured(path.read_text())
    # why the step either side goes too: they start and stop the profiler
    steady = statistics.median(steps[i] for i in range(2, a - 1))
    assert steps[a - 1] > 1.5 * steady and steps[b + 1] > 5 * steady and steps[1] > 2 * steady
    kept = [i for i in steps if i != 1 and not a - 1 <= i <= b + 1]
    got = train_log.read_untraced_step(path)
    assert got.format == train_log.STEP_MS.name and got.per_value == 1
    assert got.iterations_used == tuple(kept) and kept[-1] > b + 1  # the steps after the capture count
    assert got.iterations_skipped == ((1, "warm-up"), *((i, "profiled") for i in range(a - 1, b + 2)))
    assert got.step_ms == pytest.approx(np.median([steps[i] for i in kept]))
    assert f"iterations {a - 1}-{b + 1} profiled" in got.basis and "iteration 1 warm-up" in got.basis
    assert got.missing is None


def test_asked_iterations_are_left_out_too(workload_log):
    path = workload_log(DENSE)
    steps, (a, _) = _step_ms(path.read_text()), _captured(path.read_text())
    last = max(steps)
    got = train_log.read_untraced_step(path, skip=[train_log.skip_range(f"{last - 2}..{last}")])
    assert got.iterations_used == tuple(range(2, a - 1))
    assert got.step_ms == pytest.approx(np.median([steps[i] for i in range(2, a - 1)]))
    assert f"iterations {last - 2}-{last} asked (--train-log-skip)" in got.basis
    for bad in ("3..1", "x", "1..", "-2"):
        with pytest.raises(ValueError):
            train_log.skip_range(bad)


# file, the test's own regex for (iteration, time), seconds?, iterations per value
REAL = [("megatron_lm_issue756.log", r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)", False, 1),
        ("megatron_lm_issue60.log", r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)", False, 5),
        ("megatron_lm_issue5.log", r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)", False, 100),
        ("megatron_lm_issue449.log", r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)", False, 100),
        ("nemo_bionemo_recipes_pr740.log", r"iteration (\d+)/.*?train_step_timing in s: ([\d.]+)", True, 1)]


@pytest.mark.parametrize("name, pattern, seconds, per_value", REAL, ids=[r[0] for r in REAL])
def test_real_megatron_and_nemo_logs_read_as_their_own_lines_say(name, pattern, seconds, per_value):
    text = (LOGS / name).read_text()
    pairs = [(int(i), float(v) * (1e3 if seconds else 1.0)) for i, v in re.findall(pattern, text)]
    log = train_log.read(LOGS / name)
    assert log.format == (train_log.NEMO if seconds else train_log.MEGATRON_LM).name
    assert log.iterations == tuple(i for i, _ in pairs)
    assert log.values_ms == pytest.approx([v for _, v in pairs])
    assert log.per_value == per_value
    got = train_log.untraced_step(log)
    # the first logged value holds the process's start: 16491.5 ms against 1993.9 next on issue 60
    assert got.iterations_skipped == ((pairs[0][0], "warm-up"),)
    assert got.step_ms == pytest.approx(np.median([v for _, v in pairs[1:]]))


def test_an_interval_mean_that_meets_the_launch_lines_profiled_range_is_left_out_whole():
    """Megatron-LM traces the steps logged S+1..E and stops after E's log line (its training.py):
    with --profile-step-start 250 --profile-step-end 260 on a --log-interval 100 log, the value
    at 300 (the mean of 201..300) goes; 200 is warm-up."""
    text = (LOGS / "megatron_lm_issue5.log").read_text()
    ms = {int(i): float(v) for i, v in re.findall(r"iteration\s+(\d+)/.*?\(ms\): ([\d.]+)", text)}
    flags = {"--profile": True, "--profile-step-start": "250", "--profile-step-end": "260"}
    profiled = train_log.profiled_by_launch_line(flags)
    assert [(r.first, r.last) for r in profiled] == [(251, 261)]
    got = train_log.read_untraced_step(LOGS / "megatron_lm_issue5.log", profiled=profiled)
    assert got.iterations_skipped == ((200, "warm-up"), (300, "profiled"))
    assert got.step_ms == pytest.approx(np.median([ms[400], ms[500], ms[600]]))
    assert "--profile-step-start 250 --profile-step-end 260 on the launch line" in got.basis
    # per iteration: the steps logged 30 and 31 (traced 30, the stop in 31's interval) go, 29 stays
    got = train_log.read_untraced_step(LOGS / "megatron_lm_issue756.log", profiled=train_log.profiled_by_launch_line(
        {"--profile": True, "--profile-step-start": "29", "--profile-step-end": "30"}))
    assert [i for i, why in got.iterations_skipped if why == "profiled"] == [30, 31] and 29 in got.iterations_used
    assert [(r.first, r.last) for r in train_log.profiled_by_launch_line({"--profile": True})] == [(11, 13)]
    assert train_log.profiled_by_launch_line({"--profile-step-start": "5"}) == ()  # no --profile: no capture


def test_a_log_with_fewer_than_two_values_left_gives_no_step_and_says_why():
    got = profclass.train_log.read_untraced_step(LOGS / "megatron_lm_nccl_issue743.log")  # a public submodule
    assert got.step_ms is None and got.iterations_used == (20,)
    assert "fewer than 2 values left" in got.missing and "not calibrated" in got.missing


def test_a_format_of_ones_own(workload_log):
    path = workload_log(DENSE)
    own = train_log.read(path, regex=r"STEP_MS it=(?P<it>\d+) ms=(?P<ms>[\d.]+)")
    assert (own.iterations, own.values_ms) == (train_log.read(path).iterations, train_log.read(path).values_ms)
    nemo = train_log.read(LOGS / "nemo_bionemo_recipes_pr740.log", regex=r"timing in s: (?P<s>[\d.]+)")
    assert nemo.iterations == tuple(range(1, 7))  # no it group: the matches in order
    assert nemo.values_ms == train_log.read(LOGS / "nemo_bionemo_recipes_pr740.log").values_ms
    for bad, why in ((r"STEP_MS it=(\d+)", "needs one named group"), (r"(?P<ms>", "not a valid regular expression"),
                     (r"(?P<ms>x)(?P<s>y)", "needs one named group")):
        with pytest.raises(ProfileError, match=why):
            train_log.read(path, regex=bad)
    with pytest.raises(ProfileError, match="no line holds a line matching"):
        train_log.read(path, regex=r"nothing (?P<ms>\d+)")


def test_the_calibration_takes_the_logs_step_and_says_where_it_came_from(workload_log):
    """HOST_PACED's own capture run's log: steps 2 and 3 are all that is left (1 warm-up, 4..8
    around the captured 5..7, and the launch line's --profile-step-start 5 --profile-step-end 8),
    and the calibration is the one --untraced-step-ms gives that number."""
    path = workload_log(HOST_PACED_LOG)
    steps = _step_ms(path.read_text())
    given = float(np.median([steps[2], steps[3]]))
    run = CliRunner().invoke(main, ["diagnose", "-q", "--format", "json", str(profile_path(HOST_PACED)),
                                    "--train-log", str(path)])
    assert run.exit_code == 0, run.output
    d = json.loads(run.output)
    _validate("diagnose", d)
    hc = d["replay"]["host_calibration"]
    assert hc["given_step_ms"] == pytest.approx(given, abs=1e-3)
    assert hc["source"].startswith(f"train log {path}: ") and "iterations 2-3 (2 log lines)" in hc["source"]
    assert "iterations 4-8 profiled" in hc["source"] and "--profile-step-start 5 --profile-step-end 8" in hc["source"]
    same = profclass.diagnose(str(profile_path(HOST_PACED)), untraced_step_ms=given).replay["host_calibration"]
    assert same["source"] == train_log.GIVEN_SOURCE
    assert {k: v for k, v in hc.items() if k != "source"} == {k: v for k, v in same.items() if k != "source"}
    assert hc["host_factor"] < 1.0  # the untraced steps ran faster than the replay's untraced step
    for fmt, said in (("markdown", f"from train log {path}"), ("text", "to meet the train log's step")):
        text = CliRunner().invoke(main, ["diagnose", "-q", "--format", fmt, str(profile_path(HOST_PACED)),
                                         "--train-log", str(path)]).output
        assert said in " ".join(text.split()), fmt


def test_a_log_that_gives_no_step_leaves_the_host_and_the_diagnosis_goes_on():
    d = profclass.diagnose(str(profile_path(HOST_PACED)), train_log=LOGS / "megatron_lm_nccl_issue743.log")
    assert "host_calibration" not in d.replay
    assert any(m.startswith("train log ") and "fewer than 2 values left" in m for m in d.missing)


@pytest.mark.parametrize("command", ["diagnose", "hook"])
def test_a_step_and_a_log_together_or_log_options_without_a_log_are_usage_errors(command, tmp_path):
    profile = str(profile_path(HOST_PACED))
    log = str(LOGS / "megatron_lm_issue5.log")
    for args, why in (([profile, "--train-log", log, "--untraced-step-ms", "30"], "not both"),
                      ([profile, "--train-log-skip", "1..3"], "--train-log FILE"),
                      ([profile, "--train-log-regex", "(?P<ms>x)"], "--train-log FILE"),
                      ([profile, "--train-log", log, "--train-log-regex", "(?P<ms>"], "not a valid regular")):
        run = CliRunner().invoke(main, [command, *args, *(["--out", str(tmp_path)] if command == "hook" else [])])
        assert run.exit_code == 2 and why in run.output, run.output
    assert not list(tmp_path.iterdir())  # refused before any work
    with pytest.raises(ProfileError, match="not both"):
        profclass.diagnose(profile, untraced_step_ms=30, train_log=log)


@pytest.mark.parametrize("log, problem", [("missing.log", "cannot read the training log (No such file"),
                                          (".", "cannot read the training log (is a directory)"),
                                          ("README.md", "no iteration times in the training log")])
def test_a_log_that_cannot_be_read_or_holds_no_iteration_time_is_one_line_and_exit_2(log, problem):
    path = LOGS / log if log != "." else LOGS
    assert_bad_input([profile_path(HOST_PACED), "--train-log", path], path, problem)


def test_the_hook_reads_the_jobs_log_and_goes_on_without_an_unreadable_one(tmp_path, workload_log):
    profile, log = str(profile_path(HOST_PACED)), str(workload_log(HOST_PACED_LOG))
    run = CliRunner().invoke(main, ["hook", profile, "--out", str(tmp_path / "ok"), "--train-log", log])
    assert run.exit_code == 0, run.output
    (record,) = (tmp_path / "ok").glob("*.profclass.json")
    hc = json.loads(record.read_text())["diagnosis"]["replay"]["host_calibration"]
    assert hc["source"].startswith(f"train log {log}: ") and hc["host_factor"] < 1.0
    missing = str(tmp_path / "missing.log")
    run = CliRunner().invoke(main, ["hook", profile, "--out", str(tmp_path / "bad"), "--train-log", missing])
    assert run.exit_code == 0 and f"profclass: error: {missing}: cannot read the training log" in run.output
    (record,) = (tmp_path / "bad").glob("*.profclass.json")
    d = json.loads(record.read_text())["diagnosis"]
    assert "host_calibration" not in d["replay"]
    assert any(m.startswith(f"{missing}: cannot read") and "not calibrated" in m for m in d["missing"])
    strict = CliRunner().invoke(main, ["hook", profile, "--out", str(tmp_path / "strict"), "--train-log", missing,
                                       "--strict"])
    assert strict.exit_code == 2 and not (tmp_path / "strict").exists()


def test_the_corpus_scripts_read_the_workload_logs_as_before():
    """workloads/calibrated_pairs.py's given step (the capture run's untraced steps 2 up to the
    first captured one) and gain_pairs.py's captured median, now through profclass.train_log,
    against their former regexes, on every corpus profile with a timer log."""
    spec = importlib.util.spec_from_file_location("calibrated_pairs", ROOT / "workloads" / "calibrated_pairs.py")
    cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cp)
    checked = 0
    for p in PROFILES.values():
        if not p.get("timer"):
            continue
        text = cp.gp.timer_text(p["timer"])
        m = re.search(r"mean step over iters (\d+)\.\.(\d+)", text)
        steps = [(int(i), float(ms)) for i, ms in re.findall(r"STEP_MS it=(\d+) ms=([0-9.]+)", text)]
        before = [ms for i, ms in steps if m and 2 <= i < int(m.group(1))]
        captured = [ms for i, ms in steps if m and int(m.group(1)) <= i <= int(m.group(2))]
        assert cp.own_untraced_ms(p) == (statistics.median(before) if len(before) >= 2 else None), p["name"]
        assert cp.gp.timer_median(p) == (statistics.median(captured) if captured else None), p["name"]
        checked += bool(before)
    assert checked > 20
