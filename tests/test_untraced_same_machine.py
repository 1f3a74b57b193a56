"""The untraced step on the capture's own machine (workloads/untraced_same_machine.py): recomputed
from the same-machine calls' packed price files and untraced logs, as docs/replay.md states it."""
from __future__ import annotations

import importlib.util
import json
import statistics

from conftest import ROOT

spec = importlib.util.spec_from_file_location("untraced_same_machine", ROOT / "workloads" / "untraced_same_machine.py")
usm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(usm)


def test_the_docs_state_what_the_packed_logs_give():
    rs = usm.rows()
    within = sum(abs(r["error"]) <= usm.WITHIN for r in rs)
    traced = sum(abs(r["traced_error"]) <= usm.WITHIN for r in rs)
    docs = (ROOT / "docs" / "replay.md").read_text()
    assert f"{within} of {len(rs)} bases within 5% of their own untraced timer (the\ntraced step itself: {traced})" in docs
    assert f"median |error| {statistics.median(abs(r['error']) for r in rs):.1f}%" in docs
    # every call of the same-machine series with a price file is read, each base's runs found
    assert {r["call"] for r in rs} >= {"AP", "AQ", "BB", "CA", "DG", "EA", "IA", "JA"}
    assert all(r["runs"] >= 2 for r in rs)


def test_a_base_priced_with_a_given_untraced_step_is_left_out():
    """Calibrated prices (``host_factor``) were solved to meet a given step: they are no test of
    the model's own untraced step."""
    packed = usm.gain_pairs._packed()
    given = {p["base"] for path, text in packed.items() if path.endswith("_prices.json")
             for p in json.loads(text)["pairs"] if p.get("host_factor")}
    assert given  # call BC's bases were priced calibrated
    assert not any(r["base"] in {g.rsplit("/", 1)[-1].removesuffix(".sqlite") for g in given} and r["call"] == "BC"
                   for r in usm.rows())


def _by_share() -> tuple[list[float], list[float]]:
    """Timer over replay per base (its calls' timers averaged), split at ``UNTRACED_CAVEAT_SHARE``
    of the traced step taken off by the per-call cost: (below, at or above)."""
    from profclass.replay.notes import host_paced
    by: dict = {}
    for r in usm.rows():
        by.setdefault((r["base"], round(r["replay"], 1)), []).append(r)
    below, above = [], []
    for g in by.values():
        r, timer = g[0], statistics.mean(x["timer"] for x in g)
        (above if host_paced(r["replay"], r["traced"]) else below).append(timer / r["replay"])
    return below, above


def test_the_caveat_share_splits_the_reliable_untraced_steps_from_the_long_ones():
    """constants.UNTRACED_CAVEAT_SHARE's basis, as its comment and docs/replay.md state it."""
    below, above = _by_share()
    assert (len(below), sum(abs(v - 1) <= 0.05 for v in below)) == (30, 29)
    assert (len(above), sum(abs(v - 1) <= 0.05 for v in above), sum(v < 0.95 for v in above)) == (37, 8, 26)
    assert round(statistics.median(below), 2) == 1.0 and round(statistics.median(above), 2) == 0.89
    # and the report's line says what they give
    from profclass.replay.notes import untraced_caveat
    line = untraced_caveat(90.0, 100.0)
    assert f"a median {round(100 * (1 - statistics.median(above)))}% faster" in line
    assert f"({sum(v < 0.95 for v in above)} of {len(above)} over 5% faster;" in line


def test_the_held_out_calls_test_the_shipped_share_and_the_unshipped_factor():
    """Calls LA-MK, made after UNTRACED_CAVEAT_SHARE was set and the 0.89 ratio measured: the
    numbers docs/replay.md and the report's caveat give, recomputed from their packed files."""
    rs = usm.held_out_rows()
    assert {r["call"] for r in rs} == {"LA", "LC", "LD", "MA", "MB", "MC", "MD", "ME", "MF", "MG", "MH", "MI", "MJ", "MK"}
    assert len(rs) == 28 and all(r["runs"] == 2 for r in rs)
    h = usm.host_paced_split(rs)
    within = sum(abs(r["error"]) <= usm.WITHIN for r in rs)
    assert (h["paced"], h["faster"], h["within"], h["slower"]) == (26, 11, 11, 4)
    # the fitted ratio, held out, gains nothing: it makes fewer bases meet their timer, not more
    assert (within, h["ratio_fit_within"]) == (13, 8) and round(h["median"], 2) == 0.98
    docs = " ".join((ROOT / "docs" / "replay.md").read_text().split())
    assert usm.held_out_summary(rs) in docs
    from profclass.replay.notes import untraced_caveat
    line = untraced_caveat(90.0, 100.0)
    assert (f"on the later calls' {h['paced']}, held out, a median {round(100 * (1 - h['median']))}%: {h['faster']} "
            f"over 5% faster, {h['slower']} over 5% slower") in line


def test_a_host_paced_report_says_its_untraced_step_is_likely_long(diagnosis):
    """The caveat where the per-call cost took 2% or more off (a launch-bound 1-GPU job), not on a
    GPU-bound pipeline, whose replay it barely moves."""
    host = diagnosis("host_1gpu")
    assert host.replay["untraced_step_ms"] < 0.98 * host.replay["measured_step_ms"]
    assert any(m.startswith("replay: untraced_step_ms takes only") for m in host.missing)
    from profclass.formatting import replay_lines
    assert f"{host.replay['untraced_step_ms']:.1f} (an upper bound on this host-paced job" in replay_lines(host)[1]
    gpu = diagnosis("mcore_gb_pp4_m8")
    assert "an upper bound" not in replay_lines(gpu)[1]
    assert gpu.replay["untraced_step_ms"] > 0.98 * gpu.replay["measured_step_ms"]
    assert not any(m.startswith("replay: untraced_step_ms takes only") for m in gpu.missing)


def test_the_caveat_names_the_fixes_off_the_host_wall_that_leave_the_replay_host_paced(diagnosis):
    """Where the caveat holds, the fixes it says may gain more than priced are exactly those whose
    wall is not the host's and whose replayed step is host-paced after them (``wall_after``):
    there the replay's host, likely slower than the job's, paces the step (call ME's dense stage).
    Host-wall fixes stay under the line's first clause (host-side prices large)."""
    from profclass.fixes import load_table
    from profclass.replay.notes import untraced_caveat

    assert "after a, b the replayed step is paced" in untraced_caveat(90.0, 100.0, ("a", "b"))
    assert "paced by that slower host" not in untraced_caveat(90.0, 100.0)
    walls = {f["id"]: f["wall"] for f in load_table()}
    seen = 0
    for name in ("host_1gpu", "mcore_ep4_base", "mcore_tp2sp_ep2"):
        d = diagnosis(name)
        line = next((m for m in d.missing if m.startswith("replay: untraced_step_ms takes only")), None)
        if line is None:
            continue
        seen += 1
        want = [f["id"] for f in d.fixes if f.get("wall_after") == "host" and walls.get(f["id"]) != "host"]
        named = line.split("; after ")[1].split(" the replayed step")[0].split(", ") if "; after " in line else []
        assert set(named) >= set(want)  # every such chosen fix is named (the line also holds the plan's)
        assert all(walls.get(i.split(":")[0]) != "host" for i in named)
    assert seen >= 2
