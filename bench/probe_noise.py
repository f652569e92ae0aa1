"""Check replay's model of probe noise against subset results recorded on real checkpoints.

    .venv/bin/python bench/probe_noise.py [bench/curves/areal-demo.jsonl ...]

Replay simulates a probe (an evaluation on a fixed fraction f of the validation set) as the full
value plus independent Gaussian noise of ``se * sqrt(1/f - 1)`` (``areal_eval/scheduling/
probes.py``). ``bench/record_curves.py`` records, for every checkpoint, the full result and the
result on a fixed subset. Per curve set this prints:

* ``offset_sd``: the standard deviation of (subset - full) / (se * sqrt(1/f - 1)); the model: 1.
* ``offset_lag1_correlation``: the correlation of (subset - full) between neighbouring
  checkpoints; the model: 0 (independent). Near 1, the subset's items keep it off the full value
  by the same amount from checkpoint to checkpoint: the offset cancels when a probe is compared
  with the previous subset result, and real probes are less noisy than the model's.
* ``paired_sd``: the standard deviation of the probe's comparison error, (sub_i - sub_j) -
  (full_i - full_j) for neighbours, over what the model predicts for it; the model: 1.
"""

from __future__ import annotations

import argparse
import math
import statistics

from common import ROOT, emit

from areal_eval.scheduling.curves import read_curves


def check(path) -> dict:
    curves = [c for c in read_curves(path) if c.subset_fraction]
    if not curves:
        raise SystemExit(f"{path}: no curve has subset values (record them with bench/record_curves.py)")
    offsets, pairs, comparisons = [], [], []
    for curve in curves:
        scale = math.sqrt(1 / curve.subset_fraction - 1)
        z = [(p.subset[0] - p.value) / (p.stderr * scale) for p in curve.points]
        offsets += z
        pairs += list(zip(z, z[1:], strict=False))
        for a, b in zip(curve.points, curve.points[1:], strict=False):
            error = (b.subset[0] - a.subset[0]) - (b.value - a.value)
            comparisons.append(error / (math.hypot(a.stderr, b.stderr) * scale))
    return {
        "curves": str(path),
        "points": len(offsets),
        "subset_fractions": sorted({c.subset_fraction for c in curves}),
        "offset_sd": round(statistics.pstdev(offsets), 3),
        "offset_lag1_correlation": round(statistics.correlation(*zip(*pairs, strict=True)), 3),
        "paired_sd": round(statistics.pstdev(comparisons), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = [ROOT / "bench" / "curves" / name for name in ("areal-demo.jsonl", "areal-demo-geometric.jsonl")]
    parser.add_argument("curves", nargs="*", default=default)
    args = parser.parse_args()
    for path in args.curves:
        emit({"benchmark": "probe_noise", **check(path)})


if __name__ == "__main__":
    main()
