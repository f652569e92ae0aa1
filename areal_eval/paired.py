"""Paired statistics of two evaluations on the same items.

Two results on the same items at neighbouring checkpoints move together: an item the model
finds hard at one step it mostly finds hard at the next. The difference of their means then has
a much smaller standard error than the two stated errors combined, and a paired test sees a
change those errors hide (Miller 2024, "Adding Error Bars to Evals", arXiv 2411.00640).

- :func:`paired_difference`: the difference of the means on the common items, its paired
  standard error (clustered where items share a cluster, such as the samples of one prompt),
  a normal confidence interval, and the unpaired error for comparison.
- :func:`mcnemar_exact`: McNemar's exact test for 0/1 scores.
- :func:`mean_scores`: each item's mean over several evaluations, a baseline to pair against.

Pure Python: the scheduler, the alerts and ``areal-eval compare`` import it in any process.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping
from statistics import NormalDist

ItemScores = Callable[[int, str], "tuple[dict, dict | None] | None"]
"""(step, metric) -> the per-item scores whose mean the metric at that step is, and their
clusters (None: that step kept no items for it)."""


class NoCommonItems(ValueError):
    """Two evaluations share no item: nothing to pair."""


@dataclasses.dataclass(frozen=True)
class PairedDifference:
    """``b - a`` on the items both evaluations scored."""

    n: int
    """Common items."""
    mean_a: float
    mean_b: float
    difference: float
    stderr: float
    """Paired standard error of ``difference`` (clustered with ``clusters``)."""
    ci_low: float
    ci_high: float
    unpaired_stderr: float
    """What the two means' own errors give, combined as if independent."""
    clusters: int | None = None
    """Clusters the error was computed over (None: every item its own)."""
    mcnemar_p: float | None = None
    """McNemar's exact two-sided p-value, where every common score is 0 or 1 and no two share a
    cluster (the test holds for independent pairs: a prompt's samples are not)."""
    guarded_stderr: float = 0.0
    """``stderr`` as if one more item (or cluster) had changed by the largest change seen, in
    either direction alike: Agresti and Min's half an item in each discordant cell, for any
    scores. Where only a handful of items changed, ``stderr`` comes from those few and is too
    small to trust (four of 400 items lost, none gained, is 2.0 of it, yet McNemar's p is 0.125);
    this one is 1.8 there and within a few percent of ``stderr`` once many items change."""

    @property
    def mcnemar_z(self) -> float | None:
        """McNemar's exact p as the normal deviate with the same two-sided tail (None where
        ``mcnemar_p`` is: a score not 0 or 1, or clustered items). Where few items changed it is
        below ``z``; where many changed one way, above it."""
        if self.mcnemar_p is None:
            return None
        if self.mcnemar_p >= 1.0:
            return 0.0
        return -NormalDist().inv_cdf(self.mcnemar_p / 2) if self.mcnemar_p > 0 else math.inf

    @property
    def z(self) -> float:
        """The difference in paired standard errors (inf for a change without spread)."""
        if self.stderr > 0:
            return self.difference / self.stderr
        return 0.0 if self.difference == 0 else math.copysign(math.inf, self.difference)


