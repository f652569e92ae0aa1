"""The evaluation ledger: what happened to every checkpoint, durably.

One JSON line per state change (``scheduled``, ``evaluated``, ``skipped``, ``superseded``,
``failed``); the last line for a step wins. With probes (``scheduler.probe_fraction``) an entry
also says what its probe did (``probe``) and holds the subset's metrics (``probe_metrics``). The
scheduler's history and a restarted flow's to-do list are both derived from it, so nothing is
evaluated twice or lost on restart.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

from areal_eval import jsonl
from areal_eval.scheduling.policy import HistoryEntry

FINAL_STATES = ("evaluated", "skipped", "superseded", "failed")
RETRIED = "retried: "
"""The prefix of a failed try that its attempt retried (``LedgerEntry.attempts``)."""


@dataclasses.dataclass
class LedgerEntry:
    step: int
    uri: str
    status: str
    reason: str = ""
    metrics: dict = dataclasses.field(default_factory=dict)
    time: float = dataclasses.field(default_factory=time.time)
    delivered: bool = False
    """An evaluated checkpoint's result is in the tracker (the ledger is the tracker's outbox)."""
    owner: str | None = None
    """Who evaluates a scheduled checkpoint, where flow runs share the run (a Prefect flow run
    id); None: the loop that owns the run."""
    probe: str | None = None
    """Its probe: ``pending`` (scheduled: a probe, not a full evaluation), ``held`` (it stayed
    within its noise: skipped, unless refinement or a forced run evaluated it later),
    ``escalated`` (it moved: scheduled for, then given, a full evaluation); None: no probe."""
    probe_metrics: dict = dataclasses.field(default_factory=dict)
    """Metrics on the probe subset: a probe's result, or the subset part of a full evaluation (the
    next probe's reference). Logged as ``eval_probe/*``; never a result."""
    attempts: list = dataclasses.field(default_factory=list)
    """The causes of its failed evaluation tries so far, oldest first: ``retried: ...`` (a try
    retried within its attempt, ``eval.retries``), then ``transient: ...`` or ``permanent: ...``
    (how the attempt ended); kept on every later line for the step, a success included."""

    @property
    def failed_attempts(self) -> int:
        """Attempts that failed (the tries retried within one are not counted apart)."""
        return sum(not a.startswith(RETRIED) for a in self.attempts)

    @property
    def deliverable(self) -> bool:
        """Holds what goes to the tracker: a result, or a probe that did not escalate."""
        return self.status == "evaluated" or (self.status == "skipped" and bool(self.probe_metrics))

    def history_entry(self, metric: str, stderr_metric: str | None) -> HistoryEntry | None:
        """What the scheduler sees of this checkpoint: a result, a pending one, or nothing (a
        pending probe is not a pending result)."""
        if self.status == "evaluated":
            return HistoryEntry(
                self.step,
                self.time,
                self.metrics.get(metric),
                self.metrics.get(stderr_metric) if stderr_metric else None,
            )
        if self.status == "scheduled" and self.probe != "pending":
            return HistoryEntry(self.step, self.time, None, None)
        return None


class Ledger:
    """Thread-safe: the flow's decision thread records while its main loop reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.RLock()
        self._latest: dict[int, LedgerEntry] = {}
        chunk = jsonl.read_complete(self.path)
        parsed, problems = jsonl.loads_skipping_torn(chunk.lines, self.path)
        self.problems: list[str] = problems
        """Lines skipped on reading, as ``path:line: why``: a line that is not JSON was torn by a
        crash mid-append (the entry before it for that step stands, so nothing is taken as done
        that was not); a JSON line with the wrong fields is an error, raised."""
        for lineno, row in parsed:
            try:
                entry = LedgerEntry(**row)
            except TypeError as exc:
                raise jsonl.JsonlError(f"{self.path}:{lineno}: bad ledger entry: {exc}") from exc
            self._latest[entry.step] = entry
        if self.path.exists() and chunk.offset < self.path.stat().st_size:
            self.problems.append(f"{self.path}:{chunk.line}: skipped (torn or corrupt line): no end of line")

    def append(self, entry: LedgerEntry) -> LedgerEntry:
        """Write ``entry`` as its step's latest line. A step's failed attempts stay on record: an
        entry that names none carries those of the step's entry before it."""
        with self._lock:
            before = self._latest.get(entry.step)
            attempts = entry.attempts or (before.attempts if before is not None else [])
            entry = dataclasses.replace(  # its own copies: a caller's dicts may change later
                entry, metrics=dict(entry.metrics), probe_metrics=dict(entry.probe_metrics), attempts=list(attempts)
            )
            row = dataclasses.asdict(entry)
            if entry.probe is None and not entry.probe_metrics:  # a run without probes: lines as before
                del row["probe"], row["probe_metrics"]
            if not entry.attempts:
                del row["attempts"]
            jsonl.append(self.path, row, sort_keys=True)
            self._latest[entry.step] = entry
        return entry

    def latest(self, step: int) -> LedgerEntry | None:
        return self._latest.get(step)

    def status(self, step: int) -> str | None:
        entry = self._latest.get(step)
        return entry.status if entry else None

    def entries(self) -> list[LedgerEntry]:
        with self._lock:
            return [self._latest[s] for s in sorted(self._latest)]

    def pending(self) -> list[LedgerEntry]:
        """Scheduled but not finished: re-queue these after a restart."""
        return [e for e in self.entries() if e.status == "scheduled"]

    def history(self, metric: str, stderr_metric: str | None) -> list[HistoryEntry]:
        entries = (e.history_entry(metric, stderr_metric) for e in self.entries())
        return [h for h in entries if h is not None]

    def probe_counts(self) -> dict[str, int]:
        """Probes run (``probed``), and those that escalated to a full evaluation; empty without probes."""
        outcomes = [e.probe for e in self.entries() if e.probe in ("held", "escalated")]
        return {"probed": len(outcomes), "escalated": outcomes.count("escalated")} if outcomes else {}

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries():
            out[e.status] = out.get(e.status, 0) + 1
        return out
