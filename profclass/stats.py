"""Student's t distribution for the step-time test of ``diff`` (Welch's t-test), without scipy.

``t.sf(x, df)`` and ``t.ppf(q, df)`` as in ``scipy.stats.t`` for real ``df > 0``:

    sf(x, df) = I_{df / (df + x^2)}(df / 2, 1 / 2) / 2          for x >= 0

with ``I`` the regularized incomplete beta function, evaluated by its continued fraction
(modified Lentz; Numerical Recipes 6.4) to double precision; ``ppf`` inverts ``sf`` by
bisection down to adjacent floats. tests/test_diff.py checks both against scipy where scipy
is installed (agreement to ~1e-14), and the diff JSON snapshots are byte-identical.
"""
from __future__ import annotations

import math

_EPS = 1e-16
_TINY = 1e-300
_MAX_TERMS = 100_000


def _beta_cf(a: float, b: float, x: float) -> float:
    """Continued fraction of I_x(a, b) (converges fast for x < (a + 1) / (a + b + 2))."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, _MAX_TERMS):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                    -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + num / c
            c = c if abs(c) > _TINY else _TINY
            step = d * c
            h *= step
        if abs(step - 1.0) < _EPS:
            break
    return h


def _log_beta_ratio(a: float, b: float) -> float:
    """log(Gamma(a + b) / (Gamma(a) Gamma(b))). For t tails b = 1/2 and a = df / 2 can be
    large, where the difference of lgammas cancels ~|lgamma(a)| * 1e-16 away: then the
    asymptotic series of Gamma(a + 1/2) / Gamma(a) (next term < 5e-15 for a >= 200)."""
    if b == 0.5 and a >= 200.0:
        r = 1.0 / a
        series = r * (-1 / 8 + r * (1 / 128 + r * (5 / 1024 - r * 21 / 32768)))
        return 0.5 * math.log(a) + math.log1p(series) - math.lgamma(0.5)
    return math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)


def betainc(a: float, b: float, x: float, y: float | None = None) -> float:
    """Regularized incomplete beta I_x(a, b); ``y = 1 - x`` when the caller has it exactly."""
    y = 1.0 - x if y is None else y
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    log_x = math.log(x) if x < 0.5 else math.log1p(-y)  # a * log(x) with x near 1: a large a
    log_y = math.log(y) if y < 0.5 else math.log1p(-x)  # would magnify log's rounding error
    front = math.exp(_log_beta_ratio(a, b) + a * log_x + b * log_y)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, y) / b


class _StudentT:
    """The two functions of ``scipy.stats.t`` that ``diff`` uses."""

    @staticmethod
    def sf(x: float, df: float) -> float:
        """P(T > x) for T ~ Student's t with ``df`` degrees of freedom."""
        x, df = float(x), float(df)
        if math.isnan(x) or math.isnan(df) or df <= 0:
            return math.nan
        if math.isinf(x):
            return 0.0 if x > 0 else 1.0
        x2 = x * x
        tail = 0.5 * betainc(0.5 * df, 0.5, df / (df + x2), x2 / (df + x2))  # P(|T| > |x|) / 2
        return tail if x >= 0 else 1.0 - tail

    @classmethod
    def ppf(cls, q: float, df: float) -> float:
        """The x with sf(x) = 1 - q (the q-quantile)."""
        q, df = float(q), float(df)
        if math.isnan(q) or math.isnan(df) or df <= 0 or not 0.0 <= q <= 1.0:
            return math.nan
        if q == 0.5:
            return 0.0
        if q < 0.5:
            return -cls.ppf(1.0 - q, df)
        if q == 1.0:
            return math.inf
        target = 1.0 - q
        lo, hi = 0.0, 1.0
        while cls.sf(hi, df) > target:
            lo, hi = hi, 2.0 * hi
        while True:  # sf falls as x grows: bisect until lo and hi are adjacent floats
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                break
            if cls.sf(mid, df) > target:
                lo = mid
            else:
                hi = mid
        return hi if abs(cls.sf(hi, df) - target) <= abs(cls.sf(lo, df) - target) else lo


t = _StudentT()
