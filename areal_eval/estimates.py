"""Means and their standard errors from sums, as every evaluator reduces them."""

from __future__ import annotations

import math


def mean_and_stderr(total: float, total_sq: float, n: float) -> tuple[float, float]:
    """Mean of ``n`` values from their sum and sum of squares, and its standard error: the
    sample variance (divided by n - 1, as lm-evaluation-harness) over n. A constant metric has
    a standard error of 0, and so has a single value (no spread to estimate); the scheduler and
    the alerts then take their ``default_stderr``."""
    mean = total / n
    return mean, sample_stderr(total_sq - n * mean * mean, n)


def sample_stderr(spread: float, n: float) -> float:
    """The standard error of a mean of ``n`` values whose squared deviations sum to ``spread``."""
    return math.sqrt(max(spread, 0.0) / (n - 1) / n) if n > 1 else 0.0
