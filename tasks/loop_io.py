"""The follow loop's effects (``areal_eval.lifecycle.follow_loop.LoopIO``) as Prefect tasks, events and logs.

Evaluations, their logging, alerts and deletions are task runs, so they show in the UI. A new
checkpoint is an event, and a training-metrics flush a plain MLflow call with a progress
update: both happen thousands of times in a long run and would bury the evaluations in the
flow run's timeline.
"""

from __future__ import annotations

import dataclasses

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from areal_eval.alerts import Alert
from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.evaluation.jobs import EvalResult
from areal_eval.evaluation.worker_pool import WarmWorkerGroups
from areal_eval.feedback import Directive
from areal_eval.launchers.devices import SlotDevices
from areal_eval.pipeline.config import PipelineConfig
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger
from tasks.alerts import send_alert
from tasks.checkpoints import announce_checkpoint, apply_retention
from tasks.evaluation import dispatch_evaluation, evaluation_task
from tasks.mlflow_logging import log_evaluation, log_failed_attempt, recorder_for, sinks_for
from tasks.reports import announce_directive, update_evaluation_table


@dataclasses.dataclass
class TaskHandle:
    """A submitted Prefect task as an ``EvaluationHandle``."""

    future: object

    def done(self) -> bool:
        return self.future.state.is_final()

    def result(self) -> EvalResult:
        return self.future.result()


class PrefectLoopIO:
    def __init__(
        self,
        cfg: PipelineConfig,
        run: RunDir,
        mlflow_run_id: str,
        ledger: Ledger,
        total_steps: int | None,
        workers: WarmWorkerGroups | SlotDevices | None = None,
    ):
        self.cfg, self.run, self.mlflow_run_id, self.ledger = cfg, run, mlflow_run_id, ledger
        self.total_steps, self.workers = total_steps, workers
        self.logger = get_run_logger()
        sinks_for(cfg, run, mlflow_run_id, single_writer=True)  # the loop owns the run: its W&B run stays open
        self.progress = create_progress_artifact(0.0, description=f"{run.run_id}: training steps done (%)")
        self._shown_tenths = 0

    def announce(self, event: CheckpointEvent) -> None:
        announce_checkpoint(event, self.run.manifest)

    def submit(self, event: CheckpointEvent, reason: str, probe: bool = False) -> TaskHandle:
        if self.cfg.eval.deployment:  # on a server: the evaluation pool's workers run it
            return TaskHandle(dispatch_evaluation.submit(event, self.run.manifest, self.cfg, reason, probe=probe))
        data = event.valid_data or self.run.valid_data  # what the publisher named, else the run's own
        task = evaluation_task(event, probe)
        return TaskHandle(task.submit(event, data, self.cfg, self.run.evals, workers=self.workers, probe=probe))

    def log_result(self, result: EvalResult, reason: str) -> None:
        log_evaluation(
            self.cfg, self.mlflow_run_id, result, reason, recorded_in=(self.run, self.run.run_id), ledger=self.ledger
        )
        update_evaluation_table(self.cfg, self.run.run_id, self.ledger)

    def send_alert(self, alert: Alert) -> None:
        send_alert(alert, self.cfg, self.mlflow_run_id, self.run)

    def log_failed_attempt(self, step: int) -> None:
        log_failed_attempt(self.cfg, self.mlflow_run_id, self.ledger, step)

    def log_training(self, rows: list[dict]) -> None:
        recorder_for(self.cfg, self.mlflow_run_id, self.run).training([r for r in rows if "loss" in r])
        if self.total_steps:  # unknown for an external trainer without train.max_steps
            self.set_progress(rows[-1]["step"] / self.total_steps)

    def set_progress(self, fraction: float) -> None:
        """In tenths: each update is an event that ``prefect deployment run --watch`` prints."""
        tenths = int(10 * min(1.0, fraction))
        if tenths > self._shown_tenths:
            self._shown_tenths = tenths
            update_progress_artifact(self.progress, 10.0 * tenths)

    def delete_checkpoints(self, events: list[CheckpointEvent]) -> None:
        apply_retention(self.cfg, self.run, self.mlflow_run_id, self.ledger, doomed=events)

    def say_directive(self, directive: Directive) -> None:
        announce_directive(self.run.run_id, directive)

    def info(self, message: str) -> None:
        self.logger.info(message)

    def warn(self, message: str) -> None:
        self.logger.warning(message)
