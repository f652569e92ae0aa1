"""Replay recorded learning curves through scheduling policies, and score them.

Each curve's checkpoints are fed in order, as checkpoint events, to the real scheduler code; a
checkpoint's value is revealed to the policy only when the policy evaluates it. Scores:

* ``evaluations``: evaluations spent, summed over curves; ``compute`` the same, plus each
  simulated probe (:mod:`.probes`, counted in ``probes``) at its fraction of a full evaluation;
* ``mean_tracking_error``: at each checkpoint the dashboard shows the latest evaluated value at
  or before it; error |value - shown| / stderr, averaged over checkpoints, then curves;
* ``mean_regret`` / ``max_regret``: best value among all checkpoints minus the value of the
  checkpoint the policy would pick as best from what it evaluated (in the curve's direction);
* ``oracle_compute`` / ``oracle_ratio`` (adaptive policies): the least compute any policy, even
  a clairvoyant one, could spend at the policy's tracking error (:mod:`.oracle`), and that
  against the fixed frontier: how much saving there is to be had at all;
* ``detection_delay`` (with an injected regression): checkpoints between the start of a
  5-stderr drop (seeded, second half, to the end) and the first evaluation at or after it.
  An evaluation counts when it happened: the refinement after the final checkpoint sees
  nothing earlier than the final checkpoint's own evaluation.
* ``alerts`` (given alert rules): each rule judges the policy's results in the order they
  were evaluated. Without injection, ``false_alerts_per_100_curves`` counts the curves where
  it fired at all; with injection, ``detected_within_2`` is the share of curves where it fired
  on a result at or after the drop, evaluated at most 2 checkpoints after it began, and
  ``false_alerts_per_100_curves`` counts the curves where it fired before the drop.
* ``feedback`` (given feedback rules): what they would have asked of training, judged as alerts
  are (:mod:`.feedback_replay`).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics

from areal_eval.alerts import AlertEngine, AlertRule, AlertsConfig
from areal_eval.config.parsing import from_dict, override_value
from areal_eval.feedback import FeedbackConfig
from areal_eval.scheduling.curves import DEFAULT_STDERR, Curve, Point
from areal_eval.scheduling.feedback_replay import acted, feedback_scores
from areal_eval.scheduling.oracle import MAX_CHECKPOINTS, oracle_compute
from areal_eval.scheduling.policy import SchedulerConfig
from areal_eval.scheduling.probes import ProbeSettings, select_with_probes

REGRESSION_STDERRS = 5.0


class Policy:
    name: str
    probes: ProbeSettings | None = None

    def select(self, curve: Curve) -> list[tuple[int, int]]:
        """The checkpoints this policy evaluates, in order: (index, index of the newest checkpoint
        when it was evaluated)."""
        raise NotImplementedError

    def select_and_probe(self, curve: Curve, seed: str) -> tuple[list[tuple[int, int]], int]:
        """:meth:`select`, and how many probes it ran (``seed`` draws their simulated noise)."""
        return self.select(curve), 0


class FixedEvery(Policy):
    """The baseline ``fixed:K``: checkpoints 0, K, 2K, ... and always the last."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError("fixed:K needs K >= 1")
        self.k, self.name = k, f"fixed:{k}"

    def select(self, curve):
        n = len(curve.points)
        return [(i, i) for i in sorted(set(range(0, n, self.k)) | {n - 1})]


class SchedulerPolicy(Policy):
    """The production scheduler (``decide``), fed one checkpoint event at a time; with ``probes``,
    a simulated probe wherever it skips (:mod:`.probes`)."""

    def __init__(self, name: str, cfg: SchedulerConfig):
        self.name, self.cfg, self.probes = name, cfg, ProbeSettings.of(cfg)

    def select(self, curve):
        return self.select_and_probe(curve, "0")[0]

    def select_and_probe(self, curve, seed):
        cfg = dataclasses.replace(self.cfg, higher_is_better=curve.higher_is_better)
        return select_with_probes(curve, cfg, self.probes, seed)


