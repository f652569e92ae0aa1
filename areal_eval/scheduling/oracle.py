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

:func:`delay_bounded_compute` adds replay's detection delay: the least compute of any policy
whose mean tracking error and mean delay (to the first evaluation at or after a drop that
starts at a checkpoint drawn uniformly from the second half, as replay injects them) are both
at most the given ones. It is the Lagrangian dual, so a lower bound by weak duality at every
pair of multipliers: for any schedules meeting both, compute >= compute + a * (error - E) +
b * (delay - D) >= the least of compute + a * error + b * delay over all schedules (a shortest
path per curve) - a * E - b * D. The best pair on a grid is returned.
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


def delay_bounded_compute(curves: list[Curve], tracking_error: float, delay: float) -> float:
    """A lower bound on the compute (full evaluations) of any policy, clairvoyant or not, with a
    mean tracking error of at most ``tracking_error`` and a mean detection delay of at most
    ``delay`` over ``curves`` (see the module). Probes only add compute: neither score counts them."""
    scale = sum(len(c.points) for c in curves)  # multipliers span compute per unit of each score
    grid = np.concatenate([[0.0], scale * np.geomspace(1e-4, 1e2, 61)])
    a, b = (m.ravel() for m in np.meshgrid(grid, grid, indexing="ij"))
    total = sum(_least_penalised(curve, a / len(curves), b / len(curves)) for curve in curves)
    return float(max(1.0 * len(curves), np.max(total - a * tracking_error - b * delay)))


def _least_penalised(curve: Curve, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per multiplier pair, the least over schedules of evaluations + ``a`` * mean tracking error
    + ``b`` * mean delay on ``curve`` (the first checkpoint always evaluated): a shortest path
    over "the next evaluated checkpoint after j is k" (k = n: none)."""
    values = np.array([p.value for p in curve.points])
    stderrs = np.array([p.stderr for p in curve.points])
    n, half = len(values), len(values) // 2
    starts = n - half  # replay draws a drop's start from half..n-1
    error = np.zeros((n, n + 1))  # checkpoints j..k-1 shown with j's value
    late = np.zeros((n, n + 1))  # delays of the starts j+1..k-1 (from the second half)
    for j in range(n):
        error[j, j + 1 :] = np.cumsum(np.abs(values[j:] - values[j]) / stderrs[j:])
        ends = np.arange(j + 1, n + 1)
        seen = np.minimum(ends, n - 1)  # replay counts the final checkpoint as seen
        first = max(j + 1, half)
        count = np.maximum(0, ends - first)  # the starts first..k-1, each seen at k
        late[j, j + 1 :] = count * seen - count * (first + ends - 1) / 2
    best = np.full((len(a), n + 1), np.inf)
    best[:, 0] = 1.0
    for k in range(1, n + 1):
        step = (k < n) + np.outer(a, error[:k, k]) / n + np.outer(b, late[:k, k]) / starts
        best[:, k] = np.min(best[:, :k] + step, axis=1)
    return best[:, n]


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
