"""When to checkpoint or evaluate: epoch/step/time frequency control for the project's trainer.

Modelled on AReaL's ``EpochStepTimeFreqCtl`` (a ``check(epochs, steps)`` call, epoch, step and
time triggers ORed) with its own field names; the drop-ins with AReaL's exact constructors and
semantics are in :mod:`areal_eval.integrations.areal`. Unlike AReaL's:

* ``freq_secs`` works without torch.distributed (the original read an unbound local);
* ``eval_before_train`` is answered by :meth:`EpochStepTimeFreqCtl.before_train`, before step 1
  (the original fired after the first update);
* one firing resets every trigger, and a trigger that comes due within ``min_gap_steps`` of the
  last firing is folded into it, so epoch and step triggers never fire on neighbouring steps;
* elapsed time comes from a monotonic clock, never the wall clock;
* ``state_dict`` stores elapsed seconds, not timestamps, so a resume does not count downtime.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

Clock = Callable[[], float]


class FrequencyControl:
    """Fires when ``frequency_steps`` steps or ``frequency_seconds`` seconds have passed.

    Either condition is enough (OR), matching how ``EpochStepTimeFreqCtl`` combines them.
    ``sync_elapsed`` lets a distributed caller agree on elapsed time across ranks (max);
    it is only called when given, so a single process needs no process group.
    """

    def __init__(
        self,
        frequency_steps: int | None = None,
        frequency_seconds: float | None = None,
        clock: Clock = time.monotonic,
        sync_elapsed: Callable[[float], float] | None = None,
    ):
        for name, value in (("frequency_steps", frequency_steps), ("frequency_seconds", frequency_seconds)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.frequency_steps = frequency_steps
        self.frequency_seconds = frequency_seconds
        self._clock = clock
        self._sync_elapsed = sync_elapsed
        self._steps_since = 0
        self._last_time = clock()

    def elapsed_seconds(self) -> float:
        elapsed = self._clock() - self._last_time
        return self._sync_elapsed(elapsed) if self._sync_elapsed else elapsed

    def due(self, steps: int = 1) -> bool:
        """Advance by ``steps`` and report whether a condition is met (does not reset)."""
        self._steps_since += steps
        if self.frequency_steps is not None and self._steps_since >= self.frequency_steps:
            return True
        if self.frequency_seconds is not None and self.elapsed_seconds() >= self.frequency_seconds:
            return True
        return False

    def reset(self) -> None:
        self._steps_since = 0
        self._last_time = self._clock()

    def check(self, steps: int = 1) -> bool:
        """``due`` then reset when it fired: the standalone AReaL behaviour."""
        fired = self.due(steps)
        if fired:
            self.reset()
        return fired

    @property
    def steps_since(self) -> int:
        return self._steps_since

    def state_dict(self) -> dict:
        return {
            "frequency_steps": self.frequency_steps,
            "frequency_seconds": self.frequency_seconds,
            "steps_since": self._steps_since,
            # Elapsed, not a timestamp: the clock of the resumed process starts elsewhere, and
            # the time the job was down is not training time.
            "elapsed_seconds": self._clock() - self._last_time,
        }

    def load_state_dict(self, state: dict) -> None:
        self.frequency_steps = state["frequency_steps"]
        self.frequency_seconds = state["frequency_seconds"]
        self._steps_since = state["steps_since"]
        self._last_time = self._clock() - state["elapsed_seconds"]


@dataclasses.dataclass
class EpochStepTimeFreqCtl:
    """OR-combined epoch, step and time triggers with AReaL's ``check(epochs, steps)`` call.

    Call ``check(epochs=int(this step ended an epoch), steps=1)`` after every training step.
    """

    freq_epochs: int | None = None
    freq_steps: int | None = None
    freq_secs: float | None = None
    eval_before_train: bool = False
    min_gap_steps: int | None = None
    """A trigger due fewer than this many steps after the last firing is folded into that
    firing (the model has barely moved). ``None``: half of ``freq_steps`` (at least 1, which
    folds nothing)."""
    clock: Clock = time.monotonic
    sync_elapsed: Callable[[float], float] | None = None

    def __post_init__(self):
        self.epoch_ctl = FrequencyControl(frequency_steps=self.freq_epochs, clock=self.clock)
        self.step_ctl = FrequencyControl(frequency_steps=self.freq_steps, clock=self.clock)
        self.time_ctl = FrequencyControl(
            frequency_seconds=self.freq_secs, clock=self.clock, sync_elapsed=self.sync_elapsed
        )
        if self.min_gap_steps is None:
            self.min_gap_steps = max(1, (self.freq_steps or 0) // 2)
        self._steps_since_fire: int | None = None  # None: never fired
        self._before_train_pending = self.eval_before_train

    def before_train(self) -> bool:
        """True once, before the first update, when ``eval_before_train`` is set."""
        fire = self._before_train_pending
        self._before_train_pending = False
        if fire:
            self._fired()
        return fire

    def check(self, epochs: int = 0, steps: int = 1) -> bool:
        self._before_train_pending = False  # training has started: too late for "before"
        due = [self.epoch_ctl.due(epochs), self.step_ctl.due(steps), self.time_ctl.due(0)]
        if self._steps_since_fire is not None:
            self._steps_since_fire += steps
        if not any(due):
            return False
        if self._steps_since_fire is not None and self._steps_since_fire < self.min_gap_steps:
            self._fired()  # folded into the recent firing
            return False
        self._fired()
        return True

    def _fired(self) -> None:
        for ctl in (self.epoch_ctl, self.step_ctl, self.time_ctl):
            ctl.reset()
        self._steps_since_fire = 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch_ctl.state_dict(),
            "step": self.step_ctl.state_dict(),
            "time": self.time_ctl.state_dict(),
            "steps_since_fire": self._steps_since_fire,
            "before_train_pending": self._before_train_pending,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch_ctl.load_state_dict(state["epoch"])
        self.step_ctl.load_state_dict(state["step"])
        self.time_ctl.load_state_dict(state["time"])
        self._steps_since_fire = state["steps_since_fire"]
        self._before_train_pending = state["before_train_pending"]
