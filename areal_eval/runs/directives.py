"""Directives from evaluation to training: durable, answered, applied once by their id.

The pipeline issues a directive when a feedback rule (:mod:`areal_eval.feedback`) fires on the
evaluation results: a line of ``directives.jsonl`` in the run directory, beside the stop request,
so a trainer needs no server and a restart of either side loses nothing. The trainer's rank 0
looks at the file at a step boundary (one ``stat`` while nothing changed), every rank agrees on
what it found, the trainer applies it and answers in ``directive_answers.jsonl``: applied at
step S, or refused with a one-line reason.

An answer counts for the training state it was made in. A trainer that resumes from a
checkpoint saved before the step of an answer lost what the directive changed, and applies it
again (``resumed_at``): each directive is applied once in the training that goes on. A
directive in ``shadow`` mode is recorded for what it would have done, and never applied.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from areal_eval.feedback import Directive
from areal_eval.runs.directory import RunDir, file_lock
from areal_eval.runs.ledger import Ledger

DIRECTIVES = "directives.jsonl"
WAITING = "waiting for the trainer"
"""A directive's outcome until the trainer answers."""
ANSWERS = "directive_answers.jsonl"


@dataclasses.dataclass(frozen=True)
class Answer:
    """The trainer's answer to a directive."""

    id: str
    step: int
    """The training step at whose end it was applied or refused."""
    applied: bool
    reason: str = ""
    """Why it was refused (empty when applied)."""
    at: float = 0.0

    def line(self) -> str:
        return f"{self.id}: applied at step {self.step}" if self.applied else f"{self.id}: refused: {self.reason}"


def _read(path: Path) -> list[dict]:
    """The complete lines of a JSONL file (a torn last line, from a crash mid-append, is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _append(path: Path, row: dict) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(row, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


class Directives:
    """A run's directives and their answers, in its directory."""

    def __init__(self, run_root: str | Path):
        self.root = Path(run_root)
        self.path, self.answers_path = self.root / DIRECTIVES, self.root / ANSWERS

    def issue(self, directives: list[Directive]) -> list[Directive]:
        """Record those not recorded yet (by id), in order; returns them."""
        if not directives:
            return []
        with file_lock(self.root / "directives.lock"):
            known = {row.get("id") for row in _read(self.path)}
            new = [d for d in directives if d.id not in known]
            for d in new:
                _append(self.path, dataclasses.asdict(dataclasses.replace(d, made_at=d.made_at or time.time())))
        return new

    def all(self) -> list[Directive]:
        return [Directive.from_json(row) for row in _read(self.path)]

    def answers(self) -> list[Answer]:
        return [Answer(**row) for row in _read(self.answers_path)]

    def answer(self, answer: Answer) -> None:
        _append(self.answers_path, dataclasses.asdict(dataclasses.replace(answer, at=answer.at or time.time())))

    def pending(self, resumed_at: int | None = None) -> list[Directive]:
        """Directives to apply: in ``act`` mode, with no answer that still holds (a refusal always
        holds; an application holds unless made after ``resumed_at``, the step of the checkpoint
        training resumed from)."""
        done = {a.id for a in self.answers() if not a.applied or resumed_at is None or a.step <= resumed_at}
        return [d for d in self.all() if d.mode == "act" and d.id not in done]


class Inbox:
    """A trainer's side of the channel: at each step boundary, the directives to apply now, the
    same on every rank, and the answers, written by rank 0."""

    def __init__(self, run_root: str | Path, *, resumed_at: int = 0):
        self.box = Directives(run_root)
        self.resumed_at = resumed_at
        self._seen: tuple[float, int] | None = None
        self._taken: set[str] = set()

    def waiting(self) -> bool:
        """On rank 0: a directive is waiting (one ``stat`` while the file is unchanged)."""
        try:
            stat = self.box.path.stat()
        except FileNotFoundError:
            return False
        if (stat.st_mtime, stat.st_size) == self._seen:
            return False
        found = [d for d in self.box.pending(self.resumed_at) if d.id not in self._taken]
        if not found:
            self._seen = (stat.st_mtime, stat.st_size)
        return bool(found)

    def agree(self, waiting: bool) -> list[Directive]:
        """The directives to apply at this step, on every rank alike (collective when ``waiting``,
        which every rank must pass the same: reduce rank 0's :meth:`waiting` first)."""
        if not waiting:
            return []
        from areal_eval import distributed  # torch: only trainers, never the flows, import it

        found = None
        if distributed.rank() == 0:
            found = [d for d in self.box.pending(self.resumed_at) if d.id not in self._taken]
        found = distributed.broadcast_object(found) if distributed.world_size() > 1 else found
        self._taken.update(d.id for d in found)
        return found

    def take(self) -> list[Directive]:
        """:meth:`waiting` and :meth:`agree` in one, for a loop with no reduce of its own."""
        from areal_eval import distributed

        here = 1.0 if distributed.rank() == 0 and self.waiting() else 0.0
        return self.agree(distributed.all_reduce_max_scalar(here) > 0)

    def answer(self, directive: Directive, step: int, refused: str | None = None) -> Answer:
        """Rank 0 records the answer; returns it (every rank may call it: only rank 0 writes)."""
        from areal_eval import distributed

        answer = Answer(directive.id, step, applied=refused is None, reason=refused or "")
        if distributed.rank() == 0:
            self.box.answer(answer)
        return answer


