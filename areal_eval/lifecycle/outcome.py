"""What an evaluation attempt comes to, decided the same way on every path.

The in-flow loop (:class:`~areal_eval.lifecycle.follow_loop.FollowLoop`), the flow runs that
evaluate one checkpoint (``evaluate-checkpoint``: trigger, manual run, sweep) and the evaluation
service each finish an attempt with :func:`record_outcome`: it records the attempt in the run's
planner and ledger, judges it by the alert rules, and says what the caller still has to do
(deliver the result to the tracker, send the alerts, or nothing, as a transient failure left for
another attempt). Each then does it with :func:`follow_outcome`, in the same order on every
path, through its own :class:`AfterOutcome` (a Prefect task, a log line, its planner's queue).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Protocol

from areal_eval.alerts import Alert, AlertEngine
from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.disk import is_disk_full
from areal_eval.evaluation.jobs import EvalResult
from areal_eval.failures import is_bad_checkpoint, is_permanent
from areal_eval.feedback import Directive, FeedbackJudge
from areal_eval.lifecycle.planner import EvaluationPlanner
from areal_eval.runs.directives import Directives
from areal_eval.scheduling.policy import Decision


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One evaluation attempt of a checkpoint: its result, or the error it raised."""

    event: CheckpointEvent
    result: EvalResult | None = None
    error: BaseException | None = None
    probe: bool = False
    """The probe subset only (the scheduler chose a probe)."""

    def __post_init__(self):
        if (self.result is None) == (self.error is None):
            raise ValueError("an attempt has a result or an error, not both or neither")


@dataclasses.dataclass(frozen=True)
class Outcome:
    alerts: list[Alert]
    """What the alert rules fired: the caller sends them."""
    deliver: bool = False
    """The caller delivers the result (metrics, or a held probe as ``eval_probe/*``) to the
    tracker, then marks it delivered (``EvaluationPlanner.delivered``)."""
    retry: str | None = None
    """A transient failure, left scheduled for another attempt: its cause."""
    decision: Decision | None = None
    """A probe's verdict: held (skipped), or escalated to a full evaluation queued next."""
    looked_back: list[CheckpointEvent] = dataclasses.field(default_factory=list)
    """A skipped checkpoint this result made worth a look (``scheduler.look_back``), scheduled
    for the caller's ``owner`` and queued: the caller evaluates it next."""
    directives: list[Directive] = dataclasses.field(default_factory=list)
    """What the feedback rules asked of training with this result (issued in the run directory,
    where the trainer reads them): the caller says them."""


def record_outcome(
    planner: EvaluationPlanner,
    attempt: Attempt,
    alerts: AlertEngine,
    *,
    max_attempts: int = 1,
    logged_by_evaluator: bool = False,
    deleted: Collection[int] = (),
    owner: str | None = None,
    feedback: FeedbackJudge | None = None,
) -> Outcome:
    """Record ``attempt`` and judge it.

    A failure is failed for good when permanent, a bad checkpoint or the ``max_attempts``-th
    (``areal_eval.failures``), and only then alerted on; before that it is queued again. A full
    disk is raised with nothing recorded: the checkpoint stays scheduled for when there is room.
    A probe is held or escalated (no alert judges a probe). A result is judged against earlier steps.
    ``logged_by_evaluator``: the evaluation logged its own metrics (a dispatched deployment run,
    ``evaluate-checkpoint``), so there is nothing left to deliver. A result that looks back
    (:meth:`EvaluationPlanner.evaluated`) schedules that checkpoint for ``owner``, unless
    retention ``deleted`` it. The ``feedback`` rules then judge the run's results in step order,
    and what they call for that was not issued before is issued now, beside the ledger.
    """
    event, step = attempt.event, attempt.event.global_step
    if attempt.error is not None:
        exc = attempt.error
        if is_disk_full(exc):  # no attempt to record or retry: the run stops, the same command resumes it
            raise exc
        cause = f"probe failed: {exc}" if attempt.probe else str(exc)
        permanent, retried = is_permanent(exc), getattr(exc, "retried", [])
        if not planner.attempt_failed(
            event,
            cause,
            permanent=permanent,
            max_attempts=max_attempts,
            retried=retried,
            bad_checkpoint=is_bad_checkpoint(exc),
        ):
            return Outcome([], retry=cause)
        return Outcome(alerts.check(step, None, planner.ledger.latest(step).reason))
    result = attempt.result
    if attempt.probe:
        decision = planner.probed(event, result.probe_metrics)
        if decision.evaluate:
            return Outcome([], decision=decision)
        if logged_by_evaluator:
            planner.delivered(step)
        return Outcome([], deliver=not logged_by_evaluator, decision=decision)
    looked_back = planner.evaluated(
        event,
        result.metrics,
        delivered=logged_by_evaluator,
        probe_metrics=result.probe_metrics,
        notes=result.notes,
        retried=result.retried,
        deleted=deleted,
        owner=owner,
    )
    fired = alerts.check(step, result.metrics, final=event.final)
    return Outcome(
        fired,
        deliver=not logged_by_evaluator,
        looked_back=looked_back,
        directives=issue_directives(planner, feedback),
    )


