"""How far noise-aware alert rules can go on a curve set, whatever the scheduler does.

    .venv/bin/python bench/alert_limits.py [CURVES ...]   (default: the shared Pythia curves and ours)

Issue #14 asks for at most 1 false alert per 100 curves without injection and at least 95% of
injected 5-stderr drops detected within 2 checkpoints. Per curve set and per rule this prints both
counts (injection seeds 0-9, as README's table) for the adaptive policy and for ``fixed:1``, which
evaluates every checkpoint: no policy gives a rule more results to judge, so where ``fixed:1``
misses a target, scheduling cannot meet it with that rule.

It also counts ``curves_with_a_drop_the_injected_size``: curves that, without injection, already
fall by ``REGRESSION_STDERRS`` of their stderr or more from the better of the two checkpoints
before, and stay down at the next checkpoint (the mean of the two). An injected drop looks like
that, so a rule that catches nearly every injected drop fires on these curves too, and replay
counts those firings as false alerts.

And it asks whether any forecast from the results before a checkpoint could tell an injected drop
from the clean curve's own movement (``forecasts``). For each forecast (the mean of the 3 results
before, the one result before, and the one before plus half its last change, scaled to the step
gap) it takes the residual of each checkpoint from its forecast, in errors of their difference,
in the bad direction: per clean curve the worst, and for the injected drops (seeds 0-9, without
items) the one at the checkpoint where the drop starts. Where the clean curves' worst residuals
reach as far as the drops' typical one, a rule on that forecast that finds the drops fires on
the clean curves too.

On curves that keep their items, ``item_losses`` asks the same of rules that read items: how
much of the items' score is lost against a baseline (the items' mean over the 3 results before,
or the one result before) at every result of a run of 1-3 in a row, in stderrs of the run's
first result: ``lost``, and ``lost less gained``, where items that gained at every result of
the run are set against it. Per clean curve its worst run; per injected drop (seeds 0-9) the
largest over the runs a rule could judge within 2 checkpoints of its start. A rule silent on
every clean curve finds at most the drops beyond the clean curves' largest; the last line pools
every item-level set given, for a threshold that holds on all of them.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics

from common import ROOT, emit

from areal_eval.alerts import AlertRule
from areal_eval.scheduling.curves import read_curves
from areal_eval.scheduling.replay import REGRESSION_STDERRS, as_replayed, parse_policy, replay

RULES = {
    "stderrs 3": {"stderrs": 3.0},
    "stderrs 3.5": {"stderrs": 3.5},
    "stderrs 4": {"stderrs": 4.0},
    "stderrs 2.5, baseline_results 3": {"stderrs": 2.5, "baseline_results": 3},
    "stderrs 3, baseline_results 3": {"stderrs": 3.0, "baseline_results": 3},
    "stderrs 3.5, baseline_results 3": {"stderrs": 3.5, "baseline_results": 3},
}
SEEDS = range(10)


def has_a_drop_the_injected_size(curve) -> bool:
    sign = 1.0 if curve.higher_is_better else -1.0
    points = curve.points
    for j in range(1, len(points)):
        before = max(sign * p.value for p in points[max(0, j - 2) : j])
        after = statistics.fmean(sign * p.value for p in points[j : j + 2])
        if before - after >= REGRESSION_STDERRS * points[j].stderr:
            return True
    return False


FORECASTS = ("mean of 3", "the one before", "damped trend")


def forecast_residual(points, t: int, forecast: str, sign: float) -> float:
    """How far checkpoint ``t`` lies from ``forecast`` made from the checkpoints before it, in
    errors of their difference, positive in the bad direction (``sign``: 1 higher is better)."""
    y, steps, se = [p.value for p in points], [p.step for p in points], [p.stderr for p in points]
    if forecast == "mean of 3":
        guess, error = statistics.fmean(y[t - 3 : t]), math.sqrt(sum(e * e for e in se[t - 3 : t])) / 3
    elif forecast == "the one before":
        guess, error = y[t - 1], se[t - 1]
    else:  # half the last change, per step, carried over the gap to this checkpoint
        gain = 0.5 * (steps[t] - steps[t - 1]) / (steps[t - 1] - steps[t - 2])
        guess = y[t - 1] + gain * (y[t - 1] - y[t - 2])
        error = math.hypot((1 + gain) * se[t - 1], gain * se[t - 2])
    return sign * (guess - y[t]) / math.hypot(se[t], error)


def _sign(curve) -> float:
    return 1.0 if curve.higher_is_better else -1.0


def forecasts(curves) -> dict:
    out = {}
    for forecast in FORECASTS:
        worst_clean = sorted(
            max(forecast_residual(c.points, t, forecast, _sign(c)) for t in range(3, len(c.points))) for c in curves
        )
        drops = [
            forecast_residual(curve.points, start, forecast, _sign(curve))
            for seed in SEEDS
            for curve, start in as_replayed(curves, True, seed, use_items=False)
            if start >= 3
        ]
        out[forecast] = {
            "clean_worst_median": round(statistics.median(worst_clean), 2),
            "clean_worst_max": round(worst_clean[-1], 2),
            "drop_median": round(statistics.median(drops), 2),
            "drops_beyond_clean_worst_max": round(sum(d > worst_clean[-1] for d in drops) / len(drops), 3),
        }
    return out


ITEM_BASELINES = {"mean of 3": 3, "the one before": 1}
ITEM_RUNS = (1, 2, 3)


def lost_in_a_row(points, k: int, run: int, baseline: int, sign: float) -> tuple[float, float]:
    """(lost, gained): the items' score below (above) their mean over the ``baseline`` results
    before ``k`` at every one of the ``run`` results from ``k``, summed, in stderrs of ``k``."""
    before = points[max(0, k - baseline) : k]
    n = len(points[k].items)
    base = [statistics.fmean(p.items[i] for p in before) for i in range(n)]
    results = [p.items for p in points[k : k + run]]
    lost = sum(max(0.0, min(sign * (base[i] - r[i]) for r in results)) for i in range(n))
    gained = sum(max(0.0, min(sign * (r[i] - base[i]) for r in results)) for i in range(n))
    return lost / n / points[k].stderr, gained / n / points[k].stderr


def item_losses(curves) -> dict:
    out, beyond = {}, set()
    for (name, baseline), run, net in itertools.product(ITEM_BASELINES.items(), ITEM_RUNS, (False, True)):

        def score(points, k, sign, run=run, baseline=baseline, net=net):
            lost, gained = lost_in_a_row(points, k, run, baseline, sign)
            return lost - gained if net else lost

        worst_clean = sorted(
            max(score(c.points, k, _sign(c)) for k in range(1, len(c.points) - run + 1)) for c in curves
        )
        drops = {
            (seed, curve.name): max(score(curve.points, k, _sign(curve)) for k in range(start, last + 1))
            for seed in SEEDS
            for curve, start in as_replayed(curves, True, seed)
            if (last := min(start + 2, len(curve.points) - 1) - run + 1) >= start  # the run ends by start + 2
        }
        found = {drop for drop, value in drops.items() if value > worst_clean[-1]}
        beyond |= found
        out[f"{'lost less gained' if net else 'lost'}, {run} in a row, against {name}"] = {
            "clean_worst_median": round(statistics.median(worst_clean), 2),
            "clean_worst_max": round(worst_clean[-1], 2),
            "drop_median": round(statistics.median(drops.values()), 2),
            "drops_beyond_clean_worst_max": round(len(found) / (len(curves) * len(SEEDS)), 3),
        }
    out["any of them"] = {"drops_beyond_clean_worst_max": round(len(beyond) / (len(curves) * len(SEEDS)), 3)}
    return out


def limits(path) -> dict:
    curves = read_curves(path)
    rules = [AlertRule(name, "regression", **fields) for name, fields in RULES.items()]
    policies = [parse_policy("adaptive"), parse_policy("fixed:1")]
    clean = replay(curves, policies, alert_rules=rules)["policies"]
    injected = [replay(curves, policies, regression=True, seed=s, alert_rules=rules)["policies"] for s in SEEDS]
    table = {}
    for policy in clean:
        for rule in RULES:
            detected = statistics.fmean(run[policy]["alerts"][rule]["detected_within_2"] for run in injected)
            table[f"{policy} | {rule}"] = {
                "false_alerts_per_100_curves": clean[policy]["alerts"][rule]["false_alerts_per_100_curves"],
                "detected_within_2": round(detected, 3),
            }
    return {
        "curves": str(path),
        "count": len(curves),
        "curves_with_a_drop_the_injected_size": sum(map(has_a_drop_the_injected_size, curves)),
        "rules": table,
        "forecasts": forecasts(curves),
    } | ({"item_losses": item_losses(curves)} if curves[0].points[0].items is not None else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = [
        ROOT.parent / "shared" / "data" / "curves" / "pythia-v0.jsonl",
        ROOT / "bench" / "curves" / "areal-demo.jsonl",
        ROOT / "bench" / "curves" / "areal-demo-geometric.jsonl",
        ROOT / "bench" / "curves" / "sft-math.jsonl",
        ROOT / "bench" / "curves" / "sft-math-geometric.jsonl",
    ]
    parser.add_argument("curves", nargs="*", default=[p for p in default if p.exists()])
    args = parser.parse_args()
    for path in args.curves:
        emit({"benchmark": "alert_limits", **limits(path)})
    pooled = [c for path in args.curves for c in read_curves(path) if c.points[0].items is not None]
    if pooled:  # one threshold for every set: above the largest clean value of them all
        emit(
            {"benchmark": "alert_limits", "curves": "every item-level set together", "count": len(pooled)}
            | {"item_losses": item_losses(pooled)}
        )


if __name__ == "__main__":
    main()
