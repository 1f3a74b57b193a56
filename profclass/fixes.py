"""Stage 5, fixes: render the fixes table (``data/fixes.toml``) for the verdict and runner-up.

The table is data. This module only evaluates each entry's conditions against a *context*
(facts derived from the profile) and computes each fix's expected gain: an upper bound in
ms per step, from the measured time the fix can remove (``GAINS``).
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


# How each fix's ceiling is computed from job-level numbers (ms per step); see docs/fixes.md.
GAINS = {
    "straggler_wait": lambda n: n["straggler_wait_ms"],
    "exposed_ep_transfer": lambda n: n["exposed_ep_ms"],
    # EP overlap hides the all-to-all behind other compute: at most the smaller of the two
    "exposed_ep_transfer_hideable": lambda n: min(n["exposed_ep_ms"], n["compute_ms"]),
    "exposed_dp": lambda n: n["exposed_dp_ms"],
    "exposed_tp": lambda n: 0.0,
    "idle_sync": lambda n: n["idle_sync_ms"],
    "idle_launch": lambda n: n["idle_launch_ms"],
    "gc": lambda n: min(n["gc_ms"], n["host_ms"]),
    "recompute_minus_selective": lambda n: max(0.0, n["recompute_ms"] - n["selective_keep_ms"]),
    "idle_alloc": lambda n: n["idle_alloc_ms"],
    "offload": lambda n: n["offload_ms"],
    "memory_all": lambda n: n["memory_ms"],
    # halving the footprint can remove at most about half of what fitting costs
    "memory_half": lambda n: n["memory_ms"] / 2.0,
    "exposed_comm_wait": lambda n: n["comm_wait_ms"],
    "compute_low_sm": lambda n: n["compute_ms"] * max(0.0, 1.0 - n["sm_busy"]),
    "compute_elementwise": lambda n: n["elementwise_ms"],
    "compute_gemm_half": lambda n: n["gemm_ms"] / 2.0,
}


def select(walls: list[str], ctx: dict, flags: dict, numbers: dict, step_ms: float) -> list[dict]:
    """Fixes for ``walls`` (verdict, runner-up) that apply and are not on yet, each with
    ``expected_gain_ms``/``expected_gain_pct`` (an upper bound), sorted by that gain."""
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
            mine.append({"wall": wall, "title": fix["title"], "flags": fix["flags"], "why": fix["why"],
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
