"""Formatting shared by the reporters (``report``, ``html``, ``diff.render``), so that one
quantity is written the same way in every output."""
from __future__ import annotations

from .fixes import load_table, request_parts
from .replay.notes import host_paced


def pct(share: float) -> str:
    """A share (0..1) as a whole percentage."""
    return f"{100 * share:.0f}%"


def shorten(text: str, limit: int, mark: str = "...") -> str:
    """``text`` cut to at most ``limit`` characters, ``mark`` saying where it was cut."""
    return text if len(text) <= limit else text[: limit - len(mark)] + mark


def signed_ms(x: float) -> str:
    """A change in ms with its sign; two decimals for changes too small for one."""
    return f"{x:+.1f}" if abs(x) >= 0.05 else f"{x:+.2f}"


def p_value(p: float | None) -> str:
    return "untested" if p is None else "p<1e-6" if p < 1e-6 else f"p={p:.3g}"


def md_cell(x) -> str:
    """A Markdown table cell: pipes would end the cell, newlines the row."""
    return str(x).replace("|", "\\|").replace("\n", " ")


def md_code(x: str) -> str:
    """Markdown inline code that survives backticks inside it."""
    fence = "``" if "`" in x else "`"
    return f"{fence}{x}{fence}" if fence == "`" else f"{fence} {x} {fence}"


def by_rank(devices: list[dict]) -> list[dict]:
    """Per-GPU rows in rank order, those without a rank last."""
    return sorted(devices, key=lambda x: (x["rank"] is None, x["rank"]))


def waits_ms_per_step(device: dict) -> float:
    """Time one GPU spent waiting for its peers in collectives, ms per steady step."""
    return device["comm"]["exposed_wait_ns"] / max(device["iterations"], 1) / 1e6 if device["comm"] else 0.0


def layout_lines(d) -> list[str]:
    """The parallel layout and the pipeline bubble, one plain sentence each (every reporter)."""
    lay, pp = getattr(d, "layout", None) or {}, getattr(d, "pipeline", None) or {}
    out = []
    sizes = lay.get("sizes") or {}
    if any(v is not None for v in sizes.values()):
        # a dense job's expert sizes are Megatron's defaults (ETP = TP), not groups it uses
        dense = ((getattr(d, "config", None) or {}).get("moe") or {}).get("value") is False
        known = ", ".join(f"{k.upper()}={v}" for k, v in sizes.items()
                          if v is not None and k != "microbatches" and not (dense and k in ("etp", "edp")))
        # "inferred" sizes were read off the timeline's traffic (analyzers/layout_infer.py)
        src = sorted({"the timeline" if s == "inferred" else s for s in (lay.get("source") or {}).values() if s})
        mb = sizes.get("microbatches")
        out.append(f"Layout: {known}; micro-batches {'unknown' if mb is None else mb}; world {lay.get('world')} "
                   f"(from {', '.join(src) or 'nothing'})")
    if pp.get("bubble_ms_per_step") is not None:
        theory = f", theory {100 * pp['theory_share']:.0f}%" if pp.get("theory_share") is not None else ""
        unknown = lambda v: "?" if v is None else v  # noqa: E731
        line = (f"Pipeline: {pp['stages']} stages x {unknown(pp['virtual_stages'])} virtual, "
                f"{unknown(pp['microbatches'])} micro-batches; "
                f"bubble {pp['bubble_ms_per_step']:.1f} ms/step ({100 * pp['bubble_share']:.0f}% of the step{theory})")
        if pp.get("slowest_stage") is not None:
            line += f"; slowest stage {pp['slowest_stage']} (+{pp['stage_imbalance_ms']:.1f} ms/step over the mean)"
        layers = {r["stage"]: r.get("layers") for r in pp.get("per_stage") or [] if r.get("stage") is not None}
        if layers and None not in layers.values():
            line += f"; layers per stage {', '.join(str(layers[s]) for s in sorted(layers))} (backward norm kernels)"
        out.append(line)
    return out


def how_to_set(f: dict) -> tuple[str, str]:
    """(label, text) of how to apply a fix: its Hydra overrides where the job was launched with
    them and the fix has them (``fixes[].overrides``), else its Megatron-LM flags."""
    return ("overrides", f["overrides"]) if f.get("overrides") else ("flags", f["flags"])


NO_GAIN_MS = 0.05  # the reports' resolution: a gain that prints as 0.0 ms/step (one decimal)
NO_GAIN_WHY = f"alone: their whole range under {NO_GAIN_MS} ms/step"  # the reports' words for ``no_gain``


def no_gain(f: dict) -> bool:
    """A fix priced at no gain on this job: its whole range under ``NO_GAIN_MS`` (no collector
    pause to take off, more interleaving where the bubble is already small). The JSON ranks it
    last among the fixes; the reports list it apart, so that nobody tries it first."""
    top = f.get("gain_high_ms")
    top = f.get("expected_gain_ms") if top is None else top
    return top is not None and top < NO_GAIN_MS


def fixes_to_try(d) -> tuple[list[dict], list[dict]]:
    """(the fixes worth trying, in their ranking; those priced at no gain: ``no_gain``)."""
    fixes = getattr(d, "fixes", None) or []
    return [f for f in fixes if not no_gain(f)], [f for f in fixes if no_gain(f)]


