"""Checkpoint retention: keep the last K and the best N, never one still waiting for evaluation.

The skipped neighbours of the best are kept too: the scheduler's end-of-run refinement may still
evaluate them.

A pure decision over the manifest and the ledger, so it is tested without a store; the flow
deletes what it returns and records each deletion (MLflow tag ``deleted.<step>``), which the
sweep reads so it never tries to evaluate a deleted checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.config.parsing import AT_LEAST_1, NON_NEGATIVE, Ranges, check_ranges
from areal_eval.runs.ledger import FINAL_STATES, LedgerEntry


@dataclasses.dataclass
class RetentionConfig:
    keep_last: int | None = None
    """Keep the newest K checkpoints; None keeps every checkpoint (retention off)."""
    keep_best: int = 1
    """Also keep the N best evaluated checkpoints by the scheduler's metric."""

    RANGES: ClassVar[Ranges] = {"keep_last": AT_LEAST_1, "keep_best": NON_NEGATIVE}

    def __post_init__(self):
        check_ranges(self, self.RANGES)


def checkpoints_to_delete(
    checkpoints: list[CheckpointEvent],
    ledger: dict[int, LedgerEntry],
    cfg: RetentionConfig,
    *,
    metric: str,
    higher_is_better: bool = True,
    deleted: set[int] = frozenset(),
    kept: set[int] = frozenset(),
) -> list[CheckpointEvent]:
    """The checkpoints retention may delete now, oldest first.

    Kept: the newest ``keep_last``; the ``keep_best`` best evaluated (at least the best) and their
    unevaluated neighbours; every checkpoint whose evaluation is not settled (no ledger entry
    yet, or scheduled/in flight); the final one; ``kept`` (a rollback's target training has not
    answered yet).
    """
    if cfg.keep_last is None:
        return []
    by_step = {c.global_step: c for c in checkpoints}
    steps = sorted(by_step)
    keep = set(steps[-cfg.keep_last :])
    scored = [
        (e.metrics[metric], step)
        for step, e in ledger.items()
        if e.status == "evaluated" and isinstance(e.metrics.get(metric), (int, float))
    ]
    scored.sort(reverse=higher_is_better)
    best = {step for _, step in scored[: max(1, cfg.keep_best)]}
    keep |= {step for _, step in scored[: cfg.keep_best]}
    for i, step in enumerate(steps):  # refinement candidates
        if step in best:
            keep |= {
                s for s in steps[max(0, i - 1) : i + 2] if s in ledger and ledger[s].status in ("skipped", "superseded")
            }
    keep |= {s for s in steps if s not in ledger or ledger[s].status not in FINAL_STATES}
    keep |= {s for s in steps if by_step[s].final} | set(kept)
    return [by_step[s] for s in steps if s not in keep and s not in deleted]
