"""diff judges a pair that changed the work a step per the base's work (profclass/diff/work.py):
twice the micro-batches in 1.5x the time is an improvement of throughput, not a regression, and
half the batch in two thirds of the time is a regression. The labels come from the pairs'
construction (corpus.toml: ``realized = "per_microbatch"`` where the candidate ran more
micro-batches of the same size) and the workload's own untraced timers, not from profclass."""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import profile_path, relaunched
from profclass.cli import main
from profclass.diff.compare import diff
from profclass.diff.fix_gains import side_settings
from profclass.diff.work import ROWS, ROWS_MEASURE, SEQUENCES, global_batch_note, step_work

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))
import gain_pairs  # noqa: E402

CORPUS = tomllib.loads((ROOT / "fixtures" / "corpus.toml").read_text())
PROFILES = {p["name"] for p in CORPUS["profile"]}
COMMITTED = [p for p in CORPUS["gain_pair"] if p["candidate"] in PROFILES]


def _untraced_means(pair: dict) -> tuple[float, float]:
    """The workload's own untraced step (ms), base and candidate, the mean over their reruns."""
    import numpy as np
    runs = pair["untraced"]
    side = lambda logs: float(np.mean([np.mean(gain_pairs.untraced_steps(x)) for x in logs]))  # noqa: E731
    return side(runs["base"]), side(runs["candidate"])


@pytest.mark.parametrize("pair", COMMITTED, ids=[f"{p['base']}->{p['candidate']}" for p in COMMITTED])
def test_the_work_ratio_follows_the_pairs_construction(pair, diagnosis):
    """Every committed pair: a work ratio other than 1 exactly where the construction changed the
    micro-batches a step at the same size (corpus ``realized = "per_microbatch"``), and that
    ratio is the micro-batch counts' own."""
    b, c = diagnosis(pair["base"]), diagnosis(pair["candidate"])
    w = step_work(side_settings(b), side_settings(c), b.layout["sizes"], c.layout["sizes"])
    if pair.get("realized") == "per_microbatch":
        mb, mc = b.layout["sizes"]["microbatches"], c.layout["sizes"]["microbatches"]
        assert w is not None and w["ratio"] == pytest.approx(mc / mb), w
        # more micro-batches of one size at one DP: a larger global batch, said as such
        assert global_batch_note(w, b.layout["sizes"], c.layout["sizes"])
    else:
        assert w is None or w["ratio"] == 1.0, w
        assert not global_batch_note(w, b.layout["sizes"], c.layout["sizes"])


def test_the_same_global_batch_over_half_the_ranks_is_no_change_to_the_training():
    """Twice the sequences per rank at half the DP is the same global batch: judged per the base's
    work, with no note that the training changed; at the same DP it is twice the global batch."""
    w = dict(ratio=2.0, basis="base --global-batch-size 16 / DP 4; candidate --global-batch-size 16 / DP 2")
    assert global_batch_note(w, {"dp": 4}, {"dp": 2}) == []
    (note,) = global_batch_note(w, {"dp": 2}, {"dp": 2})
    assert note.startswith("the candidate trains 2x the base's global batch")


WORK_PAIRS = [p for p in COMMITTED if p.get("realized") == "per_microbatch"]
BY_NAME = {p["name"]: p for p in CORPUS["profile"]}


@pytest.mark.parametrize("pair", WORK_PAIRS, ids=[f"{p['base']}->{p['candidate']}" for p in WORK_PAIRS])
def test_more_work_a_step_is_judged_per_the_base_work_as_the_timer_says(pair, diagnosis):
    """The decision reads the step per the base's work, in the direction the captured runs' own
    CUDA-event timer gives per the base's work (corpus ``workload_step_ms``), whatever the raw
    step did: a longer step for twice the micro-batches is not, by itself, a regression."""
    base, cand = BY_NAME[pair["base"]], BY_NAME[pair["candidate"]]
    timer_gain = gain_pairs.realized_gain(pair, base, cand, (base["workload_step_ms"], cand["workload_step_ms"]))
    r = diff(diagnosis(pair["base"]), diagnosis(pair["candidate"]))
    w = r.step["work"]
    assert w["measure"] == SEQUENCES and w["ratio"] == 2.0
    assert r.step["delta_ms"] > 0 and r.judged_step is w  # every such pair's raw step grew
    assert w["candidate_ms_per_base_work"] == pytest.approx(r.step["candidate_ms"] / 2, abs=0.01)
    assert (w["delta_ms"] < 0) == (timer_gain > 0), (w["delta_ms"], timer_gain)
    assert r.change == ("no significant change" if not w["test"]["significant"] else
                        "improvement" if w["delta_ms"] < 0 else "regression")
    assert "per the base's work" in r.verdict["summary"]
    assert any("2x the base's global batch" in n for n in r.notes)
    (row,) = r.fix_gains
    assert row["realized_per"] == "base work" and row["realized_gain_ms"] == pytest.approx(-w["delta_ms"], abs=0.01)


def test_a_gpu_bound_pair_is_an_improvement_as_the_untraced_timer_says(diagnosis):
    """The GPU-bound PP 4 job, 4 -> 8 micro-batches: the untraced reruns' timer realizes 147.5 ms
    a step per the base's work, and the diff calls it an improvement (p < 0.01)."""
    (pair,) = [p for p in WORK_PAIRS if p["base"] == "mcore_gb_pp4_m4"]
    tb, tc = _untraced_means(pair)
    assert tc > tb and tc / 2 < tb
    r = diff(diagnosis("mcore_gb_pp4_m4"), diagnosis("mcore_gb_pp4_m8"))
    assert r.improvement and not r.regression and r.verdict["summary"].startswith("Improvement")


