"""Honest calibration (issue 14 item 7): the thresholds' accuracy on workload families left out
of the fit, over the profiles whose label is independent of profclass (built to hit it)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from conftest import CORPUS, ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import calibrate  # noqa: E402

# The floor: the 13/16 the issue measured when whole families were first left out. Scoring
# below it means the fit generalises worse to an unseen workload than it did then.
FAMILY_HELD_OUT_FLOOR = 13 / 16


def test_every_profile_has_a_family():
    assert all(p.get("family") for p in CORPUS["profile"])
    fams = {p["family"] for p in CORPUS["profile"]}
    assert len(fams) >= 5  # leaving one out must leave several to fit


def test_family_held_out_accuracy(diagnosis, capsys):
    rows = calibrate.corpus_rows(diagnosis)
    scored = [r for r in rows if r["scored"]]
    # only labels built into the workload count; profclass's own answers are never scored
    assert all(r["label"] and r["label"] == next(p["construction"] for p in CORPUS["profile"]
                                                  if p["name"] == r["name"]) for r in scored)
    right, total, misses = calibrate.family_held_out(rows)
    with capsys.disabled():
        print(f"\nleave-one-family-out accuracy {right}/{total} = {right / total:.3f} over "
              f"{len({r['family'] for r in scored})} families" + "".join(f"\n  missed: {m}" for m in misses))
    assert total >= 15 and right / total >= FAMILY_HELD_OUT_FLOOR, misses


def test_fit_separates_a_hand_built_case():
    """Three walls each clearly dominant in two profiles: the fit must classify all six and
    leave a positive margin (log score ratio)."""
    shares = np.array([[0.8, 0.1, 0.1, 0.0], [0.7, 0.2, 0.1, 0.0], [0.1, 0.8, 0.1, 0.0],
                       [0.2, 0.6, 0.2, 0.0], [0.1, 0.1, 0.8, 0.0], [0.2, 0.1, 0.7, 0.0]])
    labels = np.array([0, 0, 1, 1, 2, 2])
    th, acc, margin = calibrate.fit(shares, labels)
    assert acc == 1.0 and margin > 0
    assert (calibrate.predict(shares, th) == labels).all()


def test_shipped_thresholds_are_the_fit_on_independent_labels(diagnosis):
    """The thresholds profclass ships are what the held-out-tested method fits on the
    independent labels alone (no hand edit, no label bent to the output), and they classify
    every such profile."""
    from profclass.classify import WALLS, load_thresholds

    rows = calibrate.corpus_rows(diagnosis)
    fit_rows = [r for r in rows if r["fitted"]]
    assert all(r["independent"] for r in fit_rows)
    th, acc, _ = calibrate.fit(np.stack([r["shares"] for r in fit_rows]),
                               np.array([WALLS.index(r["label"]) for r in fit_rows]))
    shipped = load_thresholds()
    assert [shipped[w] for w in WALLS] == pytest.approx(list(th), abs=1e-9)
    assert acc == 1.0
    ship = np.array([shipped[w] for w in WALLS])
    assert all(WALLS[calibrate.predict(r["shares"], ship)] == r["label"] for r in rows if r["scored"])
