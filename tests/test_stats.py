"""profclass/stats.py (Student's t for diff's Welch test) against scipy.stats.t."""
from __future__ import annotations

import math

import numpy as np
import pytest

from profclass import stats

scipy_stats = pytest.importorskip("scipy.stats")

RNG = np.random.default_rng(16)
# df: Welch-Satterthwaite degrees of freedom (non-integer; ~2 iterations up to ~10^5)
DFS = np.concatenate([[0.5, 1, 1.5, 2, 3, 7.25, 30, 199.9, 200, 400.5, 4000, 1e5], 10 ** RNG.uniform(-0.3, 5, 300)])
XS = np.concatenate([[0, 1e-9, 0.5, 1.96, 2.5, 10, 40, 300], 10 ** RNG.uniform(-6, 2.5, 60)])


def test_sf_matches_scipy():
    worst = 0.0
    for df in DFS:
        for x in XS:
            for s in (x, -x):
                got, want = stats.t.sf(s, df), float(scipy_stats.t.sf(s, df))
                if df == 1:  # scipy's Cauchy path loses ~1e-10 near 0 (sf(1e-9, 1) = 0.5): closed form
                    want = 0.5 - math.atan(s) / math.pi
                worst = max(worst, abs(got - want))
                if want > 1e-300:  # in the far tail: relative agreement too
                    assert got == pytest.approx(want, rel=1e-9, abs=1e-300), (s, df)
    assert worst < 1e-12


@pytest.mark.parametrize("q", [0.5, 0.6, 0.9, 0.975, 0.995, 0.9999, 0.025, 0.1])
def test_ppf_matches_scipy(q):
    for df in DFS:
        assert stats.t.ppf(q, df) == pytest.approx(float(scipy_stats.t.ppf(q, df)), rel=1e-10, abs=1e-12), df


def test_edges():
    assert stats.t.sf(math.inf, 5) == 0.0 and stats.t.sf(-math.inf, 5) == 1.0
    assert stats.t.sf(0, 3) == pytest.approx(0.5, abs=1e-15)
    assert stats.t.ppf(1.0, 3) == math.inf and stats.t.ppf(0.0, 3) == -math.inf
    assert math.isnan(stats.t.sf(1.0, 0)) and math.isnan(stats.t.ppf(1.5, 3))
    # df = 1 is the Cauchy distribution and df = 2 has a closed form
    for x in (0.1, 1.0, 3.0, 50.0):
        assert stats.t.sf(x, 1) == pytest.approx(0.5 - math.atan(x) / math.pi, rel=1e-13)
        assert stats.t.sf(x, 2) == pytest.approx(0.5 - x / (2 * math.sqrt(2 + x * x)), rel=1e-13)
