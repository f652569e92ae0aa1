"""Drop-ins for AReaL's evaluation classes: swap the import, keep the calls.

``FrequencyControl`` and ``EpochStepTimeFreqCtl`` (from :mod:`areal_eval.checkpoints.freq_ctl`,
where their rules and AReaL's fixed defects are described) and ``Evaluator`` take AReaL's
constructors (field names and argument order of ``areal/utils/timeutil.py`` and
``areal/utils/evaluator.py``) and fire on the same steps.

And what this project adds: ``Evaluator(..., publish=PublishCheckpoint(...))`` saves and
publishes the checkpoint when an evaluation is due, instead of evaluating inline, so training
never waits for evaluation; ``Evaluator.before_train`` evaluates the untouched weights
(AReaL's ``eval_before_train`` fires at the first ``evaluate`` call, after the first update).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_eval import distributed
from areal_eval.checkpoints.freq_ctl import EpochStepTimeFreqCtl, FrequencyControl
from areal_eval.checkpoints.manifest import checkpoint_name
from areal_eval.checkpoints.publisher import publish_checkpoint
from areal_eval.feedback import Directive
from areal_eval.runs.directives import Inbox

__all__ = [
    "EpochStepTimeFreqCtl",
    "Evaluator",
    "EvaluatorConfig",
    "FinetuneSpec",
    "FrequencyControl",
    "PublishCheckpoint",
]


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

    With ``publish``, each ``evaluate`` call also takes what evaluation asks of training
    (:mod:`areal_eval.runs.directives`), on every rank alike, and hands each to ``act``, which
    applies it and returns None, or returns why it cannot; the answer is recorded. A ``stop``
    that ``act`` accepts publishes this step as the final checkpoint and sets :attr:`stopped`:
    the loop ends there. ``resumed_at``: the step training resumed from (0 for a fresh start).

    A ``rollback`` that ``act`` accepts (``act`` restored the checkpoint of ``args["to_step"]``
    and pushed its weights to the rollout engines) is published at once, this step's checkpoint
    marked ``weights_from_step``; from then on :meth:`abandoned` says which policy versions' rollouts
    to drop: those the abandoned policies generated.
    """

    def __init__(
        self,
        config: Any,
        ft_spec: Any,
        publish: PublishCheckpoint | None = None,
        *,
        act: Callable[[Directive], str | None] | None = None,
        resumed_at: int = 0,
    ):
        self.config, self.ft_spec, self.publish, self.act = config, ft_spec, publish, act
        self.inbox = Inbox(Path(publish.manifest).parent, resumed_at=resumed_at) if publish else None
        self.stopped: str | None = None
        """The stop directive that ended training (its line), if any."""
        self.freq_ctl = EpochStepTimeFreqCtl(
            freq_epoch=config.freq_epochs,
            freq_step=config.freq_steps,
            freq_sec=config.freq_secs,
            initial_epoch_value=config.eval_before_train,
        )
        self.published: list[int] = []
        """Global steps published so far."""
        self.rollbacks: list[tuple[int, int]] = []
        """``(to_step, at_step)`` of each rollback applied: the policy versions after ``to_step``
        up to ``at_step`` were abandoned."""

    def abandoned(self, version: int) -> bool:
        """Whether a rollout generated by policy ``version`` (the global step of the weights it was
        sampled with) comes from a policy a rollback abandoned: drop it from the buffer."""
        return any(to_step < version <= at_step for to_step, at_step in self.rollbacks)

    def state_dict(self) -> dict:
        return {**self.freq_ctl.state_dict(), "rollbacks": [list(r) for r in self.rollbacks]}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.rollbacks = [tuple(r) for r in state.pop("rollbacks", [])]
        self.freq_ctl.load_state_dict(state)

    def before_train(self, evaluate_fn: Callable[[], Any] | None = None) -> None:
        """Evaluate (or publish, as global step 0) the weights before any update; the first
        ``evaluate`` call then does not fire for ``eval_before_train`` again."""
        self.freq_ctl.epoch_ctl.take_initial_value()
        self._run(evaluate_fn, epoch=0, step=0, global_step=0, final=False)

    def evaluate(self, evaluate_fn: Callable[[], Any] | None, epoch: int, step: int, global_step: int) -> None:
        """Call after every training step (``step``: the step within ``epoch``)."""
        epoch_ended = step == self.ft_spec.steps_per_epoch - 1
        due = self.freq_ctl.check(epochs=int(epoch_ended), steps=1)
        final = self.publish is not None and global_step == getattr(self.ft_spec, "total_train_steps", -1) - 1
        rollbacks = len(self.rollbacks)
        final = self._take_directives(global_step) or final
        if due or final or len(self.rollbacks) > rollbacks:  # a rollback's weights: published at once
            self._run(evaluate_fn, epoch, step, global_step, final)

    def _take_directives(self, global_step: int) -> bool:
        """Apply and answer what waits; True when a stop was applied (this step is the last)."""
        if self.inbox is None or self.stopped:
            return False
        for directive in self.inbox.take():
            refused = self.act(directive) if self.act else "the trainer passed no act= to Evaluator"
            if directive.action == "stop" and refused is None:
                self.stopped = directive.line()
            if directive.action == "rollback" and refused is None:
                self.rollbacks.append((int(directive.args["to_step"]), global_step))
            self.inbox.answer(directive, global_step, refused)
        return self.stopped is not None

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
                train_metrics={"weights_from_step": self.rollbacks[-1][0]} if self.rollbacks else None,
                final=final,
                api_url=self.publish.api_url,
                store=self.publish.store,
                valid_data=self.publish.valid_data,
            )
        self.published.append(global_step)  # on every rank, so all of them skip a repeat alike
