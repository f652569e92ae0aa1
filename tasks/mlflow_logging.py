"""Prefect tasks that record results: in MLflow, and in the other sinks of ``tracking.sinks``."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from areal_eval.disk import brief
from areal_eval.evaluation.jobs import EvalResult
from areal_eval.lifecycle.shared_run import SharedRun
from areal_eval.logged_models import log_validation_data
from areal_eval.pipeline.config import PipelineConfig
from areal_eval.recording import Recorder
from areal_eval.redaction import recorded_config
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger
from areal_eval.sinks import Sinks, open_sinks
from areal_eval.tracking import (
    Tracker,
    TrackingConfig,
    attempt_tags,
    resolve_tracking_uri,
)


def tracker_for(cfg: PipelineConfig) -> Tracker:
    """One tracker per store and experiment in this process: it keeps what it has logged (the
    training watermark, the evaluated steps), so logging never rereads a run's history."""
    uri = resolve_tracking_uri(cfg.tracking, cfg.work_dir)
    return _tracker(uri, cfg.tracking.experiment, cfg.tracking.artifact_location)


@functools.lru_cache(maxsize=16)
def _tracker(tracking_uri: str, experiment: str, artifact_location: str | None) -> Tracker:
    return Tracker(TrackingConfig(tracking_uri, experiment, artifact_location))


def sinks_for(cfg: PipelineConfig, run: RunDir, mlflow_run_id: str, *, single_writer: bool = False) -> Sinks | None:
    """The run's sinks besides MLflow (None: MLflow only), one set per run in this process;
    ``single_writer``: this process owns the run (the in-flow loop), asked before any record."""
    extra = [name for name in cfg.tracking.sinks if name != "mlflow"]
    if not extra:
        return None
    key = (str(run.root), mlflow_run_id, repr(cfg.tracking))
    if key not in _SINKS:
        run_name = run.run_id if run.run_id_file.exists() else run.root.name

        def on_failure(sink: str, message: str) -> None:
            """In the log and on the MLflow run (``sink.<name>.failure``), in one line."""
            log = _logger()
            log.warning("sink %s", message)
            try:
                tracker_for(cfg).set_tags(mlflow_run_id, {f"sink.{sink}.failure": message[:5000]})
            except Exception as exc:  # noqa: BLE001 - MLflow down too: the log has it
                log.warning("sink %s failure not recorded in MLflow: %r", sink, exc)

        _SINKS[key] = open_sinks(
            extra,
            wandb=cfg.tracking.wandb,
            tensorboard=cfg.tracking.tensorboard,
            run_dir=run.root,
            run_name=run_name,
            on_failure=on_failure,
            single_writer=single_writer,
        )
    return _SINKS[key]


_SINKS: dict[tuple, Sinks] = {}


def _logger():
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a flow or task run (a test, a bench)
        return logging.getLogger("areal_eval.sinks")


@task(cache_policy=NO_CACHE, name="start-tracking")
def start_tracking_run(cfg: PipelineConfig, training_run_id: str, run_dir: str, reopen: bool = False) -> str:
    """The MLflow run of a training run (created once), with the whole config as params;
    ``reopen`` marks it RUNNING again (a resumed run)."""
    tracker, run = tracker_for(cfg), RunDir(run_dir)
    run_id = tracker.start_run(
        training_run_id,
        recorded_config(dataclasses.asdict(cfg)),
        tags={"areal.run_dir": run_dir},
        reopen=reopen,
        lock=run.tracking_lock,
    )
    if run.valid_data.exists() and cfg.tracking.to_mlflow:  # the run's dataset input, with its digest
        try:
            log_validation_data(tracker.client, run_id, run.valid_data, lock=run.tracking_lock)
        except Exception as exc:  # noqa: BLE001 - a server without dataset inputs: said, the run goes on
            _logger().warning("validation data not logged as the run's dataset: %s", brief(exc))
    return run_id


