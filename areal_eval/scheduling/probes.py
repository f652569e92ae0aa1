"""Tiered evaluation: is a cheap probe worth running where the scheduler skips?

A probe evaluates a checkpoint on a fixed random subset of the validation set (a ``fraction`` of
it), so it costs that fraction of a full evaluation. It escalates to a full evaluation when it
differs from the subset value of the last full evaluation by more than ``escalate_stderrs``
standard errors of the difference. Probes never change what the dashboard shows: tracking error
is still scored on full results alone.

The pipeline runs them when ``scheduler.probe_fraction`` is set: the planner
(:class:`~areal_eval.lifecycle.planner.EvaluationPlanner`) decides with :func:`probe_verdict`,
the workers evaluate the subset (and, in every full evaluation, the subset and the rest apart,
so the next probe has its reference). Replay simulates them with the same rule.

Where a curve was recorded with subset values (``bench/record_curves.py``), a probe's result is
the recorded one. Elsewhere it is simulated, and this is the noise model. A recorded point is a
full evaluation on N items with standard error ``se``. A subset of n = fraction * N of those
items has standard error ``se * sqrt(N / n)``; given the full value, the subset value lies around
it with standard deviation ``se * sqrt(N / n - 1)`` (the subset is part of the full set). So a
probe, and the subset value of each full evaluation, is the point's value plus Gaussian noise of
that size, drawn independently for every checkpoint (seeded by curve, checkpoint and seed).
Independent noise ignores that the same items are scored each time: on our recorded subsets the
offset persists between checkpoints, and comparisons err by about half of what this model says
(``bench/probe_noise.py``), so the model is pessimistic for probes.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random

from areal_eval.estimates import mean_and_stderr
from areal_eval.paired import ItemScores, NoCommonItems, paired_difference
from areal_eval.scheduling.decision_history import DecisionHistory
from areal_eval.scheduling.policy import COVER_WINDOW, HistoryEntry, decide, look_back, refine


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    fraction: float = 0.2
    """Share of the validation set a probe evaluates; a probe costs this much compute."""
    escalate_stderrs: float = 2.0
    """Escalate to a full evaluation when the probe differs from the last full evaluation's
    subset value by more than this many standard errors of the difference."""

    @classmethod
    def of(cls, cfg) -> ProbeSettings | None:
        """The probes a ``SchedulerConfig`` asks for (None: none)."""
        if cfg.probe_fraction is None:
            return None
        return cls(cfg.probe_fraction, cfg.probe_escalate_stderrs)

    def __post_init__(self):
        if not 0 < self.fraction < 1:
            raise ValueError(f"probe_fraction must be in (0, 1), got {self.fraction}")
        if self.escalate_stderrs < 0:
            raise ValueError(f"probe_escalate_stderrs must be >= 0, got {self.escalate_stderrs}")


def subset_result(curve, i: int, fraction: float, seed: str) -> tuple[float, float]:
    """Checkpoint ``i``'s (value, stderr) on the probe subset: of its items, where the curve has
    them (the subset a probe of the pipeline scores); recorded, where the curve was recorded
    with subset values of this ``fraction``; else simulated (see the module)."""
    point = curve.points[i]
    if point.items is not None:  # the real subset: the items a probe of this fraction scores
        chosen = [point.items[j] for j in probe_items(len(point.items), fraction)]
        return mean_and_stderr(sum(chosen), sum(v * v for v in chosen), len(chosen))
    if point.subset is not None and curve.subset_fraction == fraction:
        return point.subset
    rng = random.Random(f"{seed}:{curve.name}:{i}")
    noise = rng.gauss(0.0, point.stderr * math.sqrt(1.0 / fraction - 1.0))
    return point.value + noise, point.stderr / math.sqrt(fraction)


def probe_moved(
    probe: float, probe_stderr: float, reference: float, reference_stderr: float, *, stderrs: float
) -> bool:
    """Did the probe move beyond its noise from the last full evaluation's subset value?"""
    return abs(probe - reference) > stderrs * math.hypot(probe_stderr, reference_stderr)