def issue_directives(planner: EvaluationPlanner, feedback: FeedbackJudge | None) -> list[Directive]:
    """What the feedback rules call for on the run's evaluated results, issued once each: those
    that rest on the newest result, while training goes on. A late result of an older checkpoint
    (a look-back, a refinement, a sweep) steers nothing: training has moved past it."""
    if feedback is None or not feedback.active or any(e.final for e in planner.events()):
        return []
    results = [(e.step, e.metrics) for e in planner.ledger.entries() if e.status == "evaluated"]
    newest = max((step for step, _ in results), default=None)
    called = [d for d in feedback.directives(results) if d.steps[-1] == newest]
    return Directives(planner.ledger.path.parent).issue(called)


class AfterOutcome(Protocol):
    """How a path does what follows an outcome."""

    def look_back_at(self, event: CheckpointEvent) -> None:
        """A skipped checkpoint the result made worth a look, scheduled for this path: evaluate it next."""

    def record_failed_attempt(self, step: int) -> None:
        """The step's failed attempts so far, in the tracker (a failure of that is said, not raised)."""

    def warn(self, message: str) -> None: ...

    def say_decision(self, event: CheckpointEvent, decision: Decision) -> None:
        """A probe's verdict, or a look back's: in the path's log."""

    def deliver(self, event: CheckpointEvent, result: EvalResult, reason: str) -> None:
        """The result (a held probe's too) to the tracker, then marked delivered."""

    def send(self, alert: Alert) -> None: ...

    def say_directive(self, directive: Directive) -> None:
        """A directive issued (or recorded in shadow mode): in the path's log."""


def directive_line(directive: Directive) -> str:
    """A directive as every path logs it: ``feedback: lr_scale@40 (shadow): accuracy flat ...``."""
    return f"feedback: {directive.line()}"


def decision_line(event: CheckpointEvent, decision: Decision) -> str:
    """A decision as every path logs it: ``checkpoint step 40: skip (reason)``."""
    verdict = "probe" if decision.probe else "evaluate" if decision.evaluate else "skip"
    return f"checkpoint step {event.global_step}: {verdict} ({decision.reason})"


def follow_outcome(attempt: Attempt, outcome: Outcome, after: AfterOutcome, *, reason: str) -> None:
    """What follows an outcome (:func:`record_outcome`), the same on every path and in this order:
    the looked-back checkpoints queued, the failed attempts recorded, a retry or the result's notes
    said, a probe's verdict said, the result delivered (``reason``: its decision, unless a probe's
    verdict says otherwise), the alerts sent, the directives said."""
    step = attempt.event.global_step
    for event in outcome.looked_back:
        after.look_back_at(event)
    if attempt.error is not None or attempt.result.retried:
        after.record_failed_attempt(step)
    if outcome.retry is not None:
        after.warn(f"checkpoint step {step}: evaluation attempt failed, queued again: {outcome.retry}")
    elif attempt.result is not None and outcome.decision is None:
        for note in attempt.result.notes:
            after.warn(f"checkpoint step {step}: {note}")
    if outcome.decision is not None:
        after.say_decision(attempt.event, outcome.decision)
    if outcome.deliver:
        after.deliver(attempt.event, attempt.result, outcome.decision.reason if outcome.decision else reason)
    for alert in outcome.alerts:
        after.send(alert)
    for directive in outcome.directives:
        after.say_directive(directive)
