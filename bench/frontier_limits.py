"""What the adaptive policy could save at all, given the detection delay it must keep.

    .venv/bin/python bench/frontier_limits.py [--scan] [CURVES ...]   (default: the shared Pythia curves and ours)

Issue #31 asks adaptive for at most 0.6 of the fixed frontier's compute at equal tracking error
with a detection delay of at most 1. Per curve set, over injection seeds 0-9, this prints
adaptive's compute, tracking error and delay, the fixed frontier's compute at that error, the
clairvoyant floor at that error (``oracle_compute``, no delay asked) and the floor for any
policy that also keeps a mean delay of at most 1 (``delay_bounded_compute``), each as a ratio
to the frontier. Where the delay-bounded floor lies far below 0.6 of the frontier, the delay
does not stop the target; what stops it is knowing where the curve moves before evaluating.
``--scan`` adds, for injection seed 0, that floor over the frontier at other tracking errors
(``floor_ratio_at_tracking_error``): where a policy could best operate.
"""

from __future__ import annotations

import argparse
import statistics

from common import ROOT, emit

from areal_eval.scheduling.curves import read_curves
from areal_eval.scheduling.oracle import delay_bounded_compute
from areal_eval.scheduling.replay import as_replayed, fixed_frontier_compute, parse_policy, replay

SEEDS = range(10)
SCAN = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0)


def scan(curves) -> dict:
    """The delay-bounded floor over the fixed frontier at each tracking error of ``SCAN`` (seed 0)."""
    replayed, fixed = [curve for curve, _ in as_replayed(curves, True, 0)], {}
    return {
        str(error): round(
            delay_bounded_compute(replayed, error, 1.0)
            / fixed_frontier_compute(curves, error, regression=True, seed=0, fixed=fixed),
            3,
        )
        for error in SCAN
    }


def limits(path, with_scan: bool = False) -> dict:
    curves = read_curves(path)
    rows = []
    for seed in SEEDS:
        row = replay(curves, [parse_policy("adaptive")], regression=True, seed=seed)["policies"]["adaptive"]
        replayed = [curve for curve, _ in as_replayed(curves, True, seed)]
        floor = delay_bounded_compute(replayed, row["mean_tracking_error"], 1.0)
        rows.append(row | {"delay_bounded_compute": floor, "delay_bounded_ratio": floor / row["frontier_compute"]})

    def mean(key: str, digits: int = 3) -> float:
        return round(statistics.fmean(r[key] for r in rows), digits)

    return {
        "curves": str(path),
        "count": len(curves),
        "adaptive_compute": mean("compute", 1),
        "tracking_error": mean("mean_tracking_error"),
        "detection_delay": mean("detection_delay"),
        "frontier_compute": mean("frontier_compute", 1),
        "frontier_ratio": mean("frontier_ratio"),
        "oracle_ratio": mean("oracle_ratio"),
        "delay_bounded_ratio": mean("delay_bounded_ratio"),
    } | ({"floor_ratio_at_tracking_error": scan(curves)} if with_scan else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = [
        ROOT.parent / "shared" / "data" / "curves" / "pythia-v0.jsonl",
        *sorted((ROOT / "bench" / "curves").glob("*.jsonl")),
    ]
    parser.add_argument("--scan", action="store_true", help="the floor at other tracking errors too (seed 0)")
    parser.add_argument("curves", nargs="*", default=[p for p in default if p.exists()])
    args = parser.parse_args()
    for path in args.curves:
        emit({"benchmark": "frontier_limits", **limits(path, args.scan)})


if __name__ == "__main__":
    main()
