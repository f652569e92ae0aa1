"""Does training's own metric help the scheduler? The adaptive policy replayed with and without
``scheduler.train_metric`` on recorded curves that carry each checkpoint's training rows.

    .venv/bin/python bench/train_signal.py [bench/curves/train-signal.jsonl] [--metric loss]

For each curve, replayed from 3 phases (0, 1 or 2 of its first checkpoints after step 0 left
out, so that the schedule meets the collapse at each place of its cover bound's cycle): the
evaluations each way (compute), and, where the curve collapses (a curve of
``record_curves.py --preset collapse``: its learning rate raised at ``--jump-at``), how many
checkpoints after the jump the first evaluation came (detection delay; 0: the first checkpoint
at or after it was evaluated). Healthy curves show what the signal costs (evaluations it adds,
each a false alarm there). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from common import ROOT, emit


def delay(chosen: list[int], steps: list[int], jump_at: int) -> int | None:
    """Checkpoints from the first one at or after ``jump_at`` to the first evaluated there."""
    start = next((i for i, s in enumerate(steps) if s >= jump_at), None)
    if start is None:
        return None
    return min((i for i in chosen if i >= start), default=len(steps) - 1) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("curves", nargs="?", default=str(ROOT / "bench" / "curves" / "train-signal.jsonl"))
    parser.add_argument("--metric", default="loss", help="the training metric the scheduler reads")
    parser.add_argument("--jump-at", type=int, default=300, help="the step the collapse curves' learning rate jumped")
    args = parser.parse_args()
    from areal_eval.scheduling.curves import read_curves
    from areal_eval.scheduling.replay import parse_policy

    blind, told = parse_policy("adaptive"), parse_policy(f"adaptive:train_metric={args.metric}")
    rows = []
    for whole in read_curves(Path(args.curves)):
        for phase in range(3):  # the first checkpoints after step 0 left out: the schedule's phase shifts
            curve = dataclasses.replace(whole, points=whole.points[:1] + whole.points[1 + phase :])
            steps = [p.step for p in curve.points]
            row = {"curve": curve.name, "phase": phase, "checkpoints": len(steps)}
            for name, policy in (("blind", blind), ("told", told)):
                chosen = sorted({i for i, _ in policy.select(curve)})
                row[f"{name}_evaluations"] = len(chosen)
                if "collapse" in curve.name:
                    row[f"{name}_delay"] = delay(chosen, steps, args.jump_at)
            rows.append(row)
    collapsed = [r for r in rows if "blind_delay" in r]
    healthy = [r for r in rows if "blind_delay" not in r]

    def both(key: str, of: list[dict]) -> dict:
        ways = ("blind", "told")
        return {way: round(statistics.fmean(r[f"{way}_{key}"] for r in of), 3) if of else None for way in ways}

    emit(
        {
            "benchmark": "train_signal",
            "curves": args.curves,
            "metric": args.metric,
            "collapse_delay_checkpoints": both("delay", collapsed),
            "collapse_evaluations": both("evaluations", collapsed),
            "healthy_evaluations": both("evaluations", healthy),
            "per_curve": rows,
        }
    )


if __name__ == "__main__":
    main()
