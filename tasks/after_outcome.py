"""What a flow run that evaluates from outside the run (``evaluate-checkpoint``: the trigger,
the service, the sweep) does after an outcome, as Prefect tasks and its log: its side of
:func:`~areal_eval.lifecycle.outcome.follow_outcome`."""

from __future__ import annotations

import dataclasses

from prefect import get_run_logger

from areal_eval.alerts import Alert
from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.checkpoints.remote_run import push_requests, push_results, remote_store
from areal_eval.evaluation.jobs import EvalResult
from areal_eval.feedback import Directive
from areal_eval.lifecycle.outcome import decision_line
from areal_eval.lifecycle.shared_run import SharedRun
from areal_eval.pipeline.config import PipelineConfig
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger
from areal_eval.scheduling.policy import Decision
from tasks.alerts import send_alert
from tasks.mlflow_logging import log_evaluation, log_failed_attempt
from tasks.reports import announce_directive


@dataclasses.dataclass
class FlowRunOutcomes:
    cfg: PipelineConfig
    mlflow_run_id: str
    run: RunDir
    shared: SharedRun
    looked_back: list[CheckpointEvent]
    """The flow run's own: checkpoints claimed for it, evaluated after what it claimed."""

    def look_back_at(self, event: CheckpointEvent) -> None:
        self.looked_back.append(event)

    def record_failed_attempt(self, step: int) -> None:
        try:
            log_failed_attempt(self.cfg, self.mlflow_run_id, Ledger(self.run.ledger), step)
        except Exception as exc:  # noqa: BLE001 - the ledger has it; MLflow gets it with the run's end
            get_run_logger().warning("step %d: failed attempt not in MLflow yet: %r", step, exc)

    def warn(self, message: str) -> None:
        get_run_logger().warning(message)

    def say_decision(self, event: CheckpointEvent, decision: Decision) -> None:
        get_run_logger().info(decision_line(event, decision))

    def deliver(self, event: CheckpointEvent, result: EvalResult, reason: str) -> None:
        log_evaluation(self.cfg, self.mlflow_run_id, result, reason, recorded_in=(self.run, event.run_id))
        self.shared.delivered(event.global_step)
        self.tell_trainer()

    def send(self, alert: Alert) -> None:
        send_alert(alert, self.cfg, self.mlflow_run_id, self.run)
        if alert.stop_training:
            self.tell_trainer()

    def say_directive(self, directive: Directive) -> None:
        announce_directive(self.shared.run_id or self.run.root.name, directive)
        self.tell_trainer()

    def tell_trainer(self) -> None:
        """A run that lives on S3 (this is a local copy): what is asked of its trainer, and the
        results, go there."""
        try:
            if (store := remote_store(self.run.root, self.cfg.storage.s3)) is not None:
                push_requests(store, self.run.root)
                push_results(store, self.run.root)
        except Exception as exc:  # noqa: BLE001 - the next request sends it with its own
            get_run_logger().warning("what was asked of training has not reached %s yet: %r", self.run.root, exc)
