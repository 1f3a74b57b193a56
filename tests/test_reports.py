"""Reports people look at: the representative-iteration timeline, the top kernels, the HTML
and Markdown reports, the timeline command and progress on stderr, on real fixtures."""
from __future__ import annotations

import base64
import io
import os
import pty
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

import profclass
from profclass import intervals as iv
from profclass import timeline_view as tv
from profclass.cli import main
from profclass.formatting import md_cell
from profclass.html import render_html
from profclass.progress import Reporter, reporter
from profclass.report import render_markdown

from conftest import ROOT, profile_path

BUSY_LANES = {"compute", "memcpy", *tv.COLLECTIVE_TYPES, *tv.GROUP_LANES}


@pytest.fixture(scope="module")
def kept():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = profclass.diagnose(str(profile_path(name)), keep_timelines=True)
        return cache[name]

    return get


def test_timelines_are_kept_only_when_asked(kept):
    d = kept("host_1gpu")
    assert d.timelines and "timelines" not in d.to_dict()
    assert profclass.diagnose(str(profile_path("host_1gpu"))).timelines is None
    with pytest.raises(ValueError, match="keep_timelines"):
        tv.top_kernels(profclass.diagnose(str(profile_path("host_1gpu"))))


@pytest.mark.parametrize("name", ["comm_4gpu", "host_1gpu"])
def test_representative_iteration_is_the_steady_step_nearest_the_median(kept, name):
    d = kept(name)
    picks = tv.representative_iterations(d.timelines)
    durations = np.array([np.mean([(g.steady["step_end"] - g.steady["start"]).to_numpy()[k]
                                   for g in d.timelines]) for k in range(len(d.timelines[0].steady))])
    for g, (lo, hi, label) in zip(d.timelines, picks):
        row = g.steady[g.steady["start"] == lo]
        assert len(row) == 1 and int(row["step_end"].iloc[0]) == hi and row["label"].iloc[0] == label
    chosen = int(np.flatnonzero(d.timelines[0].steady["start"].to_numpy() == picks[0][0])[0])
    assert abs(durations[chosen] - np.median(durations)) == pytest.approx(np.min(np.abs(durations - np.median(durations))))
    if len(d.timelines) > 1:  # the same iteration on every GPU, so collectives line up
        assert len({label for _, _, label in picks}) == 1


@pytest.mark.parametrize("name", ["comm_4gpu", "host_1gpu"])
def test_lanes_cover_the_step_exactly_once_busy_or_idle(kept, name):
    for v in tv.iteration_views(kept(name)):
        lanes = v.lanes
        assert (lanes["start"] >= v.lo).all() and (lanes["end"] <= v.hi).all() and (lanes["end"] > lanes["start"]).all()
        busy_rows = lanes[lanes["lane"].isin(BUSY_LANES)]
        busy = iv.union(busy_rows["start"], busy_rows["end"])
        idle = lanes[lanes["lane"] == "idle"]
        idle_set = (idle["start"].to_numpy(), idle["end"].to_numpy())
        assert iv.total(busy) + iv.total(idle_set) == v.hi - v.lo
        assert iv.total(iv.intersect(busy, idle_set)) == 0
        gemm = lanes[lanes["lane"] == "GEMM"]
        comp = lanes[lanes["lane"] == "compute"]
        g_set = (gemm["start"].to_numpy(), gemm["end"].to_numpy())
        assert iv.total(iv.subtract(g_set, (comp["start"].to_numpy(), comp["end"].to_numpy()))) == 0
        assert (lanes.loc[lanes["lane"] == "NVTX", "level"] < tv.NVTX_LEVELS).all()


def test_comm_timeline_shows_its_collectives_and_nvtx(kept):
    views = tv.iteration_views(kept("comm_4gpu"))
    assert [v.rank for v in views] == [0, 1, 2, 3]
    for v in views:
        present = set(v.lanes["lane"])
        # a lane per parallel group: the all-to-all is EP, the all-reduce DP
        assert {"compute", "EP comm", "DP comm", "idle", "NVTX"} <= present
        texts = set(v.lanes.loc[v.lanes["lane"] == "NVTX", "text"])
        assert v.iteration in texts  # the iteration's own NVTX range is on its lane


def test_top_kernels_agree_with_the_collective_analysis(kept):
    d = kept("comm_4gpu")
    top = tv.top_kernels(d, 5)
    assert list(top["ms_per_step"]) == sorted(top["ms_per_step"], reverse=True)
    a2a = next(c for c in d.collectives if c["collective"] == "all_to_all")
    row = top[top["kind"] == "nccl all_to_all"].iloc[0]
    # two routes to the same number: kernel durations vs matched collective instances
    assert row["ms_per_step"] == pytest.approx(a2a["transfer_ms_per_step"] + a2a["wait_ms_per_step"], rel=0.02)
    assert row["share"] == pytest.approx(row["ms_per_step"] / d.window["step_ms"]["mean"])


def test_top_kernels_cover_the_compute_union(kept):
    d = kept("host_1gpu")
    every = tv.top_kernels(d, 10**6)
    union_ms = next(e["value"] for e in d.evidence if e["metric"] == "compute kernels")
    # summed kernel time can exceed the union (overlap) but never fall short of it
    assert every["ms_per_step"].sum() >= union_ms * 0.999
    assert (every["calls_per_step"] > 0).all() and (every["mean_us"] > 0).all()


def _images(page: str):
    return re.findall(r'<img [^>]*src="data:(image/[a-z+]+);base64,([A-Za-z0-9+/=]+)"', page)


