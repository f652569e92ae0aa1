"""Prefect tasks that record results: in MLflow, and in the other sinks of ``tracking.sinks``."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from areal_eval.compare import versus_previous_best
from areal_eval.disk import brief
from areal_eval.evaluation.items import stored_items
from areal_eval.evaluation.jobs import EvalResult
from areal_eval.lifecycle.shared_run import SharedRun
from areal_eval.logged_models import TABLE_EVERY_S, checkpoint_model, log_checkpoints_table, log_validation_data
from areal_eval.pipeline.config import PipelineConfig
from areal_eval.redaction import recorded_config
from areal_eval.runs.directory import RunDir, file_lock
from areal_eval.runs.ledger import Ledger
from areal_eval.sinks import Sinks, open_sinks
from areal_eval.tracking import (
    BEST_ALIAS,
    FAILURE_TAG,
    PROBE_PREFIX,
    Tracker,
    artifact_location,
    attempt_tags,
    resolve_tracking_uri,
)


def tracker_for(cfg: PipelineConfig) -> Tracker:
    """One tracker per store and experiment in this process: it keeps what it has logged (the
    training watermark, the evaluated steps), so logging never rereads a run's history."""
    uri = resolve_tracking_uri(cfg.tracking, cfg.work_dir)
    return _tracker(uri, cfg.tracking.experiment, artifact_location(cfg.tracking, uri))


@functools.lru_cache(maxsize=16)
def _tracker(tracking_uri: str, experiment: str, artifact_location: str | None) -> Tracker:
    return Tracker(tracking_uri, experiment, artifact_location)


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
    if run.valid_data.exists():  # the run's dataset input, with its digest
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
    with file_lock(shared.run.tracking_lock):
        logged = tracker_for(cfg).log_train_metrics(mlflow_run_id, rows, reread_watermark=True)
    record_training(cfg, shared.run, mlflow_run_id, rows)
    return logged


def record_training(cfg: PipelineConfig, run: RunDir, mlflow_run_id: str, rows: list[dict]) -> None:
    """Training rows to the sinks besides MLflow (each takes each row once)."""
    sinks = sinks_for(cfg, run, mlflow_run_id)
    if sinks is not None:
        sinks.record_training(rows)


@task(cache_policy=NO_CACHE, name="log-evaluation", task_run_name="log-step-{result.global_step}")
def log_evaluation(
    cfg: PipelineConfig, run_id: str, result: EvalResult, reason: str, recorded_in: tuple[RunDir, str] | None = None
) -> bool:
    """Metrics at ``step=global_step``, linked to the checkpoint's LoggedModel, and the run's
    table of checkpoints; False if the step was already logged.
    Probe metrics go in as ``eval_probe/*`` (a probe has no others). Given where the result is
    recorded (the run directory and training run id), the checkpoint is also registered if it
    is the best."""
    step = result.global_step
    tracker = tracker_for(cfg)
    ledger = Ledger(recorded_in[0].ledger) if recorded_in is not None else None
    entry = ledger.latest(step) if ledger is not None else None
    tags = attempt_tags(entry) if entry is not None else {}  # attempts that failed before this one
    logged = False
    if result.probe_metrics:
        logged = tracker.log_evaluation(run_id, step, result.probe_metrics, tags=tags, prefix=PROBE_PREFIX)
    if result.metrics:
        model_id = checkpoint_model_or_none(tracker, run_id, step, result.uri)
        tags |= {"last_evaluated_step": step}
        logged = tracker.log_evaluation(run_id, step, result.metrics, tags=tags, model_id=model_id)
        log_items(tracker, run_id, result, recorded_in)
        if recorded_in is not None and cfg.tracking.registered_model:
            register_best(cfg, tracker, run_id, *recorded_in, result)
    if ledger is not None:  # its decision, in the run's table of checkpoints: a side record, warned about
        try:
            log_checkpoints_table(tracker.client, run_id, ledger.entries(), at_most_every_s=TABLE_EVERY_S)
        except Exception as exc:  # noqa: BLE001 - an artifact store that refuses: the run's end writes it again
            _logger().warning("step %d: the table of checkpoints not updated in MLflow: %s", step, brief(exc))
    sinks = sinks_for(cfg, recorded_in[0], run_id) if recorded_in is not None else None
    if sinks is not None:  # where the result is recorded: a dispatched evaluation's owner records it there
        items = result.items or stored_items(recorded_in[0].evals, step)
        sinks.record_evaluation(step, result.probe_metrics, prefix=PROBE_PREFIX, uri=result.uri)
        sinks.record_evaluation(step, result.metrics, items=items, uri=result.uri)
    return logged


