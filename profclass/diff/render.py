"""A ``DiffResult`` as one line, terminal text (rich) or Markdown (a pull-request comment)."""
from __future__ import annotations

import io

from ..classify import WALLS
from ..formatting import md_cell, p_value, shorten, signed_ms
from ..kernels import collective_label
from ..pitfalls import how_to_fix
from .compare import DiffResult
from .verdict import judged_of
from .fix_gains import fix_gain_lines
from .split import split_lines


def one_line(r: DiffResult) -> str:
    """The diff as one line for a training log."""
    s = r.step
    sig = "significant" if r.significant else "not significant"
    wall = f", {r.verdict['wall']} {signed_ms(r.walls_delta_ms[r.verdict['wall']])} ms/step" if r.verdict["wall"] else ""
    per = "" if s.get("work") is None else f" per the base's work, x{s['work']['ratio']:g} the work a step"
    per += " by the runs' timers" if r.judged_step is s.get("timer") else ""
    return (f"vs baseline: {r.change}, step {s['base_ms']:.1f} -> {s['candidate_ms']:.1f} ms "
            f"({r.judged_step['delta_pct']:+.1f}%{per}, {sig}{wall})")


def _ci(t: dict, what: str = "") -> str:
    """A test's 95% confidence interval of the change, as the reports write it ('' without one)."""
    lo_hi = t["ci95_delta_ms"]
    return f", 95% CI{what} [{lo_hi[0]:+.2f}, {lo_hi[1]:+.2f}] ms" if lo_hi else ""


def work_line(w: dict, decides: bool = True) -> str:
    """``step.work`` in words: the measure, both sides' work and the test per the base's work
    (``decides``: the decision is judged on it, not on the runs' timers)."""
    t = w["test"]
    ci = _ci(t)
    return (f"Work: the candidate does x{w['ratio']:g} the base's work a step ({w['measure']}: {w['basis']}); "
            f"per the base's work its step is {w['candidate_ms_per_base_work']:.2f} ms ({w['delta_pct']:+.1f}%), "
            f"{t['method']}, {p_value(t['p_value'])}{ci}{': the decision is judged on this' if decides else ''}. "
            f"The tables are per step, as measured")


def timer_line(timer: dict | None) -> str | None:
    """``step.timer`` in words, for the text and Markdown renderers."""
    if timer is None:
        return None
    sides = "; ".join(f"{side} {timer[side]['source']}" for side in ("base", "candidate"))
    if timer["test"] is None:
        return f"Timers: {sides}; not tested (too few values): the decision is the captured windows'"
    t = timer["test"]
    ci = _ci(t)
    per = "" if timer["work_ratio"] == 1.0 else " per the base's work"
    p = "" if t["p_value"] is None else f", p={t['p_value']:.3g}"
    return (f"Timers (the runs' training logs, outside the profiler): {sides}; change {timer['delta_ms']:+.2f} ms"
            f"{per} ({timer['delta_pct']:+.1f}%), {t['method']}{p}{ci}: the decision is judged on this")


def _esc(text: str) -> str:
    """Data printed as text: a "[tag]" in it is not a rich style (rich imported only to draw)."""
    from rich.markup import escape
    return escape(text)


