"""The follow / decide / evaluate / record loop of one training run, without Prefect.

The loop follows the run's manifest (decisions are made in a :class:`DecisionThread` the moment a
checkpoint is durable), starts the chosen evaluations, collects them in any order, records and
alerts on each result, ships training metrics, and applies retention, until the final
checkpoint and the end-of-run refinement are handled. What it does outside itself goes through
a :class:`LoopIO`: the ``train-and-evaluate`` flow backs it with Prefect tasks, a benchmark or a
test with plain calls, so every path runs the same loop.

Faults on the side never end the loop. Results and training metrics reach the tracker through a
:class:`~areal_eval.lifecycle.delivery.Deliverer` in a thread of its own, retried with backoff while MLflow
is unreachable (and after a restart, from the ledger); an alert that cannot be sent is warned
about (the alert task retries it first). The loop goes on deciding and evaluating meanwhile.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from areal_eval.alerts import Alert, AlertEngine
from areal_eval.checkpoints.manifest import CheckpointEvent, Manifest
from areal_eval.checkpoints.retention import RetentionConfig, checkpoints_to_delete
from areal_eval.evaluation.jobs import EvalResult
from areal_eval.feedback import Directive, FeedbackJudge
from areal_eval.lifecycle.decision_thread import DecisionThread
from areal_eval.lifecycle.delivery import Deliverer, Notifier
from areal_eval.lifecycle.followers import JsonlFollower, ManifestFollower
from areal_eval.lifecycle.outcome import Attempt, decision_line, follow_outcome, record_outcome
from areal_eval.lifecycle.planner import EvaluationPlanner
from areal_eval.runs.directives import rollback_targets
from areal_eval.runs.ledger import Ledger
from areal_eval.scheduling.policy import Decision


class EvaluationHandle(Protocol):
    """An evaluation under way (a ``concurrent.futures.Future`` is one)."""

    def done(self) -> bool: ...

    def result(self) -> EvalResult:
        """The result; raises the evaluation's error if it failed."""


class TrainingJob(Protocol):
    def poll(self) -> int | None: ...

    def wait(self, timeout_s: float) -> int: ...

    def raise_for_status(self, what: str) -> None: ...


class LoopIO(Protocol):
    """The loop's effects. Each call may be slow (a Prefect task, an MLflow request); none is
    on the decision path, which runs in its own thread."""

    def announce(self, event: CheckpointEvent) -> None:
        """A new durable checkpoint (emit its event for automations and the UI)."""

    def submit(self, event: CheckpointEvent, reason: str, probe: bool = False) -> EvaluationHandle:
        """Start evaluating ``event`` (``probe``, passed only with probes on: on the probe subset
        only); returns at once."""

    def log_result(self, result: EvalResult, reason: str) -> None:
        """Record a finished evaluation (metrics at its own step; a probe's as ``eval_probe/*``)."""

    def send_alert(self, alert: Alert) -> None:
        """Notify (from a notifier thread: it may be slow, it never holds up the loop)."""

    def log_failed_attempt(self, step: int) -> None:
        """Record the failed attempts of ``step`` so far (the ledger has them) in the tracker."""

    def log_training(self, rows: list[dict]) -> None:
        """Ship training-log rows; raising keeps them for the next flush. Called from the
        delivery thread, as is ``log_result``."""

    def delete_checkpoints(self, events: list[CheckpointEvent]) -> None:
        """Delete what retention lets go, and record it."""

    def say_directive(self, directive: Directive) -> None:
        """A directive issued (kept in the run directory already): in the log and the UI."""

    def info(self, message: str) -> None: ...

    def warn(self, message: str) -> None: ...


@dataclasses.dataclass
class LoopConfig:
    poll_interval_s: float = 0.5
    """Longest wait for a new decision before the loop looks at evaluations and training again."""
    train_log_every_s: float = 5.0
    """Training rows are shipped in one flush this often (and once the final checkpoint is in)."""
    slots: int = 1
    """Evaluations in flight at once; waiting checkpoints coalesce only when every slot is busy."""
    results_logged_by_evaluator: bool = False
    """The evaluation logs its own result to the tracker (a dispatched deployment run); the loop
    still records it and puts it through the alert rules."""
    retention: RetentionConfig | None = None
    """Delete checkpoints as they settle; None keeps all."""
    delivery_timeout_s: float = 60.0
    """Once the run is handled, how long to keep trying to deliver to an unreachable tracker; what
    is left is delivered by the next run of the same command."""
    external_timeout_s: float | None = None
    """Training runs elsewhere (no job to watch): wait up to this long for each next checkpoint,
    and take training metrics from the checkpoints' ``train_metrics``. None: without a training
    job the manifest must already hold the final checkpoint."""
    max_attempts: int = 1
    """Evaluation attempts of one checkpoint before a transient failure is recorded ``failed``
    (``eval.max_attempts``); a permanent failure is failed at once (``areal_eval.failures``)."""
    refined: bool = False
    """The run was refined and ended before (its evaluation state says so) and no training can add to it:
    a re-run only reports. Refining again could evaluate more, since a refined neighbour that ties
    the best becomes the best, with neighbours of its own; every other path refines once too."""


