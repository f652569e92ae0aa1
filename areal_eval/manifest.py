"""The checkpoint manifest: the durable, append-only log of announced checkpoints.

A checkpoint is appended only after its files are written, hashed and renamed into place, so
anything in the manifest can be evaluated. The manifest survives a flow restart: a follower
re-reads it from the start and the evaluation ledger tells what was already handled.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


@dataclasses.dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class CheckpointEvent:
    """What training announces about one durable checkpoint."""

    run_id: str
    uri: str
    epoch: int
    epoch_step: int
    global_step: int
    wall_time: float
    train_metrics: dict
    files: tuple[FileEntry, ...] = ()
    final: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, row: dict) -> "CheckpointEvent":
        row = dict(row)
        row["files"] = tuple(FileEntry(**f) for f in row.get("files", ()))
        return cls(**row)

    def payload(self) -> dict:
        """The event payload for Prefect and webhooks (file list left out: it can be long)."""
        data = dataclasses.asdict(self)
        data.pop("files")
        return data


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Manifest:
    """JSON lines at ``path``; one ``CheckpointEvent`` a line."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, event: CheckpointEvent) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(event.to_json() + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if new:
            _fsync_dir(self.path.parent)

    def read_from(self, offset: int = 0) -> tuple[list[CheckpointEvent], int]:
        """Complete lines after byte ``offset``; returns them and the offset to resume from.

        A line still being written (no newline yet) is left for the next call.
        """
        if not self.path.exists():
            return [], offset
        with self.path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        events = []
        for lineno, line in enumerate(data[:end].splitlines(), start=1):
            if not line.strip():
                continue
            try:
                events.append(CheckpointEvent.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError) as exc:
                raise CheckpointError(f"{self.path}: bad manifest entry after byte {offset} (line {lineno}): {exc}") from exc
        return events, offset + end

    def events(self) -> list[CheckpointEvent]:
        return self.read_from(0)[0]

    def find(self, global_step: int) -> CheckpointEvent:
        """The announced checkpoint at ``global_step`` (the last entry wins)."""
        matches = [e for e in self.events() if e.global_step == global_step]
        if not matches:
            raise CheckpointError(f"{self.path}: no checkpoint at step {global_step} in the manifest")
        return matches[-1]
