"""Between checkpoints and workers: decide, queue, record (the followers are in ``areal_eval.lifecycle.followers``).

Prefect-free, so the flow body stays a readable loop of task calls and the logic is tested
without a server. Every checkpoint that passes through ends in the ledger as evaluated,
skipped, superseded or failed, with a reason.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import threading
import time
from collections.abc import Collection
from typing import Generic, TypeVar

from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.feedback import FeedbackJudge
from areal_eval.paired import ItemScores, paired_stderrs
from areal_eval.runs.ledger import FINAL_STATES, RETRIED, Ledger, LedgerEntry
from areal_eval.scheduling.decision_history import DecisionHistory
from areal_eval.scheduling.policy import Decision, SchedulerConfig, decide, look_back, refine
from areal_eval.scheduling.probes import ProbeJudge, ProbeSettings

T = TypeVar("T")


class CoalescingQueue(Generic[T]):
    """The bounded queue between the scheduler and the evaluation workers.

    When evaluation falls behind training, waiting checkpoints are coalesced to the newest: the
    older ones are returned as superseded (to be recorded with that reason), never silently lost,
    and the backlog cannot grow without bound. Pinned items (the first and final checkpoint) are
    never superseded; they are served first, oldest first. With ``coalesce=False`` it is a plain
    FIFO that supersedes nothing.
    """

    def __init__(self, capacity: int, step_of=lambda item: item.global_step, coalesce: bool = True):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.coalesce = coalesce
        self._step_of = step_of
        self._items: list[T] = []
        self._pinned: list[T] = []

    def __len__(self) -> int:
        return len(self._items) + len(self._pinned)

    def push(self, item: T, pinned: bool = False) -> list[T]:
        """Add ``item``; returns the items it superseded (oldest first) when over capacity."""
        if pinned or not self.coalesce:
            self._pinned.append(item)
            self._pinned.sort(key=self._step_of)
            return []
        self._items.append(item)
        self._items.sort(key=self._step_of)
        superseded = []
        while len(self._items) > self.capacity:
            superseded.append(self._items.pop(0))
        return superseded

    def pop(self, free_slots: int = 1) -> tuple[T, list[T]]:
        """The next item and the older ones it supersedes: a pinned item (none superseded), else
        the newest. With ``free_slots`` workers free, the newest that many waiting items are all
        served (this one first) and only older ones are superseded: coalescing starts only when
        every slot is busy."""
        if self._pinned:
            return self._pinned.pop(0), []
        if not self._items:
            raise IndexError("pop from an empty queue")
        cut = max(0, len(self._items) - max(1, free_slots))
        superseded, self._items = self._items[:cut], self._items[cut:]
        return self._items.pop(), superseded


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class EvaluationPlanner:
    """Decisions, the queue and the ledger; thread-safe, so a :class:`DecisionThread` can offer
    checkpoints while the flow's loop takes work and records results."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        ledger: Ledger,
        items: ItemScores | None = None,
        *,
        feedback: FeedbackJudge | None = None,
    ):
        """``items``: the run's per-item scores, so that probes, movement and regressions are
        judged paired on them; ``feedback``: the run's feedback rules, whose acting ones have a
        checkpoint evaluated while they count (:meth:`FeedbackJudge.watching`)."""
        self.feedback = feedback
        self._lock = threading.RLock()
        self.cfg = cfg
        self.ledger = ledger
        self.queue: CoalescingQueue[CheckpointEvent] = CoalescingQueue(cfg.queue_capacity, coalesce=cfg.coalesce)
        self._events: dict[int, CheckpointEvent] = {}
        self._train: list[tuple[int, float]] = []
        """``(step, scheduler.train_metric)`` of the checkpoints offered so far, in step order."""
        # What decide() reads, kept per record: a decision costs the same at any run length.
        self._decisions = DecisionHistory(cfg.higher_is_better)
        self._skipped: set[int] = set()
        """Steps skipped or superseded now: what a look-back may evaluate."""
        probes = ProbeSettings.of(cfg)
        self.probes = ProbeJudge(probes, cfg.metric, cfg.stderr_name, cfg.default_stderr, items) if probes else None
        self._paired = paired_stderrs(items, cfg.metric) if items is not None else None
        for entry in ledger.entries():
            self._index(entry)

    def _index(self, entry: LedgerEntry) -> None:
        self._decisions.set(entry.step, entry.history_entry(self.cfg.metric, self.cfg.stderr_name))
        if entry.status in ("skipped", "superseded"):
            self._skipped.add(entry.step)
        else:
            self._skipped.discard(entry.step)
        if self.probes:
            self.probes.remember(entry.step, entry.status, entry.probe_metrics)

    def _train_values(self, step: int) -> list[tuple[int, float]]:
        """``scheduler.train_metric`` of the checkpoints offered up to ``step``, as each published it
        (every path sees the manifest's events in step order); the newest 64 are plenty."""
        end = bisect.bisect_right(self._train, (step, math.inf))
        return self._train[max(0, end - 64) : end]

    def history(self):
        return self.ledger.history(self.cfg.metric, self.cfg.stderr_name)

    def _record(self, entry: LedgerEntry) -> None:
        self._index(self.ledger.append(entry))

    @_locked
    def decide(self, event: CheckpointEvent) -> Decision:
        """Decide on a newly announced checkpoint and record the decision (scheduled or skipped);
        nothing is queued. A checkpoint already decided keeps its decision."""
        value = event.train_metrics.get(self.cfg.train_metric) if self.cfg.train_metric else None
        if event.global_step not in self._events and isinstance(value, (int, float)) and math.isfinite(value):
            bisect.insort(self._train, (event.global_step, float(value)))
        self._events[event.global_step] = event
        status = self.ledger.status(event.global_step)
        if status in FINAL_STATES:
            return Decision(False, f"already {status} (ledger)")
        if status == "scheduled":  # scheduled before a restart: resume it
            probe = self.ledger.latest(event.global_step).probe == "pending"
            return Decision(True, "resumed: scheduled before restart", pinned=True, probe=probe)
        step = event.global_step
        offered = self._decisions.offered_before(step)
        train = self._train_values(step)
        decision = decide(event, self._decisions.view(), self.cfg, offered, paired=self._paired, train=train)
        if not decision.evaluate and self.feedback is not None and self.feedback.acting:
            if why := self.feedback.watching(self._results()):
                decision = Decision(True, why)
        if not decision.evaluate and self.probes:  # compared when it is done, with the full result before it
            decision = Decision(True, f"probe: {decision.reason}", probe=True)
        status = "scheduled" if decision.evaluate else "skipped"
        self._record(LedgerEntry(step, event.uri, status, decision.reason, probe="pending" if decision.probe else None))
        return decision

    def _results(self) -> list[tuple[int, dict]]:
        return [(e.step, e.metrics) for e in self.ledger.entries() if e.status == "evaluated"]

    def is_probe(self, step: int) -> bool:
        """``step`` is scheduled for a probe, not a full evaluation."""
        entry = self.ledger.latest(step)
        return entry is not None and entry.status == "scheduled" and entry.probe == "pending"

    @_locked
    def probed(self, event: CheckpointEvent, probe_metrics: dict) -> Decision:
        """Record a probe's result: held (skipped, within its noise) or escalated to a full
        evaluation, queued pinned. Returns which, with the reason the ledger gives."""
        step = event.global_step
        scheduled = self.ledger.latest(step)
        moved, why = self.probes.judge(step, probe_metrics)
        skip_reason = scheduled.reason.removeprefix("probe: ") if scheduled else ""
        if moved:
            reason = f"escalated: {why}"
            owner = scheduled.owner if scheduled else None
            self._record(
                LedgerEntry(
                    step, event.uri, "scheduled", reason, probe="escalated", probe_metrics=probe_metrics, owner=owner
                )
            )
            self.queue.push(event, pinned=True)
            return Decision(True, reason, pinned=True)
        reason = f"{skip_reason}; {why}"
        self._record(LedgerEntry(step, event.uri, "skipped", reason, probe="held", probe_metrics=probe_metrics))
        return Decision(False, reason)

    @_locked
    def offer(self, event: CheckpointEvent) -> Decision:
        """Decide on a newly announced checkpoint; queue it or record the skip."""
        decision = self.decide(event)
        if decision.evaluate:
            for old in self.queue.push(event, pinned=decision.pinned):
                self._supersede(old, event)
        return decision

    @_locked
    def events(self) -> list[CheckpointEvent]:
        """Every checkpoint offered so far, in step order."""
        return [self._events[s] for s in sorted(self._events)]

    @_locked
    def refine(self, deleted: set[int] = frozenset(), owner: str | None = None) -> list[CheckpointEvent]:
        """Once the final checkpoint is evaluated: queue the skipped checkpoints worth a look
        (``scheduler.refine``), pinned so none is coalesced away. Returns them.

        ``deleted``: steps retention removed; they stay recorded as skipped. ``owner``: who
        evaluates them (see :class:`~areal_eval.lifecycle.shared_run.SharedRun`).
        """
        skipped = [e.step for e in self.ledger.entries() if e.status in ("skipped", "superseded")]
        queued = []
        for step, reason in refine(self.history(), skipped, self.cfg, deleted):
            if (event := self._reschedule(step, reason, owner)) is not None:
                queued.append(event)
        return queued

    def _reschedule(self, step: int, reason: str, owner: str | None) -> CheckpointEvent | None:
        """Schedule a skipped checkpoint again (a refinement, a look-back), pinned so none is
        coalesced away; None when it was not offered in this process."""
        event = self._events.get(step)
        if event is None:
            return None
        probed = self.ledger.latest(step).probe  # a held probe stays on record: it ran
        self._record(LedgerEntry(step, event.uri, "scheduled", reason, owner=owner, probe=probed))
        self.queue.push(event, pinned=True)
        return event

    @_locked
    def next(self, free_slots: int = 1) -> CheckpointEvent | None:
        """The checkpoint to evaluate now (newest waiting); waiting ones older than the newest
        ``free_slots`` are superseded."""
        if not len(self.queue):
            return None
        event, older = self.queue.pop(free_slots)
        for old in older:
            self._supersede(old, event)
        return event

    def _supersede(self, old: CheckpointEvent, by: CheckpointEvent, why: str = "") -> None:
        reason = f"evaluation behind training: coalesced to step {by.global_step}{why}"
        self._record(LedgerEntry(old.global_step, old.uri, "superseded", reason))

    def _fall_back(self, failed: int) -> None:
        """The checkpoint waiting ones were coalesced to is bad: the newest of them is evaluated
        instead (the others now coalesce to it, so a bad one falls back again)."""
        coalesced = f"evaluation behind training: coalesced to step {failed}"
        waiting = sorted(
            e.step
            for e in self.ledger.entries()
            if e.status == "superseded" and e.reason.split(" (")[0] == coalesced and e.step in self._events
        )
        if not waiting:
            return
        newest = self._events[waiting[-1]]
        why = f" (step {failed} failed verification)"
        self._record(
            LedgerEntry(newest.global_step, newest.uri, "scheduled", f"fallback: step {failed} failed verification")
        )
        self.queue.push(newest, pinned=True)
        for step in waiting[:-1]:
            self._supersede(self._events[step], newest, why)

    @_locked
    def evaluated(
        self,
        event: CheckpointEvent,
        metrics: dict,
        *,
        delivered: bool = False,
        probe_metrics: dict | None = None,
        notes: list[str] = (),
        retried: list[str] = (),
        deleted: Collection[int] = (),
        owner: str | None = None,
    ) -> list[CheckpointEvent]:
        """Record a result, with the reason it was scheduled for and the evaluation's ``notes``
        (what went wrong without failing it); ``retried``: the causes of the tries that failed
        before it (kept as attempts); ``delivered``: already in the tracker; ``probe_metrics``:
        its subset part, with probes.

        Returns the skipped checkpoint the result makes worth a look now (``scheduler.look_back``,
        none or one), scheduled for ``owner`` and queued pinned; ``deleted``: steps retention
        removed, never looked back at."""
        scheduled = self.ledger.latest(event.global_step)
        reason = scheduled.reason if scheduled and scheduled.status == "scheduled" else ""
        reason = "; ".join([reason, *notes]) if reason and notes else reason or "; ".join(notes)
        probe = scheduled.probe if scheduled and scheduled.status == "scheduled" else None
        attempts = [*(scheduled.attempts if scheduled else []), *(RETRIED + c for c in retried)]
        self._record(
            LedgerEntry(
                event.global_step,
                event.uri,
                "evaluated",
                reason,
                dict(metrics),
                delivered=delivered,
                probe=probe,
                probe_metrics=dict(probe_metrics or {}),
                attempts=attempts,
            )
        )
        step = event.global_step
        looked_back = []
        for earlier, why in look_back(
            self._decisions.view(), step, self._skipped, self.cfg, paired=self._paired, deleted_steps=deleted
        ):
            if (skipped := self._reschedule(earlier, why, owner)) is not None:
                looked_back.append(skipped)
        return looked_back

    @_locked
    def delivered(self, step: int) -> None:
        """The result (or the probe) of ``step`` is in the tracker."""
        entry = self.ledger.latest(step)
        if entry is not None and entry.deliverable and not entry.delivered:
            self._record(dataclasses.replace(entry, delivered=True, time=time.time()))

    def undelivered(self) -> list:
        """Results (and probes) that never reached the tracker (before a restart)."""
        return [e for e in self.ledger.entries() if e.deliverable and not e.delivered]

    @_locked
    def claim(self, event: CheckpointEvent, reason: str, owner: str) -> None:
        """``owner`` evaluates ``event`` for ``reason`` (as scheduled: a pending probe stays one)."""
        self._events[event.global_step] = event
        before = self.ledger.latest(event.global_step)  # a pending probe stays one; one that ran stays on record
        probe = before.probe if before else None
        self._record(LedgerEntry(event.global_step, event.uri, "scheduled", reason, owner=owner, probe=probe))

    @_locked
    def failed(self, event: CheckpointEvent, error: str) -> None:
        self._record(LedgerEntry(event.global_step, event.uri, "failed", error))

    @_locked
    def attempt_failed(
        self,
        event: CheckpointEvent,
        cause: str,
        *,
        permanent: bool,
        max_attempts: int,
        retried: list[str] = (),
        bad_checkpoint: bool = False,
    ) -> bool:
        """Record a failed evaluation attempt (``areal_eval.failures``). A permanent one, or the
        ``max_attempts``-th, makes the checkpoint ``failed`` (returns True); a transient one before
        that leaves it scheduled and unclaimed, queued again, for a later attempt (returns False)."""
        step = event.global_step
        entry = self.ledger.latest(step)
        earlier = [*(entry.attempts if entry else []), *(RETRIED + c for c in retried)]
        attempts = [*earlier, f"{'permanent' if permanent else 'transient'}: {cause}"]
        failed = sum(not a.startswith(RETRIED) for a in attempts)
        if permanent or failed >= max_attempts:
            reason = cause if failed == 1 else f"gave up after {failed} attempts: {cause}"
            self._record(LedgerEntry(step, event.uri, "failed", reason, attempts=attempts))
            if bad_checkpoint:
                self._fall_back(step)
            return True
        reason, probe = (entry.reason, entry.probe) if entry else ("", None)
        self._record(LedgerEntry(step, event.uri, "scheduled", reason, probe=probe, attempts=attempts))
        self._events[step] = event
        self.queue.push(event, pinned=True)
        return False

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self.queue)
