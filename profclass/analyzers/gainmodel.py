"""What a fix's gain model returns: a prediction of the step time it saves, with its range.

Every analyzer's ``GAINS`` maps a model name (``data/fixes.toml`` ``gain``) to a function of
the job numbers (ms per step, plus ``step_ms`` and ``gpus``) that returns a ``Gain``, or None
when the profile does not show what the model needs (the fix then claims no number). The
models and their constants are in docs/fixes.md ("Gain models").
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Gain:
    """One fix's predicted saving, ms per step of the profiled job."""

    model: str  # the model's name (its data/fixes.toml ``gain``)
    estimate_ms: float  # best estimate
    low_ms: float  # range: what the model's uncertain constant or term allows
    high_ms: float
    ceiling_ms: float  # the whole time of what the fix targets (the upper bound of old)
    basis: str  # how it was computed, with the numbers


def gain(model: str, estimate: float, low: float, high: float, ceiling: float, basis: str) -> Gain:
    """A ``Gain`` with its range ordered around the estimate (low <= estimate <= high)."""
    est = float(estimate)
    return Gain(model=model, estimate_ms=est, low_ms=min(float(low), est), high_ms=max(float(high), est),
                ceiling_ms=max(float(ceiling), 0.0), basis=f"{model}: {basis}")


def removed(model: str, ms: float, what: str) -> Gain:
    """A fix that removes the measured time outright: estimate = range = ceiling."""
    return gain(model, ms, ms, ms, ms, f"removes the {what}, {ms:.1f} ms/step")


def share_of(model: str, ceiling: float, share: float, low_share: float, high_share: float, what: str) -> Gain:
    """A fix that removes a share of a measured time (shares stated in docs/fixes.md)."""
    return gain(model, ceiling * share, ceiling * low_share, ceiling * high_share, ceiling,
                f"{share:.2f} x {what} {ceiling:.1f} ms/step (range {low_share:.2f}-{high_share:.2f} x)")


def as_gain(model: str, value) -> Gain | None:
    """A ``GAINS`` result as a ``Gain``: a plain number (a model that only knows the time it
    targets) becomes that ceiling, claimed as such; None stays unpriced."""
    if value is None or isinstance(value, Gain):
        return value
    v = float(value)
    return gain(model, v, 0.0, v, v, f"ceiling only, no model yet: the whole targeted time {v:.1f} ms/step")
