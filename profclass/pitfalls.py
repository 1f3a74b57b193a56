"""Configuration pitfalls: evaluate the rules table (``data/rules.toml``) against facts
derived from the profile. Each rule is a conjunction of named facts; the facts are the only
code here, so adding a rule over existing facts is a data change."""
from __future__ import annotations

import math

from .tables import read_table

HEADROOM_SHARE = 0.6  # peak memory below this share of the card counts as ample headroom
LONG_CONTEXT = 16384


def load_rules() -> list[dict]:
    return read_table("rules")["rule"]


def _int(v) -> int | None:
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return None


def facts(flags: dict, env: dict, cfg: dict, peak_share: float | None, n_gpus: int,
          kernel_names=None) -> dict[str, bool]:
    """Named facts about one run. ``flags`` from the captured command line, ``env`` the captured
    environment, ``cfg`` the Diagnosis config section, ``peak_share`` peak memory / capacity,
    ``kernel_names`` the window's distinct kernel names (full)."""
    seq = _int(flags.get("--seq-length"))
    cp = _int(flags.get("--context-parallel-size")) or 1
    guess = 2 ** round(math.log2(max(seq / 4096, 1))) if seq else None
    disp = cfg.get("dispatcher", {}).get("value")
    backend = str(flags.get("--moe-flex-dispatcher-backend", ""))
    domain = _int(env.get("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"))
    platform = cfg.get("platform", {}).get("value")
    expected_domain = 72 if platform == "nvl72" else n_gpus
    return {
        "flex_backend_set": "--moe-flex-dispatcher-backend" in flags,
        "dispatcher_type_flex": str(flags.get("--moe-token-dispatcher-type", "")) == "flex",
        "ep_overlap": "--overlap-moe-expert-parallel-comm" in flags,
        "pp_gt1": (_int(flags.get("--pipeline-model-parallel-size")) or 1) > 1,
        "vpp": any(f in flags for f in ("--num-layers-per-virtual-pipeline-stage",
                                        "--num-virtual-stages-per-pipeline-rank")),
        "shared_expert_overlap": "--moe-shared-expert-overlap" in flags,
        "full_recompute": (str(flags.get("--recompute-granularity", "")) == "full"
                           or cfg.get("recompute", {}).get("value") == "full"),
        "cuda_graphs": bool(cfg.get("cuda_graphs", {}).get("value")) or any(
            f in flags for f in ("--cuda-graph-impl", "--enable-cuda-graph", "--external-cuda-graph")),
        "hybridep": disp == "hybridep" or backend == "hybridep",
        "hybridep_domain_matches": domain is not None and domain == expected_domain,
        "long_context": bool(seq and seq >= LONG_CONTEXT),
        "cp_far_from_guess": bool(guess and max(cp, guess) / min(cp, guess) >= 4),
        "memory_headroom": peak_share is not None and peak_share < HEADROOM_SHARE,
        "memory_measured": peak_share is not None,
        "activation_fusion_flag": "--bias-activation-fusion" in flags,
        "activation_unfused": _unfused(kernel_names, "activation"),
    }


def _unfused(kernel_names, family: str) -> bool:
    """Whether the window runs a fusion flag's family as PyTorch's own pointwise kernels
    (compute.fusion_codes), not as a compiled (Triton) or library kernel."""
    if kernel_names is None or not len(kernel_names):
        return False
    from .analyzers.compute import FUSION_FLAGS, fusion_codes
    code = 1 + [key for key, _, _ in FUSION_FLAGS].index(family)
    return bool((fusion_codes(kernel_names) == code).any())


FORCE_BALANCE_FLAGS = ("--moe-router-force-load-balancing", "--force-balance")


def routing_mode(flags: dict) -> str | None:
    """force-balanced / learned routing from a captured command line; None when unknown."""
    if not flags:
        return None
    return "force-balanced" if any(f in flags for f in FORCE_BALANCE_FLAGS) else "learned"


def diff_facts(base_flags: dict, candidate_flags: dict) -> dict[str, bool]:
    """Facts about a pair of runs (rules with ``scope = "diff"``)."""
    a, b = routing_mode(base_flags), routing_mode(candidate_flags)
    return {"routing_mode_differs": a is not None and b is not None and a != b}