def render_text(r: DiffResult, width: int = 120, top: int = 12) -> str:
    from rich.console import Console

    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    s, t = r.step, r.step["test"]
    con.print(f"[bold]profclass diff[/bold]  base {_esc(', '.join(r.base['inputs']))}")
    con.print(_esc(f"                candidate {', '.join(r.candidate['inputs'])}"))
    con.print(f"[bold]{_esc(r.verdict['summary'])}[/bold]")
    for line in split_lines(r.step.get("split")):  # after the recognised change the verdict leads with
        con.print(_esc(line + "."))
    con.print(f"Step: base {s['base_ms']:.2f} ms (std {s['base_std_ms']:.2f}, n={s['base_iterations']}), "
              f"candidate {s['candidate_ms']:.2f} ms (std {s['candidate_std_ms']:.2f}, n={s['candidate_iterations']}), "
              f"ratio {s['ratio']:.4f}")
    ci = _ci(t, " of the change")
    p = p_value(t["p_value"])
    con.print(_esc(f"Test: {t['method']}, {p}{ci}; significant needs p<{t['alpha']} and |change|>={t['min_effect_pct']:g}%"))
    if s.get("work"):
        con.print(_esc(work_line(s["work"], judged_of(s) is s["work"]) + "."))
    if s.get("timer"):
        con.print(_esc(timer_line(s["timer"]) + "."))
    _print_walls(con, r)
    if r.causes:
        con.print(_esc(f"Waiting vs transfer: {r.causes['summary']}."))
    _print_kernels(con, r, top)
    _print_communication(con, r)
    if r.config_changes:
        con.print(_esc("Configuration changes: " + "; ".join(
            f"{c['key']}: {c['base']} -> {c['candidate']} ({c['source']})" for c in r.config_changes)))
    else:
        con.print("Configuration changes: none visible in the profiles")
    for line in fix_gain_lines(r.fix_gains):
        con.print(_esc(f"Known fix: {line}"))
    for p in r.pitfalls:
        con.print(_esc(f"Pitfall ({p['rule']}): {p['message']} Fix: {how_to_fix(p)}"))
    for n in r.notes:
        con.print(_esc(f"Note: {n}"))
    return buf.getvalue()


def _table(title: str, columns: tuple[str, ...], left: tuple[str, ...]):
    """A rich table; the columns in ``left`` are left-justified, the numbers right-justified."""
    from rich.table import Table

    tb = Table(title=title, show_edge=False)
    for col in columns:
        # kernel names are long: one line each, cut with an ellipsis
        tb.add_column(col, justify="left" if col in left else "right", no_wrap=col == "kernel", overflow="ellipsis")
    return tb


def _print_walls(con, r: DiffResult) -> None:
    tb = _table("Walls (ms/step)", ("wall", "base", "candidate", "delta"), ("wall",))
    for w in WALLS:
        x = r.walls[w]
        tb.add_row(w, f"{x['base_ms']:.2f}", f"{x['candidate_ms']:.2f}", signed_ms(x["delta_ms"]))
    con.print(tb)
    tb = _table("Inside the walls", ("wall", "metric", "unit", "base", "candidate", "delta"), ("wall", "metric", "unit"))
    for c in r.components:
        tb.add_row(c["wall"], _esc(c["metric"]), _esc(c["unit"]), f"{c['base']:.2f}", f"{c['candidate']:.2f}", signed_ms(c["delta"]))
    con.print(tb)


def _print_kernels(con, r: DiffResult, top: int) -> None:
    tb = _table(f"Kernels whose time per step changed most (top {top}, mean per GPU)",
                ("kernel", "status", "n/step base", "n/step cand", "ms/step base", "ms/step cand", "delta"),
                ("kernel", "status"))
    for k in r.kernels[:top]:
        tb.add_row(_esc(shorten(k["name"], 50)), k["status"], f"{k['base']['count_per_step']:.1f}",
                   f"{k['candidate']['count_per_step']:.1f}", f"{k['base']['ms_per_step']:.3f}",
                   f"{k['candidate']['ms_per_step']:.3f}", signed_ms(k["delta_ms_per_step"]))
    con.print(tb)
    for word, names in (("Appeared", r.appeared), ("Vanished", r.vanished)):
        if names:
            con.print(_esc(f"{word} ({len(names)}): " + "; ".join(shorten(n, 60) for n in names[:8])
                             + (" ..." if len(names) > 8 else "")))


def _print_communication(con, r: DiffResult) -> None:
    comm = r.communication
    if comm["collectives"]:
        tb = _table("Communication (ms/step, mean per GPU)",
                    ("collective", "calls base", "calls cand", "exposed base", "exposed cand", "overlapped base",
                     "overlapped cand"), ("collective",))
        for m in comm["collectives"]:
            tb.add_row(collective_label(m["collective"], m["group"]), f"{m['base']['calls_per_step']:.1f}", f"{m['candidate']['calls_per_step']:.1f}",
                       f"{m['base']['exposed_ms']:.2f}", f"{m['candidate']['exposed_ms']:.2f}",
                       f"{m['base']['overlapped_ms']:.2f}", f"{m['candidate']['overlapped_ms']:.2f}")
        con.print(tb)
    con.print(_esc("Communication pattern: " + ("; ".join(comm["changes"]) if comm["changes"] else "unchanged")))


