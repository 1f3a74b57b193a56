"""Regression triage: compare the profile of a known-good run (base) with a new one (candidate).

``diff(base, candidate)`` diagnoses both sides (each a file, a list of rank files, a directory,
an already computed ``Diagnosis``, or a stored diagnosis JSON) and reports:

- the steady-state step time of each side with its per-iteration spread, the ratio, and
  whether the change is significant given that spread (Welch's t-test on the per-iteration
  step times plus a minimum effect size; see ``step_test`` and docs/diff.md);
- the change of every wall in ms per step, and of the quantities inside each wall (GEMM vs
  other compute, exposed time per collective type, idle after syncs / late launches, recompute,
  allocator and offload time);
- the kernels whose time per step changed most, matched by normalised name, and the kernels
  that appeared or vanished;
- changes in the communication pattern (collective mix, dispatcher, libraries, overlap) and in
  the configuration visible in the profiles (CUDA graphs, FP8, recompute, command-line flags);
- a one-sentence verdict naming the wall that explains most of the change.
"""
from __future__ import annotations

import io
import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields

import numpy as np

from .classify import WALLS
from .errors import ProfileError
from .pipeline import Diagnosis, _jsonable
from .pipeline import diagnose as _diagnose

ALPHA = 0.05  # two-sided significance level of the step-time test
MIN_EFFECT = 0.02  # a change smaller than this fraction of the base step is never "significant"
UNTESTED_MIN_EFFECT = 0.05  # with fewer than two iterations on a side there is no spread to test
KERNEL_MIN_MS = 0.005  # kernels below this on both sides are noise, not part of the change


# ---------------------------------------------------------------------------------------------
# step time and significance

def step_test(base: list[float], candidate: list[float], alpha: float = ALPHA,
              min_effect: float = MIN_EFFECT) -> dict:
    """Is the candidate's mean step different from the base's, given the per-iteration spread?

    Welch's t-test (unequal variances) on the per-iteration step times of both sides, and the
    relative change must reach ``min_effect``. With fewer than two iterations on a side there
    is no spread: then only a change of at least ``UNTESTED_MIN_EFFECT`` (or ``min_effect`` if
    larger) counts, and ``method`` says the change was not tested.
    """
    x = np.asarray(base, float)
    y = np.asarray(candidate, float)
    if x.size == 0 or y.size == 0:
        raise ValueError("step_test needs at least one iteration on each side")
    mx, my = float(x.mean()), float(y.mean())
    delta = my - mx
    rel = delta / mx if mx > 0 else 0.0
    out = dict(method="", alpha=alpha, min_effect_pct=round(100 * min_effect, 3),
               p_value=None, t=None, df=None, ci95_delta_ms=None, significant=False)
    if x.size < 2 or y.size < 2:
        threshold = max(min_effect, UNTESTED_MIN_EFFECT)
        out.update(method=f"untested (fewer than 2 iterations on a side): |change| >= {100 * threshold:.0f}%",
                   significant=bool(abs(rel) >= threshold))
        return out
    vx, vy = float(x.var(ddof=1)), float(y.var(ddof=1))
    se2 = vx / x.size + vy / y.size
    if se2 <= 0:  # no spread on either side: any difference is exact
        p, t, df, half = (0.0 if delta != 0 else 1.0), None, None, 0.0
    else:
        from . import stats  # Student t without scipy (profclass/stats.py)
        se = math.sqrt(se2)
        t = delta / se
        # Welch-Satterthwaite degrees of freedom
        df = se2 ** 2 / ((vx / x.size) ** 2 / (x.size - 1) + (vy / y.size) ** 2 / (y.size - 1))
        p = float(2 * stats.t.sf(abs(t), df))
        half = float(stats.t.ppf(0.975, df) * se)
    out.update(method="Welch t-test on per-iteration step times",
               p_value=round(p, 6), t=None if t is None else round(float(t), 3),
               df=None if df is None else round(float(df), 2),
               ci95_delta_ms=[round(delta - half, 3), round(delta + half, 3)],
               significant=bool(p < alpha and abs(rel) >= min_effect))
    return out