def _condition_true(fact_values: dict[str, bool], cond: str) -> bool:
    """A rule condition: a fact name, or ``not`` and a fact name; unknown facts are false."""
    neg = cond.startswith("not ")
    value = fact_values.get(cond[4:] if neg else cond, False)
    return not value if neg else value


def check(fact_values: dict[str, bool], cost_numbers: dict, step_ms: float, scope: str = "run") -> list[dict]:
    from .analyzers import GAINS  # numpy, pandas: only where a rule is priced
    from .analyzers.gainmodel import as_gain
    out = []
    for rule in load_rules():
        if rule.get("scope", "run") != scope:
            continue
        if not all(_condition_true(fact_values, c) for c in rule["when"]):
            continue
        cost = rule.get("cost", "")
        basis = None
        if cost == "recompute_ms":
            ms = cost_numbers.get("recompute_ms", 0.0)
            basis = ("recompute_ms: the recomputed forward's span measured inside backward (its kernels, the "
                     "collectives it re-issues, the launch gaps between them), ms per step")
        elif cost and cost_numbers:
            g = as_gain(cost, GAINS[cost]({**cost_numbers, "step_ms": step_ms}))
            ms, basis = (None, None) if g is None else (max(0.0, g.estimate_ms), g.basis)
        else:
            ms = None
        # in the launch line's own terms where it set Hydra overrides (a Bridge recipe, NeMo)
        said = rule.get("overrides") if fact_values.get("launched_with_overrides") else None
        out.append({"id": rule["id"], "rule": rule["id"], "title": rule["title"], "message": rule["message"], "fix": rule["fix"],
                    "overrides": said,
                    "cost_ms_per_step": None if ms is None else round(ms, 2),
                    "cost_pct": None if ms is None or not step_ms else round(100 * ms / step_ms, 1),
                    "cost_basis": None if ms is None else basis,
                    "facts": [c for c in rule["when"]]})
    return out


def how_to_fix(p: dict) -> str:
    """A pitfall's fix in the launch line's terms: its Hydra overrides where the job was launched
    with them and the rule has them (``pitfalls[].overrides``), else its flags' text."""
    return p.get("overrides") or p.get("fix", "")


def cost_text(p: dict) -> str:
    """A pitfall's cost and fix in words, for the text/Markdown/HTML reports (the fix alone when
    unpriced)."""
    fix = f" Fix: {how_to_fix(p)}."
    if p.get("cost_ms_per_step") is None:
        return fix
    how = "replayed" if str(p.get("cost_basis") or "").startswith("replay:") else "measured"
    pct = "" if p.get("cost_pct") is None else f", {p['cost_pct']:.0f}% of the step"
    return f" Costs ~{p['cost_ms_per_step']:.1f} ms/step{pct} ({how}).{fix}"


def _priced_by() -> dict:
    """Rule id -> the fix whose replayed gain prices it (``priced_by``), or None."""
    return {r["id"]: r.get("priced_by") for r in load_rules()}


def undoing_fixes(found: list[dict]) -> tuple[str, ...]:
    """The fixes (``priced_by`` in rules.toml) whose replayed gain is a found pitfall's cost."""
    by_rule = _priced_by()
    return tuple(dict.fromkeys(by_rule[p["rule"]] for p in found if by_rule.get(p["rule"])))


def priced(found: list[dict], prices: dict, step_ms: float) -> list[dict]:
    """The found pitfalls with each cost that a replayed fix prices (``prices``: fix id ->
    (best ms per step, basis), the replay's) in place of the measured share: what the step would
    lose, not what the violation's own time adds up to (a saving on every slot of a pipeline's
    critical path, collectives and launches included, or hidden behind other work)."""
    by_rule = _priced_by()
    out = []
    for p in found:
        got = prices.get(by_rule.get(p["rule"]) or "")
        if got is not None:
            ms, basis = max(0.0, got[0]), got[1]
            p = {**p, "cost_ms_per_step": round(ms, 2), "cost_pct": round(100 * ms / step_ms, 1) if step_ms else None,
                 "cost_basis": basis}
        out.append(p)
    return out
