"""The bounded queue between the scheduler and the evaluation workers.

When evaluation falls behind training, waiting checkpoints are coalesced to the newest: the
older ones are returned as superseded (to be recorded with that reason), never silently lost,
and the backlog cannot grow without bound. Pinned items (the first and final checkpoint) are
never superseded; they are served first, oldest first. With ``coalesce=False`` it is a plain
FIFO that supersedes nothing.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class CoalescingQueue(Generic[T]):
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
