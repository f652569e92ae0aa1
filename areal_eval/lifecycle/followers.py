"""Following files that grow: the run's manifest and its training log."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from areal_eval import jsonl
from areal_eval.checkpoints.manifest import CheckpointEvent, Manifest


class ManifestFollower:
    """New manifest entries since the last poll (a restarted follower re-reads from the start).

    Lines that are not entries of run ``run_id`` are skipped; :meth:`take_problems` says which.
    """

    def __init__(self, manifest: Manifest, run_id: str | None = None):
        self.manifest, self.run_id = manifest, run_id
        self._offset, self._line = 0, 1
        self._problems: list[str] = []
        self._lock = threading.Lock()

    def poll(self) -> list[CheckpointEvent]:
        chunk = self.manifest.read(self._offset, self._line, self.run_id)
        self._offset, self._line = chunk.offset, chunk.line
        with self._lock:
            self._problems += chunk.problems
        return chunk.events

    def take_problems(self) -> list[str]:
        """Lines skipped since the last call, each as ``path:line: why``."""
        with self._lock:
            problems, self._problems = self._problems, []
        return problems

    def caught_up(self) -> bool:
        """Every complete entry written so far has been read."""
        try:
            return os.stat(self.manifest.path).st_size <= self._offset
        except FileNotFoundError:
            return True

    def wait(self, timeout_s: float, every_s: float = 0.002) -> None:
        """Return as soon as the manifest grows, or after ``timeout_s``.

        A stat every 2 ms costs nothing and keeps durable-to-decision latency in milliseconds,
        where sleeping a whole poll interval would add hundreds.
        """
        deadline = time.monotonic() + timeout_s
        while self.caught_up() and time.monotonic() < deadline:
            time.sleep(every_s)


class JsonlFollower:
    """New complete JSON lines of a growing file (the training log). A line that is not JSON
    (torn by a crash, then closed by the next append) is skipped; :meth:`take_problems` says which."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offset, self._line = 0, 1
        self._problems: list[str] = []

    def poll(self) -> list[dict]:
        chunk = jsonl.read_complete(self.path, self._offset, self._line)
        self._offset, self._line = chunk.offset, chunk.line
        parsed, problems = jsonl.loads_skipping_torn(chunk.lines, self.path)
        self._problems += problems
        return [row for _, row in parsed]

    def take_problems(self) -> list[str]:
        """Lines skipped since the last call, each as ``path:line: why``."""
        problems, self._problems = self._problems, []
        return problems
