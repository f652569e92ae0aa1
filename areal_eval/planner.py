"""Between checkpoints and workers: follow the manifest, decide, queue, record.

Prefect-free, so the flow body stays a readable loop of task calls and the logic is tested
without a server. Every checkpoint that passes through ends in the ledger as evaluated,
skipped, superseded or failed, with a reason.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from areal_eval.eval_queue import CoalescingQueue
from areal_eval.ledger import FINAL_STATES, Ledger
from areal_eval.manifest import CheckpointEvent, Manifest
from areal_eval.scheduler import Decision, SchedulerConfig, decide


class ManifestFollower:
    """New manifest entries since the last poll (a restarted follower re-reads from the start)."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self._offset = 0

    def poll(self) -> list[CheckpointEvent]:
        events, self._offset = self.manifest.read_from(self._offset)
        return events

    def wait(self, timeout_s: float, every_s: float = 0.002) -> None:
        """Return as soon as the manifest grows, or after ``timeout_s``.

        A stat every 2 ms costs nothing and keeps durable-to-decision latency in milliseconds,
        where sleeping a whole poll interval would add hundreds.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if os.stat(self.manifest.path).st_size > self._offset:
                    return
            except FileNotFoundError:
                pass
            time.sleep(every_s)


class JsonlFollower:
    """New complete JSON lines of a growing file (the training log)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offset = 0

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class EvaluationPlanner:
    def __init__(self, cfg: SchedulerConfig, ledger: Ledger):
        self.cfg = cfg
        self.ledger = ledger
        self.queue: CoalescingQueue[CheckpointEvent] = CoalescingQueue(cfg.queue_capacity, coalesce=cfg.coalesce)
        self._events: dict[int, CheckpointEvent] = {}

    def history(self):
        return self.ledger.history(self.cfg.metric, self.cfg.stderr_metric)

    def offer(self, event: CheckpointEvent) -> Decision:
        """Decide on a newly announced checkpoint; queue it or record the skip."""
        self._events[event.global_step] = event
        status = self.ledger.status(event.global_step)
        if status in FINAL_STATES:
            return Decision(False, f"already {status} (ledger)")
        if status == "scheduled":  # scheduled before a restart: resume it
            decision = Decision(True, "resumed: scheduled before restart", pinned=True)
        else:
            decision = decide(event, self.history(), self.cfg)
        if not decision.evaluate:
            self.ledger.record(event.global_step, event.uri, "skipped", decision.reason)
            return decision
        if status != "scheduled":
            self.ledger.record(event.global_step, event.uri, "scheduled", decision.reason)
        for old in self.queue.push(event, pinned=decision.pinned):
            self._supersede(old, event)
        return decision

    def next(self) -> CheckpointEvent | None:
        """The checkpoint to evaluate now (newest waiting); older waiting ones are superseded."""
        if not len(self.queue):
            return None
        event, older = self.queue.pop()
        for old in older:
            self._supersede(old, event)
        return event

    def _supersede(self, old: CheckpointEvent, by: CheckpointEvent) -> None:
        self.ledger.record(old.global_step, old.uri, "superseded", f"evaluation behind training: coalesced to step {by.global_step}")

    def evaluated(self, event: CheckpointEvent, metrics: dict) -> None:
        self.ledger.record(event.global_step, event.uri, "evaluated", "", metrics)

    def failed(self, event: CheckpointEvent, error: str) -> None:
        self.ledger.record(event.global_step, event.uri, "failed", error)

    @property
    def waiting(self) -> int:
        return len(self.queue)
