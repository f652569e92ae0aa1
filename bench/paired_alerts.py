"""Regression alerts judged by the paired error of item differences against the unpaired rule.

    .venv/bin/python bench/paired_alerts.py bench/curves/areal-demo.jsonl bench/curves/areal-demo-geometric.jsonl

On item-level curves (every point keeps each item's score), each regression rule judges every
checkpoint (``fixed:1``) twice: with the items (paired) and with them stripped (the two
results' own errors combined); an injected drop lowers the items, so both judge the same drop.
Reports, per rule, the clean curves it fires on, and over injected 5-stderr drops (seeds 0-9)
the share detected within 2 checkpoints and the share with an alert before the drop. Prints one
JSON line.
"""

from __future__ import annotations

import random

from common import emit, item_curves_from_args

from areal_eval.alerts import NOISE_AWARE_REGRESSION, AlertRule
from areal_eval.scheduling import replay

RULES = [
    {"stderrs": 3.0},
    {"stderrs": 3.0, "baseline_results": 3},
    {"stderrs": 5.0, "baseline_results": 3},
    {"stderrs": 1.5, "baseline_results": 3, "confirm": 2},
    {"stderrs": 2.0, "baseline_results": 3, "confirm": 2},
    {"stderrs": 2.0, "baseline_results": 5, "confirm": 2},
    {"stderrs": 3.0, "baseline_results": 3, "confirm": 2},
    NOISE_AWARE_REGRESSION,
]
"""Each row: a regression rule's noise settings (AlertRule fields). ``confirm: 2`` fires once the
next result breaches too; ``at_once_stderrs`` fires unconfirmed on a drop that large. The last
is replay's default ``noise_aware`` rule."""


def judge(curves, settings: dict, paired: bool) -> dict:
    """The rule over the item curves (``paired``) or over the same curves, each drop injected
    into the items first, with the items stripped (so both judge the same drops)."""
    seen = (lambda c: c) if paired else replay.without_items
    rule = AlertRule("rule", "regression", **settings)
    every = [[(i, i) for i in range(len(c.points))] for c in curves]
    clean = sum(bool(replay.alerts_fired(seen(c), e, rule)) for c, e in zip(curves, every, strict=True))
    detected = early = total = 0
    for seed in range(10):
        for curve, evaluations in zip(curves, every, strict=True):
            hit, start = replay.inject_regression(curve, random.Random(f"{seed}:{curve.name}"))
            alerts = replay.alerts_fired(seen(hit), evaluations, rule)
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
    for settings in RULES:
        name = ", ".join(f"{key} {value:g}" for key, value in settings.items())
        out[name] = {"paired": judge(curves, settings, paired=True), "unpaired": judge(curves, settings, paired=False)}
    emit(out)


if __name__ == "__main__":
    main()
