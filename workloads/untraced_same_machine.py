#!/usr/bin/env python3
"""The replay's step without the profiler against the untraced timer of the same configuration run
on the same machine in the same lease: every base a same-machine call (``same_machine_pairs.sh``,
calls AP-JA) captured, priced and then ran again untraced.

    python workloads/untraced_same_machine.py [--markdown]

Each call's ``*_prices.json`` (packed in fixtures/timers.tar.xz) holds, per base, the traced
window's step and the replay's untraced step as profclass computed them at the call's commit
(before the twins ran); the base's configuration (``capture NAME CONFIG`` in
``same_machine_pairs.sh``) names its untraced runs (``PREFIX_CONFIG_uN.log`` in the same folder),
each averaged over iterations 6-30 (or to its last), then over the runs. Unlike the corpus's table
(docs/replay.md, "Without the profiler"), whose reruns ran in other sessions on other machines,
capture and reruns here share a host, so the difference is the model's. The prices are the
calls' own, not this tree's: the table says how the untraced step stood when each was priced.
Bases priced with a given untraced step (``host_factor``) are left out.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gain_pairs = _module("gain_pairs", ROOT / "fixtures" / "gain_pairs.py")  # the packed timer logs
judge_pairs = _module("judge_pairs", ROOT / "workloads" / "judge_pairs.py")  # a run's mean step

FIRST, LAST = 6, 30  # the steady iterations of a 30-step untraced run (judge_pairs.py's window)
WITHIN = 5.0  # issue 30's target for the untraced step, % of the timer


def configs() -> dict[str, str]:
    """Capture name -> configuration, from same_machine_pairs.sh's ``capture NAME CONFIG`` lines."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^\s*capture (\w+) (\w+)", (ROOT / "workloads" / "same_machine_pairs.sh").read_text(), re.M):
        out.setdefault(m.group(1), m.group(2))
    return out


def run_mean(text: str) -> float | None:
    """judge_pairs' mean step over iterations FIRST..LAST, or to the run's last where it ran fewer."""
    its = [int(it) for it, _ in judge_pairs.STEP.findall(text)]
    return judge_pairs.run_mean(text, FIRST, min(LAST, max(its))) if its and max(its) >= FIRST else None


def rows() -> list[dict]:
    packed = gain_pairs._packed()
    cfg = configs()
    out = []
    for path in sorted(p for p in packed if p.endswith("_prices.json") and "previous" not in p):
        folder, call = path.rsplit("/", 1)[0], path.rsplit("/", 1)[1].split("_")[0]
        seen = set()
        for p in json.loads(packed[path])["pairs"]:
            base = Path(p["base"]).name.removesuffix(".sqlite")
            if base in seen or p.get("host_factor") or base not in cfg:
                continue
            seen.add(base)
            logs = sorted(k for k in packed if k.startswith(f"{folder}/{call}_{cfg[base]}_u") and k.endswith(".log"))
            runs = [m for m in (run_mean(packed[k]) for k in logs) if m]
            if not runs:
                continue
            timer = statistics.mean(runs)
            out.append(dict(call=call.upper(), base=base, config=cfg[base], traced=p["base_step_ms"],
                            replay=p["base_untraced_step_ms"], timer=timer, runs=len(runs),
                            spread=100 * (max(runs) - min(runs)) / timer,
                            error=100 * (p["base_untraced_step_ms"] - timer) / timer,
                            traced_error=100 * (p["base_step_ms"] - timer) / timer))
    return out


def summary(rs: list[dict]) -> str:
    within = sum(abs(r["error"]) <= WITHIN for r in rs)
    traced = sum(abs(r["traced_error"]) <= WITHIN for r in rs)
    return (f"{within} of {len(rs)} within {WITHIN:g}% of the same machine's untraced timer (the traced step "
            f"itself: {traced}); median |error| {statistics.median(abs(r['error']) for r in rs):.1f}% "
            f"(traced {statistics.median(abs(r['traced_error']) for r in rs):.1f}%)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    rs = rows()
    if a.markdown:
        print("| call | base (configuration) | traced step, ms | replay without the profiler, ms | untraced timer, ms (runs, spread) | error |")
        print("|---|---|---:|---:|---:|---:|")
    for r in rs:
        if a.markdown:
            print(f"| {r['call']} | `{r['base']}` (`{r['config']}`) | {r['traced']:.1f} | {r['replay']:.1f} | "
                  f"{r['timer']:.1f} ({r['runs']}, {r['spread']:.1f}%) | {r['error']:+.1f}% |")
        else:
            print(f"{r['call']:4s} {r['base']:18s} traced {r['traced']:8.1f} replay {r['replay']:8.1f} "
                  f"timer {r['timer']:8.1f} ({r['runs']} runs, {r['spread']:4.1f}%)  {r['error']:+6.1f}%")
    print(("\n" if a.markdown else "") + summary(rs) + ".")
    return 0


if __name__ == "__main__":
    sys.exit(main())
