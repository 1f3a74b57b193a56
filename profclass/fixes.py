"""Stage 5, fixes: render the fixes table (``data/fixes.toml``) for the verdict and runner-up
(the pipeline adds a found pitfall's fix and those the fix plan takes from other walls).

The table is data. This module only evaluates each entry's conditions against a *context*
(facts derived from the profile) and predicts each fix's gain in ms per step: a best
estimate, a range and the ceiling (the whole time of what it targets), from the fix's gain
model (``GAINS``, gathered from the analyzers that measure what it needs; docs/fixes.md).
"""
from __future__ import annotations

from .tables import read_table


def request_parts(request: str) -> list[tuple[str, str]]:
    """(fix id, change text) of each fix a request names, in order: fixes joined by "+" are
    applied together, each with an optional ``:key=value,...`` change
    ("recompute_off+host_bigger_launches:microbatch_factor=2")."""
    return [(fid, rest) for fid, _, rest in (one.partition(":") for one in request.split("+"))]


def requested(item: str) -> dict:
    """A fix asked for by id, with the change a pair made where its transform takes it
    ("host_bigger_launches:microbatch_factor=4"); fixes joined by "+" are applied together, in
    that order ("recompute_off+host_bigger_launches:microbatch_factor=2")."""
    parts = [(fid, {k: _change_value(v) for k, v in (kv.split("=", 1) for kv in rest.split(",") if "=" in kv)})
             for fid, rest in request_parts(item)]
    return {"id": "+".join(fid for fid, _ in parts), "request": item, "parts": parts}


def _change_value(text: str):
    """A change's value: a number, or a word (``pp_interleave:p2p=batched``)."""
    try:
        return float(text)
    except ValueError:
        return text


def request_text(fix_id: str, change: dict) -> str:
    """A fix asked for with the change a pair made, as ``requested`` reads it back
    ("host_bigger_launches:microbatch_factor=4")."""
    return fix_id + (":" + ",".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}"
                                    for k, v in change.items()) if change else "")


def load_table() -> list[dict]:
    return read_table("fixes")["fix"]


def _context_matches(ctx: dict, key: str, expected) -> bool:
    """Whether context fact ``key`` has the table's expected value (or one of a list)."""
    value = ctx.get(key)
    if isinstance(expected, list):
        return value in expected
    return value == expected


def _flag_on(flags: dict, spec: str) -> bool:
    name, _, want = spec.partition(" ")
    if name not in flags:
        return False
    return not want or str(flags[name]) == want


def predict(fix: dict, numbers: dict, step_ms: float) -> dict:
    """One fix's predicted gain (ms per step) from its model (``gain`` in the table), as the
    JSON fields; every number None when the profile does not show what the model needs."""
    from .analyzers import GAINS  # each analyzer prices the fixes of what it measures (numpy, pandas)
    from .analyzers.gainmodel import as_gain

    model = fix.get("gain", "")
    g = as_gain(model, GAINS[model]({**numbers, "step_ms": step_ms})) if model else None
    if g is None:
        return dict(expected_gain_ms=None, expected_gain_pct=None, gain_low_ms=None, gain_high_ms=None,
                    gain_ceiling_ms=None, gain_model=model,
                    gain_basis=f"{model}: not priced, the profile does not show what it needs" if model
                    else "no gain model")

    def cap(ms: float) -> float:  # a fix cannot save more than the step, nor cost more than it
        return round(max(-step_ms, min(ms, step_ms)), 2)

    est = cap(g.estimate_ms)
    return dict(expected_gain_ms=est, expected_gain_pct=round(100.0 * est / step_ms, 1) if step_ms else None,
                gain_low_ms=cap(g.low_ms), gain_high_ms=cap(g.high_ms), gain_ceiling_ms=cap(g.ceiling_ms),
                gain_model=g.model, gain_basis=g.basis)


# why a fix of neither the verdict's wall nor the runner-up's is listed (``for``)
ORIGIN = {"pitfall": "the fix of a pitfall found", "plan": "the plan takes it where its wall holds the replayed step back most"}


