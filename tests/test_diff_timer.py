"""diff decides on the runs' own timers where both training logs are given (profclass/diff/timer.py).
The labels are the workloads' untraced timers and the pairs' construction (corpus.toml), not
profclass: a decision on one replicate's logs is judged against the other replicate's runs."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import profile_path
from profclass.cli import main
from profclass.diff.compare import diff
from profclass.train_log import parse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "workloads"))
import diff_decisions  # noqa: E402
import gain_pairs  # noqa: E402

# call IA's untraced reruns of the drop-and-pad pair (corpus.toml): 1x H200, no nsys
DROPLESS_LOG = "fixtures/timers/s49/ia_ia_moe1_learned_u1.log"
PADDED_LOG = "fixtures/timers/s49/ia_ia_moe1_capacity_u1.log"


def _log(path: str):
    return parse(gain_pairs.timer_text(path), path)


def _write(tmp_path: Path, path: str, keep: int | None = None) -> str:
    """A packed timer log as a file (its first ``keep`` lines only, where given)."""
    text = gain_pairs.timer_text(path)
    if keep is not None:
        text = "\n".join(text.splitlines()[:keep]) + "\n"
    out = tmp_path / Path(path).name
    out.write_text(text)
    return str(out)


def test_the_runs_logs_decide_where_two_captured_iterations_cannot(diagnosis):
    """Drop-and-pad saved 22% a step (the reruns: 23.8 ms). Two captured iterations a side cannot
    show it (Welch p = 0.25, df 1); the two runs' logs, 25 values a side, do, and the fix's row
    gets the gain on its price's footing."""
    b, c = diagnosis("mcore_moe1_dropless"), diagnosis("mcore_moe1_padded")
    windows = diff(b, c)
    assert windows.change == "no significant change" and windows.step["timer"] is None
    r = diff(b, c, base_log=_log(DROPLESS_LOG), candidate_log=_log(PADDED_LOG))
    t = r.step["timer"]
    assert r.change == "improvement" and r.judged_step is t
    assert (t["base"]["values"], t["candidate"]["values"], t["work_ratio"]) == (25, 25, 1.0)
    assert t["test"]["significant"] and t["test"]["p_value"] < 1e-3
    # the windows' own test is kept as it was
    assert r.step["test"] == windows.step["test"]
    (row,) = r.fix_gains
    assert row["realized_gain_timer_ms"] == pytest.approx(-t["delta_ms"])
    # the second replicate, which the decision did not read, realized 25.6 ms
    assert row["realized_gain_timer_ms"] == pytest.approx(25.6, abs=0.15 * 25.6)
    assert row["within_range_timer"] is (row["gain_low_ms"] <= row["realized_gain_timer_ms"] <= row["gain_high_ms"])
    assert "by the runs' timers" in r.verdict["summary"] and "the runs' own timers" in r.verdict["summary"]


def test_logs_judge_per_the_base_work_where_the_pair_changed_it(diagnosis):
    """4 -> 8 micro-batches of one size: the candidate's log values are divided by the work ratio,
    as the windows' are (the reruns saved 147.5 ms a step per the base's work)."""
    pair = next(p for p in gain_pairs.corpus()["gain_pair"] if p["candidate"] == "mcore_gb_pp4_m8")
    logs = [_log(pair["untraced"][side][0]) for side in ("base", "candidate")]
    r = diff(diagnosis("mcore_gb_pp4_m4"), diagnosis("mcore_gb_pp4_m8"), base_log=logs[0], candidate_log=logs[1])
    t = r.step["timer"]
    assert t["work_ratio"] == r.step["work"]["ratio"] == 2.0
    assert r.change == "improvement" and r.judged_step is t
    assert -t["delta_ms"] == pytest.approx(147.5, abs=0.15 * 147.5)
    assert r.fix_gains[0]["realized_per"] == "base work"


def test_a_log_with_too_few_values_leaves_the_decision_to_the_windows(diagnosis, tmp_path):
    """A log cut after its warm-up and one more iteration holds one value: untested, said in
    notes[], and the decision is the windows' as without logs."""
    b, c = diagnosis("mcore_moe1_dropless"), diagnosis("mcore_moe1_padded")
    short = parse(Path(_write(tmp_path, DROPLESS_LOG, keep=3)).read_text(), "short.log")
    r = diff(b, c, base_log=short, candidate_log=_log(PADDED_LOG))
    assert r.step["timer"]["test"] is None and r.step["timer"]["base"]["values"] == 1
    assert r.change == diff(b, c).change and r.judged_step is r.step
    assert any("short.log" in n and "not tested" in n for n in r.notes)
    assert all(row["realized_gain_timer_ms"] is None for row in r.fix_gains)
    with pytest.raises(ValueError, match="both runs' training logs"):  # one timer has nothing to compare with
        diff(b, c, base_log=short)


def test_cli_logs_usage_and_bad_input(tmp_path):
    base, cand = str(profile_path("mcore_moe1_dropless")), str(profile_path("mcore_moe1_padded"))
    blog, clog = _write(tmp_path, DROPLESS_LOG), _write(tmp_path, PADDED_LOG)
    runner = CliRunner()
    ok = runner.invoke(main, ["diff", base, cand, "--base-log", blog, "--candidate-log", clog, "--format", "json"])
    assert ok.exit_code == 0, ok.output
    out = json.loads(ok.output)
    assert out["change"] == "improvement" and out["step"]["timer"]["test"]["significant"]
    text = runner.invoke(main, ["diff", base, cand, "--base-log", blog, "--candidate-log", clog])
    assert "Timers (the runs' training logs, outside the profiler)" in text.output
    one = runner.invoke(main, ["diff", base, cand, "--base-log", blog])
    assert one.exit_code == 2 and "both --base-log and --candidate-log" in one.output
    bad = runner.invoke(main, ["diff", base, cand, "--base-log", str(ROOT / "README.md"), "--candidate-log", clog])
    assert bad.exit_code == 2 and "README.md" in bad.output and "Traceback" not in bad.output
    assert len(bad.output.strip().splitlines()) == 1


def test_cli_reads_another_format_with_a_regex(tmp_path):
    """A log in a format of one's own: --train-log-regex reads both."""
    base, cand = str(profile_path("mcore_moe1_dropless")), str(profile_path("mcore_moe1_padded"))
    logs = []
    for path in (DROPLESS_LOG, PADDED_LOG):
        text = re.sub(r"STEP_MS it=(\d+) ms=", r"step \1 took ", gain_pairs.timer_text(path))
        (tmp_path / Path(path).name).write_text(text)
        logs.append(str(tmp_path / Path(path).name))
    r = CliRunner().invoke(main, ["diff", base, cand, "--base-log", logs[0], "--candidate-log", logs[1],
                                  "--train-log-regex", r"step (?P<it>\d+) took (?P<ms>[0-9.]+)", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["step"]["timer"]["base"]["values"] >= 20


def test_the_decisions_table_in_the_docs_is_what_the_timers_give():
    """workloads/diff_decisions.py, recomputed: each pair decided on its first untraced replicate's
    logs against its second replicate's outcome; docs/diff.md quotes the count."""
    rows = diff_decisions.timer_rows()
    hits = sum(r["decided"] == r["outcome"] for r in rows)
    assert len(rows) >= 80
    assert f"{hits} of {len(rows)}" in (ROOT / "docs" / "diff.md").read_text()
    # the drop-and-pad pair is decided as its other replicate ran
    row = next(r for r in rows if r["pair"]["candidate"] == "mcore_moe1_padded")
    assert row["decided"] == row["outcome"] == "improvement"
