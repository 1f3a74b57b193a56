"""Stage 6, report: a Diagnosis as terminal text (rich), Markdown, or JSON."""
from __future__ import annotations

import io

from rich.console import Console
from rich.markup import escape  # data printed as text: "[host]", "[low, best]" are not rich's style tags
from rich.table import Table

from .classify import WALLS
from .fixes import gain_text
from .pitfalls import cost_text
from .formatting import NO_GAIN_WHY, by_rank, fixes_to_try, how_to_set, layout_lines, md_cell, md_code, no_gain_line, \
    pct, plan_steps, replay_lines, trade_off_text, waits_ms_per_step, what_if_lines
from .kernels import collective_name
from .pipeline import Diagnosis


def render_text(d: Diagnosis, console: Console | None = None, width: int = 110) -> str:
    """The terminal report. Returns the text (also printed to ``console`` when given)."""
    buf = io.StringIO()
    con = console or Console(file=buf, width=width, force_terminal=False, color_system=None)
    v, w = d.verdict, d.window
    con.print(f"[bold]profclass[/bold]  {escape(', '.join(d.inputs))}")
    con.print(f"[bold]Verdict: {v['wall'].upper()} wall[/bold]  confidence {v['confidence']:.2f}, "
              f"runner-up {v['runner_up']}")
    con.print(escape(v["summary"]))
    con.print(f"Steady state: {w['iterations']} iterations from {escape(w['source'])}, step "
              f"{w['step_ms']['mean']:.1f} ms mean, {w['step_ms']['median']:.1f} median, "
              f"{w['step_ms']['std']:.1f} std")
    t = Table(title="Time per wall (job)", show_edge=False)
    t.add_column("wall")
    t.add_column("share", justify="right")
    t.add_column("ms/step", justify="right")
    for wall in WALLS:
        t.add_row(wall, pct(d.walls[wall]["share"]), f"{d.walls[wall]['ms_per_step']:.2f}")
    con.print(t)
    if len(d.devices) > 1:
        t = Table(title="Per rank", show_edge=False)
        for col in ("rank", "pid", "GPU", "wall", "compute", "comm", "host", "memory", "step ms", "waits ms/step"):
            t.add_column(col, justify="right" if col not in ("wall",) else "left")
        for dv in by_rank(d.devices):
            t.add_row(str(dv["rank"]), str(dv["pid"]), str(dv["device"]), dv["wall"],
                      *[pct(dv["walls"][x]["share"]) for x in WALLS], f"{dv['step_ms']:.1f}",
                      f"{waits_ms_per_step(dv):.1f}")
        con.print(t)
    for s in d.stragglers:
        con.print(f"[bold]Straggler[/bold]: " + escape(f"rank {s['rank']} (pid {s['pid']}, GPU {s['device']}): {s['reason']}; "
                  f"{s['detail']}; the others wait {s['others_wait_ms_per_step']:.1f} ms/step for it"))
    for line in layout_lines(d):
        con.print(escape(line))
    _replay_text(d, con)
    if d.collectives:
        t = Table(title="Collectives (ms/step, mean over ranks)", show_edge=False)
        for col in ("collective", "group", "n", "transfer", "wait", "exposed transfer", "exposed wait", "overlapped"):
            t.add_column(col, justify="left" if col in ("collective", "group") else "right")
        for c in d.collectives:
            t.add_row(collective_name(c["collective"], c["group"]), c["group"], str(c["instances"]), f"{c['transfer_ms_per_step']:.2f}",
                      f"{c['wait_ms_per_step']:.2f}", f"{c['exposed_transfer_ms_per_step']:.2f}",
                      f"{c['exposed_wait_ms_per_step']:.2f}", f"{c['overlapped_ms_per_step']:.2f}")
        con.print(t)
    t = Table(title="Evidence", show_edge=False)
    for col in ("wall", "metric", "value", "unit", "note"):
        t.add_column(col, justify="right" if col == "value" else "left")
    for e in d.evidence:
        t.add_row(e["wall"], escape(e["metric"]), f"{e['value']:.3f}", escape(e["unit"]), escape(e["note"]))
    con.print(t)
    _fixes_text(d, con)
    for p in d.pitfalls:
        con.print("[bold]Pitfall[/bold]: " + escape(f"{p.get('rule', '')}: {p.get('message', '')}{cost_text(p)}"))
    if d.missing:
        con.print("Missing from the profile: " + escape("; ".join(d.missing)))
    return buf.getvalue() if console is None else ""


def _fixes_text(d: Diagnosis, con: Console) -> None:
    """The fixes to try with their flags, gains and bases; then those priced at no gain."""
    to_try, none = fixes_to_try(d)
    if to_try:
        con.print("[bold]Fixes to try[/bold] (predicted gain, best estimate and range):")
        for i, f in enumerate(to_try, 1):
            trade = f"\n   {trade_off_text(f)}" if f.get("trade_off") else ""
            con.print(escape(f"{i}. [{f['wall']}] {f['title']}  ({gain_text(f)})\n   {': '.join(how_to_set(f))}{trade}\n"
                             f"   why: {f['why']}\n   gain: {f['gain_basis']}"))
    if none:
        con.print(f"[bold]Priced at no gain on this job[/bold] ({NO_GAIN_WHY}):")
        for f in none:
            con.print(escape(f"- [{f['wall']}] {no_gain_line(f, d)}"))


def _replay_text(d: Diagnosis, con: Console) -> None:
    for line in replay_lines(d):
        con.print(escape(line))
    if d.plan:
        con.print("[bold]Fix plan[/bold] (each fix replayed on top of the ones before it, from the step "
                  "without the profiler):")
        for i, step in enumerate(plan_steps(d), 1):
            con.print(escape(f"{i}. {step}"))
    for line in what_if_lines(d):
        con.print(escape(line))


