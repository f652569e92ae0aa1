"""What each sink has acknowledged, durably: the sinks' half of exactly once.

A result or training row is the sink's to deliver until the sink took it; the line saying so is
appended right after (``<run>/sinks/outbox.jsonl``). Flow runs of one run take turns on it (a
lock beside it) from the check to the acknowledgement, so two processes never deliver one point.
A sink that failed is simply behind: its next call, in this process or the next, delivers what
it has not acknowledged. A sink whose points are durable only once it is closed (W&B) has its
acknowledgements *held* in memory until then: a process killed first leaves them unwritten.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from areal_eval import jsonl
from areal_eval.runs.directory import file_lock


class SinkOutbox:
    def __init__(self, directory: str | Path):
        self.path = Path(directory) / "outbox.jsonl"
        self._lock = self.path.with_suffix(".lock")
        self._acked: set[tuple[str, str]] = set()
        self._through: dict[str, int] = {}
        self._held: dict[str, list[dict]] = {}
        self._offset, self._line = 0, 1

    @contextlib.contextmanager
    def turn(self) -> Iterator[SinkOutbox]:
        """Hold the run's sink lock, with what other processes acknowledged read in."""
        with file_lock(self._lock):
            self._read_new()
            yield self

    def has(self, sink: str, key: str) -> bool:
        return (sink, key) in self._acked

    def ack(self, sink: str, key: str, *, held: bool = False) -> None:
        self._write({"sink": sink, "key": key}, held)
        self._acked.add((sink, key))

    def through(self, sink: str) -> int:
        """The last training step ``sink`` took (-1: none)."""
        return self._through.get(sink, -1)

    def ack_through(self, sink: str, step: int, *, held: bool = False) -> None:
        self._write({"sink": sink, "through": step}, held)
        self._through[sink] = max(step, self.through(sink))

    def _write(self, row: dict, held: bool) -> None:
        if held:
            self._held.setdefault(row["sink"], []).append(row)
        else:
            jsonl.append(self.path, row)

    def commit(self, sink: str) -> None:
        """``sink`` made what it was given durable (it closed): its held acknowledgements are written."""
        for row in self._held.pop(sink, []):
            jsonl.append(self.path, row)

    def drop(self, sink: str) -> None:
        """``sink`` failed before its points were durable: what it held is to be delivered again."""
        for row in self._held.pop(sink, []):
            if "key" in row:
                self._acked.discard((sink, row["key"]))
        self._through.pop(sink, None)
        self._offset, self._line = 0, 1  # read the file again: it says what was written

    def _read_new(self) -> None:
        chunk = jsonl.read_complete(self.path, self._offset, self._line)
        rows, _ = jsonl.loads_skipping_torn(chunk.lines, self.path)  # a torn last line: not acknowledged
        for _, row in rows:
            if "through" in row:
                self._through[row["sink"]] = max(int(row["through"]), self.through(row["sink"]))
            else:
                self._acked.add((row["sink"], row["key"]))
        self._offset, self._line = chunk.offset, chunk.line