def no_gain_line(f: dict, d=None) -> str:
    """A fix priced at no gain, in one sentence: what it is and why it would not help here, and
    what it wins in the fix plan of ``d`` where the plan takes it after other fixes (their
    saving can make room for it: more interleaving after larger micro-batches)."""
    ends = [f.get(k) for k in ("gain_low_ms", "gain_high_ms")]
    span = f", range {ends[0]:.1f} to {ends[1]:.1f}" if None not in ends else ""
    step = next((p for p in (getattr(d, "plan", None) or []) if p["id"] == f["id"]), None)
    later = f"; the fix plan takes it after others, for -{step['gain_ms']:.1f} ms" if step else ""
    return (f"{f['title']} ({f['expected_gain_ms']:.1f} ms/step{span}{later}): {f['gain_basis']} "
            f"({': '.join(how_to_set(f))})")


def trade_off_text(f: dict) -> str:
    """What a fix gives up besides time (``fixes[].trade_off``), in words; '' where nothing."""
    t = f.get("trade_off")
    if not t:
        return ""
    if t.get("at_least_pct") is None:
        return f"trade-off: {t['what']}, not measured on this profile"
    return f"trade-off: {t['what']}, at least {t['at_least_pct']:.1f}% at the captured routing"


def plan_steps(d) -> list[str]:
    """The fix plan as sentences: each fix, what it wins on top of the earlier ones, the step
    after it, and the wall that comes next (and what the fix gives up besides time)."""
    # a plan step may be a fix of another wall than the listed ones' (one that undoes a pitfall)
    titles = {f["id"]: f["title"] for f in (*load_table(), *d.fixes)}
    trades = {f["id"]: trade_off_text(f) for f in d.fixes}
    return [f"{titles.get(p['id'], p['id'])}: -{p['gain_ms']:.1f} ms -> step {p['step_ms_after']:.1f} ms, "
            f"then the {p['wall_after']} wall" + (f" ({trades[p['id']]})" if trades.get(p["id"]) else "")
            for p in (getattr(d, "plan", None) or [])]


def what_if_lines(d) -> list[str]:
    """Each fix (or fixes together) asked for with ``--what-if``: its replayed gain, range and
    the step it leaves, from the step without the profiler."""
    r = getattr(d, "replay", None) or {}
    start = r.get("untraced_step_ms")
    # the ones the replay could not price are in missing[], which says why
    out = ["What if " + m[len("what-if "):] for m in getattr(d, "missing", None) or [] if m.startswith("what-if ")]
    if not r.get("requested") or start is None:
        return out
    titles = {f["id"]: f["title"] for f in load_table()}
    for ask, p in r["requested"].items():
        names = " + ".join(titles.get(fid, fid) for fid, _ in request_parts(ask))
        out.append(f"What if {names} ({ask}): -{p['best_ms']:.1f} ms/step [{p['low_ms']:.1f}, {p['high_ms']:.1f}] "
                   f"-> step {start - p['best_ms']:.1f} ms" + (f" ({trade_off_text(p)})" if p.get("trade_off") else ""))
    return out


def _bound_words(d, r: dict) -> str:
    """Why the step without the profiler is an upper bound, where ``untraced_step_bound`` says so."""
    if r.get("untraced_step_bound") != "upper":
        return "."
    why = [w for w, yes in (("this host-paced job", host_paced(r["untraced_step_ms"], r["measured_step_ms"])),
                            ("a window at the run's start", (getattr(d, "window", None) or {}).get("capture_start")
                             == "process")) if yes]
    return f" (an upper bound on {' and '.join(why) or 'this job'}: --untraced-step-ms or --train-log calibrates it)."


def replay_lines(d) -> list[str]:
    """The replay section in words: its fidelity, the critical path, the step without each wall."""
    r = getattr(d, "replay", None) or {}
    if not r or r.get("error_pct") is None:
        return []
    walls = ("compute", "communication", "host", "memory")
    out = [f"Replay: the captured step replayed from its dependency graph takes {r['step_ms']:.1f} ms "
           f"({r['error_pct']:+.2f}% of the measured {r['measured_step_ms']:.1f} ms); the slowest rank's "
           "critical path, ms/step: " + ", ".join(f"{w} {r['critical_path_ms'][w]:.1f}" for w in walls) + ".",
           "Step without each wall, ms: " + ", ".join(f"{w} {r['without_wall_ms'][w]:.1f}" for w in walls)
           + f"; without the profiler's overhead {r['untraced_step_ms']:.1f}" + _bound_words(d, r)]
    if r.get("note"):
        out.append(r["note"][0].upper() + r["note"][1:] + ".")
    hc = r.get("host_calibration")
    if hc:
        source = f", from {hc['source']}" if hc.get("source") else ""  # since schema 2.16.0
        out.append(f"Host calibrated to the job's own step without the profiler ({hc['given_step_ms']:.1f} ms{source}): "
                   + hc["note"] + ".")
    ps = r.get("pipeline_schedule")
    if ps and ps.get("error_pct") is not None:
        kind = "1F1B" if ps["v"] == 1 else f"interleaved ({ps['v']} chunks a stage, P2P {ps.get('p2p', 'batched')})"
        line = (f"Pipeline schedule: Megatron-Core's {kind} simulated at p {ps['p']}, m {ps['m']} takes "
                f"{ps['simulated_step_ms']:.1f} ms ({ps['error_pct']:+.2f}% of the measured); "
                "the PP fixes are priced on it")
        if ps.get("sync_idle_ms"):
            line += ("; the GPUs idle after the P2P calls' device syncs, ms/step by stage: "
                     + ", ".join(f"{x:.1f}" for x in ps["sync_idle_ms"]))
        if ps.get("pause_ms"):
            line += f"; the hosts' collector pauses, {ps['pause_ms']:.1f} ms/step, stall it one after another"
        out.append(line + ".")
    return out
