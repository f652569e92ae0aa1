"""Prefect task that evaluates one checkpoint on separate torchrun workers."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from areal_eval.evaluation import CorruptCheckpoint, EvalConfig, EvalResult, evaluate_checkpoint
from areal_eval.manifest import CheckpointError, CheckpointEvent


def worth_retrying(task, task_run, state) -> bool:
    """A killed or hung worker may succeed next time; a corrupt checkpoint will not."""
    exc = state.result(raise_on_failure=False)
    return not isinstance(exc, (CorruptCheckpoint, CheckpointError))


@task(cache_policy=NO_CACHE, name="evaluate-checkpoint", task_run_name="evaluate-step-{event.global_step}",
      retry_condition_fn=worth_retrying, retry_delay_seconds=1)
def evaluate_task(event: CheckpointEvent, data_path: Path, cfg: EvalConfig, work_dir: Path, max_length: int) -> EvalResult:
    """Load the checkpoint on ``cfg.nproc`` ranks and reduce its metrics; raises on failure."""
    return evaluate_checkpoint(event, data_path, cfg, work_dir, max_length)


def evaluate(event: CheckpointEvent, data_path: Path, cfg: EvalConfig, work_dir: Path, max_length: int) -> EvalResult:
    return evaluate_task.with_options(retries=cfg.retries)(event, data_path, cfg, work_dir, max_length)


def submit_evaluation(event: CheckpointEvent, data_path: Path, cfg: EvalConfig, work_dir: Path, max_length: int):
    return evaluate_task.with_options(retries=cfg.retries).submit(event, data_path, cfg, work_dir, max_length)
