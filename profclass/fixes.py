"""Stage 5, fixes: render the fixes table (``data/fixes.toml``) for the verdict and runner-up.

The table is data. This module only evaluates each entry's conditions against a *context*
(facts derived from the profile) and computes each fix's expected gain: an upper bound in
ms per step, from the measured time the fix can remove (``GAINS``, gathered from the
analyzers that measure it).
"""
from __future__ import annotations

from .tables import read_table


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


def select(walls: list[str], ctx: dict, flags: dict, numbers: dict, step_ms: float) -> list[dict]:
    """Fixes for ``walls`` (verdict, runner-up) that apply and are not on yet, each with
    ``expected_gain_ms``/``expected_gain_pct`` (an upper bound), sorted by that gain."""
    from .analyzers import GAINS  # each analyzer prices the fixes of what it measures (numpy, pandas)

    out = []
    for rank, wall in enumerate(walls):
        mine = []
        for order, fix in enumerate(load_table()):
            if fix["wall"] != wall:
                continue
            if not all(_context_matches(ctx, k, v) for k, v in fix.get("requires", {}).items()):
                continue
            if any(_context_matches(ctx, k, v) for k, v in fix.get("skip_if", {}).items()):
                continue
            if any(_flag_on(flags, f) for f in fix.get("skip_if_flags", [])):
                continue
            gain = max(0.0, float(GAINS[fix["gain"]](numbers))) if fix.get("gain") else 0.0
            gain = min(gain, step_ms)
            mine.append({"id": fix["id"], "wall": wall, "title": fix["title"], "flags": fix["flags"], "why": fix["why"],
                         "for": "verdict" if rank == 0 else "runner_up",
                         "expected_gain_ms": round(gain, 2),
                         "expected_gain_pct": round(100.0 * gain / step_ms, 1) if step_ms else 0.0,
                         "gain_basis": fix.get("gain", ""), "table_order": order, "_wall_rank": rank})
        out.extend(mine)
    # the largest ceiling first; ties keep the verdict's wall, then the table's own order
    out.sort(key=lambda f: (-f["expected_gain_ms"], f["_wall_rank"], f["table_order"]))
    for f in out:
        del f["_wall_rank"]
    return out