def scale_learning_rate(directive: Directive, optimizer, scheduler=None) -> str | None:
    """Apply an ``lr_scale`` directive: every parameter group's learning rate times its factor,
    and the scheduler's base rates too, so the schedule goes on from the lower level (and a
    checkpoint of the scheduler keeps it). Returns why it was refused, or None."""
    factor = directive.args.get("factor")
    if not isinstance(factor, (int, float)) or not 0 < factor:
        return f"factor {factor!r} is not a positive number"
    multiply_learning_rate(optimizer, scheduler, factor)
    return None


def multiply_learning_rate(optimizer, scheduler, factor: float) -> None:
    """Every parameter group's learning rate, and the scheduler's base rates, times ``factor``."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]


def apply_directive(
    directive: Directive, optimizer, scheduler=None, *, who: str = "this trainer", roll_back=None
) -> tuple[str | None, bool]:
    """What a trainer does with a directive: ``(why it was refused or None, whether training
    stops here)``. ``roll_back(to_step)`` restores the checkpoint of ``to_step`` (weights,
    optimizer, schedule, data position) and returns why it could not, or None; a trainer without
    it refuses rollbacks. After a rollback the learning rate is scaled as ``lr_scale`` would."""
    if directive.action == "stop":
        return None, True
    if directive.action == "lr_scale":
        return scale_learning_rate(directive, optimizer, scheduler), False
    if directive.action == "rollback" and roll_back is not None:
        refused = roll_back(int(directive.args["to_step"]))
        return refused or scale_learning_rate(directive, optimizer, scheduler), False
    return f"{directive.action} is not supported by {who}", False


def rollback_targets(run_root: str | Path) -> set[int]:
    """Steps that rollbacks training has yet to answer go back to: retention keeps them."""
    return {int(d.args["to_step"]) for d in Directives(run_root).pending() if d.action == "rollback"}


def evaluation_results(run_root: str | Path) -> list[tuple[int, dict]]:
    """The run's evaluated checkpoints so far, in step order: ``(step, metrics)``, each metric with
    its standard error beside it. For a trainer that acts on them itself (a data mix, a KL
    coefficient); cheap enough to call at every save."""
    ledger = Ledger(RunDir(run_root).ledger)
    return [(e.step, dict(e.metrics)) for e in ledger.entries() if e.status == "evaluated"]


def directive_records(run_root: str | Path) -> list[dict]:
    """Each directive of the run with what came of it, for the run's record (the MLflow table,
    the summary): ``not applied (shadow mode)``, the trainer's latest answer (``applied at step
    S``, ``refused: ...``), or ``waiting for the trainer``."""
    box = Directives(run_root)
    answers = {a.id: a for a in box.answers()}  # the latest answer of each
    rows, published = [], None
    for d in box.all():
        if d.mode == "shadow":
            outcome = "not applied (shadow mode)"
        elif d.id in answers:
            outcome = answers[d.id].line().split(": ", 1)[1]
            if d.action == "rollback" and answers[d.id].applied:
                published = published or [e.step for e in Ledger(RunDir(run_root).ledger).entries()]
                gone = [s for s in published if int(d.args["to_step"]) < s < answers[d.id].step]
                outcome += f"; abandoned (on record): checkpoints {', '.join(map(str, gone))}" if gone else ""
        else:
            outcome = WAITING
        rows.append(
            {
                "id": d.id,
                "action": d.action,
                "mode": d.mode,
                "steps": list(d.steps),
                "reason": d.reason,
                "outcome": outcome,
            }
        )
    return rows
