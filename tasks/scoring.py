"""Prefect task that evaluates one checkpoint on separate torchrun workers."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.deployments import run_deployment

from areal_eval.checkpoints.manifest import CheckpointError, CheckpointEvent
from areal_eval.config.pipeline import PipelineConfig
from areal_eval.evaluation.jobs import CorruptCheckpoint, EvalResult, EvaluationFailed, run_evaluation_job
from areal_eval.evaluation.worker_pool import WarmWorkerGroups
from tasks.mlflow_logging import tracker_for


def worth_retrying(task, task_run, state) -> bool:
    """A killed or hung worker may succeed next time; a corrupt checkpoint will not."""
    exc = state.result(raise_on_failure=False)
    return not isinstance(exc, (CorruptCheckpoint, CheckpointError))


@task(
    cache_policy=NO_CACHE,
    name="score-checkpoint",
    task_run_name="score-step-{event.global_step}",
    retry_condition_fn=worth_retrying,
    retry_delay_seconds=1,
)
def score_checkpoint(
    event: CheckpointEvent,
    data_path: Path,
    cfg: PipelineConfig,
    work_dir: Path,
    workers: WarmWorkerGroups | None = None,
) -> EvalResult:
    """Fetch the checkpoint, load it on ``cfg.eval.nproc`` ranks (a free group of ``workers``)
    and reduce its metrics; raises on failure."""
    with workers.lease() if workers is not None else contextlib.nullcontext() as group:
        return run_evaluation_job(
            event, data_path, cfg.eval, work_dir, cfg.model.max_length, cfg.storage.s3, cfg.checkpoint_cache, group
        )


_process_workers: WarmWorkerGroups | None = None
"""Warm worker groups every evaluation of this process runs on (the evaluation service's)."""


@contextlib.contextmanager
def serve_warm_workers(cfg: PipelineConfig, work_dir: Path) -> Iterator[WarmWorkerGroups]:
    """Warm worker groups (``eval.slots`` of ``eval.nproc`` ranks) for every ``evaluate`` call
    this process makes while inside: a long-lived service pays worker start-up once."""
    global _process_workers
    with WarmWorkerGroups(
        cfg.eval.slots, cfg.eval.nproc, work_dir, cfg.eval.nice, cfg.eval.collective_timeout_s
    ) as groups:
        _process_workers = groups
        try:
            yield groups
        finally:
            _process_workers = None


def score_now(event: CheckpointEvent, data_path: Path, cfg: PipelineConfig, work_dir: Path) -> EvalResult:
    """Evaluate now (a task run), on the process's warm workers if it keeps some."""
    return score_checkpoint.with_options(retries=cfg.eval.retries)(event, data_path, cfg, work_dir, _process_workers)


def submit_scoring(
    event: CheckpointEvent,
    data_path: Path,
    cfg: PipelineConfig,
    work_dir: Path,
    workers: WarmWorkerGroups | None = None,
):
    return score_checkpoint.with_options(retries=cfg.eval.retries).submit(event, data_path, cfg, work_dir, workers)


def warm_workers(cfg: PipelineConfig, work_dir: Path) -> contextlib.AbstractContextManager:
    """Evaluation ranks kept for a whole flow run (``eval.warm_workers``), a group per slot, or nothing."""
    if cfg.eval.warm_workers and not cfg.eval.deployment:
        return WarmWorkerGroups(cfg.eval.slots, cfg.eval.nproc, work_dir, cfg.eval.nice, cfg.eval.collective_timeout_s)
    return contextlib.nullcontext()


@task(cache_policy=NO_CACHE, name="dispatch-evaluation", task_run_name="dispatch-step-{event.global_step}")
def dispatch_evaluation(
    event: CheckpointEvent, manifest: Path, pipeline_cfg: PipelineConfig, reason: str
) -> EvalResult:
    """Run ``evaluate-checkpoint`` on the evaluation pool and wait; it logs the metrics to MLflow
    (read back from there: idempotent, so nothing lands twice). The flow decided, and it records
    and alerts."""
    cfg = pipeline_cfg.eval
    run = run_deployment(
        cfg.deployment,
        timeout=cfg.job_timeout_s,
        poll_interval=1,
        idempotency_key=f"{event.run_id}:{event.global_step}",  # a retried dispatch reuses the run
        parameters={
            "global_step": event.global_step,
            "manifest": str(manifest),
            "run_id": event.run_id,
            "params": dataclasses.asdict(pipeline_cfg),
            "reason": reason,
            "dispatched": True,
        },
    )
    if not run.state or not run.state.is_completed():
        raise EvaluationFailed(
            f"checkpoint step {event.global_step}: {cfg.deployment} run {run.name} ended {run.state}"
        )
    tracker = tracker_for(pipeline_cfg)
    mlflow_run = tracker.find_run(event.run_id)
    metrics = {
        k.removeprefix("eval/"): v
        for k, v in tracker.client.get_run(mlflow_run).data.metrics.items()
        if k.startswith("eval/")
    }
    step_metrics = {k: tracker.eval_history(mlflow_run, k).get(event.global_step) for k in metrics}
    return EvalResult(event.global_step, event.uri, {k: v for k, v in step_metrics.items() if v is not None}, 0.0)