def probe_verdict(probe: tuple[float, float], reference: tuple[float, float], stderrs: float) -> tuple[bool, str]:
    """Escalate? ``probe`` and ``reference`` are (value, stderr) on the probe subset, the reference
    from the newest full evaluation; returns the verdict and the reason, as the ledger records it."""
    moved = probe_moved(*probe, *reference, stderrs=stderrs)
    gap = abs(probe[0] - reference[0]) / max(math.hypot(probe[1], reference[1]), 1e-12)
    relation = ">" if moved else "<="
    return moved, f"probe {probe[0]:.4g} vs {reference[0]:.4g} on the subset: {gap:.2f} {relation} {stderrs:g} stderr"


def paired_probe_verdict(probe: tuple[dict, dict | None], reference: tuple[dict, dict | None], stderrs: float):
    """Escalate? The probe's item scores against the same items of the newest full evaluation:
    their paired difference beyond ``stderrs`` paired standard errors (None: no common items)."""
    try:
        d = paired_difference(reference[0], probe[0], probe[1], what="the probe and the full evaluation before it")
    except NoCommonItems:
        return None
    gap = abs(d.difference) / max(d.stderr, 1e-12) if d.difference else 0.0
    moved = gap > stderrs
    relation = ">" if moved else "<="
    return moved, (
        f"probe {d.mean_b:.4g} vs {d.mean_a:.4g} on the subset: {gap:.2f} {relation} {stderrs:g} stderr, "
        f"paired on {d.n} common items"
    )


class ProbeJudge:
    """Judges a probe against the subset part of the newest full evaluation before its step, as
    the planner records them (a probe decided before that result was in is judged once it is).

    With ``items`` (the run's per-item scores, as the alert rules read them) and both
    evaluations' items kept, the probe is judged on the paired difference of its items against
    the same items of that evaluation; else on the two subset means and their own errors."""

    def __init__(
        self,
        settings: ProbeSettings,
        metric: str,
        stderr_metric: str | None,
        default_stderr: float,
        items: ItemScores | None = None,
    ):
        self.settings, self.metric, self.stderr_metric, self.default_stderr = (
            settings,
            metric,
            stderr_metric,
            default_stderr,
        )
        self.items = items
        self._references: dict[int, dict] = {}
        self._steps: list[int] = []

    def remember(self, step: int, status: str, probe_metrics: dict) -> None:
        """A ledger entry: a full evaluation with a subset part becomes a reference."""
        if status == "evaluated" and self.metric in probe_metrics:
            if step not in self._references:
                bisect.insort(self._steps, step)
            self._references[step] = probe_metrics

    def judge(self, step: int, probe_metrics: dict) -> tuple[bool, str]:
        """Escalate the probe at ``step``? With the reason the ledger records."""
        value = probe_metrics.get(self.metric)
        i = bisect.bisect_left(self._steps, step)
        if value is None or not math.isfinite(value):
            return True, f"probe gave no finite {self.metric} to compare"
        if not i:
            return True, f"no full evaluation before step {step} to compare the probe with"
        reference = self._references[self._steps[i - 1]]
        if self.items is not None:
            probe_items_, reference_items = self.items(step, self.metric), self.items(self._steps[i - 1], self.metric)
            if probe_items_ and reference_items:
                verdict = paired_probe_verdict(probe_items_, reference_items, self.settings.escalate_stderrs)
                if verdict is not None:
                    return verdict
        return probe_verdict(
            self._with_stderr(probe_metrics), self._with_stderr(reference), self.settings.escalate_stderrs
        )

    def _with_stderr(self, metrics: dict) -> tuple[float, float]:
        stderr = metrics.get(self.stderr_metric) if self.stderr_metric else None
        return metrics[self.metric], stderr if stderr and stderr > 0 else self.default_stderr


