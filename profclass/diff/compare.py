"""The comparison itself: step times and their test, walls, the quantities inside each wall,
kernels, communication pattern and configuration of a base run against a candidate run."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

from ..classify import WALLS
from ..config import RUN_FLAG_ITEMS, launched_with_overrides, run_flags
from ..contract import saved_side_notes, stamp
from ..kernels import collective_label, collective_name
from ..pipeline import Diagnosis, _jsonable
from ..replay.run import replayer_of
from .causes import attribute
from ..fixes import load_table
from . import work
from .fix_gains import side_settings, caveats, fix_gains, without_pauses
from .saved import as_diagnosis
from .split import split_step
from .stats import ALPHA, MIN_EFFECT, step_test
from .timer import read_logs, timer_note, timer_step, with_timer_gains
from .verdict import judged_of, lead_with_fix, verdict_of

KERNEL_MIN_MS = 0.005  # kernels below this on both sides are noise, not part of the change


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
    causes: dict | None = None  # wait vs transfer, waiting charged to the waited-for rank's wall (causes.py)
    fix_gains: list[dict] = field(default_factory=list)  # known fixes applied: predicted vs realized

    @property
    def judged_step(self) -> dict:
        """What the decision judged: ``step.timer`` where both runs' training logs were tested,
        else ``step.work`` (per the base's work) where the pair changed the work a step, else
        ``step``; each carries ``delta_ms``, ``delta_pct`` and ``test``."""
        return judged_of(self.step)

    def to_dict(self) -> dict:
        return stamp(asdict(self))  # schema_version, profclass_version first (profclass.contract)

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
    """One row per collective and group (PP send/recv apart from the EP all-to-all that shares
    its kernel name); a type's calls per step (kernel table) split over its groups by their
    instance counts."""
    rows: dict[str, dict] = {}
    instances: dict[str, dict[str, int]] = {}
    for c in d.collectives:
        key = collective_label(c["collective"], c["group"])
        r = rows.setdefault(key, dict(collective=c["collective"], group=c["group"], transfer_ms=0.0, wait_ms=0.0,
                                      exposed_ms=0.0, overlapped_ms=0.0, calls_per_step=0.0))
        r["transfer_ms"] += c["transfer_ms_per_step"]
        r["wait_ms"] += c["wait_ms_per_step"]
        r["exposed_ms"] += c["exposed_transfer_ms_per_step"] + c["exposed_wait_ms_per_step"]
        r["overlapped_ms"] += c["overlapped_ms_per_step"]
        # keyed as the kernel table names its rows: the PP share of SendRecv is its "send/recv"
        by_key = instances.setdefault(collective_name(c["collective"], c["group"]), {})
        by_key[key] = by_key.get(key, 0) + int(c.get("instances") or 0)
    calls: dict[str, float] = {}
    for k in d.kernels:
        if k["is_comm"] and k["collective"]:
            calls[k["collective"]] = calls.get(k["collective"], 0.0) + k["count_per_step"]
    for ctype, n in calls.items():
        shares = instances.get(ctype) or {ctype: 1}
        total = sum(shares.values())
        for key, count in shares.items():
            r = rows.setdefault(key, dict(collective=ctype, group="", transfer_ms=0.0, wait_ms=0.0, exposed_ms=0.0,
                                          overlapped_ms=0.0, calls_per_step=0.0))
            r["calls_per_step"] += n * (count / total if total else 1.0 / len(shares))
    return rows


def _charged_recompute_ms(d: Diagnosis) -> float:
    """The recompute the memory wall took, ms per step (the ``memory`` section; 0 where absent)."""
    return float((getattr(d, "memory", None) or {}).get("recompute_charged_ms_per_step") or 0.0)


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
    # recompute sits in memory only where the card is near capacity (classify charges it
    # there); elsewhere it stays in the walls it runs in, so the rows follow the walls table
    total, charged = f("recompute_ns"), (_charged_recompute_ms(b), _charged_recompute_ms(c))
    add("memory", "recompute charged to memory (card near capacity)", charged)
    add("compute", "recompute kept in the walls it runs in (card not near capacity)",
        (max(total[0] - charged[0], 0.0), max(total[1] - charged[1], 0.0)))
    add("memory", "idle around allocator calls", f("idle_alloc_ns"))
    off_b = _feature_ms(b, "offload_exposed_ns") + _feature_ms(b, "idle_offload_ns")
    off_c = _feature_ms(c, "offload_exposed_ns") + _feature_ms(c, "idle_offload_ns")
    add("memory", "offload copies and their waits", (off_b, off_c))
    add("memory", "allocator calls", f("alloc_calls", 1.0), "calls/step")
    return out


def _kernel_changes(b: Diagnosis, c: Diagnosis) -> tuple[list[dict], list[str], list[str]]:
    # one kernel name can be two kinds (SendRecv: EP all-to-all and PP send/recv rows)
    key = ("name", "op", "collective")
    bt = {(k["name"], k["op"], k["collective"]): k for k in b.kernels}
    ct = {(k["name"], k["op"], k["collective"]): k for k in c.kernels}
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
    for key in sorted(set(cb) | set(cc)):
        rb, rc = cb.get(key), cc.get(key)
        z = dict(calls_per_step=0.0, transfer_ms=0.0, wait_ms=0.0, exposed_ms=0.0, overlapped_ms=0.0)
        pick = lambda r: {k: round(float((r or z).get(k, 0.0)), 3) for k in z}  # noqa: E731
        mix.append(dict(collective=(rc or rb)["collective"], group=(rc or rb)["group"],
                        base=pick(rb), candidate=pick(rc),
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
            changes.append(f"{collective_label(m['collective'], m['group'])} {m['status']} "
                           f"({max(m['base']['calls_per_step'], m['candidate']['calls_per_step']):.1f} calls/step)")
        else:
            nb, nc = m["base"]["calls_per_step"], m["candidate"]["calls_per_step"]
            if abs(nc - nb) >= max(0.5, 0.1 * nb):
                changes.append(f"{collective_label(m['collective'], m['group'])} calls per step {nb:.1f} -> {nc:.1f}")
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
        if key in RUN_FLAG_ITEMS:  # compared below as the flags they set
            continue
        eb, ec = b.config.get(key), c.config.get(key)
        vb, vc = (eb or {}).get("value"), (ec or {}).get("value")
        if vb != vc:
            out.append(dict(key=key, base=vb, candidate=vc, source=(ec or eb)["source"]))
    fb, fc = run_flags(b.config), run_flags(c.config)
    for flag in sorted(set(fb) | set(fc)):
        if fb.get(flag) != fc.get(flag):
            out.append(dict(key=flag, base=fb.get(flag), candidate=fc.get(flag), source="command line"))
    if b.nsys_versions != c.nsys_versions:
        out.append(dict(key="nsys_version", base=", ".join(b.nsys_versions), candidate=", ".join(c.nsys_versions),
                        source="profile metadata"))
    return out


def _per_work_moves(walls: dict, components: list[dict], kernels: list[dict], ratio: float):
    """Each wall's, component's (ms/step) and kernel's move with the candidate's time per the
    base's work (the candidate's / ``ratio``), kernels re-sorted by the size of that move."""
    pw = lambda b, c: round(c / ratio - b, 3)  # noqa: E731
    moves = {w: pw(x["base_ms"], x["candidate_ms"]) for w, x in walls.items()}
    comps = [dict(x, delta=pw(x["base"], x["candidate"])) if x["unit"] == "ms/step" else x for x in components]
    kerns = sorted((dict(k, delta_ms_per_step=pw(k["base"]["ms_per_step"], k["candidate"]["ms_per_step"]))
                    for k in kernels), key=lambda k: -abs(k["delta_ms_per_step"]))
    return moves, comps, kerns


def _decision(judged: dict) -> tuple[bool, bool, bool, str]:
    """significant, regression, improvement, change of a step comparison (``step``, or
    ``step.work`` where the pair changed the work a step: per the base's work)."""
    significant = bool(judged["test"]["significant"])
    regression, improvement = significant and judged["delta_ms"] > 0, significant and judged["delta_ms"] < 0
    return significant, regression, improvement, (
        "regression" if regression else "improvement" if improvement else "no significant change")


def _per_work(step_work: dict, xb: list, xc: list, alpha: float, min_effect: float) -> dict:
    """``step.work``: the measure, and the candidate's step per the base's work with its own test."""
    yc = work.per_base_work(xc, step_work)
    mb, mc = float(np.mean(xb)), float(np.mean(yc))
    return dict(step_work, candidate_ms_per_base_work=round(mc, 3), delta_ms=round(mc - mb, 3),
                delta_pct=round(100 * (mc / mb - 1), 3) if mb > 0 else float("nan"),
                test=step_test(xb, yc, alpha=alpha, min_effect=min_effect))


def _windows_step(b: Diagnosis, c: Diagnosis, xb: list, xc: list, means: tuple[float, float], alpha: float,
                  min_effect: float) -> dict:
    """``step``: both captured windows' mean step (``means``: of ``xb`` and ``xc``), spread and their test."""
    mb, mc = means
    ratio = mc / mb if mb > 0 else float("nan")
    return dict(base_ms=round(mb, 3), candidate_ms=round(mc, 3), delta_ms=round(mc - mb, 3),
                delta_pct=round(100 * (ratio - 1), 3), ratio=round(ratio, 4),
                base_std_ms=b.window["step_ms"]["std"], candidate_std_ms=c.window["step_ms"]["std"],
                base_iterations=len(xb), candidate_iterations=len(xc),
                test=step_test(xb, xc, alpha=alpha, min_effect=min_effect))


def diff(base, candidate, iteration_regex: str | None = None, alpha: float = ALPHA,
         min_effect: float = MIN_EFFECT, base_log=None, candidate_log=None) -> DiffResult:
    """Compare a base run with a candidate run. Raises ProfileError on bad input.
    ``base_log``, ``candidate_log``: both runs' training logs (paths or ``train_log.TrainLog``s),
    whose iterations outside the profiler decide the change (``step.timer``; diff/timer.py)."""
    logs = read_logs(base_log, candidate_log)
    b = as_diagnosis(base, iteration_regex)
    c = as_diagnosis(candidate, iteration_regex)
    xb, xc = b.window["step_ms"]["per_iteration"], c.window["step_ms"]["per_iteration"]
    mb, mc = float(np.mean(xb)), float(np.mean(xc))
    step = _windows_step(b, c, xb, xc, (mb, mc), alpha, min_effect)
    sb, sc = side_settings(b), side_settings(c)
    sizes_b, sizes_c = b.layout.get("sizes") or {}, c.layout.get("sizes") or {}
    step_work = work.step_work(sb, sc, sizes_b, sizes_c)
    # a measure equal on both sides is no change of work: judged as measured
    same = step_work is None or step_work["ratio"] == 1.0
    step["work"] = None if same else _per_work(step_work, xb, xc, alpha, min_effect)
    step["timer"] = None if logs is None else timer_step(
        logs, (run_flags(b.config), run_flags(c.config)), 1.0 if same else step_work["ratio"], alpha, min_effect)
    significant, regression, improvement, change = _decision(judged_of(step))
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
    notes += saved_side_notes(b, c) + work.global_batch_note(step_work, sizes_b, sizes_c) + timer_note(step["timer"])
    causes = attribute(b, c)
    # a rise in waiting is the waited-for rank's wall, not communication
    verdict_deltas = causes["walls_delta_ms"] if causes and causes["charged"] else walls_delta
    v_components, v_kernels = components, kernels
    if step["work"]:  # the verdict's wall, component and kernel per the base's work too
        verdict_deltas, v_components, v_kernels = _per_work_moves(walls, components, kernels, step["work"]["ratio"])
    # one replayer of the base for both: the fixes' prices and the step's split
    rb = replayer_of(getattr(getattr(b, "extra", None), "replay_inputs", None))
    applied = fix_gains(b, c, (sb, sc), mb, mc, rb, step_work)
    table = {f["id"]: f for f in load_table()}
    step["split"] = split_step(b, c, mc - mb, applied, table, rb)
    applied = with_timer_gains(without_pauses(applied, step["split"], table), step["timer"])
    notes += caveats(applied)
    verdict = lead_with_fix(verdict_of(step, significant, change, verdict_deltas, v_components, v_kernels), applied,
                            significant, change, (getattr(b, "pipeline", None) or {}).get("stages") == 1, table)
    return DiffResult(
        base=_side(b), candidate=_side(c), step=step, significant=significant, regression=regression,
        improvement=improvement, change=change,
        verdict=verdict,
        walls=walls, walls_delta_ms=walls_delta, components=components, kernels=kernels,
        appeared=appeared, vanished=vanished, communication=_communication(b, c),
        config_changes=_config_changes(b, c), notes=notes, pitfalls=_pair_pitfalls(b, c, mb), causes=causes,
        fix_gains=applied)


def _pair_pitfalls(b: Diagnosis, c: Diagnosis, step_ms: float) -> list[dict]:
    from ..pitfalls import check, diff_facts

    # told as overrides where either side was launched with them (a Bridge recipe, NeMo)
    launched = {"launched_with_overrides": any(launched_with_overrides(d.config) for d in (b, c))}
    return check({**diff_facts(run_flags(b.config), run_flags(c.config)), **launched}, {}, step_ms, scope="diff")