@dataclasses.dataclass
class _InFlight:
    event: CheckpointEvent
    handle: EvaluationHandle
    reason: str
    probe: bool = False


def _favour_the_decision_thread() -> None:
    """Keep durable->decision in milliseconds while this thread is busy in MLflow calls.

    The loop's process orchestrates: its work is I/O and library calls, and the one thread whose
    latency counts is the decision thread. Two interpreter settings stood in its way (measured by
    ``bench/scale.py``): full garbage collections, which stop every thread and scanned a heap
    that holds torch, MLflow and Prefect for 50-500 ms, and the 5 ms GIL switch interval, paid at
    each of a decision's few GIL handovers. What exists now (imports, config) lives as long as
    the process, so it is frozen out of collections (after one last collection, so no garbage is
    kept), and the switch interval drops to 1 ms.
    """
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))


class FollowLoop:
    """One run's loop; :meth:`run` returns the ledger once everything is handled."""

    def __init__(
        self,
        planner: EvaluationPlanner,
        manifest: Manifest,
        train_log: Path,
        alerts: AlertEngine,
        io: LoopIO,
        cfg: LoopConfig | None = None,
        training: TrainingJob | None = None,
        on_iteration: Callable[[float], None] | None = None,
        run_id: str | None = None,
        feedback: FeedbackJudge | None = None,
    ):
        cfg = cfg or LoopConfig()
        if cfg.slots < 1:
            raise ValueError("slots must be >= 1")
        self.planner, self.manifest, self.alerts, self.io, self.cfg = planner, manifest, alerts, io, cfg
        self.feedback = feedback
        self.follower = ManifestFollower(manifest, run_id)
        """Entries of another run (``run_id`` given) and torn lines are skipped and warned about."""
        self.train_log = JsonlFollower(train_log)
        self.training = training
        self.on_iteration = on_iteration
        self.in_flight: list[_InFlight] = []
        self.deleted: set[int] = set()
        self.delivery: Deliverer | None = None
        self.notifier: Notifier | None = None

    def run(self) -> Ledger:
        _favour_the_decision_thread()
        self.delivery = Deliverer(
            self.io.log_result,
            self.io.log_training,
            self.io.warn,
            lambda result: self.planner.delivered(result.global_step),
            self.cfg.train_log_every_s,
        )
        self.notifier = Notifier(self.io.send_alert, self.io.warn)
        for problem in self.planner.ledger.problems:
            self.io.warn(problem)
        for entry in self.planner.undelivered():  # results a killed run evaluated but never delivered
            result = EvalResult(entry.step, entry.uri, entry.metrics, 0.0, probe_metrics=entry.probe_metrics)
            self.delivery.add_result(result, entry.reason)
        try:
            with DecisionThread(self.planner, self.follower) as decisions:
                training_error = self._follow(decisions)
            self.delivery.add_rows(self.train_log.poll(), flush_now=True)
        finally:  # on every way out, deliver what can be (the rest waits in the ledger and the training log)
            unsent = self.notifier.close(self.cfg.delivery_timeout_s)
            if unsent:
                self.io.warn(
                    f"{unsent} alert notifications or attempt records were in flight when the run ended: not retried"
                )
            results, rows = self.delivery.close(self.cfg.delivery_timeout_s)
            if results or rows:
                self.io.warn(
                    f"the tracker did not take {results} results and {rows} training rows; they are in the "
                    "ledger and the training log, and the same command delivers them"
                )
        if training_error is not None:
            raise training_error
        return self.planner.ledger

    def _follow(self, decisions: DecisionThread) -> Exception | None:
        """Turn after turn until the final checkpoint and the refinement after it are handled, or
        training died and what it published is; returns training's error, if it died."""
        final_seen, refined, decided, training_error = False, self.cfg.refined, [], None
        external = self.cfg.external_timeout_s is not None
        last_checkpoint_at = time.monotonic()
        while True:
            started = time.perf_counter()
            settled = bool(decided)
            for problem in self.follower.take_problems() + self.train_log.take_problems():
                self.io.warn(problem)
            for event, decision in decided:
                self.io.announce(event)
                self._log_decision(event, decision)
                final_seen |= event.final
                last_checkpoint_at = time.monotonic()
            rows = self.train_log.poll()
            if external:  # no training log of ours: the publisher's metrics, at each checkpoint's step
                rows += [{"step": event.global_step, **event.train_metrics} for event, _ in decided]
            self.delivery.add_rows(rows, flush_now=final_seen)
            settled |= self._collect_finished()
            if self.cfg.retention is not None and self.cfg.retention.keep_last is not None and settled:
                self._apply_retention()
            self._start_evaluations()
            training_error = training_error or self._training_error()
            idle = not self.in_flight and not self.planner.waiting and not decided and decisions.idle()
            if training_error is not None and idle:
                return training_error  # every checkpoint training published before it died is handled
            if final_seen and not self.in_flight and not self.planner.waiting:
                if refined:
                    return None
                refined = True  # once: the skipped neighbours of the best, now that the run is over
                for event in self.planner.refine(self.deleted):
                    self._log_decision(event, Decision(True, self.planner.ledger.latest(event.global_step).reason))
            if self.training is None and not final_seen and idle:
                if not external:
                    raise RuntimeError(f"{self.manifest.path}: no final checkpoint and no training job to wait for")
                if time.monotonic() - last_checkpoint_at > self.cfg.external_timeout_s:
                    raise RuntimeError(
                        f"{self.manifest.path}: no checkpoint from the external trainer for "
                        f"{self.cfg.external_timeout_s:.0f} s, and no final one (train.external_timeout_s)"
                    )
            if self.on_iteration:
                self.on_iteration(time.perf_counter() - started)
            decided = decisions.drain(timeout_s=self.cfg.poll_interval_s)

    def _log_decision(self, event: CheckpointEvent, decision: Decision) -> None:
        self.io.info(decision_line(event, decision))

    def _collect_finished(self) -> bool:
        """Record every finished evaluation, whatever order they finish in."""
        finished = [f for f in self.in_flight if f.handle.done()]
        for done in finished:
            self.in_flight.remove(done)
            self._collect(done)
        return bool(finished)

    def _collect(self, done: _InFlight) -> None:
        try:
            attempt = Attempt(done.event, result=done.handle.result(), probe=done.probe)
        except Exception as exc:  # noqa: BLE001 - recorded, alerted once failed for good, the loop goes on
            attempt = Attempt(done.event, error=exc, probe=done.probe)
        outcome = record_outcome(
            self.planner,
            attempt,
            self.alerts,
            max_attempts=self.cfg.max_attempts,
            logged_by_evaluator=self.cfg.results_logged_by_evaluator,
            deleted=self.deleted,
            feedback=self.feedback,
        )
        follow_outcome(attempt, outcome, _InFlow(self), reason=done.reason)

    def _start_evaluations(self) -> None:
        while len(self.in_flight) < self.cfg.slots and (
            event := self.planner.next(self.cfg.slots - len(self.in_flight))
        ):
            reason = self.planner.ledger.latest(event.global_step).reason
            probe = self.planner.is_probe(event.global_step)
            handle = self.io.submit(event, reason, probe=True) if probe else self.io.submit(event, reason)
            self.in_flight.append(_InFlight(event, handle, reason, probe))

    def _apply_retention(self) -> None:
        sched = self.planner.cfg
        doomed = checkpoints_to_delete(
            self.planner.events(),
            {e.step: e for e in self.planner.ledger.entries()},
            self.cfg.retention,
            metric=sched.metric,
            higher_is_better=sched.higher_is_better,
            deleted=self.deleted,
            kept=rollback_targets(self.planner.ledger.path.parent),
        )
        if doomed:
            self.io.delete_checkpoints(doomed)
            self.deleted.update(e.global_step for e in doomed)

    def _training_error(self) -> Exception | None:
        """Training's error once it died (a rank killed, an exception); the loop then handles what
        was already published and raises it."""
        if self.training is None or self.training.poll() in (None, 0):
            return None
        try:
            self.training.wait(10)
            self.training.raise_for_status("training")
        except Exception as exc:  # noqa: BLE001 - raised once the published checkpoints are handled
            self.io.warn(f"training failed; evaluating what it published before ending: {exc}")
            return exc
        return None


class _InFlow:
    """What the in-flow loop does after an outcome (:func:`follow_outcome`): its own log, the
    tracker through its delivery thread and notifier, looked-back checkpoints on its queue."""

    def __init__(self, loop: FollowLoop):
        self.loop = loop

    def look_back_at(self, event: CheckpointEvent) -> None:  # queued already: the loop starts it next
        reason = self.loop.planner.ledger.latest(event.global_step).reason
        self.say_decision(event, Decision(True, reason))

    def record_failed_attempt(self, step: int) -> None:
        self.loop.notifier.call(
            f"failed attempt of step {step} not recorded in the tracker", self.loop.io.log_failed_attempt, step
        )

    def warn(self, message: str) -> None:
        self.loop.io.warn(message)

    def say_decision(self, event: CheckpointEvent, decision: Decision) -> None:
        self.loop._log_decision(event, decision)

    def deliver(self, event: CheckpointEvent, result: EvalResult, reason: str) -> None:
        self.loop.delivery.add_result(result, reason)

    def send(self, alert: Alert) -> None:
        self.loop.notifier.add(alert)

    def say_directive(self, directive: Directive) -> None:
        self.loop.io.say_directive(directive)
