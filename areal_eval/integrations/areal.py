"""Drop-ins for AReaL's evaluation classes: swap the import, keep the calls.

``FrequencyControl``, ``EpochStepTimeFreqCtl`` and ``Evaluator`` take AReaL's constructors
(field names and argument order of ``areal/utils/timeutil.py`` and ``areal/utils/evaluator.py``)
and fire on the same steps: inside ``FrequencyControl`` a step and a time condition must both
hold (AND); ``EpochStepTimeFreqCtl`` fires when its epoch, step or time control does (OR).

What differs, on purpose (AReaL's defects, fixed):

* a time condition works without torch.distributed (AReaL reads an unbound local there);
* intervals come from a monotonic clock, not the wall clock;
* ``state_dict`` also stores the elapsed seconds, so a resume does not count the downtime
  (a state saved by AReaL itself still loads, measured from its wall-clock timestamps).

And what this project adds: ``Evaluator(..., publish=PublishCheckpoint(...))`` saves and
publishes the checkpoint when an evaluation is due, instead of evaluating inline, so training
never waits for evaluation; ``Evaluator.before_train`` evaluates the untouched weights
(AReaL's ``eval_before_train`` fires at the first ``evaluate`` call, after the first update).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_eval import distributed
from areal_eval.checkpoints.manifest import checkpoint_name
from areal_eval.checkpoints.publisher import publish_checkpoint


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

    def drop_initial_value(self) -> None:
        """The initial firing already happened elsewhere (:meth:`Evaluator.before_train`)."""
        self._initial_value = False

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

    ``check(epochs, steps)`` advances all three controls and is True when any fired.
    """

    freq_epoch: int | None
    freq_step: int | None
    freq_sec: float | None
    initial_epoch_value: bool = False
    group: Any = None
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self):
        self.epoch_ctl = FrequencyControl(
            frequency_steps=self.freq_epoch, initial_value=self.initial_epoch_value, clock=self.clock
        )
        self.step_ctl = FrequencyControl(frequency_steps=self.freq_step, clock=self.clock)
        self.time_ctl = FrequencyControl(frequency_seconds=self.freq_sec, group=self.group, clock=self.clock)

    def check(self, epochs: int, steps: int) -> bool:
        # All three advance on every call (no short-circuit), as in AReaL.
        fired = [self.epoch_ctl.check(epochs), self.step_ctl.check(steps), self.time_ctl.check()]
        return any(fired)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch_ctl.state_dict(),
            "step": self.step_ctl.state_dict(),
            "time": self.time_ctl.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch_ctl.load_state_dict(state["epoch"])
        self.step_ctl.load_state_dict(state["step"])
        self.time_ctl.load_state_dict(state["time"])


@dataclasses.dataclass
class EvaluatorConfig:
    """The fields of AReaL's ``EvaluatorConfig`` that its ``Evaluator`` reads (pass AReaL's own
    config object just as well)."""

    freq_epochs: int | None = None
    """Evaluate every this many epochs."""
    freq_steps: int | None = None
    """Evaluate every this many steps."""
    freq_secs: float | None = None
    """Evaluate when this many seconds have passed."""
    eval_before_train: bool = False
    """Evaluate at the first ``evaluate`` call (after the first update, as AReaL does); see
    :meth:`Evaluator.before_train` for the untouched weights."""


@dataclasses.dataclass
class FinetuneSpec:
    """AReaL's ``FinetuneSpec(total_train_epochs, dataset_size, train_batch_size)``."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    @property
    def steps_per_epoch(self) -> int:
        return (self.dataset_size + self.train_batch_size - 1) // self.train_batch_size

    @property
    def total_train_steps(self) -> int:
        return self.total_train_epochs * self.steps_per_epoch


@dataclasses.dataclass
class PublishCheckpoint:
    """Where and how :class:`Evaluator` publishes a checkpoint instead of evaluating inline."""

    save: Callable[[Path], None]
    """Writes the model to the given directory the way evaluation loads it (``save_pretrained``:
    safetensors weights, config, tokenizer). Called on every rank; saving may be collective."""
    checkpoint_root: str | Path
    """Checkpoints go to ``checkpoint_root/global_step_XXXXXXXX``."""
    manifest: str | Path
    """The run's manifest, which ``train-and-evaluate`` follows (or the sweep reads)."""
    run_id: str
    store: str | None = None
    """``s3://bucket/prefix`` to upload each checkpoint; None: publish the local directory."""
    api_url: str | None = None
    """A Prefect API to post the checkpoint event to (event-triggered evaluation); None: the
    manifest only."""
    valid_data: str | Path | None = None
    """The validation data for this run; None: ``data/valid.jsonl`` beside the manifest."""


class Evaluator:
    """AReaL's ``Evaluator(config, ft_spec)`` and ``evaluate(evaluate_fn, epoch, step, global_step)``.

    Without ``publish`` it calls ``evaluate_fn()`` inline when due, as AReaL does. With
    ``publish`` it saves and publishes the checkpoint instead, and the pipeline evaluates it on
    its own workers; the last step of training is always published, marked final.
    """

    def __init__(self, config: Any, ft_spec: Any, publish: PublishCheckpoint | None = None):
        self.config, self.ft_spec, self.publish = config, ft_spec, publish
        self.freq_ctl = EpochStepTimeFreqCtl(
            freq_epoch=config.freq_epochs,
            freq_step=config.freq_steps,
            freq_sec=config.freq_secs,
            initial_epoch_value=config.eval_before_train,
        )
        self.published: list[int] = []
        """Global steps published so far."""

    def state_dict(self) -> dict:
        return self.freq_ctl.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.freq_ctl.load_state_dict(state)

    def before_train(self, evaluate_fn: Callable[[], Any] | None = None) -> None:
        """Evaluate (or publish, as global step 0) the weights before any update; the first
        ``evaluate`` call then does not fire for ``eval_before_train`` again."""
        self.freq_ctl.epoch_ctl.drop_initial_value()
        self._run(evaluate_fn, epoch=0, step=0, global_step=0, final=False)

    def evaluate(self, evaluate_fn: Callable[[], Any] | None, epoch: int, step: int, global_step: int) -> None:
        """Call after every training step (``step``: the step within ``epoch``)."""
        epoch_ended = step == self.ft_spec.steps_per_epoch - 1
        due = self.freq_ctl.check(epochs=int(epoch_ended), steps=1)
        final = self.publish is not None and global_step == getattr(self.ft_spec, "total_train_steps", -1) - 1
        if due or final:
            self._run(evaluate_fn, epoch, step, global_step, final)

    def _run(self, evaluate_fn, epoch: int, step: int, global_step: int, final: bool) -> None:
        if self.publish is None:
            if evaluate_fn is not None:
                evaluate_fn()
            return
        if global_step in self.published:
            return  # step 0 published by before_train, then due again at the first step
        target = Path(self.publish.checkpoint_root) / checkpoint_name(global_step)
        self.publish.save(target)
        distributed.barrier()  # every rank's shard is written before rank 0 announces it
        if distributed.rank() == 0:
            publish_checkpoint(
                target,
                self.publish.manifest,
                self.publish.run_id,
                global_step,
                epoch=epoch,
                epoch_step=step,
                final=final,
                api_url=self.publish.api_url,
                store=self.publish.store,
                valid_data=self.publish.valid_data,
            )
        self.published.append(global_step)  # on every rank, so all of them skip a repeat alike
