"""Probes judged paired on their items against probes judged on the two subset means.

    .venv/bin/python bench/paired_probes.py bench/curves/areal-demo.jsonl bench/curves/areal-demo-geometric.jsonl

Replays the item-level curves with injected regressions (seeds 0-9) under the adaptive
scheduler, without probes and with probes (``probe_fraction`` 0.2, ``probe_escalate_stderrs``
2): once with the items (a probe is judged on the paired difference of its items against the
same items of the last full evaluation, as the pipeline judges a run that keeps items) and once
with them stripped (the recorded subset means and their own errors). Prints, per policy, the
means over seeds of the replay's scores, as one JSON line.
"""

from __future__ import annotations

import statistics

from common import emit, item_curves_from_args

PROBES = "adaptive:probe_fraction=0.2,probe_escalate_stderrs=2"
KEEP = ("evaluations", "probes", "compute", "mean_tracking_error", "detection_delay", "frontier_ratio")


def mean_scores(curves, spec: str, use_items: bool = True) -> dict:
    from areal_eval.scheduling import replay

    policy = replay.parse_policy(spec)
    runs = [
        replay.replay(curves, [policy], regression=True, seed=s, use_items=use_items)["policies"][spec]
        for s in range(10)
    ]
    return {k: round(statistics.fmean(r[k] for r in runs), 3) for k in KEEP if k in runs[0]}


def main() -> None:
    curves = item_curves_from_args(__doc__.splitlines()[0])
    emit(
        {
            "benchmark": "paired_probes",
            "curves": len(curves),
            "adaptive, no probes": mean_scores(curves, "adaptive"),
            "probes judged on subset means": mean_scores(curves, PROBES, use_items=False),
            "probes judged paired on items": mean_scores(curves, PROBES),
        }
    )


if __name__ == "__main__":
    main()
