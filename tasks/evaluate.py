"""Prefect task that evaluates one checkpoint on separate torchrun workers."""

from __future__ import annotations

from pathlib import Path

from prefect.cache_policies import NO_CACHE
from prefect import task

from areal_eval.evaluation import EvalConfig, EvalResult, evaluate_checkpoint
from areal_eval.manifest import CheckpointEvent


@task(cache_policy=NO_CACHE, name="evaluate-checkpoint", task_run_name="evaluate-step-{event.global_step}")
def evaluate(event: CheckpointEvent, data_path: Path, cfg: EvalConfig, work_dir: Path, max_length: int) -> EvalResult:
    """Load the checkpoint on ``cfg.nproc`` ranks and reduce its metrics; raises on failure."""
    return evaluate_checkpoint(event, data_path, cfg, work_dir, max_length)
