"""The HTML report: one self-contained file (pictures inlined, no scripts, no network).

It shows the verdict with its confidence and runner-up, a stacked bar per rank of the
steady-state step by wall, the timeline of one representative steady iteration per GPU,
the top kernels and collectives, the fixes with their flags, the evidence, and what the
profile was missing. Pictures are matplotlib figures inlined as PNG (timeline: thousands of
bars, so a raster stays small) and SVG (the bar chart: crisp at any zoom).
"""
from __future__ import annotations

import base64
import html
import io

from .version import __version__
from . import timeline_view as tv
from .classify import WALLS
from .fixes import gain_text
from .pitfalls import cost_text
from .formatting import NO_GAIN_WHY, by_rank, fixes_to_try, how_to_set, layout_lines, no_gain_line, pct, plan_steps, \
    replay_lines, shorten, trade_off_text, waits_ms_per_step, what_if_lines
from .kernels import collective_name

TOP_KERNELS = 15
KERNEL_NAME_MAX = 90  # characters of a kernel name shown (the full name is in the title attribute)

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: #1d1d1f; margin: 0 auto; max-width: 1280px; padding: 18px 28px 40px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.inputs { color: #555; font-size: 12.5px; word-break: break-all; }
.verdict { border-left: 8px solid var(--wall); background: #f6f7f9; padding: 12px 18px; margin: 14px 0; }
.verdict .wall { font-size: 26px; font-weight: 700; color: var(--wall); text-transform: uppercase; }
.verdict .meta { font-size: 15px; margin-left: 12px; color: #333; }
.verdict p { margin: 6px 0 0; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0; }
th, td { padding: 3px 10px; border-bottom: 1px solid #e6e6e6; text-align: left; vertical-align: top; }
th { background: #fafafa; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.kernel { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 6px; border-radius: 2px; }
figure { margin: 8px 0; } figure img { max-width: 100%; height: auto; display: block; }
figcaption { color: #555; font-size: 12.5px; }
ol.fixes li { margin-bottom: 10px; } code { background: #f1f1f4; padding: 1px 4px; border-radius: 3px;
  font-size: 12.5px; } .gain { font-weight: 600; }
.muted { color: #666; } footer { margin-top: 32px; color: #777; font-size: 12px; }
"""


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _figure_uri(fig, fmt: str) -> str:
    buf = io.BytesIO()
    tv.save_figure(fig, buf, fmt=fmt)
    mime = {"png": "image/png", "svg": "image/svg+xml"}[fmt]
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _table(headers: list[str], rows: list[list], numeric: set[int] = frozenset(), cls: dict | None = None) -> str:
    cls = cls or {}
    head = "".join(f'<th class="num">{_e(h)}</th>' if i in numeric else f"<th>{_e(h)}</th>"
                   for i, h in enumerate(headers))
    body = []
    for r in rows:
        cells = []
        for i, c in enumerate(r):
            klass = " ".join(k for k in ("num" if i in numeric else "", cls.get(i, "")) if k)
            cells.append(f'<td class="{klass}">{c}</td>' if klass else f"<td>{c}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_html(d, progress=None) -> str:
    """The report for a ``Diagnosis`` made with ``keep_timelines=True``, as one HTML string.
    Without timelines (per-rank summaries only: the nsys recipe's reducer) it says so in place of
    the timeline and the top kernels."""
    out = _verdict(d)
    if progress:
        progress("drawing the wall chart")
    out += _walls(d)
    if progress:
        progress("drawing the timeline")
    pictures = (_timeline(d), _top_kernels(d)) if getattr(d, "timelines", None) else (_no_timelines(), [])
    out += pictures[0] + _ranks(d) + pictures[1] + _collectives(d) + _fixes(d)
    rows = [[_e(e["wall"]), _e(e["metric"]), f"{e['value']:.3f}", _e(e["unit"]), _e(e["note"])] for e in d.evidence]
    out += ["<h2>Evidence</h2>", _table(["wall", "metric", "value", "unit", "note"], rows, {2})]
    out += _missing_and_config(d)
    nsys = ", ".join(d.nsys_versions) or "unknown"
    out.append(f"<footer>profclass {_e(__version__)}; nsys {_e(nsys)}.</footer></body></html>\n")
    return "\n".join(out)


def _verdict(d) -> list[str]:
    """The document head, the inputs, and the verdict box."""
    v, w = d.verdict, d.window
    colour = tv.WALL_COLOURS.get(v["wall"], "#444")
    return [f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>profclass: {_e(v['wall'])} wall</title><style>{CSS}</style></head><body>",
            "<h1>profclass report</h1>",
            f"<div class=\"inputs\">{_e(', '.join(d.inputs))}</div>",
            f"<section class=\"verdict\" id=\"verdict\" style=\"--wall: {colour}\">"
            f"<span class=\"wall\">{_e(v['wall'])} wall</span>"
            f"<span class=\"meta\">confidence {v['confidence']:.2f}, runner-up {_e(v['runner_up'])}</span>"
            f"<p>{_e(v['summary'])}</p>"
            f"<p class=\"muted\">Steady state: {w['iterations']} iterations from {_e(w['source'])}, step "
            f"{w['step_ms']['mean']:.1f} ms mean (median {w['step_ms']['median']:.1f}, std {w['step_ms']['std']:.1f}, "
            f"min {w['step_ms']['min']:.1f}, max {w['step_ms']['max']:.1f}).</p></section>"]


def _walls(d) -> list[str]:
    rows = [[f'<span class="swatch" style="background:{tv.WALL_COLOURS[x]}"></span>{_e(x)}',
             pct(d.walls[x]["share"]), f"{d.walls[x]['ms_per_step']:.2f}"] for x in WALLS]
    return ["<h2>Where the steady-state step goes</h2>", _table(["wall", "share", "ms/step"], rows, {1, 2}),
            f"<figure><img alt=\"steady-state ms per step by wall, per rank\" src=\"{_figure_uri(tv.walls_figure(d), 'svg')}\">"
            "<figcaption>Each rank's mean steady-state step, split into the four walls.</figcaption></figure>"]


def _no_timelines() -> list[str]:
    return ["<h2>Timeline</h2><p class=\"muted\">Not drawn: this report was made from per-rank summaries "
            "(nsys recipe profclass), which leave the timelines where they were read. "
            "<code>profclass diagnose --format html</code> on the same reports draws the timeline and the top "
            "kernels.</p>"]


def _timeline(d) -> list[str]:
    return ["<h2>Timeline of one steady-state iteration</h2>",
            f"<figure><img alt=\"timeline of one representative steady-state iteration per GPU\" "
            f"src=\"{_figure_uri(tv.timeline_figure(d), 'png')}\">"
            "<figcaption>Per GPU: compute kernels (GEMMs darker), each collective type, copies, GPU idle, and "
            "NVTX ranges (host clock) when present, over the steady iteration closest to the median step."
            "</figcaption></figure>"]


def _ranks(d) -> list[str]:
    """The per-rank table (several GPUs only) and the stragglers."""
    out = []
    if len(d.devices) > 1:
        rows = [[_e(dv["rank"]), _e(dv["pid"]), _e(dv["device"]), _e(dv["wall"]),
                 *[pct(dv["walls"][x]["share"]) for x in WALLS], f"{dv['step_ms']:.1f}",
                 f"{waits_ms_per_step(dv):.1f}"] for dv in by_rank(d.devices)]
        out += ["<h2>Per rank</h2>",
                _table(["rank", "pid", "GPU", "wall", *WALLS, "step ms", "waits ms/step"], rows,
                       {0, 1, 2, 4, 5, 6, 7, 8, 9})]
    for s in d.stragglers:
        out.append(f"<p><b>Straggler:</b> rank {_e(s['rank'])} (pid {_e(s['pid'])}, GPU {_e(s['device'])}): "
                   f"{_e(s['reason'])}; {_e(s['detail'])}; the others wait "
                   f"{s['others_wait_ms_per_step']:.1f} ms/step for it.</p>")
    return out


def _top_kernels(d) -> list[str]:
    top = tv.top_kernels(d, TOP_KERNELS)
    rows = [[f"<span title=\"{_e(r.kernel)}\">{_e(shorten(r.kernel, KERNEL_NAME_MAX, '…'))}</span>", _e(r.kind),
             f"{r.ms_per_step:.2f}", f"{100 * r.share:.1f}%", f"{r.calls_per_step:.1f}", f"{r.mean_us:.1f}"]
            for r in top.itertuples()]
    return [f"<h2>Top kernels</h2><p class=\"muted\">GPU time per steady step, mean over "
            f"{len(d.devices)} GPU(s); kernels may overlap, so the shares need not add up.</p>",
            _table(["kernel", "kind", "ms/step", "of step", "calls/step", "mean µs"], rows, {2, 3, 4, 5},
                   {0: "kernel"})]


def _collectives(d) -> list[str]:
    if not d.collectives:
        return ["<h2>Collectives</h2>", "<p class=\"muted\">No collectives in the steady state.</p>"]
    rows = [[_e(collective_name(c["collective"], c["group"])), _e(c["group"]), _e(c["instances"]), f"{c['transfer_ms_per_step']:.2f}",
             f"{c['wait_ms_per_step']:.2f}", f"{c['exposed_transfer_ms_per_step']:.2f}",
             f"{c['exposed_wait_ms_per_step']:.2f}", f"{c['overlapped_ms_per_step']:.2f}"]
            for c in d.collectives]
    return ["<h2>Collectives</h2>", *[f"<p>{_e(line)}</p>" for line in layout_lines(d)],
            "<p class=\"muted\">ms per step, mean over ranks; wait is time spent waiting for peers.</p>",
            _table(["collective", "group", "n", "transfer", "wait", "exposed transfer", "exposed wait",
                    "overlapped"], rows, {2, 3, 4, 5, 6, 7})]


def _fixes(d) -> list[str]:
    """The replay and the fix plan, the fixes with their flags, then the pitfalls."""
    out = []
    if d.replay:
        out += ["<h2>What-if replay</h2>"] + [f"<p>{_e(line)}</p>" for line in replay_lines(d)]
    if d.plan:
        out += ["<h3>Fix plan</h3>", "<ol class=\"plan\">" + "".join(f"<li>{_e(s)}</li>" for s in plan_steps(d)) + "</ol>"]
    out += [f"<p class=\"whatif\">{_e(line)}</p>" for line in what_if_lines(d)]
    out += ["<h2>Fixes to try</h2>"]
    to_try, none = fixes_to_try(d)
    if to_try:
        items = [f"<li><b>{_e(f['title'])}</b> <span class=\"muted\">[{_e(f['wall'])}]</span> "
                 f"<span class=\"gain\">{_e(gain_text(f))}</span><br><span class=\"muted\">{_e(f['gain_basis'])}</span>"
                 + "<br>{}: <code>{}</code>".format(*map(_e, how_to_set(f)))
                 + f"<br><span class=\"muted\">{_e(f['why'])}</span>"
                 + (f"<br><b>{_e(trade_off_text(f))}</b>" if f.get("trade_off") else "") + "</li>"
                 for f in to_try]
        out += ["<p class=\"muted\">Predicted gains: the best estimate and its range (docs/fixes.md).</p>",
                "<ol class=\"fixes\">" + "".join(items) + "</ol>"]
    else:
        out.append("<p class=\"muted\">No fix applies." + (" Those below are priced at no gain." if none else "") + "</p>")
    if none:
        out += ["<h3>Priced at no gain on this job</h3>",
                f"<p class=\"muted\">({_e(NO_GAIN_WHY)})</p>",
                "<ul class=\"nogain\">" + "".join(f"<li>{_e(no_gain_line(f, d))}</li>" for f in none) + "</ul>"]
    out += [f"<p><b>Pitfall</b> ({_e(p.get('rule', ''))}): {_e(p.get('message', '') + cost_text(p))}</p>"
            for p in d.pitfalls]
    return out


def _missing_and_config(d) -> list[str]:
    out = ["<h2>Missing from the profile</h2>",
           "<ul>" + "".join(f"<li>{_e(m)}</li>" for m in d.missing) + "</ul>" if d.missing
           else "<p class=\"muted\">Nothing: every table profclass reads was present.</p>"]
    rows = [[_e(k), _e(_value(c.get("value"))), _e(c.get("source", ""))] for k, c in d.config.items()
            if isinstance(c, dict)]
    if rows:
        out += ["<h2>Configuration seen in the profile</h2>", _table(["setting", "value", "from"], rows)]
    return out


def _value(v) -> str:
    if isinstance(v, dict):
        return " ".join(k if val is True else f"{k} {val}" for k, val in v.items())
    return str(v)
