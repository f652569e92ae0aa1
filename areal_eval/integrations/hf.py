"""A Hugging Face ``Trainer`` callback (TRL's trainers are Trainers too): every checkpoint the
Trainer saves is published to the pipeline, and a stop request from the pipeline ends training.

    trainer = Trainer(..., callbacks=[PublishCheckpoints("runs/my-run", run_id="my-run")])

On each save, the evaluation files of ``output_dir/checkpoint-N`` (weights, config, tokenizer)
are linked into ``run_dir/checkpoints/global_step_N`` and published with their sizes and
sha256: to the run's manifest, to ``store`` when it is ``s3://``, and as an event when a Prefect
API is given. Hashing, uploading and publishing run in a thread of their own, one checkpoint
after another, so training does not wait for them; the final checkpoint's are waited for.
Optimizer, scheduler, RNG and trainer state stay behind: evaluation never needs them, and they
are pickles.
"""

from __future__ import annotations

import os
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from areal_eval import distributed, jsonl
from areal_eval.checkpoints.manifest import Manifest, checkpoint_name
from areal_eval.checkpoints.publisher import check_has_weights, publish_checkpoint
from areal_eval.checkpoints.store import S3Config
from areal_eval.runs.directives import Inbox, apply_directive
from areal_eval.runs.directory import RunDir, StopSignal

RUN_DIR_ENV = "AREAL_EVAL_RUN_DIR"
TRAINING_STATE = ("optimizer.", "scheduler.", "scaler.", "rng_state", "trainer_state.json", "training_args.bin")
"""Names (prefixes) of the files a Trainer checkpoint holds for resuming training only."""


def evaluation_files(checkpoint: Path) -> list[Path]:
    """The files of a Trainer checkpoint that evaluation needs; refuses one without weights."""
    check_has_weights(checkpoint)
    return [p for p in sorted(checkpoint.iterdir()) if p.is_file() and not p.name.startswith(TRAINING_STATE)]


def link_or_copy(files: list[Path], target: Path) -> None:
    """``target`` gets the files as hard links (no copy on the same file system), written whole:
    a directory that exists is from an earlier attempt and is replaced."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for source in files:
        try:
            os.link(source, partial / source.name)
        except OSError:  # another file system, or links not supported
            shutil.copy2(source, partial / source.name)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def trainer_rollback(output_dir: str | Path, model, optimizer, schedule):
    """A rollback for a running Trainer: ``roll_back(to_step)`` loads the weights, optimizer and
    scheduler state of the Trainer's own ``checkpoint-<to_step>`` (rank 0 says whether it is
    still there: ``save_total_limit`` may have rotated it away) and returns None, or why not.
    The data position and RNG stay where they are: the Trainer's loop owns them."""

    def roll_back(to_step: int) -> str | None:
        import torch

        source = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{to_step}"
        needed = [source / "optimizer.pt", source / "scheduler.pt", source / "config.json"]
        gone = None if all(p.exists() for p in needed) else str(source)
        gone = distributed.broadcast_object(gone) if distributed.world_size() > 1 else gone
        if gone is not None:
            return f"its target, the Trainer's checkpoint {gone}, is gone (save_total_limit?)"
        model.load_state_dict(type(model).from_pretrained(source).state_dict())
        optimizer.load_state_dict(torch.load(source / "optimizer.pt", weights_only=True))
        if schedule is not None:
            schedule.load_state_dict(torch.load(source / "scheduler.pt", weights_only=True))
        return None

    return roll_back


def trainer_trackers(args) -> dict:
    """Where this Trainer logs: its active W&B run (the ``wandb`` integration started it before
    this callback's ``on_train_begin``) and its TensorBoard ``logging_dir``."""
    found: dict = {}
    if "tensorboard" in (args.report_to or []):
        # Its TensorBoardCallback's directory: $TENSORBOARD_LOGGING_DIR (transformers 5), or
        # ``logging_dir`` (4.x), else ``runs/<time>_<host>`` in output_dir, whose parent
        # ``tensorboard --logdir`` is given.
        logdir = os.environ.get("TENSORBOARD_LOGGING_DIR") or getattr(args, "logging_dir", None)
        found["tensorboard_logdir"] = str(Path(logdir or Path(args.output_dir) / "runs").expanduser().resolve())
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is not None:
        found["wandb"] = {"run_id": run.id, "project": run.project, "entity": run.entity, "group": run.group or None}
    return found


