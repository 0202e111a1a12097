"""Confidence intervals: the one implementation every report of this package and its benchmarks uses.

* ``wilson_interval``: a success rate's Wilson score interval. It stays inside [0, 1] and keeps its coverage for
  small samples and rates near 0 or 1, where the normal (Wald) interval fails.
* ``mean_interval``: a mean's Student-t interval, mean +- t(confidence, n - 1) * s / sqrt(n) with the sample standard
  deviation ``s``. When the values have known bounds (a reward in [0, 1], a coverage) the interval is clipped to
  them: the mean cannot lie outside, and a t interval of a few bounded values easily pokes out. Without bounds it is
  the plain t interval, which is approximate for non-normal values (say so where it is reported: ``describe``).
* ``mean_summary``: mean, interval and n as one JSON-ready dict (benchmark results).

All in the standard library (no SciPy): the t quantile is found by bisection on the exact CDF.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from .errors import InputError

__all__ = [
    "check_confidence",
    "describe_mean_interval",
    "mean_interval",
    "mean_summary",
    "student_t_quantile",
    "wilson_interval",
]


def check_confidence(confidence: Any) -> float:
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise InputError(f"confidence: expected a number strictly between 0 and 1, got {confidence!r}.")
    return float(confidence)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` for a success rate of ``successes`` out of ``trials``."""
    if trials < 1 or not 0 <= successes <= trials:
        raise InputError(
            f"successes/trials: expected 0 <= successes <= trials and trials >= 1, got {successes}/{trials}."
        )
    z = statistics.NormalDist().inv_cdf(0.5 + check_confidence(confidence) / 2)
    rate = successes / trials
    denominator = 1 + z * z / trials
    center = (rate + z * z / (2 * trials)) / denominator
    half_width = z / denominator * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials))
    # At 0 and `trials` successes the bound is exactly 0 (1); the formula gives it up to rounding.
    low = 0.0 if successes == 0 else center - half_width
    high = 1.0 if successes == trials else center + half_width
    return low, high


def student_t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile (0.5 < probability < 1) of Student's t with ``df`` degrees of freedom.

    Bisection on the exact CDF for integer ``df`` (Abramowitz & Stegun 26.7.3 / 26.7.4).
    """
    if not 0.5 < probability < 1 or isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise InputError(
            f"probability/df: expected 0.5 < probability < 1 and an integer df >= 1, got {probability!r}, {df!r}."
        )
    target = 2 * probability - 1  # P(|T| <= t)
    high = 1.0
    while _t_central_probability(high, df) < target:
        high *= 2
    low = 0.0
    for _ in range(200):
        middle = (low + high) / 2
        if _t_central_probability(middle, df) < target:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


def _t_central_probability(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with integer ``df`` (A&S 26.7.3 for odd df, 26.7.4 for even df)."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    term = total = 1.0
    if df % 2:
        for k in range(1, (df - 1) // 2):  # 1 + 2/3 cos^2 + (2*4)/(3*5) cos^4 + ... up to cos^(df-3)
            term *= cos2 * (2 * k) / (2 * k + 1)
            total += term
        series = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
        return 2 / math.pi * (theta + series)
    for k in range(1, df // 2):  # 1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ... up to cos^(df-2)
        term *= cos2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def mean_interval(
    values: Sequence[float], confidence: float = 0.95, bounds: tuple[float, float] | None = None
) -> tuple[float, float] | None:
    """Student-t confidence interval ``(low, high)`` for the mean of ``values``, clipped to ``bounds`` (the values'
    known range, e.g. ``(0.0, 1.0)``) when given; None for fewer than 2 values or any infinite or NaN one (e.g. the
    PSNR of two identical frames), where no interval exists."""
    confidence = check_confidence(confidence)
    values = [float(value) for value in values]
    if bounds is not None:
        low_bound, high_bound = (float(bound) for bound in bounds)
        if not low_bound <= high_bound:
            raise InputError(f"bounds: expected (low, high) with low <= high, got {bounds!r}.")
        outside = [value for value in values if not low_bound <= value <= high_bound]
        if outside:
            raise InputError(f"values: {outside[:3]} lie outside the given bounds [{low_bound}, {high_bound}].")
    if len(values) < 2 or not all(math.isfinite(value) for value in values):
        return None
    mean = statistics.fmean(values)
    half_width = (
        student_t_quantile(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    )
    low, high = mean - half_width, mean + half_width
    if bounds is not None:
        low, high = max(low, low_bound), min(high, high_bound)
    return low, high


def describe_mean_interval(bounds: tuple[float, float] | None) -> str:
    """How a report names the ``mean_interval`` it used."""
    if bounds is None:
        return "student_t (approximate: the values' bounds are unknown)"
    return f"student_t clipped to the known bounds [{bounds[0]:g}, {bounds[1]:g}]"


def mean_summary(
    values: Sequence[float], confidence: float = 0.95, bounds: tuple[float, float] | None = None
) -> dict[str, Any]:
    """``{"mean", "low", "high", "n", "interval"}`` of ``mean_interval`` (low/high NaN for fewer than 2 values)."""
    values = [float(value) for value in values]
    if not values:
        raise InputError("values: expected at least one value.")
    interval = mean_interval(values, confidence, bounds)
    low, high = interval if interval is not None else (math.nan, math.nan)
    return {
        "mean": statistics.fmean(values),
        "low": low,
        "high": high,
        "n": len(values),
        "confidence": confidence,
        "interval": describe_mean_interval(bounds),
    }
