#!/usr/bin/env python3
"""Calibrate the wall thresholds on the labelled corpus (fixtures/corpus.toml).

    python bench/calibrate.py            # fit, print the table and the family-held-out accuracy
    python bench/calibrate.py --write    # also write profclass/data/calibration.toml

The verdict is argmax over walls of share / threshold. Only the ratios between thresholds
matter, so compute is pinned at 0.5 and the other three are searched on a grid from 0.10 to
compute's 0.5 (an overhead never needs a larger share than compute to count). The fit
maximises accuracy, then the smallest margin log(score_label / best other score), then the
next smallest and so on (leximin), so the chosen thresholds sit as far as possible from every
decision boundary.

Which profiles count: a label is evidence only when it is independent of profclass, i.e. the
workload was built to hit that wall (``construction == label``); labels that are profclass's
own measured answer are shown, never fitted or scored. Profiles with a straggler are fitted
too: the waiting it causes is already in its wall's share and the verdict is the highest score
(``classify.decide_with_straggler``); ``held_out`` ones are never fitted.

Held-out accuracy leaves a whole workload *family* out (``family`` in corpus.toml: one
generator and scenario): near-duplicate captures of one workload (NVTX on/off, one report or
per rank, another GPU) would otherwise leak the held-out profile into the fit.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from profclass.classify import WALLS  # noqa: E402

COMPUTE = 0.5
# the overheads' thresholds run up to compute's and no further: compute is the step's intended
# work, so an overhead holding a given share of the step counts at least as much as compute
# holding it (without this bound the margin search drives communication to the grid's edge,
# 0.60, on the corpus's few communication labels, all above 55%)
GRID = np.round(np.arange(0.10, COMPUTE + 0.001, 0.02), 2)
CANDIDATES = np.array([[COMPUTE, c, h, m] for c, h, m in itertools.product(GRID, GRID, GRID)])


def corpus() -> list[dict]:
    with open(os.path.join(ROOT, "fixtures", "corpus.toml"), "rb") as fh:
        return tomllib.load(fh)["profile"]


def corpus_rows(diagnose_one=None) -> list[dict]:
    """One row per profile: its label, family, whether it may be fitted/scored, and shares.
    ``diagnose_one(name)`` returns a Diagnosis (tests pass their cached one)."""
    if diagnose_one is None:
        from profclass.pipeline import diagnose

        by_name = {p["name"]: p for p in corpus()}
        diagnose_one = lambda name: diagnose(os.path.join(ROOT, "fixtures", "profiles", by_name[name]["path"]))  # noqa: E731
    rows = []
    for p in corpus():
        d = diagnose_one(p["name"])
        independent = bool(p["label"]) and p.get("construction", "") == p["label"]
        rows.append(dict(name=p["name"], label=p["label"], family=p["family"], straggler=bool(d.stragglers),
                         independent=independent, held_out=bool(p.get("held_out")),
                         scored=independent, fitted=independent and not p.get("held_out"),
                         shares=np.array([d.walls[w]["share"] for w in WALLS]), verdict=d.verdict["wall"]))
    return rows


def predict(shares: np.ndarray, th: np.ndarray) -> np.ndarray:
    return np.argmax(shares / th, axis=-1)


def fit(shares: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, float, float]:
    """The grid thresholds with the best (accuracy, smallest margin); all candidates at once."""
    score = shares[None, :, :] / CANDIDATES[:, None, :]  # (candidates, profiles, walls)
    rows = np.arange(len(labels))
    mine = score[:, rows, labels]
    other = np.where(np.eye(len(WALLS), dtype=bool)[labels][None], -np.inf, score).max(axis=2)
    acc = (mine > other).mean(axis=1)
    # each profile's margin, smallest first: ties in the smallest are broken by the next one
    # (leximin), so no threshold drifts to the grid's edge where it decides no profile
    margins = np.sort(np.round(np.log(np.maximum(mine, 1e-9) / np.maximum(other, 1e-9)), 9), axis=1)
    best = np.lexsort(tuple(margins[:, k] for k in reversed(range(margins.shape[1]))) + (acc,))[-1]
    return CANDIDATES[best], float(acc[best]), float(margins[best, 0])


def family_held_out(rows: list[dict]) -> tuple[int, int, list[str]]:
    """Refit without each family, classify that family's scored profiles: (right, total, misses)."""
    right, total, misses = 0, 0, []
    for fam in sorted({r["family"] for r in rows if r["scored"]}):
        train = [r for r in rows if r["fitted"] and r["family"] != fam]
        th, _, _ = fit(np.stack([r["shares"] for r in train]), np.array([WALLS.index(r["label"]) for r in train]))
        for r in (r for r in rows if r["scored"] and r["family"] == fam):
            ok = WALLS[predict(r["shares"], th)] == r["label"]
            right, total = right + ok, total + 1
            if not ok:
                misses.append(f"{r['name']} ({fam}): {WALLS[predict(r['shares'], th)]}, label {r['label']}")
    return right, total, misses


def report(rows: list[dict], th: np.ndarray) -> list[str]:
    lines = [f"{'profile':32s} {'family':20s} {'label':14s} " + " ".join(f"{w[:6]:>7s}" for w in WALLS)
             + "  fitted verdict"]
    for r in rows:
        v = WALLS[predict(r["shares"], th)] + (" (straggler)" if r["straggler"] else "")
        v += ("" if r["fitted"] else " (held out)" if r["scored"]
              else " (label is profclass's own answer: not scored)" if r["label"] and not r["independent"] else "")
        lines.append(f"{r['name']:32s} {r['family']:20s} {r['label'] or '-':14s} "
                     + " ".join(f"{s:7.2f}" for s in r["shares"]) + f"  {v}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write profclass/data/calibration.toml")
    args = ap.parse_args()
    rows = corpus_rows()
    fit_rows = [r for r in rows if r["fitted"]]
    th, acc, m = fit(np.stack([r["shares"] for r in fit_rows]), np.array([WALLS.index(r["label"]) for r in fit_rows]))
    right, total, misses = family_held_out(rows)
    print("\n".join(report(rows, th)))
    print("\nthresholds: " + ", ".join(f"{w}={t:.2f}" for w, t in zip(WALLS, th)))
    print(f"training accuracy {acc:.3f} on {len(fit_rows)} profiles; smallest margin {m:.3f} (log score ratio)")
    print(f"leave-one-family-out accuracy {right}/{total}" + "".join(f"\n  missed: {x}" for x in misses))
    if args.write:
        path = os.path.join(ROOT, "profclass", "data", "calibration.toml")
        with open(path, "w") as fh:
            fh.write("# Wall thresholds: a wall's score is its share of steady-state time divided by its\n"
                     "# threshold; the highest score is the verdict. Fitted on the labelled corpus\n"
                     "# (fixtures/corpus.toml) by `python bench/calibrate.py --write`; do not edit by hand.\n"
                     f"# Training accuracy {acc:.3f} on {len(fit_rows)} profiles, leave-one-family-out "
                     f"{right}/{total}, smallest margin {m:.3f}.\n[thresholds]\n")
            for w, t in zip(WALLS, th):
                fh.write(f"{w} = {t:.2f}\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
