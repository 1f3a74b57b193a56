"""`profclass explain`: the reference without a profile (walls, fixes table, rules)."""
from __future__ import annotations

from .classify import WALLS, load_thresholds
from .fixes import load_table
from .pitfalls import load_rules

WALL_SIGNS = {
    "memory": "time paid to fit: recomputed forward kernels, GPU idle around cudaMalloc/cudaFree "
              "inside steady iterations, exposed host<->device offload copies; peak memory vs capacity",
    "communication": "collective/all-to-all time that no compute hides (transfer), and time waiting "
                     "for the slowest peer (moved to that rank's wall when it is a straggler)",
    "host": "GPU idle between kernels: launched late (CPU-bound), after host synchronisations, "
            "kernels shorter than their launch call",
    "compute": "the GPU busy with compute most of the step; SM utilisation says whether grouped "
               "GEMM, fusion or FP8 is the lever",
}


def reference() -> dict:
    th = load_thresholds()
    return {
        "walls": [{"wall": w, "threshold": th[w], "looks_like": WALL_SIGNS[w]} for w in WALLS],
        "fixes": load_table(),
        # the measured quantities the tables price fixes and pitfalls from (analyzers' GAINS)
        "gains": sorted({f["gain"] for f in load_table() if f.get("gain")}
                        | {r["cost"] for r in load_rules() if r.get("cost")}),
        "rules": load_rules(),
    }


def render_reference() -> str:
    ref = reference()
    lines = ["THE FOUR WALLS (verdict = highest share / threshold)", ""]
    for w in ref["walls"]:
        lines.append(f"  {w['wall']:<14} threshold {w['threshold']:.2f}  {w['looks_like']}")
    lines += ["", "FIXES, per wall, in the order to try them", ""]
    for wall in WALLS:
        lines.append(f"  [{wall}]")
        for f in (f for f in ref["fixes"] if f["wall"] == wall):
            cond = ", ".join(f"{k}={v}" for k, v in f.get("requires", {}).items())
            lines.append(f"    - {f['id']}: {f['title']}")
            lines.append(f"      flags: {f['flags']}")
            if f.get("overrides"):  # where the job is launched with Hydra overrides (Megatron-Bridge)
                lines.append(f"      overrides: {f['overrides']}")
            lines.append(f"      why:   {f['why']}" + (f"  (when {cond})" if cond else ""))
    lines += ["", "CONFIGURATION RULES (pitfalls)", ""]
    for r in ref["rules"]:
        lines.append(f"  {r['id']}: {r['title']}")
        lines.append(f"      when {' and '.join(r['when'])}; fix: {r['fix']}")
        if r.get("overrides"):  # the same fix as Hydra overrides (Megatron-Bridge)
            lines.append(f"      overrides: {r['overrides']}")
    return "\n".join(lines) + "\n"
