"""``areal-eval compare RUN STEP_A STEP_B``: two evaluations of one run, paired on their items.

For each evaluator whose per-item file both steps have, each score it keeps is compared on the
items both scored: the two means, their difference with its paired standard error and 95%
interval, the unpaired error beside it, and McNemar's exact p-value for 0/1 scores. The samples
of one prompt are clustered (their errors are computed over prompts).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from areal_eval.checkpoints.manifest import checkpoint_name, step_of_name
from areal_eval.evaluation.items import (
    SCORE_COLUMNS,
    items_dir,
    lm_eval_metrics,
    lm_eval_scores,
    metric_scores,
    read_items,
    scores_of,
    stored_items,
)
from areal_eval.paired import NoCommonItems, PairedDifference, paired_difference

EXTRA = {"lm_loss": {"nll": ("nll", None)}}
"""Per-item scores worth comparing that no metric is the mean of (lm_loss's is a ratio of sums)."""


@dataclasses.dataclass(frozen=True)
class Comparison:
    evaluator: str
    score: str
    result: PairedDifference


def step_items(run_dir: Path, step: int) -> Path:
    evals = run_dir / "evals"
    if not evals.is_dir():
        raise FileNotFoundError(f"{run_dir}: not a run directory with evaluations (no {evals})")
    directory = items_dir(evals / f"{checkpoint_name(step)}.json")
    if not directory.is_dir():
        kept = steps_with_items(evals)
        shown = ", ".join(map(str, kept)) if kept else "none"
        raise FileNotFoundError(
            f"step {step}: no per-item results in {directory} (not evaluated, or eval.items off); "
            f"steps of {run_dir} with items: {shown}"
        )
    return directory


def steps_with_items(evals_dir: Path) -> list[int]:
    """The steps whose evaluations left per-item files in ``evals_dir``, in order."""
    steps = (
        (step_of_name(directory.name.removesuffix(".items")), directory) for directory in evals_dir.glob("*.items")
    )
    return sorted(step for step, directory in steps if step is not None and any(directory.glob("*.parquet")))


def compare_steps(run_dir: str | Path, step_a: int, step_b: int) -> list[Comparison]:
    run_dir = Path(run_dir)
    dir_a, dir_b = step_items(run_dir, step_a), step_items(run_dir, step_b)
    out = []
    for path_a in sorted(dir_a.glob("*.parquet")):
        path_b = dir_b / path_a.name
        if not path_b.exists():
            continue
        evaluator = path_a.stem
        rows_a, rows_b = read_items(path_a), read_items(path_b)
        if not rows_a or not rows_b:
            continue
        if evaluator == "lm_eval":  # the harness's documents, by doc_id, per task and metric
            for metric in lm_eval_metrics(rows_a):
                a, b = lm_eval_scores(rows_a, metric), lm_eval_scores(rows_b, metric)
                if a and b:
                    what = f"steps {step_a} and {step_b} (lm_eval {metric})"
                    out.append(Comparison(evaluator, metric, paired_difference(a[0], b[0], what=what)))
            continue
        for score, (column, greedy) in {**SCORE_COLUMNS.get(evaluator, {}), **EXTRA.get(evaluator, {})}.items():
            a, clusters = scores_of(rows_a, column, greedy)
            b, _ = scores_of(rows_b, column, greedy)
            if not a or not b:
                continue  # greedy answers only: no sampled rows
            what = f"steps {step_a} and {step_b} ({evaluator} {score})"
            out.append(Comparison(evaluator, score, paired_difference(a, b, clusters, what=what)))
    if not out:
        raise ValueError(f"steps {step_a} and {step_b} of {run_dir}: no evaluator kept items at both")
    return out


def format_table(run_dir, step_a: int, step_b: int, comparisons: list[Comparison]) -> str:
    head = (
        f"{'evaluator':<14}{'score':<24}{'items':>6}{f'step {step_a}':>12}{f'step {step_b}':>12}"
        f"{'diff':>10}{'paired se':>11}{'95% interval':>22}{'unpaired se':>13}{'McNemar p':>11}"
    )
    lines = [f"{run_dir}: step {step_a} -> step {step_b}, paired on common items", head]
    for c in comparisons:
        r = c.result
        p = f"{r.mcnemar_p:.3g}" if r.mcnemar_p is not None else "-"
        items = f"{r.n}" + (f"/{r.clusters}" if r.clusters else "")
        interval = f"[{r.ci_low:+.4f}, {r.ci_high:+.4f}]"
        lines.append(
            f"{c.evaluator:<14}{c.score:<24}{items:>6}{r.mean_a:>12.4f}{r.mean_b:>12.4f}{r.difference:>+10.4f}"
            f"{r.stderr:>11.4f}{interval:>22}{r.unpaired_stderr:>13.4f}{p:>11}"
        )
    return "\n".join(lines)


def versus_previous_best(evals_dir: str | Path, previous: int, step: int, metric: str) -> dict[str, str]:
    """Tags for a new best checkpoint: how ``metric`` at ``step`` differs from the best before it
    (at ``previous``) on the items both scored, and whether the 95% interval of that paired
    difference excludes 0 (``distinguishable``: ``true``, ``false``, or ``unknown`` where either
    evaluation kept no items of the metric)."""
    tags = {"vs_previous_best.step": str(previous)}
    a, b = (
        metric_scores(stored_items(evals_dir, previous), metric),
        metric_scores(stored_items(evals_dir, step), metric),
    )
    try:
        r = paired_difference(a[0], b[0], a[1], what=f"steps {previous} and {step}") if a and b else None
    except NoCommonItems:
        r = None
    if r is None:
        return tags | {
            "vs_previous_best.distinguishable": "unknown",
            "vs_previous_best": f"over the best before it (step {previous}): no items of {metric} to pair",
        }
    distinct = r.ci_low > 0 or r.ci_high < 0
    verdict = "distinguishable" if distinct else "within the noise"
    return tags | {
        "vs_previous_best.difference": f"{r.difference:+.6g}",
        "vs_previous_best.paired_stderr": f"{r.stderr:.6g}",
        "vs_previous_best.ci95": f"[{r.ci_low:+.6g}, {r.ci_high:+.6g}]",
        "vs_previous_best.distinguishable": str(distinct).lower(),
        "vs_previous_best": (
            f"{r.difference:+.4g} (paired stderr {r.stderr:.2g}, on {r.n} items) over the best before it "
            f"(step {previous}): {verdict}"
        ),
    }