def paired_difference(
    a: Mapping[Hashable, float],
    b: Mapping[Hashable, float],
    clusters: Mapping[Hashable, Hashable] | None = None,
    *,
    confidence: float = 0.95,
    what: str = "the two evaluations",
) -> PairedDifference:
    """The paired difference ``b - a`` over the keys both score (items, or (item, sample))."""
    keys = [k for k in a if k in b]
    n = len(keys)
    if n == 0:
        raise NoCommonItems(f"{what} share no items: nothing to pair")
    xs, ys = [float(a[k]) for k in keys], [float(b[k]) for k in keys]
    ds = [y - x for x, y in zip(xs, ys, strict=True)]
    mean_a, mean_b = math.fsum(xs) / n, math.fsum(ys) / n
    mean_d = math.fsum(ds) / n
    groups = None
    if clusters is None:
        largest = max(map(abs, ds))
        squares = math.fsum([(d - mean_d) ** 2 for d in ds])  # a list: fsum reads it faster than a generator
        stderr = math.sqrt(squares / (n - 1) / n) if n > 1 else 0.0  # _stderr(ds, mean_d), its sum once
        guarded = math.sqrt((squares + largest * largest) / (n * (n + 1)))
    else:
        by_cluster: dict[Hashable, float] = {}
        changes: dict[Hashable, float] = {}
        for k, d in zip(keys, ds, strict=True):
            by_cluster[clusters[k]] = by_cluster.get(clusters[k], 0.0) + (d - mean_d)
            changes[clusters[k]] = changes.get(clusters[k], 0.0) + d
        groups = len(by_cluster)
        # Cluster-robust (CR1): the spread of cluster sums, with the small-sample factor G / (G - 1).
        spread = math.fsum(s * s for s in by_cluster.values())
        stderr = math.sqrt(groups / (groups - 1) * spread) / n if groups > 1 else 0.0
        largest = max(abs(c) for c in changes.values())  # a cluster moves as one
        guarded = math.sqrt((groups + 1) / groups * (spread + largest * largest)) / n
    unpaired = math.hypot(_stderr(xs, mean_a), _stderr(ys, mean_b))
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * stderr
    binary = {*xs, *ys} <= {0.0, 1.0}
    return PairedDifference(
        n=n,
        mean_a=mean_a,
        mean_b=mean_b,
        difference=mean_d,
        stderr=stderr,
        ci_low=mean_d - half,
        ci_high=mean_d + half,
        unpaired_stderr=unpaired,
        clusters=groups,
        mcnemar_p=mcnemar_exact(xs, ys) if binary and groups in (None, n) else None,
        guarded_stderr=guarded,
    )


def mean_scores(scores: list[Mapping[Hashable, float]]) -> dict[Hashable, float]:
    """Each item's mean score over several evaluations, on the items all of them scored: a
    baseline of several results to pair one result against."""
    first, rest = scores[0], scores[1:]
    common = (
        list(first) if all(s.keys() >= first.keys() for s in rest) else [k for k in first if all(k in s for s in rest)]
    )
    return {k: math.fsum(s[k] for s in scores) / len(scores) for k in common}


def _stderr(values: list[float], mean: float) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    return math.sqrt(math.fsum([(v - mean) ** 2 for v in values]) / (n - 1) / n)


def mcnemar_exact(a: list[float], b: list[float]) -> float:
    """McNemar's exact two-sided p-value for paired 0/1 scores: of the discordant items, how
    unlikely a split at least this uneven is when either direction is equally likely."""
    pairs = collections.Counter(zip(a, b, strict=True))
    up, down = pairs[0.0, 1.0], pairs[1.0, 0.0]
    n, k = up + down, min(up, down)
    if n == 0:
        return 1.0
    # P(X <= k) for X ~ Binomial(n, 1/2), summed in log space (n may be large).
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(k + 1)]
    top = max(logs)
    tail = math.exp(top + math.log(math.fsum(math.exp(v - top) for v in logs)) - n * math.log(2))
    return min(1.0, 2 * tail)


def paired_stderrs(items: ItemScores, metric: str) -> Callable[[int, int], float | None]:
    """(step_a, step_b) -> the paired standard error of ``metric``'s difference between two
    evaluated steps, on the items both kept (None where either kept none, or none in common):
    the scheduler's ``paired``. Each step's items are read once they exist (they do not change)."""
    read: dict[int, tuple] = {}

    def scores(step: int):
        if step not in read:
            found = items(step, metric)
            if not found:
                return None
            read[step] = found
        return read[step]

    def paired(a: int, b: int) -> float | None:
        first, second = scores(a), scores(b)
        if first is None or second is None:
            return None
        try:
            return paired_difference(first[0], second[0], clusters=first[1]).stderr
        except NoCommonItems:
            return None

    return paired