def start_tracking(cfg: PipelineConfig, run: RunDir) -> str:
    """The MLflow run the flow that owns ``run`` writes to (reopened if the run is resumed)."""
    return start_tracking_run(cfg, run.run_id, str(run.root), reopen=True)


def log_published_train_metrics(cfg: PipelineConfig, mlflow_run_id: str, shared: SharedRun) -> int:
    """The ``train_metrics`` a publisher passed with the run's checkpoints, each once, in step
    order: every flow run of the run calls it, whichever decided those checkpoints, and the run's
    tracking lock with the watermark read fresh keeps two flow runs from logging a step twice.
    A step published below one already logged is dropped (publish in step order)."""
    events = shared.manifest.read(run_id=shared.run_id).events
    rows = [{"step": e.global_step, **e.train_metrics} for e in events if e.train_metrics]
    if not rows:
        return 0
    return recorder_for(cfg, mlflow_run_id, shared.run).training(rows, lock=shared.run.tracking_lock)


def recorder_for(
    cfg: PipelineConfig,
    mlflow_run_id: str,
    run: RunDir | None = None,
    *,
    training_run_id: str | None = None,
    ledger: Ledger | None = None,
) -> Recorder:
    """The recording step (:class:`~areal_eval.recording.Recorder`) for the run's MLflow run
    and its other sinks, saying what it warns about in the flow run's log."""
    logger = _logger()
    return Recorder(
        tracker_for(cfg),
        mlflow_run_id,
        run=run,
        training_run_id=training_run_id,
        ledger=ledger,
        sinks=sinks_for(cfg, run, mlflow_run_id) if run is not None else None,
        to_mlflow=cfg.tracking.to_mlflow,
        registered_model=cfg.tracking.registered_model,
        metric=cfg.scheduler.metric,
        higher_is_better=cfg.scheduler.higher_is_better,
        warn=logger.warning,
        info=logger.info,
    )


@task(cache_policy=NO_CACHE, name="log-evaluation", task_run_name="log-step-{result.global_step}")
def log_evaluation(
    cfg: PipelineConfig,
    run_id: str,
    result: EvalResult,
    reason: str,
    *,
    recorded_in: tuple[RunDir, str] | None = None,
    ledger: Ledger | None = None,
) -> bool:
    """The recording step for one result (:meth:`Recorder.result`; ``reason``, its decision, is
    in the run's ledger and table of checkpoints); False if the step was already logged. Given
    where the result is recorded (the run directory and training run id), its items, the
    registered best and the other sinks too; ``ledger``: the run's, as the caller keeps it
    (else read from the run directory)."""
    run, training_run_id = recorded_in if recorded_in is not None else (None, None)
    return recorder_for(cfg, run_id, run, training_run_id=training_run_id, ledger=ledger).result(result)


@task(cache_policy=NO_CACHE, name="finish-tracking")
def finish_tracking(
    cfg: PipelineConfig,
    run_id: str,
    ledger: Ledger,
    plot: Path | None,
    *,
    status: str | None = "FINISHED",
    failure: str | None = None,
) -> None:
    """The run's end in MLflow and its other sinks (:meth:`Recorder.end`): decisions, the curve
    plot, counts, and the run ended with ``status`` (``failure`` as the tag ``areal.failure``);
    ``status`` None refreshes them on a run that already ended."""
    recorder_for(cfg, run_id, RunDir(ledger.path.parent)).end(ledger, plot, status=status, failure=failure)


@task(cache_policy=NO_CACHE, name="log-failed-attempt", task_run_name="log-failed-attempt-{step}")
def log_failed_attempt(cfg: PipelineConfig, run_id: str, ledger: Ledger, step: int) -> None:
    """A checkpoint's failed attempts so far, as tags on the MLflow run (count and last cause)."""
    entry = ledger.latest(step)
    if entry is not None and entry.attempts:
        tracker_for(cfg).set_tags(run_id, attempt_tags(entry))