# ---------------------------------------------------------------------------------------------
# inputs

def _load_json(path: str) -> Diagnosis:
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise ProfileError(path, f"cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(path, f"not JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(doc, dict) and isinstance(doc.get("diagnosis"), dict):
        doc = doc["diagnosis"]  # a `profclass hook` record
    names = {f.name for f in fields(Diagnosis)}
    required = {f.name for f in fields(Diagnosis) if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(doc, dict) or not required <= doc.keys():
        raise ProfileError(path, "not a profclass diagnosis (expected the JSON of 'profclass diagnose "
                                 "--format json' or of 'profclass hook')")
    if not doc.get("kernels"):
        raise ProfileError(path, "stored diagnosis has no per-kernel table (written by an older profclass); "
                                 "diff the profile itself")
    return Diagnosis(**{k: v for k, v in doc.items() if k in names})


def _as_diagnosis(side, iteration_regex: str | None) -> Diagnosis:
    if isinstance(side, Diagnosis):
        return side
    paths = [side] if isinstance(side, (str, bytes)) or hasattr(side, "__fspath__") else list(side)
    paths = [os.fsdecode(p) for p in paths]
    if not paths:
        raise ProfileError("(none)", "no profile given")
    if len(paths) == 1 and paths[0].endswith(".json"):
        return _load_json(paths[0])
    return _diagnose(paths, iteration_regex=iteration_regex)


# ---------------------------------------------------------------------------------------------
# the comparison

@dataclass
class DiffResult:
    """What ``profclass diff`` reports; ``to_dict`` is the JSON output."""

    base: dict
    candidate: dict
    step: dict
    significant: bool
    regression: bool
    improvement: bool
    change: str  # "regression" | "improvement" | "no significant change"
    verdict: dict
    walls: dict
    walls_delta_ms: dict
    components: list[dict]
    kernels: list[dict]
    appeared: list[str]
    vanished: list[str]
    communication: dict
    config_changes: list[dict]
    notes: list[str] = field(default_factory=list)
    pitfalls: list[dict] = field(default_factory=list)  # rules with scope "diff" (data/rules.toml)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_jsonable)


def _side(d: Diagnosis) -> dict:
    s = d.window["step_ms"]
    return dict(inputs=list(d.inputs), wall=d.verdict["wall"], summary=d.verdict["summary"],
                iterations=len(s["per_iteration"]), window_source=d.window["source"],
                step_ms=dict(mean=s["mean"], median=s["median"], std=s["std"],
                             per_iteration=list(s["per_iteration"])),
                gpus=len(d.devices))


def _feature_ms(d: Diagnosis, key: str, scale: float = 1e-6) -> float:
    """Mean over GPUs of a per-GPU feature (ns over the window) per step."""
    vals = [dv["features"].get(key) or 0 for dv in d.devices]
    its = [max(dv["iterations"], 1) for dv in d.devices]
    return float(np.mean([v / it for v, it in zip(vals, its)])) * scale if vals else 0.0


def _collective_rows(d: Diagnosis) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for c in d.collectives:
        r = rows.setdefault(c["collective"], dict(group=c["group"], transfer_ms=0.0, wait_ms=0.0,
                                                  exposed_ms=0.0, overlapped_ms=0.0, calls_per_step=0.0))
        r["transfer_ms"] += c["transfer_ms_per_step"]
        r["wait_ms"] += c["wait_ms_per_step"]
        r["exposed_ms"] += c["exposed_transfer_ms_per_step"] + c["exposed_wait_ms_per_step"]
        r["overlapped_ms"] += c["overlapped_ms_per_step"]
    for k in d.kernels:
        if k["is_comm"] and k["collective"]:
            r = rows.setdefault(k["collective"], dict(group="", transfer_ms=0.0, wait_ms=0.0, exposed_ms=0.0,
                                                      overlapped_ms=0.0, calls_per_step=0.0))
            r["calls_per_step"] += k["count_per_step"]
    return rows


def _components(b: Diagnosis, c: Diagnosis) -> list[dict]:
    """The quantities inside each wall, both sides, ms per step (counts per step where noted)."""
    def f(key, scale=1e-6):
        return _feature_ms(b, key, scale), _feature_ms(c, key, scale)

    out = []

    def add(wall, metric, pair, unit="ms/step"):
        bv, cv = pair
        out.append(dict(wall=wall, metric=metric, unit=unit, base=round(bv, 3), candidate=round(cv, 3),
                        delta=round(cv - bv, 3)))

    gemm, comp = f("gemm_ns"), f("compute_ns")
    add("compute", "GEMM kernels", gemm)
    add("compute", "other compute kernels", (max(comp[0] - gemm[0], 0.0), max(comp[1] - gemm[1], 0.0)))
    cb, cc = _collective_rows(b), _collective_rows(c)
    for ctype in sorted(set(cb) | set(cc)):
        add("communication", f"{ctype} exposed",
            (cb.get(ctype, {}).get("exposed_ms", 0.0), cc.get(ctype, {}).get("exposed_ms", 0.0)))
    add("communication", "copies exposed (non-offload)", f("exposed_copy_ns"))
    add("host", "idle after host syncs", f("idle_sync_ns"))
    add("host", "idle, launch-late", f("idle_launch_ns"))
    add("host", "idle, other (queued work waiting)", f("idle_other_ns"))
    add("host", "host synchronisations", f("sync_calls", 1.0), "calls/step")
    add("host", "kernels launched", f("kernels", 1.0), "per step")
    add("host", "kernels shorter than their launch", f("launch_bound_kernels", 1.0), "per step")
    add("memory", "recompute (estimate)", f("recompute_ns"))
    add("memory", "idle around allocator calls", f("idle_alloc_ns"))
    off_b = _feature_ms(b, "offload_exposed_ns") + _feature_ms(b, "idle_offload_ns")
    off_c = _feature_ms(c, "offload_exposed_ns") + _feature_ms(c, "idle_offload_ns")
    add("memory", "offload copies and their waits", (off_b, off_c))
    add("memory", "allocator calls", f("alloc_calls", 1.0), "calls/step")
    return out


def _kernel_changes(b: Diagnosis, c: Diagnosis) -> tuple[list[dict], list[str], list[str]]:
    key = ("name", "op")
    bt = {(k["name"], k["op"]): k for k in b.kernels}
    ct = {(k["name"], k["op"]): k for k in c.kernels}
    rows = []
    for kk in set(bt) | set(ct):
        kb, kc = bt.get(kk), ct.get(kk)
        bms, cms = (kb or {}).get("ms_per_step", 0.0), (kc or {}).get("ms_per_step", 0.0)
        bn, cn = (kb or {}).get("count_per_step", 0.0), (kc or {}).get("count_per_step", 0.0)
        if max(bms, cms) < KERNEL_MIN_MS:
            continue
        meta = kc or kb
        status = "appeared" if kb is None else "vanished" if kc is None else "changed"
        rows.append(dict(zip(key, kk), status=status, library=meta["library"], collective=meta["collective"],
                         is_comm=meta["is_comm"], is_gemm=meta["is_gemm"], is_fp8=meta["is_fp8"],
                         base=dict(count_per_step=bn, ms_per_step=bms),
                         candidate=dict(count_per_step=cn, ms_per_step=cms),
                         delta_ms_per_step=round(cms - bms, 4), delta_count_per_step=round(cn - bn, 3)))
    rows.sort(key=lambda r: (-abs(r["delta_ms_per_step"]), r["name"]))
    appeared = [r["name"] for r in sorted(rows, key=lambda r: -r["candidate"]["ms_per_step"])
                if r["status"] == "appeared"]
    vanished = [r["name"] for r in sorted(rows, key=lambda r: -r["base"]["ms_per_step"])
                if r["status"] == "vanished"]
    return rows, appeared, vanished


def _overlap_share(rows: dict[str, dict]) -> float | None:
    total = sum(r["transfer_ms"] + r["wait_ms"] for r in rows.values())
    return round(sum(r["overlapped_ms"] for r in rows.values()) / total, 4) if total > 0 else None


def _communication(b: Diagnosis, c: Diagnosis) -> dict:
    cb, cc = _collective_rows(b), _collective_rows(c)
    mix = []
    for ctype in sorted(set(cb) | set(cc)):
        rb, rc = cb.get(ctype), cc.get(ctype)
        z = dict(calls_per_step=0.0, transfer_ms=0.0, wait_ms=0.0, exposed_ms=0.0, overlapped_ms=0.0)
        pick = lambda r: {k: round(float((r or z).get(k, 0.0)), 3) for k in z}  # noqa: E731
        mix.append(dict(collective=ctype, group=(rc or rb)["group"], base=pick(rb), candidate=pick(rc),
                        status="appeared" if rb is None else "vanished" if rc is None else "both",
                        delta_exposed_ms=round(pick(rc)["exposed_ms"] - pick(rb)["exposed_ms"], 3)))
    libs_b = _feature_libraries(b)
    libs_c = _feature_libraries(c)
    disp_b = b.config.get("dispatcher", {}).get("value")
    disp_c = c.config.get("dispatcher", {}).get("value")
    ov_b, ov_c = _overlap_share(cb), _overlap_share(cc)
    changes = []
    if disp_b != disp_c:
        changes.append(f"dispatcher {disp_b} -> {disp_c}")
    if set(libs_b) != set(libs_c):
        changes.append(f"communication libraries {sorted(libs_b) or ['none']} -> {sorted(libs_c) or ['none']}")
    for m in mix:
        if m["status"] != "both":
            changes.append(f"{m['collective']} {m['status']} "
                           f"({max(m['base']['calls_per_step'], m['candidate']['calls_per_step']):.1f} calls/step)")
        else:
            nb, nc = m["base"]["calls_per_step"], m["candidate"]["calls_per_step"]
            if abs(nc - nb) >= max(0.5, 0.1 * nb):
                changes.append(f"{m['collective']} calls per step {nb:.1f} -> {nc:.1f}")
    if ov_b is not None and ov_c is not None and abs(ov_c - ov_b) >= 0.05:
        changes.append(f"communication hidden under compute {100 * ov_b:.0f}% -> {100 * ov_c:.0f}%")
    return dict(collectives=mix, dispatcher=dict(base=disp_b, candidate=disp_c),
                libraries=dict(base=libs_b, candidate=libs_c),
                overlap_share=dict(base=ov_b, candidate=ov_c), changes=changes)


def _feature_libraries(d: Diagnosis) -> dict[str, float]:
    """Communication time per step by library (mean over GPUs)."""
    libs: dict[str, float] = {}
    for dv in d.devices:
        for lib, ns in (dv["features"].get("comm_libraries") or {}).items():
            libs[lib] = libs.get(lib, 0.0) + ns / max(dv["iterations"], 1) / 1e6 / len(d.devices)
    return {k: round(v, 3) for k, v in sorted(libs.items())}


def _config_changes(b: Diagnosis, c: Diagnosis) -> list[dict]:
    out = []
    for key in sorted(set(b.config) | set(c.config)):
        if key == "command_line_flags":
            continue
        eb, ec = b.config.get(key), c.config.get(key)
        vb, vc = (eb or {}).get("value"), (ec or {}).get("value")
        if vb != vc:
            out.append(dict(key=key, base=vb, candidate=vc, source=(ec or eb)["source"]))
    fb = (b.config.get("command_line_flags") or {}).get("value") or {}
    fc = (c.config.get("command_line_flags") or {}).get("value") or {}
    for flag in sorted(set(fb) | set(fc)):
        if fb.get(flag) != fc.get(flag):
            out.append(dict(key=flag, base=fb.get(flag), candidate=fc.get(flag), source="command line"))
    if b.nsys_versions != c.nsys_versions:
        out.append(dict(key="nsys_version", base=", ".join(b.nsys_versions), candidate=", ".join(c.nsys_versions),
                        source="profile metadata"))
    return out


def _fmt_p(p: float | None) -> str:
    if p is None:
        return "untested"
    return "p<1e-6" if p < 1e-6 else f"p={p:.3g}"


def _fmt_ms(x: float) -> str:
    return f"{x:+.1f}" if abs(x) >= 0.05 else f"{x:+.2f}"


def _verdict(step: dict, significant: bool, change: str, walls_delta: dict, components: list[dict],
             kernels: list[dict]) -> dict:
    delta = step["delta_ms"]
    t = step["test"]
    test_txt = f"Welch {_fmt_p(t['p_value'])}" if t["p_value"] is not None else t["method"]
    head = (f"step {step['base_ms']:.1f} -> {step['candidate_ms']:.1f} ms "
            f"({100 * (step['ratio'] - 1):+.1f}%, x{step['ratio']:.3f}; {test_txt})")
    sign = 1.0 if delta >= 0 else -1.0
    moves = {w: walls_delta[w] for w in WALLS}
    same_dir = {w: v for w, v in moves.items() if v * sign > 0}
    wall = max(same_dir, key=lambda w: abs(same_dir[w])) if same_dir and delta != 0 else None
    if not significant:
        largest = max(moves, key=lambda w: abs(moves[w]))
        tail = (f"; the largest wall move is {largest} {_fmt_ms(moves[largest])} ms/step"
                if abs(moves[largest]) >= 0.05 else "")
        return dict(kind="no significant change", wall=None,
                    summary=f"No significant change: {head}{tail}.")
    word = "Regression" if change == "regression" else "Improvement"
    if wall is None:  # every wall moved against the step (cannot happen with consistent walls)
        return dict(kind=change, wall=None, summary=f"{word}: {head}; no wall moved in its direction.")
    chief = [c for c in components if c["wall"] == wall and c["unit"] == "ms/step" and c["delta"] * sign > 0]
    chief_txt = ""
    if chief:
        top = max(chief, key=lambda c: abs(c["delta"]))
        chief_txt = f", chiefly {top['metric']} ({_fmt_ms(top['delta'])} ms/step)"
    kern_txt = ""
    if wall in ("compute", "communication"):
        mine = [k for k in kernels if (k["is_comm"] == (wall == "communication")) and k["op"] == "kernel"
                and k["delta_ms_per_step"] * sign > 0]
        if mine:
            k = mine[0]  # kernels are sorted by |delta|
            name = k["name"] if len(k["name"]) <= 60 else k["name"][:57] + "..."
            kern_txt = f"; top kernel {name} {_fmt_ms(k['delta_ms_per_step'])} ms/step"
    summary = (f"{word}: {head}; the {wall} wall explains most of it "
               f"({_fmt_ms(walls_delta[wall])} of {_fmt_ms(delta)} ms/step){chief_txt}{kern_txt}.")
    return dict(kind=change, wall=wall, summary=summary)


def diff(base, candidate, iteration_regex: str | None = None, alpha: float = ALPHA,
         min_effect: float = MIN_EFFECT) -> DiffResult:
    """Compare a base run with a candidate run. Raises ProfileError on bad input."""
    b = _as_diagnosis(base, iteration_regex)
    c = _as_diagnosis(candidate, iteration_regex)
    xb, xc = b.window["step_ms"]["per_iteration"], c.window["step_ms"]["per_iteration"]
    mb, mc = float(np.mean(xb)), float(np.mean(xc))
    test = step_test(xb, xc, alpha=alpha, min_effect=min_effect)
    ratio = mc / mb if mb > 0 else float("nan")
    step = dict(base_ms=round(mb, 3), candidate_ms=round(mc, 3), delta_ms=round(mc - mb, 3),
                delta_pct=round(100 * (ratio - 1), 3), ratio=round(ratio, 4),
                base_std_ms=b.window["step_ms"]["std"], candidate_std_ms=c.window["step_ms"]["std"],
                base_iterations=len(xb), candidate_iterations=len(xc), test=test)
    significant = bool(test["significant"])
    regression = significant and mc > mb
    improvement = significant and mc < mb
    change = "regression" if regression else "improvement" if improvement else "no significant change"
    walls = {w: dict(base_ms=b.walls[w]["ms_per_step"], candidate_ms=c.walls[w]["ms_per_step"],
                     delta_ms=round(c.walls[w]["ms_per_step"] - b.walls[w]["ms_per_step"], 3),
                     base_share=b.walls[w]["share"], candidate_share=c.walls[w]["share"]) for w in WALLS}
    walls_delta = {w: walls[w]["delta_ms"] for w in WALLS}
    step["attributed_delta_ms"] = round(sum(walls_delta.values()), 3)
    components = _components(b, c)
    kernels, appeared, vanished = _kernel_changes(b, c)
    notes = []
    if len(b.devices) != len(c.devices):
        notes.append(f"the runs have different GPU counts ({len(b.devices)} vs {len(c.devices)}): "
                     "per-GPU means are compared")
    for name, d in (("base", b), ("candidate", c)):
        if d.window["source"] == "whole":
            notes.append(f"{name}: no iterations found (whole capture used), so its step time has no spread")
    return DiffResult(
        base=_side(b), candidate=_side(c), step=step, significant=significant, regression=regression,
        improvement=improvement, change=change,
        verdict=_verdict(step, significant, change, walls_delta, components, kernels),
        walls=walls, walls_delta_ms=walls_delta, components=components, kernels=kernels,
        appeared=appeared, vanished=vanished, communication=_communication(b, c),
        config_changes=_config_changes(b, c), notes=notes, pitfalls=_pair_pitfalls(b, c, mb))


def _pair_pitfalls(b: Diagnosis, c: Diagnosis, step_ms: float) -> list[dict]:
    from .pitfalls import check, diff_facts

    def flags(d):
        return d.config.get("command_line_flags", {}).get("value", {})
    return check(diff_facts(flags(b), flags(c)), {}, step_ms, scope="diff")


# ---------------------------------------------------------------------------------------------
# rendering

def _short(name: str, n: int = 70) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def one_line(r: DiffResult) -> str:
    """The diff as one line for a training log."""
    s = r.step
    sig = "significant" if r.significant else "not significant"
    wall = f", {r.verdict['wall']} {_fmt_ms(r.walls_delta_ms[r.verdict['wall']])} ms/step" if r.verdict["wall"] else ""
    return (f"vs baseline: {r.change}, step {s['base_ms']:.1f} -> {s['candidate_ms']:.1f} ms "
            f"({s['delta_pct']:+.1f}%, {sig}{wall})")


def render_text(r: DiffResult, width: int = 120, top: int = 12) -> str:
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    s, t = r.step, r.step["test"]
    con.print(f"[bold]profclass diff[/bold]  base {', '.join(r.base['inputs'])}")
    con.print(f"                candidate {', '.join(r.candidate['inputs'])}")
    con.print(f"[bold]{r.verdict['summary']}[/bold]")
    con.print(f"Step: base {s['base_ms']:.2f} ms (std {s['base_std_ms']:.2f}, n={s['base_iterations']}), "
              f"candidate {s['candidate_ms']:.2f} ms (std {s['candidate_std_ms']:.2f}, n={s['candidate_iterations']}), "
              f"ratio {s['ratio']:.4f}")
    ci = f", 95% CI of the change [{t['ci95_delta_ms'][0]:+.2f}, {t['ci95_delta_ms'][1]:+.2f}] ms" \
        if t["ci95_delta_ms"] else ""
    p = _fmt_p(t["p_value"])
    con.print(f"Test: {t['method']}, {p}{ci}; significant needs p<{t['alpha']} and |change|>={t['min_effect_pct']:g}%")
    tb = Table(title="Walls (ms/step)", show_edge=False)
    for col in ("wall", "base", "candidate", "delta"):
        tb.add_column(col, justify="left" if col == "wall" else "right")
    for w in WALLS:
        x = r.walls[w]
        tb.add_row(w, f"{x['base_ms']:.2f}", f"{x['candidate_ms']:.2f}", _fmt_ms(x["delta_ms"]))
    con.print(tb)
    tb = Table(title="Inside the walls", show_edge=False)
    for col in ("wall", "metric", "unit", "base", "candidate", "delta"):
        tb.add_column(col, justify="right" if col in ("base", "candidate", "delta") else "left")
    for c in r.components:
        tb.add_row(c["wall"], c["metric"], c["unit"], f"{c['base']:.2f}", f"{c['candidate']:.2f}", _fmt_ms(c["delta"]))
    con.print(tb)
    tb = Table(title=f"Kernels whose time per step changed most (top {top}, mean per GPU)", show_edge=False)
    for col in ("kernel", "status", "n/step base", "n/step cand", "ms/step base", "ms/step cand", "delta"):
        tb.add_column(col, justify="left" if col in ("kernel", "status") else "right",
                      no_wrap=col == "kernel", overflow="ellipsis")
    for k in r.kernels[:top]:
        tb.add_row(_short(k["name"], 50), k["status"], f"{k['base']['count_per_step']:.1f}",
                   f"{k['candidate']['count_per_step']:.1f}", f"{k['base']['ms_per_step']:.3f}",
                   f"{k['candidate']['ms_per_step']:.3f}", _fmt_ms(k["delta_ms_per_step"]))
    con.print(tb)
    if r.appeared:
        con.print(f"Appeared ({len(r.appeared)}): " + "; ".join(_short(n, 60) for n in r.appeared[:8])
                  + (" ..." if len(r.appeared) > 8 else ""))
    if r.vanished:
        con.print(f"Vanished ({len(r.vanished)}): " + "; ".join(_short(n, 60) for n in r.vanished[:8])
                  + (" ..." if len(r.vanished) > 8 else ""))
    comm = r.communication
    if comm["collectives"]:
        tb = Table(title="Communication (ms/step, mean per GPU)", show_edge=False)
        for col in ("collective", "calls base", "calls cand", "exposed base", "exposed cand", "overlapped base",
                    "overlapped cand"):
            tb.add_column(col, justify="left" if col == "collective" else "right")
        for m in comm["collectives"]:
            tb.add_row(m["collective"], f"{m['base']['calls_per_step']:.1f}", f"{m['candidate']['calls_per_step']:.1f}",
                       f"{m['base']['exposed_ms']:.2f}", f"{m['candidate']['exposed_ms']:.2f}",
                       f"{m['base']['overlapped_ms']:.2f}", f"{m['candidate']['overlapped_ms']:.2f}")
        con.print(tb)
    con.print("Communication pattern: " + ("; ".join(comm["changes"]) if comm["changes"] else "unchanged"))
    if r.config_changes:
        con.print("Configuration changes: " + "; ".join(
            f"{c['key']}: {c['base']} -> {c['candidate']} ({c['source']})" for c in r.config_changes))
    else:
        con.print("Configuration changes: none visible in the profiles")
    for p in r.pitfalls:
        con.print(f"Pitfall ({p['rule']}): {p['message']} Fix: {p['fix']}")
    for n in r.notes:
        con.print(f"Note: {n}")
    return buf.getvalue()


def render_markdown(r: DiffResult, top: int = 10) -> str:
    """A pull-request comment."""
    s, t = r.step, r.step["test"]
    icon = {"regression": "Regression", "improvement": "Improvement"}.get(r.change, "No significant change")
    p = _fmt_p(t["p_value"])
    lines = [f"## profclass diff: **{icon}** ({s['delta_pct']:+.1f}% step time)", "", r.verdict["summary"], "",
             "| | base | candidate |", "|---|---:|---:|",
             f"| step (mean, ms) | {s['base_ms']:.2f} | {s['candidate_ms']:.2f} |",
             f"| std (ms) | {s['base_std_ms']:.2f} | {s['candidate_std_ms']:.2f} |",
             f"| iterations | {s['base_iterations']} | {s['candidate_iterations']} |", "",
             f"Ratio {s['ratio']:.4f}; {t['method']}, {p}; significant: **{'yes' if r.significant else 'no'}** "
             f"(needs p<{t['alpha']} and a change of at least {t['min_effect_pct']:g}%).", "",
             "| wall | base ms/step | candidate ms/step | delta |", "|---|---:|---:|---:|"]
    lines += [f"| {w} | {r.walls[w]['base_ms']:.2f} | {r.walls[w]['candidate_ms']:.2f} | "
              f"{_fmt_ms(r.walls[w]['delta_ms'])} |" for w in WALLS]
    moved = [c for c in r.components if c["unit"] == "ms/step" and abs(c["delta"]) >= 0.05]
    if moved:
        lines += ["", "<details><summary>Inside the walls</summary>", "",
                  "| wall | metric | base | candidate | delta |", "|---|---|---:|---:|---:|"]
        lines += [f"| {c['wall']} | {c['metric']} | {c['base']:.2f} | {c['candidate']:.2f} | {_fmt_ms(c['delta'])} |"
                  for c in sorted(moved, key=lambda c: -abs(c["delta"]))]
        lines += ["", "</details>"]
    if r.kernels:
        lines += ["", f"### Kernels whose time per step changed most (top {top}, mean per GPU)", "",
                  "| kernel | status | n/step | ms/step | delta |", "|---|---|---:|---:|---:|"]
        for k in r.kernels[:top]:
            name = _short(k["name"], 80).replace("|", "\\|")
            lines.append(f"| `{name}` | {k['status']} | {k['base']['count_per_step']:.1f} -> "
                         f"{k['candidate']['count_per_step']:.1f} | {k['base']['ms_per_step']:.3f} -> "
                         f"{k['candidate']['ms_per_step']:.3f} | {_fmt_ms(k['delta_ms_per_step'])} |")
    if r.appeared or r.vanished:
        lines.append("")
        if r.appeared:
            lines.append(f"Appeared: {len(r.appeared)} kernel name(s), e.g. `{_short(r.appeared[0], 80)}`.")
        if r.vanished:
            lines.append(f"Vanished: {len(r.vanished)} kernel name(s), e.g. `{_short(r.vanished[0], 80)}`.")
    comm = r.communication["changes"]
    lines += ["", "**Communication pattern:** " + ("; ".join(comm) if comm else "unchanged") + "."]
    if r.config_changes:
        lines += ["", "**Configuration changes:** " + "; ".join(
            f"`{c['key']}` {c['base']} -> {c['candidate']}" for c in r.config_changes) + "."]
    for n in r.notes:
        lines += ["", f"Note: {n}."]
    for p in r.pitfalls:
        lines += ["", f"**Pitfall** ({p['rule']}): {p['message']} Fix: `{p['fix']}`."]
    return "\n".join(lines) + "\n"