def gain_text(f: dict) -> str:
    """A fix's predicted gain in words, for the text/Markdown/HTML reports; where it is listed
    for a pitfall or for the plan, that too."""
    origin = f"; {ORIGIN[f['for']]}" if f.get("for") in ORIGIN else ""
    if f.get("expected_gain_ms") is None:
        return "gain not priced" + origin
    pct = "" if f.get("expected_gain_pct") is None else f" ({f['expected_gain_pct']:.0f}%)"
    then = f", then the {f['wall_after']} wall" if f.get("wall_after") else ""  # replayed: what comes next
    return f"~{f['expected_gain_ms']:.1f} ms/step{pct}, range {f['gain_low_ms']:.1f} to {f['gain_high_ms']:.1f}{then}{origin}"


def predict_by_id(fix_id: str, numbers: dict, step_ms: float, change: dict | None = None) -> dict:
    """``predict`` for the table's fix ``fix_id``, whether or not it applies to the profile.
    ``change``: what the applied change was where a model takes it (``microbatch_factor``: the
    micro-batch grew that many times; otherwise the model prices its stated default)."""
    fix = next(f for f in load_table() if f["id"] == fix_id)
    return predict(fix, {**numbers, **(change or {})}, step_ms)


def _applies(fix: dict, ctx: dict, flags: dict) -> bool:
    if not all(_context_matches(ctx, k, v) for k, v in fix.get("requires", {}).items()):
        return False
    if any(_context_matches(ctx, k, v) for k, v in fix.get("skip_if", {}).items()):
        return False
    return not any(_flag_on(flags, f) for f in fix.get("skip_if_flags", []))


def _flags(fix: dict, ctx: dict, key: str = "flags") -> str | None:
    """The fix's flags (``key``: or its Hydra ``overrides``), with its MoE-only ones (``moe_flags``,
    ``moe_overrides``) where the job is MoE; None where the fix has none."""
    said, extra = fix.get(key), fix.get(f"moe_{key}") if _context_matches(ctx, "moe", True) else None
    if not said or not extra:
        return said
    head, sep, tail = said.partition(";")
    return f"{head} {extra}{sep}{tail}"


def joined(chosen: list[dict], every_wall: list[dict], undoing: tuple, plan: list[dict]) -> list[dict]:
    """``chosen`` (the verdict's and runner-up's fixes) with the fixes of the pitfalls found
    (``undoing``) and those the fix plan took from other walls (the one whose removal shortens
    the replayed step most, those its steps exposed), each marked so (``for``): the plan names no
    fix the list does not price."""
    have = {f["id"] for f in chosen}
    more = {*undoing, *(p["id"] for p in plan)} - have
    return chosen + [{**f, "for": "pitfall" if f["id"] in undoing else "plan"} for f in every_wall if f["id"] in more]


def rank_key(f: dict) -> tuple:
    """The ranking rule: the largest best estimate first (an unpriced fix last); equal estimates
    keep the verdict's wall first, then the table's own order."""
    est = f["expected_gain_ms"]
    return (est is None, -(est or 0.0), f["for"] != "verdict", f["table_order"])


def select(walls: list[str], ctx: dict, flags: dict, numbers: dict, step_ms: float) -> list[dict]:
    """Fixes for ``walls`` (verdict, runner-up) that apply and are not on yet, each with its
    predicted gain (``predict``), ranked by ``rank_key``."""
    out, table = [], load_table()  # parsed once: select runs over every wall (the plan's pool)
    for rank, wall in enumerate(walls):
        for order, fix in enumerate(table):
            if fix["wall"] != wall or not _applies(fix, ctx, flags):
                continue
            # in the launch line's own terms where it set Hydra overrides (a Bridge recipe, NeMo)
            said = _flags(fix, ctx, "overrides") if ctx.get("launched_with_overrides") else None
            out.append({"id": fix["id"], "wall": wall, "title": fix["title"], "flags": _flags(fix, ctx), "overrides": said,
                        "why": fix["why"],
                        "for": "verdict" if rank == 0 else "runner_up", **predict(fix, numbers, step_ms),
                        "table_order": order})
    out.sort(key=rank_key)
    return out