def test_half_the_work_in_less_time_is_a_regression(diagnosis):
    """The same pair the other way: the step is 33% shorter for half the micro-batches, and per the
    base's work 34% longer (the timer: 894 -> 600 ms a step, 1200 per the base's 8 micro-batches)."""
    (pair,) = [p for p in WORK_PAIRS if p["base"] == "mcore_gb_pp4_m4"]
    tb, tc = _untraced_means(pair)
    assert tb * 2 > tc  # reversed: the m4 run's step x2 is the longer time for the m8's work
    r = diff(diagnosis("mcore_gb_pp4_m8"), diagnosis("mcore_gb_pp4_m4"))
    assert r.step["delta_ms"] < 0 and r.step["work"]["ratio"] == 0.5
    assert r.regression and not r.improvement and r.judged_step["delta_pct"] > 30


def test_cli_fail_above_reads_the_change_per_the_base_work(tmp_path):
    """--fail-above: the raw step's +49% is not the gate; per the base's work it is -25%, and the
    reverse pair (+34% per work, -33% raw) fails it."""
    m4, m8 = (str(profile_path(n)) for n in ("mcore_gb_pp4_m4", "mcore_gb_pp4_m8"))
    up = CliRunner().invoke(main, ["diff", m4, m8, "--fail-above", "3"])
    assert up.exit_code == 0, up.output
    assert "Work: the candidate does x2 the base's work a step" in up.output
    down = CliRunner().invoke(main, ["diff", m8, m4, "--fail-above", "3", "--format", "markdown"])
    assert down.exit_code == 4, down.output
    assert down.output.startswith("## profclass diff: **Regression** (+")


def test_flagless_pair_measures_its_work_in_rows(tmp_path):
    """The launch line replaced by a wrapper's (no flag names the batch): the micro-batch count and
    the normalisation kernels' rows off the timeline measure the work, with the same decision."""
    made = [relaunched(n, tmp_path / f"{n}.sqlite", lambda command, args: ("train", ["job.yaml"]))
            for n in ("mcore_gb_pp4_m4", "mcore_gb_pp4_m8")]
    r = diff(*made)
    w = r.step["work"]
    assert w["measure"] == ROWS_MEASURE and w["ratio"] == 2.0 and "rows x" in w["basis"]
    assert r.improvement and not r.regression


def test_a_bigger_micro_batch_at_the_same_global_batch_is_the_same_work(diagnosis):
    """Micro-batch 1 -> 4 with the micro-batches 8 -> 2: the same sequences a step, judged as
    measured (no ``step.work``)."""
    r = diff(diagnosis("mcore_ep2_small_mbs1"), diagnosis("mcore_ep2_small_mbs4"))
    assert r.step["work"] is None and r.judged_step is r.step
    assert r.fix_gains[0]["realized_per"] == "step"


@pytest.mark.parametrize("sb, sc, sizes_b, sizes_c, want", [
    # the global batch over DP on one side, micro-batch size x count on the other: one measure
    ({"--global-batch-size": "64"}, {"--micro-batch-size": "2", "--num-microbatches": "16"},
     {"dp": 4}, {"dp": 2}, (SEQUENCES, 2.0)),
    # only the count is known: a smaller micro-batch or a larger global batch reads the same
    ({"--num-microbatches": 4}, {"--num-microbatches": 8}, {}, {}, None),
    # rows with a different TP (sequence parallelism divides the rows): no measure
    ({ROWS: 4096.0, "--num-microbatches": 4}, {ROWS: 2048.0, "--num-microbatches": 8},
     {"tp": 1}, {"tp": 2}, None),
    ({ROWS: 4096.0, "--num-microbatches": 4}, {ROWS: 2048.0, "--num-microbatches": 16},
     {"tp": 2}, {"tp": 2}, (ROWS_MEASURE, 2.0)),
])
def test_one_measure_on_both_sides_or_none(sb, sc, sizes_b, sizes_c, want):
    w = step_work(sb, sc, sizes_b, sizes_c)
    assert (None if w is None else (w["measure"], w["ratio"])) == want


@pytest.mark.parametrize("one_stage, wall", [(False, "communication"), (True, "host")])
def test_more_micro_batches_on_one_stage_are_charged_to_the_wall_they_moved(one_stage, wall):
    """More micro-batches of one size are the pipeline bubble's lever (communication, the fix's
    wall) only where there is a pipeline; on one stage (call MC's MoE pair: the host wall moved
    most per the base's work) the verdict keeps the wall the change moved most."""
    from profclass.diff.verdict import lead_with_fix
    from profclass.fixes import load_table

    measured = {"kind": "improvement", "wall": "host", "summary": "Improvement: step 96.4 -> 132.8 ms"}
    row = {"fix": "pp_microbatches", "title": "More micro-batches per step", "detected_by": "up:--num-microbatches",
           "predicted_gain_ms": 14.2, "gain_low_ms": 13.9, "gain_high_ms": 14.7, "realized_gain_ms": 30.0,
           "realized_per": "base work"}
    table = {f["id"]: f for f in load_table()}
    v = lead_with_fix(measured, [row], True, "improvement", one_stage, table)
    assert v["wall"] == wall and v["summary"].endswith(f"charged to the {wall} wall. Measured: step 96.4 -> 132.8 ms")
