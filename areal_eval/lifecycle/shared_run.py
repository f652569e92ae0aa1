"""One training run, shared by the flow runs that evaluate it from outside.

``train-and-evaluate`` owns its run for the whole run (:class:`~areal_eval.runs.directory.RunLock`) and
decides in one process. A trainer that publishes on its own is evaluated by many short flow runs
instead: one per checkpoint event, a manual ``prefect deployment run``, the cron sweep, several at
once on different workers. They share the run's ledger, and each decides and records under one
lock (``decisions.lock``) with the same planner the in-flow loop uses. So:

- every checkpoint in the manifest is decided once, in step order, exactly as the in-flow planner
  would decide it, whichever event arrives first;
- a checkpoint scheduled for evaluation is claimed by one flow run (its ledger entry names it);
  the claim of a flow run that is no longer alive is taken over;
- a result is judged by the alert rules against earlier steps only, and throttling lives in the
  run directory (``evaluation_state.json``), not in a process;
- after the final checkpoint and the refinement around the best, the run is ended once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Iterator

from areal_eval import jsonl
from areal_eval.alerts import AlertEngine, AlertsConfig
from areal_eval.checkpoints.manifest import CheckpointError, CheckpointEvent, Manifest
from areal_eval.evaluation.items import run_item_scores
from areal_eval.failures import retry_backoff_s
from areal_eval.feedback import FeedbackConfig, FeedbackJudge
from areal_eval.lifecycle.outcome import Attempt, Outcome, record_outcome
from areal_eval.lifecycle.planner import EvaluationPlanner
from areal_eval.runs.directory import RunDir, file_lock
from areal_eval.runs.ledger import Ledger
from areal_eval.scheduling.policy import SchedulerConfig


@dataclasses.dataclass(frozen=True)
class Claim:
    """What one flow run is to do about one checkpoint."""

    event: CheckpointEvent
    evaluate: bool
    reason: str
    """Why it is evaluated (the scheduler's reason, with a forced reason next to it), or why not."""
    probe: bool = False
    """Evaluate the probe subset only (a probe the scheduler chose; a forced evaluation is full)."""


class SharedRun:
    """A run's ledger, alert state and decisions as a flow run from outside sees them: each call
    reads them from the run directory and writes them back under the run's decisions lock."""

    def __init__(
        self,
        run: RunDir,
        manifest: Manifest,
        scheduler: SchedulerConfig,
        alerts: AlertsConfig,
        run_id: str | None = None,
        *,
        feedback: FeedbackConfig | None = None,
    ):
        self.run, self.manifest, self.scheduler, self.alerts, self.run_id = run, manifest, scheduler, alerts, run_id
        self.feedback = feedback
        """The feedback rules (None: none), on the scheduler's metric unless they name their own."""
        self._decided: list[CheckpointEvent] = []

    @contextlib.contextmanager
    def _locked(self) -> Iterator[EvaluationPlanner]:
        """The run's planner, read fresh from the ledger, while this process holds the lock."""
        with file_lock(self.run.decisions_lock):
            items = run_item_scores(self.run.evals)
            yield EvaluationPlanner(self.scheduler, Ledger(self.run.ledger), items, feedback=self._judge(items))

    def _state(self) -> dict:
        return read_state(self.run)

    def _save_state(self, state: dict) -> None:
        write_state(self.run, state)

    def _decide_all(self, planner: EvaluationPlanner) -> list[CheckpointEvent]:
        """Decide every checkpoint of the manifest not decided yet, in step order; returns those
        (and keeps them for :meth:`take_decided`, whichever call decided them)."""
        if not self.manifest.path.exists():
            raise CheckpointError(f"{self.manifest.path}: no such manifest file")
        events = sorted(self.manifest.read(run_id=self.run_id).events, key=lambda e: e.global_step)
        new = [e for e in events if planner.ledger.status(e.global_step) is None]
        for event in events:
            planner.decide(event)
        self._decided += new
        return new

    def take_decided(self) -> list[CheckpointEvent]:
        """The checkpoints this object decided since the last call, in the order decided."""
        decided, self._decided = self._decided, []
        return decided

    def claim(
        self, step: int, owner: str, forced: str | None = None, alive: Callable[[str], bool] = lambda owner: False
    ) -> tuple[Claim, list[CheckpointEvent]]:
        """Decide what is undecided, then claim ``step`` for ``owner`` if it is to be evaluated.

        ``forced``: evaluate it even if the scheduler skipped it (or it failed), for this reason
        ("manual", "sweep"); never a checkpoint already evaluated. ``alive(owner)`` says whether
        another claimant still runs. Returns the claim and the checkpoints decided now.
        """
        with self._locked() as planner:
            new = self._decide_all(planner)
            entry = planner.ledger.latest(step)
            event = next((e for e in planner.events() if e.global_step == step), None)
            if event is None or entry is None:
                raise CheckpointError(f"{self.manifest.path}: no checkpoint at step {step} in the manifest")
            if entry.status == "evaluated":
                return Claim(event, False, f"already evaluated ({entry.reason})"), new
            if entry.status == "scheduled" and entry.owner not in (None, owner) and alive(entry.owner):
                return Claim(event, False, f"being evaluated by {entry.owner}"), new
            if entry.status == "scheduled":  # done as scheduled (a pending probe is probed)
                reason = entry.reason if not forced else f"{forced}; scheduler: {entry.reason}"
            elif forced:
                reason = f"{forced}; scheduler: {entry.status}, {entry.reason}"
            else:
                return Claim(event, False, f"{entry.status}: {entry.reason}"), new
            planner.claim(event, reason, owner)
            return Claim(event, True, reason, planner.is_probe(step)), new

    def unhandled(self, alive: Callable[[str], bool], now: Callable[[], float] = time.time) -> list[int]:
        """Steps scheduled for evaluation that no live flow run is evaluating (a lost event, a
        crashed run, a transient failure whose backoff is over): what a sweep picks up by default."""
        with self._locked() as planner:
            self._decide_all(planner)
            return [
                e.step
                for e in planner.ledger.entries()
                if e.status == "scheduled"
                and (e.owner is None or not alive(e.owner))
                and (not e.attempts or now() >= e.time + retry_backoff_s(e.failed_attempts))
            ]

    def skipped(self) -> list[int]:
        """Steps the scheduler skipped or superseded (a sweep re-evaluates them only when asked)."""
        return [e.step for e in Ledger(self.run.ledger).entries() if e.status in ("skipped", "superseded")]

    def record_outcome(
        self,
        attempt: Attempt,
        *,
        max_attempts: int = 1,
        logged_by_evaluator: bool = True,
        deleted: Collection[int] = (),
        owner: str | None = None,
    ) -> Outcome:
        """:func:`~areal_eval.lifecycle.outcome.record_outcome` under the run's lock, as the
        in-flow loop records its attempts: the alert rules judge a result against the earlier
        steps of the ledger, and throttle across flow runs (the state is in the run directory).
        A checkpoint the result looks back at is claimed for ``owner``, who evaluates it next."""
        with self._locked() as planner:
            self._decide_all(planner)  # as the in-flow planner, which decides each checkpoint once published
            state = self._state()
            engine = AlertEngine(self.alerts, time.time, state.get("notified"), run_item_scores(self.run.evals))
            for entry in planner.ledger.entries():
                if entry.status == "evaluated" and entry.step != attempt.event.global_step:
                    engine.remember(entry.step, entry.metrics)
            outcome = record_outcome(
                planner,
                attempt,
                engine,
                max_attempts=max_attempts,
                logged_by_evaluator=logged_by_evaluator,
                deleted=deleted,
                owner=owner,
                feedback=self._judge(run_item_scores(self.run.evals)),
            )
            if engine.notified != state.get("notified", {}):
                self._save_state({**state, "notified": engine.notified})
        return outcome

    def _judge(self, items) -> FeedbackJudge | None:
        if self.feedback is None:
            return None
        return FeedbackJudge(
            self.feedback, metric=self.scheduler.metric, higher_is_better=self.scheduler.higher_is_better, items=items
        )

    def delivered(self, step: int) -> None:
        """What ``step``'s entry holds (a held probe) is in the tracker."""
        with self._locked() as planner:
            planner.delivered(step)

    def refinements(self, owner: str, deleted: set[int] = frozenset()) -> list[CheckpointEvent]:
        """Once the final checkpoint is decided and nothing scheduled is left: the skipped
        neighbours of the best, claimed by ``owner`` (once per run)."""
        with self._locked() as planner:
            self._decide_all(planner)
            state = self._state()
            if state.get("refined") or not self._settled(planner):
                return []
            refined = planner.refine(deleted, owner=owner)
            self._save_state({**state, "refined": True})
            return refined

    def finish(self) -> Ledger | None:
        """The ledger, the first time the run is over (final checkpoint, refinement and every
        evaluation handled); None before, and after that first time."""
        with self._locked() as planner:
            self._decide_all(planner)
            state = self._state()
            if not state.get("refined") or state.get("finished") or not self._settled(planner):
                return None
            self._save_state({**state, "finished": True})
            return planner.ledger

    def ended(self) -> bool:
        """The run was ended (by this path, or by the flow that owned it)."""
        return bool(self._state().get("finished"))

    @staticmethod
    def _settled(planner: EvaluationPlanner) -> bool:
        entries = planner.ledger.entries()
        final = any(e.final for e in planner.events())
        return final and not any(e.status == "scheduled" for e in entries)


def mark_over(run: RunDir) -> None:
    """The run's owner (``train-and-evaluate``) refined and ended it: flow runs that evaluate
    it later (manual, sweep) do neither again."""
    write_state(run, {**read_state(run), "refined": True, "finished": True})


def read_state(run: RunDir) -> dict:
    """The run's evaluation state (alert throttling, refined, finished); empty before any."""
    return jsonl.read_json(run.evaluation_state, {})


def write_state(run: RunDir, state: dict) -> None:
    jsonl.write_json(run.evaluation_state, state)