def render_markdown(d: Diagnosis, timeline_image: str | None = None, top_kernels: int = 10) -> str:
    """The report for an issue or pull request (GitHub-flavoured Markdown).

    With timelines (``diagnose(..., keep_timelines=True)``) it adds the top kernels;
    ``timeline_image`` links a picture made by ``profclass timeline``."""
    v, w = d.verdict, d.window
    lines = [f"## profclass: **{v['wall']}** wall (confidence {v['confidence']:.2f}, runner-up {v['runner_up']})",
             "", v["summary"], "",
             f"Steady state: {w['iterations']} iterations ({w['source']}), step {w['step_ms']['mean']:.1f} ms "
             f"(median {w['step_ms']['median']:.1f}, std {w['step_ms']['std']:.1f}).", "",
             "| wall | share | ms/step |", "|---|---:|---:|"]
    lines += [f"| {x} | {pct(d.walls[x]['share'])} | {d.walls[x]['ms_per_step']:.2f} |" for x in WALLS]
    if timeline_image:
        lines += ["", f"![one representative steady-state iteration per GPU]({timeline_image})"]
    if len(d.devices) > 1:
        lines += ["", "| rank | GPU | wall | compute | comm | host | memory | step ms |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
        for dv in by_rank(d.devices):
            lines.append(f"| {dv['rank']} | {dv['device']} | {dv['wall']} | "
                         + " | ".join(pct(dv["walls"][x]["share"]) for x in WALLS) + f" | {dv['step_ms']:.1f} |")
    for s in d.stragglers:
        lines += ["", f"**Straggler:** rank {s['rank']} ({s['reason']}): {s['detail']}; the others wait "
                      f"{s['others_wait_ms_per_step']:.1f} ms/step for it."]
    lines += [x for line in layout_lines(d) for x in ("", line)]
    if d.collectives:
        lines += ["", "| collective | group | n | transfer | wait | exposed transfer | exposed wait | overlapped |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {collective_name(c['collective'], c['group'])} | {c['group']} | {c['instances']} | {c['transfer_ms_per_step']:.2f} | "
                  f"{c['wait_ms_per_step']:.2f} | {c['exposed_transfer_ms_per_step']:.2f} | "
                  f"{c['exposed_wait_ms_per_step']:.2f} | {c['overlapped_ms_per_step']:.2f} |" for c in d.collectives]
        lines += ["", "Collectives in ms per step, mean over ranks (wait: time spent waiting for peers)."]
    if getattr(d, "timelines", None) and top_kernels:
        from .timeline_view import top_kernels as top
        t = top(d, top_kernels)
        lines += ["", "| kernel | kind | ms/step | of step | calls/step |", "|---|---|---:|---:|---:|"]
        lines += [f"| {md_cell(md_code(r.kernel[:80]))} | {md_cell(r.kind)} | {r.ms_per_step:.2f} | {100 * r.share:.1f}% | "
                  f"{r.calls_per_step:.1f} |" for r in t.itertuples()]
        lines += ["", f"Top {len(t)} kernels by GPU time per steady step, mean over {len(d.devices)} GPU(s)."]
    lines += [x for line in replay_lines(d) for x in ("", line)]
    if d.plan:
        lines += ["", "### Fix plan (each fix replayed on top of the ones before it, from the step without the "
                  "profiler)", ""]
        lines += [f"{i}. {md_cell(step)}" for i, step in enumerate(plan_steps(d), 1)]
    lines += [x for line in what_if_lines(d) for x in ("", md_cell(line))]
    lines += _fixes_markdown(d)
    for p in d.pitfalls:
        lines += ["", f"**Pitfall** ({p.get('rule', '')}): {p.get('message', '')}{md_cell(cost_text(p))}"]
    if d.evidence:
        lines += ["", "<details><summary>Evidence</summary>", "", "| wall | metric | value | unit | note |",
                  "|---|---|---:|---|---|"]
        lines += [f"| {e['wall']} | {md_cell(e['metric'])} | {e['value']:.3f} | {e['unit']} | {md_cell(e['note'])} |"
                  for e in d.evidence]
        lines += ["", "</details>"]
    if d.missing:
        lines += ["", "Missing from the profile:", ""] + [f"- {m}" for m in d.missing]
    return "\n".join(lines) + "\n"


def one_line(d: Diagnosis) -> str:
    """A summary fit for a training log."""
    v = d.verdict
    shares = " ".join(f"{x}={pct(d.walls[x]['share'])}" for x in WALLS)
    return (f"profclass: {v['wall']} wall (confidence {v['confidence']:.2f}, runner-up {v['runner_up']}); "
            f"step {d.window['step_ms']['mean']:.1f} ms; {shares}")


def _fixes_markdown(d: Diagnosis) -> list[str]:
    """The fixes to try as a numbered list with their flags and bases; then those priced at no gain."""
    to_try, none = fixes_to_try(d)
    lines: list[str] = []
    if to_try:
        lines += ["", "### Fixes (predicted gain: best estimate and range)", ""]
        lines += [f"{i}. **{f['title']}** ({f['wall']}, {gain_text(f)}): {md_code(how_to_set(f)[1])}. {f['why']} "
                  f"Gain: {md_cell(f['gain_basis'])}."
                  + (f" {md_cell(trade_off_text(f))}." if f.get("trade_off") else "")
                  for i, f in enumerate(to_try, 1)]
    if none:
        lines += ["", f"Priced at no gain on this job ({NO_GAIN_WHY}):", ""]
        lines += [f"- {md_cell(no_gain_line(f, d))}" for f in none]
    return lines
