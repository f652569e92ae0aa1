"""Decisions the moment a checkpoint is published: the manifest followed, and each new checkpoint
offered to the planner, in a thread of its own."""

from __future__ import annotations

import queue
import threading

from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.lifecycle.followers import ManifestFollower
from areal_eval.lifecycle.planner import EvaluationPlanner
from areal_eval.scheduling.policy import Decision


class DecisionThread:
    """Follows the manifest and decides on each new checkpoint in a thread of its own.

    The decision is the start of the feedback path, so it must not wait while the flow's loop
    is inside a Prefect task call or an MLflow request. Decided checkpoints come out of
    :meth:`drain` for the loop to announce and log.
    """

    def __init__(self, planner: EvaluationPlanner, follower: ManifestFollower, idle_wait_s: float = 0.5):
        self.planner, self.follower, self.idle_wait_s = planner, follower, idle_wait_s
        self._decided: queue.Queue[tuple[CheckpointEvent, Decision]] = queue.Queue()
        self._stop = threading.Event()
        self._busy = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-decisions", daemon=True)

    def __enter__(self) -> DecisionThread:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._busy = True  # read and handed over: see idle()
                for event in self.follower.poll():
                    self._decided.put((event, self.planner.offer(event)))
                self._busy = False
                self.follower.wait(self.idle_wait_s)
        except BaseException as exc:  # noqa: BLE001 - surfaced by drain()
            self._error = exc
            self._decided.put(None)

    def idle(self) -> bool:
        """Nothing left to decide or to hand over: the manifest is read and every decision drained."""
        return not self._busy and self.follower.caught_up() and self._decided.empty()

    def drain(self, timeout_s: float = 0.0) -> list[tuple[CheckpointEvent, Decision]]:
        """Decisions made since the last call; waits up to ``timeout_s`` for the first one."""
        out = []
        try:
            item = self._decided.get(timeout=timeout_s) if timeout_s > 0 else self._decided.get_nowait()
            while True:
                if item is None:
                    raise RuntimeError(f"deciding on checkpoints failed: {self._error}") from self._error
                out.append(item)
                item = self._decided.get_nowait()
        except queue.Empty:
            return out