def parse_policy(spec: str) -> Policy:
    """``fixed:K``, ``adaptive`` or ``adaptive:field=value,field=value`` (scheduler fields, and
    ``probe_fraction`` / ``probe_escalate_stderrs`` to simulate probes where it skips)."""
    if spec.startswith("fixed:"):
        k = spec.split(":", 1)[1]
        if not k.strip().isdigit():
            raise ValueError(f"policy {spec!r}: K in fixed:K is a whole number of checkpoints, got {k!r}")
        return FixedEvery(int(k))
    if spec == "adaptive" or spec.startswith("adaptive:"):
        overrides = {}
        if ":" in spec:
            for item in spec.split(":", 1)[1].split(","):
                if "=" not in item:
                    raise ValueError(f"policy {spec!r}: {item!r} is not field=value")
                key, value = item.split("=", 1)
                overrides[key.strip()] = override_value(f"adaptive.{key.strip()}", value)  # as --set reads it
        cfg = from_dict(SchedulerConfig, {"stderr_metric": None, **overrides}, "adaptive")
        return SchedulerPolicy(spec, cfg)
    raise ValueError(f"unknown policy {spec!r} (fixed:K, adaptive, adaptive:field=value,...)")


def inject_regression(curve: Curve, rng: random.Random) -> tuple[Curve, int]:
    """A drop of ``REGRESSION_STDERRS`` standard errors from a random checkpoint in the second
    half to the end. On a curve with items, it is the items that drop (:func:`lower_items`)."""
    n = len(curve.points)
    start = rng.randrange(n // 2, n)
    sign = -1.0 if curve.higher_is_better else 1.0
    order = None
    if curve.points[0].items is not None:  # which items regress first: the same at every point
        order = rng.sample(range(len(curve.points[0].items)), len(curve.points[0].items))
    points = tuple(
        _with_subset_moved(p, lower_items(p, order, sign) if order is not None else dataclasses.replace(
            p, value=p.value + sign * REGRESSION_STDERRS * p.stderr
        )) if i >= start else p
        for i, p in enumerate(curve.points)
    )  # fmt: skip
    return dataclasses.replace(curve, points=points), start


def _with_subset_moved(clean: Point, regressed: Point) -> Point:
    """A recorded probe-subset value drops with the value, and its stderr moves as the value's
    did: a probe sees the regression too."""
    if clean.subset is None:
        return regressed
    value, stderr = clean.subset
    return dataclasses.replace(
        regressed, subset=(value + regressed.value - clean.value, stderr * regressed.stderr / clean.stderr)
    )


def lower_items(point: Point, order: list[int], sign: float) -> Point:
    """``point`` with its items made worse until their mean has moved ``REGRESSION_STDERRS``
    standard errors in the bad direction (``sign``): scores on a 0-1 scale (accuracy, ties ½)
    flip to the worst score one item at a time in ``order`` until the move is that many of the
    clean result's stderrs and of the regressed one's (a result at its bound, 100% accuracy,
    has a stderr of 0: its drop is sized by the error the regressed result has); other scores
    (a loss, a margin) move by one amount on the first half of ``order``. The value moves with
    them, and so does the stderr, as an evaluator would report it from the regressed items: the
    recorded one scaled by how the items' spread changed (from a spread of 0, the items' own)."""
    items, n = list(point.items), len(point.items)
    if set(items) <= {0.0, 0.5, 1.0}:
        worst, moved = (0.0 if sign < 0 else 1.0), 0.0
        total, squares = sum(items), sum(x * x for x in items)
        for j in order:
            variance = max(0.0, squares - total * total / n) / max(1, n - 1)
            noise = max(point.stderr, (variance / n) ** 0.5)
            if moved >= REGRESSION_STDERRS * noise * n:
                break
            moved += abs(items[j] - worst)
            total += worst - items[j]
            squares += worst * worst - items[j] * items[j]
            items[j] = worst
    else:
        share = order[: max(1, n // 2)]
        moved = REGRESSION_STDERRS * point.stderr * n  # the sum the items must move
        for j in share:
            items[j] += sign * moved / len(share)
    return dataclasses.replace(
        point,
        value=point.value + sign * moved / n,
        stderr=_moved_stderr(point, items),
        items=tuple(items),
    )


def _moved_stderr(clean: Point, items: list[float]) -> float:
    """The stderr of ``clean`` once its items are ``items``; one of 0 (every item at the worst
    score) counts as ``DEFAULT_STDERR``, as a curve's own does."""
    before, after = _clean_spread(clean.items), _spread(items)
    if before > 0:
        return clean.stderr * after / before or DEFAULT_STDERR
    return max(clean.stderr, after / len(items) ** 0.5)


def _spread(scores) -> float:
    return statistics.stdev(scores) if len(scores) > 1 else 0.0


@functools.lru_cache(maxsize=256)  # a clean point's items are lowered again for each seed
def _clean_spread(scores: tuple[float, ...]) -> float:
    return _spread(scores)


def score(curve: Curve, chosen: list[int]) -> dict:
    pts = curve.points
    errors, shown = [], None
    chosen_set = set(chosen)
    for i, p in enumerate(pts):
        if i in chosen_set:
            shown = p.value
        errors.append(abs(p.value - shown) / p.stderr if shown is not None else 0.0)
    better = max if curve.higher_is_better else min
    best_all = better(p.value for p in pts)
    picked = better((pts[i] for i in chosen), key=lambda p: p.value).value
    return {
        "evaluations": len(chosen),
        "tracking_error": statistics.fmean(errors),
        "regret": abs(best_all - picked),
    }


def replay(
    curves: list[Curve],
    policies: list[Policy],
    *,
    regression: bool = False,
    seed: int = 0,
    alert_rules: list[AlertRule] | None = None,
    use_items: bool = True,
    feedback: FeedbackConfig | None = None,
) -> dict:
    """Each policy's evaluations, ``compute`` (a full evaluation counts 1), tracking error, regret
    and, with ``regression``, detection delay; for every policy that is not ``fixed:K``, the
    compute the fixed-interval frontier needs for the same tracking error, and the ratio, and the
    least compute any policy could spend there (``oracle_compute``, see :mod:`.oracle`; left out
    for curves over ``MAX_CHECKPOINTS`` long) with its ratio to the frontier; and how each of
    ``alert_rules`` (on the curve's metric) fired. Without ``use_items`` the curves' items are
    dropped after the regression is injected into them: the same curves as a run that keeps no
    items would see them, so probes and alerts are judged unpaired on the same drops. With
    ``feedback``, what its rules would have asked of training (:mod:`.feedback_replay`)."""
    results = {
        policy.name: _replay_one(curves, policy, regression, seed, alert_rules, use_items, feedback)
        for policy in policies
    }
    fixed: dict[int, dict] = {}
    replayed = None
    for policy in policies:
        if not isinstance(policy, FixedEvery):
            row = results[policy.name]
            frontier = fixed_frontier_compute(
                curves, row["mean_tracking_error"], regression=regression, seed=seed, fixed=fixed, use_items=use_items
            )
            row["frontier_compute"] = round(frontier, 2)
            row["frontier_ratio"] = round(row["compute"] / frontier, 4)
            if max(len(c.points) for c in curves) <= MAX_CHECKPOINTS:  # else left out: too slow
                replayed = replayed or [curve for curve, _ in as_replayed(curves, regression, seed, use_items)]
                floor = oracle_compute(replayed, row["mean_tracking_error"])
                row["oracle_compute"] = round(floor, 2)
                row["oracle_ratio"] = round(floor / frontier, 4)
    return {"policies": results}


def fixed_frontier_compute(
    curves: list[Curve],
    tracking_error: float,
    *,
    regression: bool,
    seed: int,
    fixed: dict[int, dict],
    use_items: bool = True,
) -> float:
    """The compute of ``fixed:K`` at ``tracking_error``, interpolated linearly between the
    neighbouring K (``fixed`` caches their replays). Beyond the sparsest ``fixed:K`` (every curve
    down to its first and last checkpoint), that one's compute."""
    longest = max(len(c.points) for c in curves)
    k = 1
    while True:
        if k not in fixed:
            fixed[k] = _replay_one(curves, FixedEvery(k), regression, seed, None, use_items)  # compute only
        if fixed[k]["mean_tracking_error"] >= tracking_error or k >= longest:
            break
        k += 1
    here = fixed[k]
    if k == 1 or here["mean_tracking_error"] < tracking_error:
        return here["compute"]
    before = fixed[k - 1]
    span = here["mean_tracking_error"] - before["mean_tracking_error"]
    if span <= 0:
        return here["compute"]
    share = (tracking_error - before["mean_tracking_error"]) / span
    return before["compute"] + share * (here["compute"] - before["compute"])


def alerts_fired(curve: Curve, evaluations: list[tuple[int, int]], rule: AlertRule) -> list[tuple[int, int]]:
    """The evaluations ``(checkpoint, when)`` on which ``rule`` fires, judged in the order they
    were evaluated, as the pipeline's alert engine judges them (each point's stderr as its noise)."""
    return fired_by_rule(curve, evaluations, [rule])[rule.name]


def fired_by_rule(
    curve: Curve, evaluations: list[tuple[int, int]], rules: list[AlertRule]
) -> dict[str, list[tuple[int, int]]]:
    """:func:`alerts_fired` for each of ``rules``, by its name: one engine judges them all, as the
    pipeline's does, and reads each pair of results' items once for all of them."""
    rules = [
        dataclasses.replace(rule, metric="value", higher_is_better=curve.higher_is_better, throttle_secs=0.0)
        for rule in rules
    ]
    by_step = {p.step: p for p in curve.points}

    def items(step: int, metric: str):
        scores = by_step[step].items
        return None if scores is None else (dict(enumerate(scores)), None)

    engine = AlertEngine(AlertsConfig(rules=rules), clock=lambda: 0.0, items=items)
    fired = {rule.name: [] for rule in rules}
    for index, when in sorted(evaluations, key=lambda e: (e[1], e[0])):
        point = curve.points[index]
        final = index == len(curve.points) - 1
        for alert in engine.check(point.step, {"value": point.value, "value_stderr": point.stderr}, final=final):
            fired[alert.rule].append((index, when))
    return fired


def as_replayed(
    curves: list[Curve], regression: bool, seed: int, use_items: bool = True
) -> list[tuple[Curve, int | None]]:
    """The curves as every policy sees them: with ``regression``, each with its injected drop
    and where it starts (the same for every policy); without ``use_items``, without items."""
    if regression:
        replayed = [inject_regression(curve, random.Random(f"{seed}:{curve.name}")) for curve in curves]
    else:
        replayed = [(curve, None) for curve in curves]
    return replayed if use_items else [(without_items(curve), start) for curve, start in replayed]


def without_items(curve: Curve) -> Curve:
    """``curve`` as a run that keeps no items would have recorded it."""
    return dataclasses.replace(curve, points=tuple(dataclasses.replace(p, items=None) for p in curve.points))


def _replay_one(
    curves: list[Curve],
    policy: Policy,
    regression: bool,
    seed: int,
    alert_rules: list[AlertRule] | None = None,
    use_items: bool = True,
    feedback: FeedbackConfig | None = None,
) -> dict:
    """One policy over every curve (with the same injected regressions for every policy)."""
    per_curve, delays, probes_run, fed_back = [], [], 0, []
    false_alerts = {rule.name: 0 for rule in alert_rules or ()}
    detected = {rule.name: 0 for rule in alert_rules or ()}
    for curve, start in as_replayed(curves, regression, seed, use_items):
        evaluations, probes = policy.select_and_probe(curve, str(seed))
        if 0 not in (i for i, _ in evaluations):
            evaluations.insert(0, (0, 0))  # every policy evaluates the first checkpoint
        per_curve.append(score(curve, sorted(i for i, _ in evaluations)))
        probes_run += probes
        if start is not None:
            seen = [when for i, when in evaluations if i >= start] + [len(curve.points) - 1]
            delays.append(min(seen) - start)
        for name, fired in fired_by_rule(curve, evaluations, alert_rules).items() if alert_rules else ():
            false_alerts[name] += any(start is None or when < start for _, when in fired)
            detected[name] += start is not None and any(i >= start and when <= start + 2 for i, when in fired)
        if feedback is not None:
            fed_back.append((curve, start, acted(curve, evaluations, feedback)))
    probe_compute = probes_run * policy.probes.fraction if policy.probes else 0.0  # a probe costs its share
    out = {
        "evaluations": sum(r["evaluations"] for r in per_curve),
        "compute": round(sum(r["evaluations"] for r in per_curve) + probe_compute, 2),
        "mean_tracking_error": round(statistics.fmean(r["tracking_error"] for r in per_curve), 4),
        "mean_regret": round(statistics.fmean(r["regret"] for r in per_curve), 5),
        "max_regret": round(max(r["regret"] for r in per_curve), 5),
    }
    if policy.probes:
        out["probes"] = probes_run
    if feedback is not None:
        out["feedback"] = feedback_scores(fed_back)
    if regression:
        out["detection_delay"] = round(statistics.fmean(delays), 3)
    if alert_rules:
        out["alerts"] = {
            name: {"false_alerts_per_100_curves": round(100 * false_alerts[name] / len(curves), 2)}
            | ({"detected_within_2": round(detected[name] / len(curves), 4)} if regression else {})
            for name in false_alerts
        }
    return out
