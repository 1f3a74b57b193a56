#!/usr/bin/env python3
"""Calibrate the wall thresholds on the labelled corpus (fixtures/corpus.toml).

    python bench/calibrate.py            # fit, print the table and leave-one-out accuracy
    python bench/calibrate.py --write    # also write profclass/data/calibration.toml

Needs scikit-learn: ``pip install -e '.[calibrate]'`` (``make calibrate`` does both).

The verdict is argmax over walls of share / threshold. Only the ratios between thresholds
matter, so compute is pinned at 0.5 and the other three are searched on a grid. The fit
maximises accuracy on the profiles built to hit a wall and without a straggler (for those
the straggler's wall decides; third-party Megatron-Core profiles are checked, not fitted), then the smallest margin log(score_label / best other score), so the chosen
thresholds sit as far as possible from every decision boundary. Held-out accuracy comes from
scikit-learn's LeaveOneOut: refit without each profile, then classify it.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np
from sklearn.model_selection import LeaveOneOut

try:
    import tomllib
except ModuleNotFoundError:
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from profclass.classify import WALLS  # noqa: E402
from profclass.pipeline import diagnose  # noqa: E402

GRID = np.round(np.arange(0.10, 0.61, 0.02), 2)
COMPUTE = 0.5


def corpus_shares() -> list[dict]:
    with open(os.path.join(ROOT, "fixtures", "corpus.toml"), "rb") as fh:
        corpus = tomllib.load(fh)
    rows = []
    for p in corpus["profile"]:
        d = diagnose(os.path.join(ROOT, "fixtures", "profiles", p["path"]))
        rows.append(dict(name=p["name"], label=p["label"], straggler=bool(d.stragglers),
                         constructed=bool(p.get("construction")), held_out=bool(p.get("held_out")),
                         shares=np.array([d.walls[w]["share"] for w in WALLS]), verdict=d.verdict["wall"]))
    return rows


def predict(shares: np.ndarray, th: np.ndarray) -> np.ndarray:
    return np.argmax(shares / th, axis=1)


def margins(shares: np.ndarray, labels: np.ndarray, th: np.ndarray) -> np.ndarray:
    score = shares / th
    mine = score[np.arange(len(labels)), labels]
    other = np.where(np.eye(len(WALLS), dtype=bool)[labels], -np.inf, score).max(axis=1)
    return np.log(np.maximum(mine, 1e-9) / np.maximum(other, 1e-9))


def fit(shares: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, float, float]:
    best = None
    for comm, host, mem in itertools.product(GRID, GRID, GRID):
        th = np.array([COMPUTE, comm, host, mem])
        acc = float((predict(shares, th) == labels).mean())
        m = float(margins(shares, labels, th).min())
        key = (acc, m)
        if best is None or key > best[0]:
            best = (key, th)
    (acc, m), th = best
    return th, acc, m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write profclass/data/calibration.toml")
    args = ap.parse_args()
    rows = corpus_shares()
    # third-party profiles (no construction) have no independent label: checked, not fitted
    # held_out profiles (Megatron-Core built to hit a wall) test the fit on third-party code
    fit_rows = [r for r in rows if not r["straggler"] and r["constructed"] and not r["held_out"]]
    X = np.stack([r["shares"] for r in fit_rows])
    y = np.array([WALLS.index(r["label"]) for r in fit_rows])
    th, acc, m = fit(X, y)
    held = []
    for train, test in LeaveOneOut().split(X):
        t, _, _ = fit(X[train], y[train])
        held.append(predict(X[test], t)[0] == y[test][0])
    print(f"{'profile':34s} {'label':14s} " + " ".join(f"{w[:6]:>7s}" for w in WALLS) + "  fitted verdict")
    for r in rows:
        v = WALLS[predict(r["shares"][None], th)[0]] if not r["straggler"] else r["verdict"] + " (straggler)"
        v += " (held out)" if r["held_out"] else ("" if r["constructed"] or r["straggler"] else " (not fitted)")
        print(f"{r['name']:34s} {r['label']:14s} " + " ".join(f"{s:7.2f}" for s in r["shares"]) + f"  {v}")
    print("\nthresholds: " + ", ".join(f"{w}={t:.2f}" for w, t in zip(WALLS, th)))
    print(f"training accuracy {acc:.3f} on {len(fit_rows)} constructed profiles without a straggler; smallest margin "
          f"{m:.3f} (log score ratio); leave-one-out accuracy {np.mean(held):.3f}")
    held_rows = [r for r in rows if r["held_out"]]
    if held_rows:
        ok = sum(WALLS[predict(r["shares"][None], th)[0]] == r["label"] for r in held_rows)
        print(f"held-out Megatron-Core profiles built to hit a wall: {ok}/{len(held_rows)} correct")
    if args.write:
        path = os.path.join(ROOT, "profclass", "data", "calibration.toml")
        with open(path, "w") as fh:
            fh.write("# Wall thresholds: a wall's score is its share of steady-state time divided by its\n"
                     "# threshold; the highest score is the verdict. Fitted on the labelled corpus\n"
                     "# (fixtures/corpus.toml) by `python bench/calibrate.py --write`; do not edit by hand.\n"
                     f"# Training accuracy {acc:.3f} on {len(fit_rows)} profiles, leave-one-out accuracy "
                     f"{np.mean(held):.3f}, smallest margin {m:.3f}.\n[thresholds]\n")
            for w, t in zip(WALLS, th):
                fh.write(f"{w} = {t:.2f}\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
