"""How ``bench/feedback_convergence.py`` judges a scenario's runs: each way against no feedback,
paired on the validation items, and against the synchronous baseline's time to its quality; then
the issue's targets."""

from __future__ import annotations

from pathlib import Path

WAYS = ("none", "sync", "async", "async-stop", "async-every")
"""No feedback, the synchronous baseline, then the asynchronous ways the targets judge."""


def seconds_to_match(run_dir: Path, row: dict, ref: tuple[Path, int]) -> float | None:
    """Seconds from the run's start until it knew a result as good as the checkpoint ``ref`` (run
    directory, step): not below it by 2 paired standard errors. None if never."""
    known = dict(row["known_at_s"])
    matched = [known[step] for step, _ in row["curve"] if as_good(paired(*ref, run_dir, step, row["metric"]))]
    return min(matched, default=None)


def as_good(d: dict) -> bool:
    return d["difference"] >= -2 * d["stderr"]


def paired(run_a: Path, step_a: int, run_b: Path, step_b: int, metric: str) -> dict:
    """``b - a`` on the validation items, with its paired standard error."""
    from areal_eval.evaluation.items import metric_scores, stored_items
    from areal_eval.paired import paired_difference

    a, _ = metric_scores(stored_items(run_a / "evals", step_a), metric)
    b, _ = metric_scores(stored_items(run_b / "evals", step_b), metric)
    d = paired_difference(a, b)
    return {"difference": round(d.difference, 4), "stderr": round(d.stderr, 4), "n": d.n}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def compare(rows: dict[str, dict], dirs: dict[str, Path]) -> dict:
    """Each way against ``none``: compute saved, and quality paired on the same items; and the wall
    time until it had a result as good as the model ``sync`` ends with, against ``sync``'s."""
    none, metric = rows["none"], rows["none"]["metric"]
    ref = (dirs["sync"], rows["sync"]["end"]["step"])
    sync_s = seconds_to_match(dirs["sync"], rows["sync"], ref)
    out = {}
    for way in WAYS[1:]:
        row = rows[way]
        out[way] = {
            "compute_saved": round(1 - row["train_cpu_s"] / none["train_cpu_s"], 3),
            "steps_saved": round(1 - row["steps"] / none["steps"], 3),
            "best_vs_none_best": paired(dirs["none"], none["best"]["step"], dirs[way], row["best"]["step"], metric),
            "end_vs_none_best": paired(dirs["none"], none["best"]["step"], dirs[way], row["end"]["step"], metric),
            "end_vs_none_end": paired(dirs["none"], none["end"]["step"], dirs[way], row["end"]["step"], metric),
            "wall_vs_sync": round(row["wall_s"] / rows["sync"]["wall_s"], 3),
            "to_sync_quality_s": (to := seconds_to_match(dirs[way], row, ref)),
            "to_sync_quality_vs_sync": _ratio(to, sync_s),
        }
    return out


def verdict(kind: str, way: str, compared: dict, rows: dict) -> dict:
    """The issue's targets, for an asynchronous ``way`` (2 paired standard errors decide "within"
    and "better")."""
    c = compared[way]
    checks = {}
    if kind in ("plateau", "overfit"):
        checks["compute_saved_20pct"] = c["compute_saved"] >= 0.2
        checks["best_within_error"] = as_good(c["best_vs_none_best"])
    if kind == "collapse":
        checks["ends_as_good_as_none_best"] = as_good(c["end_vs_none_best"])
        checks["ends_better_than_none_end"] = c["end_vs_none_end"]["difference"] > 2 * c["end_vs_none_end"]["stderr"]
    if kind == "healthy":
        acted = [d for d in rows[way]["directives"] if d["mode"] == "act" and d["action"] in ("stop", "rollback")]
        checks["no_destructive_action"] = not acted
        checks["best_no_worse"] = as_good(c["best_vs_none_best"])
    checks["less_wall_than_sync"] = c["to_sync_quality_vs_sync"] is not None and c["to_sync_quality_vs_sync"] < 1
    return checks


def targets_met(results: list[dict]) -> dict:
    """Of a scenario's runs, how many met each target, by way."""
    return {
        way: {check: sum(r["targets"][way][check] for r in results) for check in results[0]["targets"][way]}
        for way in WAYS[2:]
    }
