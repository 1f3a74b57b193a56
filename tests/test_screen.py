"""The default terminal answer fits one screen on every fixture; ``--detail`` keeps the full
tables; the fix plan, when a Diagnosis has one, is shown in turn."""
from __future__ import annotations

from dataclasses import replace

import pytest
from click.testing import CliRunner

from conftest import PROFILES, profile_path
from profclass.cli import main
from profclass.formatting import fixes_to_try
from profclass.pipeline import ReplayReport
from profclass.screen import MAX_LINES, render_screen

WIDTH = 110  # what the CLI renders at


@pytest.mark.parametrize("name", list(PROFILES))
def test_one_screen_on_every_fixture(name, diagnosis):
    d = diagnosis(name)
    lines = render_screen(d).splitlines()
    assert len(lines) <= MAX_LINES == 40
    assert max(len(x) for x in lines) <= WIDTH
    assert lines[1].startswith(f"Verdict: {d.verdict['wall'].upper()} wall, confidence {d.verdict['confidence']:.2f}")
    assert any(x.startswith("Walls, ms/step") for x in lines)
    # nothing the screen promises is left out on any fixture: every block fits
    assert not any(x.startswith("Left out here") for x in lines), lines[-1]
    if d.stragglers:
        assert any(x.startswith(f"Straggler: rank {d.stragglers[0]['rank']} ") for x in lines)
    to_try, none = fixes_to_try(d)
    if to_try:
        assert any(x.startswith(f"1. [{to_try[0]['wall']}] {to_try[0]['title'][:40]}") for x in lines)
    if none:  # counted, never numbered among the fixes to try
        assert f"{len(none)} priced at no gain" in " ".join(lines)


def test_cli_prints_the_screen_and_detail_the_tables():
    path = str(profile_path("imbalance_4gpu_perrank"))
    short = CliRunner().invoke(main, ["diagnose", "-q", path])
    full = CliRunner().invoke(main, ["diagnose", "-q", "--detail", path])
    assert short.exit_code == 0 and full.exit_code == 0, short.output + full.output
    assert len(short.output.splitlines()) <= MAX_LINES < len(full.output.splitlines())
    assert "Per rank" in full.output and "Evidence" in full.output and "Per rank" not in short.output
    # the same verdict line's facts in both
    assert "Verdict: COMPUTE wall, confidence" in short.output and "Verdict: COMPUTE wall" in full.output


def test_fix_plan_and_replay_are_shown_and_the_screen_still_fits(diagnosis):
    """The plan's rows ({id, gain_ms, step_ms_after, wall_after}) in turn, worded as every
    reporter words them (formatting.plan_steps), and the step without each wall."""
    from profclass.formatting import plan_steps
    d = diagnosis("mcore_pp4_m4")
    assert len(d.plan) >= 2  # the replay's plan on this capture: CUDA graphs, then bigger launches
    lines = render_screen(d).splitlines()
    assert len(lines) <= MAX_LINES
    text = " ".join(x.strip() for x in lines)
    for i, step in enumerate(plan_steps(d), 1):
        assert f"{i}. {step}" in text
    assert f"-> step {d.plan[0]['step_ms_after']:.1f} ms, then the {d.plan[0]['wall_after']} wall" in text
    assert "Replay: step without each wall, ms: compute" in text


@pytest.mark.parametrize("name, moe", [("mcore_wrapped_dense_tp2_pp2", False), ("mcore_wrapped_tp2sp_ep2", True)])
def test_expert_sizes_and_moe_flags_only_on_moe_jobs(name, moe, diagnosis):
    """A dense job's ETP and EDP are Megatron's defaults (ETP = TP), groups it never uses, and
    MoE flags do nothing there: both are shown on MoE jobs only."""
    from profclass.formatting import layout_lines
    d = diagnosis(name)
    assert d.config["moe"]["value"] is moe
    layout = next(x for x in layout_lines(d) if x.startswith("Layout: "))
    assert ("ETP=" in layout and "EDP=" in layout) is moe
    assert "TP=2" in layout and d.layout["sizes"]["etp"] is not None  # the JSON keeps Megatron's sizes
    fusion = [f for f in d.fixes if f["id"] == "compute_fusion"]
    assert fusion, [f["id"] for f in d.fixes]
    assert ("--moe-permute-fusion" in fusion[0]["flags"]) is moe
    assert fusion[0]["flags"].startswith("--bias-activation-fusion")


def test_fixes_priced_at_no_gain_are_listed_apart_in_every_report(diagnosis):
    """On an interleaved PP 4 capture more interleaving is priced at a loss and manual GC at
    nothing (no collector pause in its window): the JSON keeps them last in fixes[], and every
    report lists them apart from the fixes to try, with their price and its basis, so nobody
    tries them first. The text report keeps each fix's [wall] tag (rich would read it as a
    style and drop it)."""
    import html as html_lib

    from profclass.html import render_html
    from profclass.report import render_markdown, render_text
    d = diagnosis("mcore_pp4_vpp2_m8")
    to_try, none = fixes_to_try(d)
    ids = {f["id"] for f in none}
    assert {"pp_interleave", "host_gc"} <= ids and to_try
    assert d.fixes[-len(none):] == none  # the JSON's ranking: last
    assert all(f["gain_high_ms"] < 0.05 for f in none) and all(f["gain_high_ms"] >= 0.05 for f in to_try)
    text = render_text(d)
    head, tail = text.split("Priced at no gain on this job")
    assert all(f"[{f['wall']}] {f['title']}" in head for f in to_try)
    assert all(f"- [{f['wall']}] {f['title']}" in tail for f in none)
    assert not any(f"[{f['wall']}] {f['title']}" in head for f in none)
    # alone it loses; after the plan's earlier fixes it wins, and the line says what the plan takes
    step = next(p for p in d.plan if p["id"] == "pp_interleave")
    assert f"the fix plan takes it after others, for -{step['gain_ms']:.1f} ms" in " ".join(tail.split())
    md = render_markdown(d)
    md_head, md_tail = md.split("Priced at no gain on this job")
    assert all(f"**{f['title']}**" in md_head for f in to_try) and not any(f"**{f['title']}**" in md_head for f in none)
    assert "(-13.4 ms/step, range" in md_tail.replace("\n", " ")
    page = html_lib.unescape(render_html(d))
    assert "<h3>Priced at no gain on this job</h3>" in page
    assert page.index(none[0]["title"]) > page.index("Priced at no gain on this job")
