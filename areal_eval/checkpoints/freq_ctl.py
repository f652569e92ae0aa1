"""When to checkpoint or evaluate: AReaL's frequency control (``areal/utils/timeutil.py``), once.

``FrequencyControl`` and ``EpochStepTimeFreqCtl`` take AReaL's constructors (field names and
argument order) and fire on the same steps: inside ``FrequencyControl`` a step and a time
condition must both hold (AND); ``EpochStepTimeFreqCtl`` fires when its epoch, step or time
control does (OR). :mod:`areal_eval.integrations.areal` offers them under AReaL's import path;
the project's trainer (``areal_eval.train``) uses them with two options of its own:

* ``fold_within_steps``: one firing restarts every control, and a control that comes due within
  that many steps of the last firing is folded into it, so epoch and step triggers never fire on
  neighbouring steps (AReaL's controls each fire on their own);
* :meth:`EpochStepTimeFreqCtl.before_train`: the initial firing before the first update (AReaL's
  ``initial_epoch_value`` fires at the first ``check``, after it).

What differs from AReaL's, on purpose (its defects, fixed): a time condition works without
torch.distributed (AReaL reads an unbound local there); intervals come from a monotonic clock,
not the wall clock; ``state_dict`` also stores the elapsed seconds, so a resume does not count
the downtime (a state saved by AReaL itself still loads, measured from its wall-clock timestamps).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any


class FrequencyControl:
    """AReaL's ``FrequencyControl(frequency_seconds, frequency_steps, initial_value, group)``.

    ``check(steps)`` is True when ``frequency_steps`` steps *and* ``frequency_seconds`` seconds
    have passed since it was last True (either one alone when only one is set; never when
    neither is, except for ``initial_value``). Elapsed time is the largest over the ranks of
    ``group`` when torch.distributed is initialized, so every rank decides alike.
    """

    def __init__(
        self,
        frequency_seconds: float | None = None,
        frequency_steps: int | None = None,
        initial_value: bool = False,
        group: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.frequency_seconds = frequency_seconds
        self.frequency_steps = frequency_steps
        self.group = group
        self._clock = clock
        self._initial_value = initial_value
        self._start = self._last_time = clock()
        self._steps = self._last_steps = 0
        self._interval_seconds: float | None = None
        self._interval_steps: int | None = None
        self._lock = threading.Lock()

    @property
    def total_seconds(self) -> float:
        return self._clock() - self._start

    @property
    def total_steps(self) -> int:
        return self._steps

    @property
    def interval_seconds(self) -> float | None:
        return self._interval_seconds

    @property
    def interval_steps(self) -> int | None:
        return self._interval_steps

    def check(self, steps: int = 1) -> bool:
        with self._lock:
            now = self._clock()
            self._steps += steps
            if self._initial_value:
                self._initial_value = False
                self._mark(now)
                return True
            self._interval_seconds = now - self._last_time
            self._interval_steps = self._steps - self._last_steps
            if self.frequency_steps is None and self.frequency_seconds is None:
                return False
            if self.frequency_seconds is not None:
                from areal_eval import distributed  # torch: not imported by the flows, which read the trainer's config

                self._interval_seconds = distributed.all_reduce_max_scalar(self._interval_seconds, self.group)
                if self._interval_seconds < self.frequency_seconds:
                    return False
            if self.frequency_steps is not None and self._interval_steps < self.frequency_steps:
                return False
            self._mark(now)
            return True

    def _mark(self, now: float) -> None:
        self._last_time, self._last_steps = now, self._steps

    def reset_time(self) -> None:
        self._last_time = self._clock()

    def reset(self) -> None:
        """Count steps and time from now, as if it had just fired (another control fired)."""
        with self._lock:
            self._mark(self._clock())

    def take_initial_value(self) -> bool:
        """The initial firing, now instead of at the next ``check`` (once)."""
        fire, self._initial_value = self._initial_value, False
        return fire

    def state_dict(self) -> dict:
        now, wall = self._clock(), time.time()
        return {
            # AReaL's keys (its spelling included), so either side can load the other's state.
            "frequence_seconds": self.frequency_seconds,
            "frequency_steps": self.frequency_steps,
            "start_time": wall - (now - self._start),
            "steps": self._steps,
            "last_time": wall - (now - self._last_time),
            "last_steps": self._last_steps,
            "interval_steps": self._interval_steps,
            "interval_seconds": self._interval_seconds,
            "initial_value": self._initial_value,
            # Ours: time since the last firing, without the time the job was down.
            "elapsed_seconds": now - self._last_time,
            "total_seconds": now - self._start,
        }

    def load_state_dict(self, state: dict) -> None:
        now, wall = self._clock(), time.time()
        self.frequency_seconds = state["frequence_seconds"]
        self.frequency_steps = state["frequency_steps"]
        self._steps, self._last_steps = state["steps"], state["last_steps"]
        self._interval_steps, self._interval_seconds = state["interval_steps"], state["interval_seconds"]
        self._initial_value = state["initial_value"]
        elapsed = state.get("elapsed_seconds", wall - state["last_time"])  # AReaL's own: timestamps
        self._last_time = now - elapsed
        self._start = now - state.get("total_seconds", wall - state["start_time"])


@dataclasses.dataclass
class EpochStepTimeFreqCtl:
    """AReaL's ``EpochStepTimeFreqCtl(freq_epoch, freq_step, freq_sec, initial_epoch_value, group)``.

    ``check(epochs, steps)`` advances all three controls and is True when any fired. Call it
    after every training step with ``epochs=int(this step ended an epoch)``.
    """

    freq_epoch: int | None = None
    freq_step: int | None = None
    freq_sec: float | None = None
    initial_epoch_value: bool = False
    group: Any = None
    clock: Callable[[], float] = time.monotonic
    fold_within_steps: int | None = None
    """A control due fewer than this many steps after the last firing is folded into that firing
    (the model has barely moved), and every firing restarts all three. None: AReaL's rule."""

    def __post_init__(self):
        self.epoch_ctl = FrequencyControl(
            frequency_steps=self.freq_epoch, initial_value=self.initial_epoch_value, clock=self.clock
        )
        self.step_ctl = FrequencyControl(frequency_steps=self.freq_step, clock=self.clock)
        self.time_ctl = FrequencyControl(frequency_seconds=self.freq_sec, group=self.group, clock=self.clock)
        self._steps_since_fire: int | None = None  # None: never fired

    def before_train(self) -> bool:
        """True once, before the first update, when ``initial_epoch_value`` is set; the first
        ``check`` then does not fire for it again."""
        fire = self.epoch_ctl.take_initial_value()
        if fire and self.fold_within_steps is not None:
            self._fired()
        return fire

    def check(self, epochs: int, steps: int) -> bool:
        # All three advance on every call (no short-circuit), as in AReaL.
        fired = [self.epoch_ctl.check(epochs), self.step_ctl.check(steps), self.time_ctl.check()]
        if self.fold_within_steps is None:
            return any(fired)
        if self._steps_since_fire is not None:
            self._steps_since_fire += steps
        if not any(fired):
            return False
        folded = self._steps_since_fire is not None and self._steps_since_fire < self.fold_within_steps
        self._fired()
        return not folded

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
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch_ctl.load_state_dict(state["epoch"])
        self.step_ctl.load_state_dict(state["step"])
        self.time_ctl.load_state_dict(state["time"])
        self._steps_since_fire = state.get("steps_since_fire")  # absent from AReaL's own