def select_with_probes(curve, cfg, probes: ProbeSettings | None, seed: str) -> tuple[list[tuple[int, int]], int]:
    """The production scheduler (``decide``, ``look_back``, ``refine``), with ``probes`` a probe wherever it
    skips: the evaluations ``(index, when)`` as ``replay.Policy.select`` gives them, and the
    number of probes run."""
    points = curve.points
    history: list[HistoryEntry] = []
    index = DecisionHistory(cfg.higher_is_better)
    chosen, skipped, probes_run = [], [], 0
    reference = None  # (index, subset value, its stderr) of the newest full evaluation
    paired = curve_paired_stderr(curve)
    at = {p.step: i for i, p in enumerate(points)}
    train = [
        (int(r["step"]), float(r[cfg.train_metric]))
        for r in curve.train
        if cfg.train_metric and isinstance(r.get(cfg.train_metric), (int, float))
    ]
    for i, p in enumerate(points):
        event = _Event(p.step, i == len(points) - 1)
        known = [t for t in train if t[0] <= p.step][-64:]  # what the trainer had published by then
        evaluate = decide(event, index.view(), cfg, index.offered_before(p.step), paired=paired, train=known).evaluate
        if not evaluate and probes and reference is not None:
            probes_run += 1
            evaluate = probe_escalates(curve, i, reference, probes, seed=seed)
        if evaluate:
            chosen.append((i, i))
            history.append(HistoryEntry(p.step, float(p.step), p.value, p.stderr))
            index.set(p.step, history[-1])
            if probes:  # its own subset result: what a probe here saw (a full result contains it)
                reference = (i, *subset_result(curve, i, probes.fraction, seed))
            for step, _ in look_back(index.view(), p.step, skipped[-COVER_WINDOW:], cfg, paired=paired):
                j = at[step]  # evaluated now, with this checkpoint the newest
                chosen.append((j, i))
                history.append(HistoryEntry(step, float(step), points[j].value, points[j].stderr))
                index.set(step, history[-1])
                skipped.remove(step)
        else:
            skipped.append(p.step)
            index.offer(p.step)
    chosen += [(at[step], len(points) - 1) for step, _ in refine(history, skipped, cfg)]
    return chosen, probes_run


def curve_paired_stderr(curve):
    """The scheduler's ``paired`` on a curve whose points keep their items (None: they do not)."""
    at = {p.step: p.items for p in curve.points if p.items is not None}
    if not at:
        return None
    cache: dict[tuple[int, int], float | None] = {}

    def paired(a: int, b: int) -> float | None:
        if (a, b) not in cache:
            ok = a in at and b in at
            cache[a, b] = paired_difference(dict(enumerate(at[a])), dict(enumerate(at[b]))).stderr if ok else None
        return cache[a, b]

    return paired


def probe_escalates(curve, i: int, reference: tuple[int, float, float], probes: ProbeSettings, *, seed: str) -> bool:
    """Would the probe of checkpoint ``i`` escalate, against the full evaluation ``reference``
    (its index, subset value and stderr)? Paired on the items where the curve has them, as the
    planner judges a run that keeps its items; else on the subset means."""
    point, base = curve.points[i], curve.points[reference[0]]
    if point.items is not None and base.items is not None:
        subset = {j: point.items[j] for j in probe_items(len(point.items), probes.fraction)}
        verdict = paired_probe_verdict((subset, None), (dict(enumerate(base.items)), None), probes.escalate_stderrs)
        if verdict is not None:
            return verdict[0]
    return probe_moved(*subset_result(curve, i, probes.fraction, seed), *reference[1:], stderrs=probes.escalate_stderrs)


@dataclasses.dataclass(frozen=True)
class _Event:
    global_step: int
    final: bool


def probe_items(n: int, fraction: float) -> list[int]:
    """The probe subset of ``n`` items: a fixed random ``fraction`` of them (at least one), the
    same every time, so a probe and the subset part of a full evaluation score the same items."""
    k = min(n, max(1, round(fraction * n)))
    return sorted(random.Random(f"areal-eval probe subset of {n}").sample(range(n), k))


def probe_rest(n: int, fraction: float) -> list[int]:
    """The items :func:`probe_items` leaves out."""
    return sorted(set(range(n)) - set(probe_items(n, fraction)))
