"""Regression alerts judged by the paired error of item differences against the unpaired rule.

    .venv/bin/python bench/paired_alerts.py bench/curves/areal-demo.jsonl bench/curves/areal-demo-geometric.jsonl

On item-level curves (every point keeps each item's score), each regression rule judges every
checkpoint (``fixed:1``) twice: with the items (paired) and with them stripped (the two
results' own errors combined); an injected drop lowers the items, so both judge the same drop.
Reports, per rule (or pair of rules, as a user configures them: either firing counts), the
clean curves it fires on, and over injected 5-stderr drops (seeds 0-9) the share detected
within 2 checkpoints and the share with an alert before the drop. Prints one JSON line.
"""

from __future__ import annotations

import random

from common import emit, item_curves_from_args

RULES = [
    [(3.0, None, None)],
    [(3.0, 3, None)],
    [(5.0, 3, None)],
    [(1.5, 3, 2)],
    [(2.0, 3, 2)],
    [(2.0, 5, 2)],
    [(3.0, 3, 2)],
    [(2.0, 3, 2), (5.0, 3, None)],
]
"""Each row: the (stderrs, baseline_results, confirm) of its rules; ``confirm`` 2 fires once the
next result breaches too. The last pairs a confirmed rule with one that fires at once on a drop
of the injected size."""


def judge(curves, rules: list[tuple], paired: bool) -> dict:
    """The rules over the item curves (``paired``) or over the same curves, each drop injected
    into the items first, with the items stripped (so both judge the same drops)."""
    from areal_eval.alerts import AlertRule
    from areal_eval.scheduling import replay

    seen = (lambda c: c) if paired else replay.without_items
    rules = [
        AlertRule(f"rule{i}", "regression", stderrs=stderrs, baseline_results=baseline, confirm=confirm)
        for i, (stderrs, baseline, confirm) in enumerate(rules)
    ]

    def fired(curve, evaluations):
        return [alert for rule in rules for alert in replay.alerts_fired(curve, evaluations, rule)]

    every = [[(i, i) for i in range(len(c.points))] for c in curves]
    clean = sum(bool(fired(seen(c), e)) for c, e in zip(curves, every, strict=True))
    detected = early = total = 0
    for seed in range(10):
        for curve, evaluations in zip(curves, every, strict=True):
            hit, start = replay.inject_regression(curve, random.Random(f"{seed}:{curve.name}"))
            hit = seen(hit)
            alerts = fired(hit, evaluations)
            detected += any(i >= start and when <= start + 2 for i, when in alerts)
            early += any(when < start for _, when in alerts)
            total += 1
    return {
        "clean_curves_fired": f"{clean}/{len(curves)}",
        "detected_within_2": round(detected / total, 3),
        "fired_before_the_drop": round(early / total, 3),
    }


def main() -> None:
    curves = item_curves_from_args(__doc__.splitlines()[0])
    out = {"benchmark": "paired_alerts", "curves": len(curves)}
    for rules in RULES:
        name = " + ".join(
            f"stderrs {stderrs:g}" + (f", baseline_results {baseline}" if baseline else "")
            + (f", confirm {confirm}" if confirm else "")
            for stderrs, baseline, confirm in rules
        )  # fmt: skip
        out[name] = {"paired": judge(curves, rules, paired=True), "unpaired": judge(curves, rules, paired=False)}
    emit(out)


if __name__ == "__main__":
    main()