def checkpoint_model_or_none(tracker: Tracker, run_id: str, step: int, uri: str) -> str | None:
    """The checkpoint's LoggedModel, its metrics linked to it; None where the tracking server
    keeps no LoggedModels (before MLflow 3): said, and the metrics go in as before."""
    try:
        return checkpoint_model(tracker.client, tracker.experiment_id, run_id, step, uri)
    except Exception as exc:  # noqa: BLE001 - the metrics matter more than the link
        _logger().warning("step %d: no MLflow LoggedModel for the checkpoint: %s", step, brief(exc))
        return None


def log_items(tracker, run_id: str, result: EvalResult, recorded_in: tuple[RunDir, str] | None) -> None:
    """The result's per-item files and answers table, after its metrics: an artifact store that
    refuses them costs the copy in MLflow only (the files stay in the run directory), never the
    metrics, and is said in the log."""
    items = result.items or (stored_items(recorded_in[0].evals, result.global_step) if recorded_in else {})
    if not items:
        return
    try:
        tracker.log_items(run_id, result.global_step, items)
    except Exception as exc:  # noqa: BLE001 - a side copy: warned, not raised
        get_run_logger().warning("step %d: per-item results not copied to MLflow: %s", result.global_step, exc)


def register_best(
    cfg: PipelineConfig, tracker: Tracker, run_id: str, run: RunDir, training_run_id: str, result: EvalResult
) -> None:
    """Move the registered model's ``best`` alias to this checkpoint if it beats the best so far.
    Flow runs of one run take turns (a lock in the run directory); a refusal is logged, never
    raised: the result is in MLflow already."""
    name = cfg.tracking.registered_model.format(run_id=training_run_id)
    try:
        with file_lock(run.registry_lock):
            version = tracker.register_if_best(
                name,
                run_id,
                result.global_step,
                result.uri,
                result.metrics,
                cfg.scheduler.metric,
                cfg.scheduler.higher_is_better,
                versus=lambda previous: versus_previous_best(
                    run.evals, previous, result.global_step, cfg.scheduler.metric
                ),
            )
    except Exception as exc:  # noqa: BLE001 - e.g. an MLflow server that refuses a local path as source
        get_run_logger().warning("step %d: not registered in model %r: %s", result.global_step, name, exc)
        return
    if version is not None:
        get_run_logger().info(
            "step %d: the best so far: model %r version %s (alias %r)", result.global_step, name, version, BEST_ALIAS
        )


@task(cache_policy=NO_CACHE, name="finish-tracking")
def finish_tracking(
    cfg: PipelineConfig,
    run_id: str,
    ledger: Ledger,
    plot: Path | None,
    status: str | None = "FINISHED",
    failure: str | None = None,
) -> None:
    """Scheduler decisions and the curve plot as artifacts, counts as tags, the run ended with
    ``status`` (and ``failure`` as the tag ``areal.failure``); ``status`` None refreshes them on
    a run that already ended."""
    tracker = tracker_for(cfg)
    tracker.log_dict(run_id, [dataclasses.asdict(e) for e in ledger.entries()], "scheduler_decisions.json")
    log_checkpoints_table(tracker.client, run_id, ledger.entries())
    if plot is not None:
        tracker.log_artifact(run_id, plot)
    entries = ledger.entries()
    tags = {f"checkpoints.{k}": v for k, v in (ledger.counts() | ledger.probe_counts()).items()}
    tags["checkpoints.failed_attempts"] = sum(len(e.attempts) for e in entries)
    for entry in entries:
        tags |= attempt_tags(entry)
    tracker.set_tags(run_id, tags | ({FAILURE_TAG: failure[:5000]} if failure else {}))
    if status == "FINISHED":
        tracker.supersede_failure(run_id)
    if status is not None:
        tracker.finish(run_id, status)
    sinks = sinks_for(cfg, RunDir(ledger.path.parent), run_id)
    if sinks is not None:  # what a sink missed on the way (it failed, or a process died), then the end
        sinks.catch_up(entries, RunDir(ledger.path.parent).evals)
        sinks.record_end(status or "RUNNING", plot=plot)
        sinks.close()


@task(cache_policy=NO_CACHE, name="log-failed-attempt", task_run_name="log-failed-attempt-{step}")
def log_failed_attempt(cfg: PipelineConfig, run_id: str, ledger: Ledger, step: int) -> None:
    """A checkpoint's failed attempts so far, as tags on the MLflow run (count and last cause)."""
    entry = ledger.latest(step)
    if entry is not None and entry.attempts:
        tracker_for(cfg).set_tags(run_id, attempt_tags(entry))
