"""The default terminal answer: one screen (at most ``MAX_LINES`` lines) of a Diagnosis.

The verdict with its confidence, the walls, the straggler, the layout, the fix plan (each fix
replayed on top of the ones before it), the top fixes with their gains, the costliest pitfall,
and the step the replay gives without each wall. ``profclass diagnose --detail`` prints
the full tables (``report.render_text``); JSON, Markdown and HTML keep everything.
Plain text, no rich: the first screen costs no table layout.
"""
from __future__ import annotations

import os
import textwrap

from .classify import WALLS
from .fixes import gain_text
from .formatting import fixes_to_try, how_to_set, layout_lines, pct, plan_steps, replay_lines, shorten, trade_off_text, \
    what_if_lines
from .pitfalls import cost_text

# a terminal's first screen: 40 of the usual 45-50 rows, leaving the prompt and the command in view
MAX_LINES = 40
TOP_FIXES = 3  # fixes shown with their flags; the rest are counted


def render_screen(d, width: int = 110) -> str:
    """At most ``MAX_LINES`` lines of at most ``width`` characters. Blocks go in order of
    importance; a block that would not fit is left out whole, and the last line says so."""
    blocks = _blocks(d, width)
    out: list[str] = []
    left_out = []
    room = MAX_LINES - 1  # the closing line
    for name, lines in blocks:
        if len(out) + len(lines) <= room:
            out += lines
        else:
            left_out.append(name)
    tail = "Full tables: --detail; everything: --format json, markdown or html."
    if left_out:
        tail = f"Left out here: {', '.join(left_out)}. " + tail
    out += _wrap(tail, width)[:1]
    return "\n".join(out) + "\n"


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    return textwrap.wrap(text, width, subsequent_indent=indent or "  ", break_on_hyphens=False) or [""]


def _inputs(paths: list[str]) -> str:
    if len(paths) <= 2:
        return ", ".join(paths)
    return f"{len(paths)} files: {paths[0]} ... {os.path.basename(paths[-1])}"


def _blocks(d, width: int) -> list[tuple[str, list[str]]]:
    v, w = d.verdict, d.window
    wrap = lambda text, indent="": _wrap(text, width, indent)  # noqa: E731
    blocks = [("header", wrap(f"profclass  {_inputs(d.inputs)}")),
              ("verdict", wrap(f"Verdict: {v['wall'].upper()} wall, confidence {v['confidence']:.2f} "
                               f"(runner-up {v['runner_up']})")),
              ("summary", wrap(v["summary"])),
              ("steady state", wrap(f"Steady state: {w['iterations']} iterations from {w['source']}, step "
                                    f"{w['step_ms']['mean']:.1f} ms mean, {w['step_ms']['median']:.1f} median, "
                                    f"{w['step_ms']['std']:.1f} std")),
              ("walls", wrap("Walls, ms/step (share): " + "; ".join(
                  f"{x} {d.walls[x]['ms_per_step']:.1f} ({pct(d.walls[x]['share'])})" for x in WALLS)))]
    if d.stragglers:
        s = d.stragglers[0]
        more = f" (+{len(d.stragglers) - 1} more)" if len(d.stragglers) > 1 else ""
        blocks.append(("straggler", wrap(
            f"Straggler: rank {s['rank']} (GPU {s['device']}): {s['reason']}; the others wait "
            f"{s['others_wait_ms_per_step']:.1f} ms/step for it{more}")))
    elif len(d.devices) > 1:
        blocks.append(("straggler", wrap(f"Straggler: none among {len(d.devices)} GPUs")))
    lay = layout_lines(d)
    if lay:
        blocks.append(("layout", [x for line in lay for x in wrap(line)]))
    if getattr(d, "plan", None):
        start = (d.replay or {}).get("untraced_step_ms") or d.window["step_ms"]["mean"]
        hc = (d.replay or {}).get("host_calibration")
        given = "the train log's step" if hc and hc.get("source", "").startswith("train log") else "the given step"
        host = f", the host x{hc['host_factor']:.2f} to meet {given}" if hc and hc["host_factor"] != 1 else ""
        blocks.append(("fix plan", wrap(f"Fix plan (each fix replayed on top of the ones before it, from the "
                                        f"{start:.1f} ms step without the profiler{host}):")
                       + [x for i, step in enumerate(plan_steps(d), 1) for x in wrap(f"{i}. {step}", "   ")]))
    asked = what_if_lines(d)
    if asked:  # asked for by name (--what-if): before the fixes profclass chose
        blocks.append(("what if", [x for line in asked for x in wrap(line, "   ")]))
    to_try, none = fixes_to_try(d)
    for i, f in enumerate(to_try[:TOP_FIXES], 1):
        head = wrap(f"{i}. [{f['wall']}] {f['title']} ({gain_text(f)})", "   ")
        trade = wrap(f"   {trade_off_text(f)}", "   ") if f.get("trade_off") else []
        label, said = how_to_set(f)
        blocks.append((f"fix {i}", head + wrap(f"   {label}: {shorten(said, 2 * width - 7 - len(label))}", "   ") + trade))
    if to_try:
        blocks.insert(len(blocks) - min(len(to_try), TOP_FIXES),
                      ("fixes", [f"Fixes to try ({len(to_try)}; predicted gain, best estimate and range):"]))
    priced = [p for p in d.pitfalls if p.get("cost_ms_per_step")]
    if priced:  # the costliest pitfall (its fix is among the fixes too, since schema 2.32.0)
        p = max(priced, key=lambda x: x["cost_ms_per_step"])
        blocks.append(("pitfall", wrap(f"Pitfall: {p['title']}.{cost_text(p)}", "   ")))
    replay = replay_lines(d)
    if replay:  # what the replay says the step is without each wall: after the fixes, if room
        blocks.append(("replay", [x for line in replay[1:2] for x in wrap("Replay: " + line[0].lower() + line[1:])]))
    rest = len(to_try) - TOP_FIXES
    counts = [f"{rest} more fix(es)"] if rest > 0 else []
    counts += [f"{len(none)} priced at no gain"] if none else []
    counts += [f"{len(d.pitfalls)} pitfall(s)"] if d.pitfalls else []
    counts += [f"{len(d.missing)} thing(s) the profile could not show"] if d.missing else []
    if counts:
        blocks.append(("counts", wrap("Also: " + ", ".join(counts) + ".")))
    return blocks
