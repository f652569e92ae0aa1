"""What the feedback rules would have asked of training on a recorded curve: shadow mode, offline.

A policy's evaluations are judged in the order they happened, as the pipeline issues directives
(:func:`areal_eval.lifecycle.outcome.issue_directives`): each arrival, the rules read every result
so far in step order, and a directive counts when it rests on the newest result, before the final
checkpoint is out. Nothing follows a stop. ``shadow`` counts as acted: it is what the rule would
have done.
"""

from __future__ import annotations

import dataclasses
import statistics

from areal_eval.feedback import FeedbackConfig, FeedbackJudge
from areal_eval.scheduling.curves import Curve

ACTIONS = ("lr_scale", "rollback", "stop")


def acted(curve: Curve, evaluations: list[tuple[int, int]], cfg: FeedbackConfig) -> list[tuple[str, int, int]]:
    """``(action, checkpoint index, when)`` of each directive the rules would have issued on
    ``evaluations`` (``(checkpoint index, when evaluated)``)."""
    by_step = {p.step: p for p in curve.points}

    def items(step: int, metric: str):
        scores = by_step[step].items
        return None if scores is None else (dict(enumerate(scores)), None)

    judge = FeedbackJudge(
        dataclasses.replace(cfg, metric=None, higher_is_better=None),
        metric="value",
        higher_is_better=curve.higher_is_better,
        items=items,
    )
    last = len(curve.points) - 1
    results, issued, out = [], set(), []
    for index, when in sorted(evaluations, key=lambda e: (e[1], e[0])):
        if when >= last:  # the final checkpoint is out: training is over
            break
        point = curve.points[index]
        results.append((point.step, {"value": point.value, "value_stderr": point.stderr}))
        newest = max(step for step, _ in results)
        for directive in judge.directives(results):
            if directive.steps[-1] == newest and directive.id not in issued:
                issued.add(directive.id)
                out.append((directive.action, index, when))
        if any(action == "stop" for action, _, _ in out):
            break
    return out


def feedback_scores(runs: list[tuple[Curve, int | None, list[tuple[str, int, int]]]]) -> dict:
    """Over curves ``(curve, where an injected drop starts or None, what was acted)``, for each
    action: the curves it acted on (per 100), how far into the curve it first acted (a share of
    the curve; what follows is the training it would change or save), and, where drops were
    injected, the share of curves it acted on within 2 checkpoints after the drop began."""
    scores = {}
    for action in ACTIONS:
        firsts, on_drop = [], 0
        for curve, start, done in runs:
            whens = [when for a, _, when in done if a == action]
            if whens:
                firsts.append(min(whens) / max(1, len(curve.points) - 1))
            on_drop += start is not None and any(start <= when <= start + 2 for when in whens)
        row = {"acted_per_100_curves": round(100 * len(firsts) / len(runs), 2)}
        if firsts:
            row["mean_first_at"] = round(statistics.fmean(firsts), 4)
        if any(start is not None for _, start, _ in runs):
            row["acted_within_2_of_drop"] = round(on_drop / len(runs), 4)
        scores[action] = row
    return scores
