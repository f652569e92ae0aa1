"""Prefect tasks around the training job (a torchrun subprocess that never touches Prefect)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from areal_eval.launchers.devices import plan_here
from areal_eval.launchers.local import TorchrunJob
from areal_eval.pipeline.config import PipelineConfig
from areal_eval.pipeline.setup import prepare_run
from areal_eval.runs.directory import RunDir
from areal_eval.train import wait_for_exit


@task(cache_policy=NO_CACHE, name="prepare-run")
def prepare_run_dir(cfg: PipelineConfig) -> RunDir:
    """Validate or generate the data, train the tokenizer, write the training spec."""
    return prepare_run(cfg)


@task(cache_policy=NO_CACHE, name="start-training")
def start_training(cfg: PipelineConfig, run: RunDir) -> TorchrunJob:
    """Launch DDP training on ``cfg.train.nproc`` ranks, on ``train.devices``; returns at once."""
    return TorchrunJob(
        "areal_eval.train",
        ["--config", str(run.train_config)],
        cfg.train.nproc,
        run.logs / "train.log",
        placement=plan_here(cfg).train,
    )


@task(cache_policy=NO_CACHE, name="wait-for-training")
def wait_for_training(job: TorchrunJob, train_log: Path, timeout_s: float = 120) -> None:
    """Training has announced its final checkpoint; collect its exit status (a job stuck after
    its ``done`` row is killed with a warning: :func:`areal_eval.train.wait_for_exit`)."""
    warning = wait_for_exit(job, train_log, timeout_s)
    if warning:
        get_run_logger().warning(warning)
