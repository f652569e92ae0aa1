"""The part of a run's history that :func:`~areal_eval.scheduling.policy.decide` reads, kept
entry by entry, so a decision costs the same at any run length."""

from __future__ import annotations

import bisect
import math

from areal_eval.scheduling.policy import COVER_WINDOW, HistoryEntry


class DecisionHistory:
    """The part of a run's history that :func:`~areal_eval.scheduling.policy.decide` reads, kept up to date
    entry by entry.

    ``decide`` looks at the newest entry, the last two finished results, the best result and the
    cadence of the last few checkpoints. Rebuilding the whole history for every checkpoint made a
    decision cost grow with the run (2.5 ms at 3,000 checkpoints); this index answers with the
    same few entries at any length, so ``decide(event, h.view(), cfg, h.offered_before(step))``
    equals ``decide`` on the full history.
    """

    def __init__(self, higher_is_better: bool = True):
        self._sign = 1.0 if higher_is_better else -1.0
        self._entries: dict[int, HistoryEntry] = {}
        self._steps: list[int] = []
        """Sorted steps in the history (queued or finished)."""
        self._finished: list[int] = []
        """Sorted steps with a finite result."""
        self._best: HistoryEntry | None = None
        self._offered: list[int] = []
        """Sorted steps of every checkpoint offered, whatever became of it."""

    def __len__(self) -> int:
        return len(self._steps)

    def offer(self, step: int) -> None:
        i = bisect.bisect_left(self._offered, step)
        if i == len(self._offered) or self._offered[i] != step:
            self._offered.insert(i, step)

    def offered_before(self, step: int, window: int = COVER_WINDOW) -> list[int]:
        """The steps offered before ``step`` and after the newest entry (at most ``window``): all
        that the cover bound counts."""
        i = bisect.bisect_left(self._offered, step)
        j = bisect.bisect_right(self._offered, self._steps[-1]) if self._steps else i
        return self._offered[max(j, i - window) : i]

    def set(self, step: int, entry: HistoryEntry | None) -> None:
        """``step``'s entry is now ``entry`` (None: not in the history, e.g. superseded or failed)."""
        self.offer(step)
        old = self._entries.pop(step, None)
        if old is not None:
            _remove(self._steps, step)
            if _is_finished(old):
                _remove(self._finished, step)
        if entry is not None:
            self._entries[step] = entry
            bisect.insort(self._steps, step)
            if _is_finished(entry):
                bisect.insort(self._finished, step)
        if old is not None and self._best is old:
            self._best = max(map(self._entries.get, self._finished), key=self._score, default=None)
        elif entry is not None and _is_finished(entry) and (self._best is None or self._beats(entry, self._best)):
            self._best = entry

    def _score(self, h: HistoryEntry) -> float:
        return self._sign * h.metric

    def _beats(self, a: HistoryEntry, b: HistoryEntry) -> bool:
        """``a`` is the best rather than ``b``; on a tie the earlier step, as ``max`` picks."""
        return self._score(a) > self._score(b) or (self._score(a) == self._score(b) and a.step < b.step)

    def view(self) -> list[HistoryEntry]:
        """The entries ``decide`` reads, in step order."""
        picked = {self._steps[-1]} if self._steps else set()
        picked |= set(self._finished[-2:])
        if self._best is not None:
            picked.add(self._best.step)
        return [self._entries[s] for s in sorted(picked)]


def _is_finished(h: HistoryEntry) -> bool:
    return h.metric is not None and math.isfinite(h.metric)


def _remove(ordered: list[int], value: int) -> None:
    i = bisect.bisect_left(ordered, value)
    if i < len(ordered) and ordered[i] == value:
        del ordered[i]