class PublishCheckpoints(TrainerCallback):
    """Publish each saved checkpoint; honour the pipeline's stop request at every step.

    Args:
        run_dir: the run's directory: ``manifest.jsonl``, ``checkpoints/`` and the stop request
            live there (``train-and-evaluate`` and ``evaluate-checkpoint`` read the same layout);
            default ``$AREAL_EVAL_RUN_DIR``.
        run_id: the run's id in the manifest and MLflow (default: ``run_dir``'s name).
        store: ``s3://bucket/prefix`` to upload each checkpoint; None: publish in place.
        s3: S3 client settings for ``store``.
        api_url: a Prefect API to post each checkpoint event to (event-triggered evaluation);
            default ``$PREFECT_API_URL``; None there too: the manifest only.
        valid_data: the validation data to evaluate on (a path the workers can read).
    """

    def __init__(
        self,
        run_dir: str | Path | None = None,
        run_id: str | None = None,
        store: str | None = None,
        s3: S3Config | None = None,
        api_url: str | None = None,
        valid_data: str | Path | None = None,
    ):
        run_dir = run_dir or os.environ.get(RUN_DIR_ENV)
        self.run = RunDir(run_dir) if run_dir else None
        self.run_id = run_id or (self.run.root.name if self.run else None)
        self.run_id_given = run_id is not None
        self.store, self.s3, self.valid_data = store, s3, valid_data
        self.api_url = api_url or os.environ.get("PREFECT_API_URL")
        self.stop = StopSignal(self.run.stop_file) if self.run else None
        self.inbox: Inbox | None = None
        """What evaluation asks of training (set when training begins)."""
        self.weights_from: int | None = None
        """The step a rollback went back to: every later checkpoint's weights descend from it."""
        self.published: list[int] = []
        """Global steps published so far (by the main process)."""
        self._publisher: ThreadPoolExecutor | None = None
        """Hashes and publishes saved checkpoints off the training loop, one at a time, in order."""
        self._publishing: list[Future] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if self.run is None:  # now, not at the first save, hours into training
            raise ValueError(
                f"PublishCheckpoints has no run directory for the manifest: pass run_dir=... or set {RUN_DIR_ENV}"
            )
        if state.is_world_process_zero:
            self._agree_on_run_id()
            jsonl.write_json(self.run.trainer_trackers, trainer_trackers(args))
        # An answer made after the step training starts from is void: its change went with that state.
        self.inbox = Inbox(self.run.root, resumed_at=state.global_step)
        resumed = [e for e in Manifest(self.run.manifest).events() if e.global_step <= state.global_step]
        self.weights_from = resumed[-1].train_metrics.get("weights_from_step") if resumed else None
        return control

    def _agree_on_run_id(self) -> None:
        """The run directory's id (a ``train-and-evaluate`` following it may have named it first)
        is the one published; a different ``run_id`` would publish entries the flow skips."""
        if jsonl.create_atomic(self.run.run_id_file, self.run_id):
            return
        if not self.run_id_given:
            self.run_id = self.run.run_id
        elif self.run.run_id != self.run_id:
            raise ValueError(f"{self.run.run_id_file} says run id {self.run.run_id!r}, not {self.run_id!r}")

    def on_save(self, args, state, control, **kwargs):
        """Link the checkpoint's evaluation files (the Trainer may rotate its own copy away), then
        hash and publish them in a thread of their own while training goes on. A publish that
        failed raises here, at the next save; the final one is waited for."""
        if not state.is_world_process_zero:
            return control
        self._raise_failed()
        source = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        target = self.run.checkpoints / checkpoint_name(state.global_step)
        link_or_copy(evaluation_files(source), target)
        # The loss logged at this very step, if any: a metric lands at the step it belongs to.
        loss = next((r["loss"] for r in state.log_history if "loss" in r and r.get("step") == state.global_step), None)
        final = state.global_step >= state.max_steps or bool(control.should_training_stop)
        if self._publisher is None:
            self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-checkpoints")
        self._publishing.append(
            self._publisher.submit(self._publish, target, state.global_step, int(state.epoch or 0), loss, final)
        )
        if final:
            self.wait()
        return control

    def _publish(self, target: Path, step: int, epoch: int, loss: float | None, final: bool) -> None:
        metrics = ({"loss": loss} if loss is not None else {}) | (
            {"weights_from_step": self.weights_from} if self.weights_from is not None else {}
        )
        publish_checkpoint(
            target,
            self.run.manifest,
            self.run_id,
            step,
            epoch=epoch,
            train_metrics=metrics or None,
            final=final,
            api_url=self.api_url,
            store=self.store,
            s3=self.s3,
            valid_data=self.valid_data,
        )
        self.published.append(step)

    def _raise_failed(self) -> None:
        for future in [f for f in self._publishing if f.done()]:
            self._publishing.remove(future)
            future.result()  # raises what the publish raised

    def wait(self) -> None:
        """Wait until every checkpoint saved so far is published; raises the first that failed."""
        while self._publishing:
            self._publishing.pop(0).result()

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.wait()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        # Every rank must stop at the same step: the first to see the request stops them all.
        if distributed.all_reduce_max_scalar(1.0 if self.stop.requested() else 0.0):
            control.should_training_stop = True
        for directive in self.inbox.take() if self.inbox else []:  # the same on every rank
            optimizer, schedule = kwargs["optimizer"], kwargs.get("lr_scheduler")
            roll_back = trainer_rollback(args.output_dir, kwargs["model"], optimizer, schedule)
            refused, stop = apply_directive(
                directive, optimizer, schedule, who="PublishCheckpoints", roll_back=roll_back
            )
            control.should_training_stop = control.should_training_stop or stop
            if directive.action == "rollback" and refused is None:
                self.weights_from = int(directive.args["to_step"])
                control.should_save = True  # the weights gone back to, published at this step
            self.inbox.answer(directive, state.global_step, refused)
        if control.should_training_stop or state.global_step >= state.max_steps:
            control.should_save = True  # the last weights are published, marked final
        return control
