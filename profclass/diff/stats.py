"""Is a change in step time real? The significance test ``profclass diff`` applies to the
per-iteration step times of both sides (docs/diff.md)."""
from __future__ import annotations

import math

import numpy as np

ALPHA = 0.05  # two-sided significance level of the step-time test
MIN_EFFECT = 0.02  # a change smaller than this fraction of the base step is never "significant"
UNTESTED_MIN_EFFECT = 0.05  # with fewer than two iterations on a side there is no spread to test


def step_test(base: list[float], candidate: list[float], alpha: float = ALPHA,
              min_effect: float = MIN_EFFECT) -> dict:
    """Is the candidate's mean step different from the base's, given the per-iteration spread?

    Welch's t-test (unequal variances) on the per-iteration step times of both sides, and the
    relative change must reach ``min_effect``. With fewer than two iterations on a side there
    is no spread: then only a change of at least ``UNTESTED_MIN_EFFECT`` (or ``min_effect`` if
    larger) counts, and ``method`` says the change was not tested.
    """
    x = np.asarray(base, float)
    y = np.asarray(candidate, float)
    if x.size == 0 or y.size == 0:
        raise ValueError("step_test needs at least one iteration on each side")
    mx, my = float(x.mean()), float(y.mean())
    delta = my - mx
    rel = delta / mx if mx > 0 else 0.0
    out = dict(method="", alpha=alpha, min_effect_pct=round(100 * min_effect, 3),
               p_value=None, t=None, df=None, ci95_delta_ms=None, significant=False)
    if x.size < 2 or y.size < 2:
        threshold = max(min_effect, UNTESTED_MIN_EFFECT)
        out.update(method=f"untested (fewer than 2 iterations on a side): |change| >= {100 * threshold:.0f}%",
                   significant=bool(abs(rel) >= threshold))
        return out
    vx, vy = float(x.var(ddof=1)), float(y.var(ddof=1))
    se2 = vx / x.size + vy / y.size
    if se2 <= 0:  # no spread on either side: any difference is exact
        p, t, df, half = (0.0 if delta != 0 else 1.0), None, None, 0.0
    else:
        from .. import stats  # Student t without scipy (profclass/stats.py)
        se = math.sqrt(se2)
        t = delta / se
        # Welch-Satterthwaite degrees of freedom
        df = se2 ** 2 / ((vx / x.size) ** 2 / (x.size - 1) + (vy / y.size) ** 2 / (y.size - 1))
        p = float(2 * stats.t.sf(abs(t), df))
        half = float(stats.t.ppf(0.975, df) * se)
    out.update(method="Welch t-test on per-iteration step times",
               p_value=round(p, 6), t=None if t is None else round(float(t), 3),
               df=None if df is None else round(float(df), 2),
               ci95_delta_ms=[round(delta - half, 3), round(delta + half, 3)],
               significant=bool(p < alpha and abs(rel) >= min_effect))
    return out