@pytest.mark.parametrize("name,wall", [("comm_4gpu", "communication"), ("host_1gpu", "host")])
def test_html_report_is_self_contained_and_complete(kept, name, wall):
    d = kept(name)
    page = render_html(d)
    assert len(page.encode()) < 3 * 2**20
    assert d.verdict["wall"] == wall
    # nothing fetched at view time: no scripts, stylesheets or remote URLs
    assert not re.search(r"<script|<link|<iframe|url\(|(src|href)=\"(?!data:)", page, re.I)
    images = _images(page)
    assert [m for m, _ in images] == ["image/svg+xml", "image/png"]
    svg, png = (base64.b64decode(b) for _, b in images)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    ET.fromstring(svg)  # well-formed
    text = re.sub(r"<[^>]+>", " ", page)
    import html as std_html
    text = std_html.unescape(text)
    assert f"{wall} wall" in text and d.verdict["summary"] in text
    assert f"confidence {d.verdict['confidence']:.2f}, runner-up {d.verdict['runner_up']}" in text
    for f in d.fixes:
        assert f["title"] in text and f["flags"] in text
    for m in d.missing:
        assert m in text
    top = tv.top_kernels(d, 1)
    assert top["kernel"][0][:60] in text
    for c in d.collectives:
        assert f"{c['transfer_ms_per_step']:.2f}" in text


def test_markdown_report_for_issues(kept):
    d = kept("comm_4gpu")
    md = render_markdown(d, timeline_image="comm_4gpu_timeline.png")
    assert md.startswith("## profclass: **communication** wall")
    assert "![one representative steady-state iteration per GPU](comm_4gpu_timeline.png)" in md
    assert "| all_to_all | EP |" in md and "`ncclDevKernel_SendRecv`" in md
    assert "<details><summary>Evidence</summary>" in md
    # every table row has as many cells as its header
    for block in re.split(r"\n\n", md):
        rows = [r for r in block.splitlines() if r.startswith("|")]
        if rows:
            widths = {len(re.split(r"(?<!\\)\|", r)) for r in rows}
            assert len(widths) == 1, block
    plain = render_markdown(profclass.diagnose(str(profile_path("comm_4gpu"))))
    assert "ncclDevKernel_SendRecv" not in plain  # no timelines, no kernel table


def test_markdown_cells_escape_pipes():
    assert md_cell("a|b\nc") == "a\\|b c"


def test_cli_html_and_timeline(tmp_path):
    runner = CliRunner()
    out = tmp_path / "report.html"
    r = runner.invoke(main, ["diagnose", str(profile_path("host_1gpu")), "--format", "html", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output == ""  # not a terminal: no progress, and the report went to the file
    assert "host wall" in out.read_text()
    svg = tmp_path / "t.svg"
    r = runner.invoke(main, ["timeline", str(profile_path("host_1gpu")), "-o", str(svg), "-q"])
    assert r.exit_code == 0, r.output
    root = ET.fromstring(svg.read_bytes())
    assert root.tag.endswith("svg")
    png = tmp_path / "t.png"
    r = runner.invoke(main, ["timeline", str(profile_path("host_1gpu")), "--out", str(png)])
    assert r.exit_code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    r = runner.invoke(main, ["timeline", str(profile_path("host_1gpu")), "-o", str(tmp_path / "t.jpg")])
    assert r.exit_code == 2 and ".png, .svg or .pdf" in r.output
    r = runner.invoke(main, ["timeline", str(tmp_path / "missing.sqlite"), "-o", str(png)])
    assert r.exit_code == 2 and r.output.strip() == f"profclass: error: {tmp_path / 'missing.sqlite'}: no such file or directory"


def test_reporter_draws_on_a_terminal_console():
    buf = io.StringIO()
    with Reporter(True, console=Console(file=buf, force_terminal=True, width=100)) as p:
        p("loading a.sqlite", 0.5)
        p("analysing 4 GPU(s)")
    assert "loading a.sqlite" in buf.getvalue() or "analysing" in buf.getvalue()
    silent = Reporter(False)
    with silent as p:
        p("nothing")  # a no-op when off
    assert not reporter(quiet=True).enabled
    assert not reporter(quiet=False, stream=io.StringIO()).enabled


def _cli_on_a_tty(args):
    """Run the CLI with stderr on a real pseudo-terminal; returns (exit code, stderr bytes)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", "from profclass.cli import main; main()", *args], stdout=subprocess.DEVNULL,
                            stderr=follower, cwd=ROOT, env={**os.environ, "COLUMNS": "100"})
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return proc.wait(timeout=120), b"".join(chunks)


def test_progress_shows_on_a_terminal_and_not_with_quiet(tmp_path):
    args = ["diagnose", str(profile_path("host_1gpu")), "--format", "html", "-o", str(tmp_path / "r.html")]
    rc, err = _cli_on_a_tty(args)
    assert rc == 0
    assert b"loading" in err and b"drawing the timeline" in err
    rc, err = _cli_on_a_tty(args + ["--quiet"])
    assert rc == 0 and err == b""


def test_uneven_iterations_still_show_one_moment_of_the_job(kept):
    # periodicity gives each GPU its own step boundaries: the picks must still overlap in time
    d = kept("mcore_alltoall_4gpu")
    picks = tv.representative_iterations(d.timelines)
    assert len({label for _, _, label in picks}) > 1  # the case this test is about
    assert max(lo for lo, _, _ in picks) < min(hi for _, hi, _ in picks)
    for g, (lo, hi, _) in zip(d.timelines, picks):
        assert ((g.steady["start"] == lo) & (g.steady["step_end"] == hi)).sum() == 1