def render_markdown(r: DiffResult, top: int = 10) -> str:
    """A pull-request comment."""
    s, t = r.step, r.step["test"]
    icon = {"regression": "Regression", "improvement": "Improvement"}.get(r.change, "No significant change")
    p = p_value(t["p_value"])
    per = "step time" if s.get("work") is None else "step time per the base's work"
    lines = [f"## profclass diff: **{icon}** ({r.judged_step['delta_pct']:+.1f}% {per})", "", r.verdict["summary"], "",
             *[x for line in split_lines(s.get("split")) for x in (md_cell(line) + ".", "")],
             "| | base | candidate |", "|---|---:|---:|",
             f"| step (mean, ms) | {s['base_ms']:.2f} | {s['candidate_ms']:.2f} |",
             f"| std (ms) | {s['base_std_ms']:.2f} | {s['candidate_std_ms']:.2f} |",
             f"| iterations | {s['base_iterations']} | {s['candidate_iterations']} |", "",
             f"Ratio {s['ratio']:.4f}; {t['method']}, {p}; significant: **{'yes' if r.significant else 'no'}** "
             f"(needs p<{t['alpha']} and a change of at least {t['min_effect_pct']:g}%).", "",
             *([md_cell(work_line(s["work"], judged_of(s) is s["work"])) + ".", ""] if s.get("work") else []),
             *([md_cell(timer_line(s["timer"])) + ".", ""] if s.get("timer") else []),
             "| wall | base ms/step | candidate ms/step | delta |", "|---|---:|---:|---:|"]
    lines += [f"| {w} | {r.walls[w]['base_ms']:.2f} | {r.walls[w]['candidate_ms']:.2f} | "
              f"{signed_ms(r.walls[w]['delta_ms'])} |" for w in WALLS]
    if r.causes:
        lines += ["", f"**Waiting vs transfer:** {r.causes['summary']}."]
    moved = [c for c in r.components if c["unit"] == "ms/step" and abs(c["delta"]) >= 0.05]
    if moved:
        lines += ["", "<details><summary>Inside the walls</summary>", "",
                  "| wall | metric | base | candidate | delta |", "|---|---|---:|---:|---:|"]
        lines += [f"| {c['wall']} | {c['metric']} | {c['base']:.2f} | {c['candidate']:.2f} | {signed_ms(c['delta'])} |"
                  for c in sorted(moved, key=lambda c: -abs(c["delta"]))]
        lines += ["", "</details>"]
    if r.kernels:
        lines += ["", f"### Kernels whose time per step changed most (top {top}, mean per GPU)", "",
                  "| kernel | status | n/step | ms/step | delta |", "|---|---|---:|---:|---:|"]
        for k in r.kernels[:top]:
            name = shorten(k["name"], 80).replace("|", "\\|")
            lines.append(f"| `{name}` | {k['status']} | {k['base']['count_per_step']:.1f} -> "
                         f"{k['candidate']['count_per_step']:.1f} | {k['base']['ms_per_step']:.3f} -> "
                         f"{k['candidate']['ms_per_step']:.3f} | {signed_ms(k['delta_ms_per_step'])} |")
    if r.appeared or r.vanished:
        lines.append("")
        if r.appeared:
            lines.append(f"Appeared: {len(r.appeared)} kernel name(s), e.g. `{shorten(r.appeared[0], 80)}`.")
        if r.vanished:
            lines.append(f"Vanished: {len(r.vanished)} kernel name(s), e.g. `{shorten(r.vanished[0], 80)}`.")
    comm = r.communication["changes"]
    lines += ["", "**Communication pattern:** " + ("; ".join(comm) if comm else "unchanged") + "."]
    if r.config_changes:
        lines += ["", "**Configuration changes:** " + "; ".join(
            f"`{c['key']}` {c['base']} -> {c['candidate']}" for c in r.config_changes) + "."]
    for line in fix_gain_lines(r.fix_gains):
        lines += ["", f"**Known fix:** {md_cell(line)}."]
    for n in r.notes:
        lines += ["", f"Note: {n}."]
    for p in r.pitfalls:
        lines += ["", f"**Pitfall** ({p['rule']}): {p['message']} Fix: `{how_to_fix(p)}`."]
    return "\n".join(lines) + "\n"
