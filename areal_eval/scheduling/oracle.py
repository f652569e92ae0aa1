"""The least compute any scheduling policy could spend for a given tracking error.

Replay scores a policy by its tracking error: at each checkpoint, how far the newest evaluated
value lies from the checkpoint's own, in standard errors. A clairvoyant scheduler that knows
every value in advance picks, for each budget of evaluations, the checkpoints that minimise that
error. No real policy does better with as many full evaluations, and probes or any other cheap
signal only decide *which* checkpoints get full evaluations: the dashboard shows full results
alone. So the clairvoyant's compute at a policy's tracking error is a floor under what any
policy, tiered or not, can spend there; against the fixed-interval frontier it says how much of
a saving is there to be had at all.

Exact: per curve, dynamic programming over "the last evaluated checkpoint before this one" gives
the least error for every number of evaluations (checked against brute force in the tests);
across curves, the lower convex hull of those tables (a Lagrangian relaxation) allots the
evaluations. The hull lies on or below every achievable allotment, so the result is a lower
bound, and it is tight wherever the curves' tables are convex.
"""

from __future__ import annotations

import itertools

import numpy as np

from areal_eval.scheduling.curves import Curve

MAX_CHECKPOINTS = 2000
"""Longest curve the bound is computed for: its time grows with the cube of a curve's length
(1000 checkpoints take about 3 s)."""


def least_tracking_errors(curve: Curve) -> np.ndarray:
    """``errors[b]``: the least tracking error summed over the curve's checkpoints (in standard
    errors) of any ``b`` evaluations that include the first checkpoint (every policy evaluates
    it); ``errors[0]`` is infinite."""
    values = np.array([p.value for p in curve.points])
    stderrs = np.array([p.stderr for p in curve.points])
    n = len(values)
    # segment[j, k]: the error of checkpoints j..k-1 while j is the newest evaluated one.
    segment = np.full((n, n + 1), np.inf)
    for j in range(n):
        segment[j, j + 1 :] = np.cumsum(np.abs(values[j:] - values[j]) / stderrs[j:])
    errors = np.full(n + 1, np.inf)
    # ending[j]: least error of checkpoints 0..j-1 with b evaluations, the newest at j.
    ending = np.full(n, np.inf)
    ending[0] = 0.0
    for b in range(1, n + 1):
        errors[b] = np.min(ending + segment[:, n])
        if b < n:
            ending = np.min(ending[:, None] + segment[:, :n], axis=0)  # the next evaluation at k > j
    return errors


def oracle_compute(curves: list[Curve], tracking_error: float) -> float:
    """The least compute (full evaluations) for a mean tracking error over ``curves`` (the mean
    of each curve's mean, as replay scores it) of at most ``tracking_error``: a lower bound for
    every policy. Below the least error reachable (every checkpoint evaluated), that compute."""
    steps = []  # (error saved per evaluation, evaluations, error saved): the hulls' edges
    compute, error = 0.0, 0.0
    for curve in curves:
        per_checkpoint = least_tracking_errors(curve) / (len(curve.points) * len(curves))
        compute, error = compute + 1, error + per_checkpoint[1]
        hull = _lower_hull(per_checkpoint)
        steps += [((e0 - e1) / (b1 - b0), b1 - b0, e0 - e1) for (b0, e0), (b1, e1) in itertools.pairwise(hull)]
    for rate, evaluations, saved in sorted(steps, key=lambda s: -s[0]):
        if error <= tracking_error:
            break
        if error - saved < tracking_error:
            return compute + (error - tracking_error) / rate
        compute, error = compute + evaluations, error - saved
    return compute


def _lower_hull(errors: np.ndarray) -> list[tuple[int, float]]:
    """The lower convex hull of ``(b, errors[b])`` for b >= 1, up to where it stops falling."""
    hull: list[tuple[int, float]] = []
    for b in range(1, len(errors)):
        point = (b, float(errors[b]))
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], point) <= 0:
            hull.pop()
        hull.append(point)
    while len(hull) >= 2 and hull[-1][1] >= hull[-2][1]:
        hull.pop()
    return hull


def _cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])
