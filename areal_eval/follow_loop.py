"""The follow / decide / evaluate / record loop of one training run, without Prefect.

The loop follows the run's manifest (decisions are made in a :class:`DecisionThread` the moment a
checkpoint is durable), starts the chosen evaluations, collects them in any order, records and
alerts on each result, ships training metrics, and applies retention, until the final
checkpoint and the end-of-run refinement are handled. What it does outside itself goes through
a :class:`LoopIO`: the ``train-and-evaluate`` flow backs it with Prefect tasks, a benchmark or a
test with plain calls, so every path runs the same loop.

Faults on the side never end the loop: a training-metrics flush that fails is kept and retried
at the next flush.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Protocol

from areal_eval.alerts import Alert, AlertEngine
from areal_eval.evaluation import EvalResult
from areal_eval.ledger import Ledger
from areal_eval.manifest import CheckpointEvent, Manifest
from areal_eval.planner import DecisionThread, EvaluationPlanner, JsonlFollower, ManifestFollower
from areal_eval.retention import RetentionConfig, checkpoints_to_delete
from areal_eval.scheduler import Decision


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

    def submit(self, event: CheckpointEvent, reason: str) -> EvaluationHandle:
        """Start evaluating ``event``; returns at once."""

    def log_result(self, result: EvalResult, reason: str) -> None:
        """Record a finished evaluation (metrics at its own step)."""

    def send_alert(self, alert: Alert) -> None: ...

    def log_training(self, rows: list[dict]) -> None:
        """Ship training-log rows; raising keeps them for the next flush."""

    def delete_checkpoints(self, events: list[CheckpointEvent]) -> None:
        """Delete what retention lets go, and record it."""

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
    """The evaluation logs and alerts on its own result (a dispatched deployment run)."""
    retention: RetentionConfig | None = None
    """Delete checkpoints as they settle; None keeps all."""


@dataclasses.dataclass
class _InFlight:
    event: CheckpointEvent
    handle: EvaluationHandle
    reason: str


class FollowLoop:
    """One run's loop; :meth:`run` returns the ledger once everything is handled."""

    def __init__(self, planner: EvaluationPlanner, manifest: Manifest, train_log: Path, alerts: AlertEngine,
                 io: LoopIO, cfg: LoopConfig = LoopConfig(), training: TrainingJob | None = None,
                 on_iteration: Callable[[float], None] | None = None):
        if cfg.slots < 1:
            raise ValueError("slots must be >= 1")
        self.planner, self.manifest, self.alerts, self.io, self.cfg = planner, manifest, alerts, io, cfg
        self.train_log = JsonlFollower(train_log)
        self.training = training
        self.on_iteration = on_iteration
        self.in_flight: list[_InFlight] = []
        self.deleted: set[int] = set()
        self._pending_rows: list[dict] = []
        self._last_flush = 0.0

    def run(self) -> Ledger:
        final_seen, refined, decided = False, False, []
        decision_thread = DecisionThread(self.planner, ManifestFollower(self.manifest))
        with decision_thread as decisions:
            while True:
                started = time.perf_counter()
                settled = bool(decided)
                for event, decision in decided:
                    self.io.announce(event)
                    self._log_decision(event, decision)
                    final_seen |= event.final
                self._ship_training_rows(final_seen)
                settled |= self._collect_finished()
                if self.cfg.retention is not None and self.cfg.retention.keep_last is not None and settled:
                    self._apply_retention()
                self._start_evaluations()
                if final_seen and not self.in_flight and not self.planner.waiting:
                    if refined:
                        break
                    refined = True  # once: the skipped neighbours of the best, now that the run is over
                    for event in self.planner.refine(self.deleted):
                        self._log_decision(event, Decision(True, self.planner.ledger.latest(event.global_step).reason))
                self._check_training()
                idle = not self.in_flight and not self.planner.waiting and not decided and decisions.idle()
                if self.training is None and not final_seen and idle:
                    raise RuntimeError(f"{self.manifest.path}: no final checkpoint and no training job to wait for")
                if self.on_iteration:
                    self.on_iteration(time.perf_counter() - started)
                decided = decisions.drain(timeout_s=self.cfg.poll_interval_s)
        self._ship_training_rows(True)
        return self.planner.ledger

    def _log_decision(self, event: CheckpointEvent, decision: Decision) -> None:
        verdict = "evaluate" if decision.evaluate else "skip"
        self.io.info(f"checkpoint step {event.global_step}: {verdict} ({decision.reason})")

    def _ship_training_rows(self, now: bool) -> None:
        self._pending_rows += self.train_log.poll()
        if not self._pending_rows or not (now or time.monotonic() - self._last_flush > self.cfg.train_log_every_s):
            return
        self._last_flush = time.monotonic()
        try:
            self.io.log_training(self._pending_rows)
        except Exception as exc:  # noqa: BLE001 - a side fault: keep the rows, retry next flush
            self.io.warn(f"training metrics not logged yet ({len(self._pending_rows)} rows kept for retry): {exc!r}")
            return
        self._pending_rows = []

    def _collect_finished(self) -> bool:
        """Record every finished evaluation, whatever order they finish in."""
        finished = [f for f in self.in_flight if f.handle.done()]
        for done in finished:
            self.in_flight.remove(done)
            self._collect(done)
        return bool(finished)

    def _collect(self, done: _InFlight) -> None:
        step = done.event.global_step
        try:
            result = done.handle.result()
        except Exception as exc:  # noqa: BLE001 - recorded as failed, alerted, the loop goes on
            self.planner.failed(done.event, str(exc))
            alerts = self.alerts.check(step, None, str(exc))
        else:
            self.planner.evaluated(done.event, result.metrics)
            if self.cfg.results_logged_by_evaluator:
                return
            self.io.log_result(result, done.reason)
            alerts = self.alerts.check(step, result.metrics)
        for alert in alerts:
            self.io.send_alert(alert)

    def _start_evaluations(self) -> None:
        while len(self.in_flight) < self.cfg.slots and (event := self.planner.next()):
            reason = self.planner.ledger.latest(event.global_step).reason
            self.in_flight.append(_InFlight(event, self.io.submit(event, reason), reason))

    def _apply_retention(self) -> None:
        sched = self.planner.cfg
        doomed = checkpoints_to_delete(self.planner.events(), {e.step: e for e in self.planner.ledger.entries()},
                                       self.cfg.retention, sched.metric, sched.higher_is_better, self.deleted)
        if doomed:
            self.io.delete_checkpoints(doomed)
            self.deleted.update(e.global_step for e in doomed)

    def _check_training(self) -> None:
        if self.training is not None and self.training.poll() not in (None, 0):
            self.training.wait(10)
            self.training.raise_for_status("training")
