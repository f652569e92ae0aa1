"""What a plateau costs any policy whose detection delay stays near 1 checkpoint: adaptive against
the fixed-interval frontier on curves that do not move at all.

    .venv/bin/python bench/plateau_floor.py [--curves 40] [--checkpoints 30] [--items 400]

Each curve is a constant accuracy (0.7) scored on ``--items`` 0/1 items drawn afresh at every
checkpoint, so every change between two results is noise. A regression on such a curve shows
nothing beforehand, so a policy sees it only by looking: seeing it at most 2 checkpoints late
(1 on average) means evaluating every 3rd checkpoint, which is fixed:3, and the tracking error
of each skipped checkpoint is the noise between two results whatever the policy. Replays
adaptive (as shipped, without its look-back after a suspected regression, and without its
end-of-run refinement too) and fixed:1-4 and prints their
evaluations, tracking error and frontier ratio, and one JSON line.

Every change on such a curve is noise, so every alert is false: it also prints, for adaptive and
fixed:1, on how many of 100 curves the default regression rule (``NOISE_AWARE_REGRESSION``) and
the same with ``stderrs`` 2.5 and 3 fire (``false_alerts_per_100_curves``).
"""

from __future__ import annotations

import argparse
import random

from common import emit

from areal_eval.alerts import NOISE_AWARE_REGRESSION, AlertRule
from areal_eval.scheduling import replay
from areal_eval.scheduling.curves import Curve, Point


def plateau_curves(count: int, checkpoints: int, items: int, seed: int = 0) -> list[Curve]:
    rng = random.Random(seed)
    curves = []
    for c in range(count):
        points = []
        for i in range(checkpoints):
            scores = tuple(1.0 if rng.random() < 0.7 else 0.0 for _ in range(items))
            value = sum(scores) / items
            points.append(Point(10 * i, value, (value * (1 - value) / (items - 1)) ** 0.5, items=scores))
        curves.append(Curve(f"plateau-{c}", True, tuple(points)))
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", type=int, default=40)
    parser.add_argument("--checkpoints", type=int, default=30)
    parser.add_argument("--items", type=int, default=400)
    args = parser.parse_args()
    curves = plateau_curves(args.curves, args.checkpoints, args.items)
    names = [
        "adaptive",
        "adaptive:look_back=0",
        "adaptive:look_back=0,refine_stderrs=null",
        "fixed:1",
        "fixed:2",
        "fixed:3",
        "fixed:4",
    ]
    rules = [
        AlertRule(f"stderrs {k:g}", "regression", **(NOISE_AWARE_REGRESSION | {"stderrs": k})) for k in (2.0, 2.5, 3.0)
    ]
    rows = replay.replay(curves, [replay.parse_policy(n) for n in names], alert_rules=rules)["policies"]
    out = {}
    for name in names:
        row = rows[name]
        out[name] = {k: row[k] for k in ("evaluations", "mean_tracking_error", "frontier_ratio") if k in row}
        if name in ("adaptive", "fixed:1"):
            out[name]["false_alerts_per_100_curves"] = {
                rule: fired["false_alerts_per_100_curves"] for rule, fired in row["alerts"].items()
            }
        print(f"{name:30s} " + ", ".join(f"{k} {v}" for k, v in out[name].items()))
    emit(out)


if __name__ == "__main__":
    main()
