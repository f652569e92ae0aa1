"""Prefect tasks around the training job (a torchrun subprocess that never touches Prefect)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from areal_eval.config.pipeline import PipelineConfig
from areal_eval.launcher import TorchrunJob, WorkerError
from areal_eval.runs.directory import RunDir
from areal_eval.runs.setup import prepare_run
from areal_eval.train import wrote_done


@task(cache_policy=NO_CACHE, name="prepare-run")
def prepare_run_dir(cfg: PipelineConfig) -> RunDir:
    """Validate or generate the data, train the tokenizer, write the training spec."""
    return prepare_run(cfg)


@task(cache_policy=NO_CACHE, name="start-training")
def start_training(cfg: PipelineConfig, run: RunDir) -> TorchrunJob:
    """Launch DDP training on ``cfg.train.nproc`` ranks; returns at once."""
    return TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], cfg.train.nproc, run.logs / "train.log")


@task(cache_policy=NO_CACHE, name="wait-for-training")
def wait_for_training(job: TorchrunJob, train_log: Path, timeout_s: float = 120) -> int:
    """Training has announced its final checkpoint; collect its exit status.

    A job that wrote its ``done`` row but does not exit within ``timeout_s`` (a rank stuck
    tearing down; seen once with forked ranks) was killed by ``wait``: its work is all on disk,
    so it is reported as a warning, not as a failed run whose every checkpoint was evaluated.
    """
    try:
        job.wait(timeout_s)
    except WorkerError as exc:
        if not wrote_done(train_log):
            raise
        get_run_logger().warning(f"training finished ({train_log} says done) but did not exit: {exc}")
        return 0
    job.raise_for_status("training")
    return job.proc.returncode
