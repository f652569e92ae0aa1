"""``evaluate-checkpoint``: evaluate one announced checkpoint, log it, run the alert rules.

Started by a deployment trigger on ``areal.checkpoint.saved`` (parameters templated from the
event payload), by ``prefect deployment run``, or by ``sweep-checkpoints``. Scheduling state is
the run's evaluation history in MLflow (skips as ``skipped.<step>`` tags), so separate triggered
runs decide consistently, a second event for the same checkpoint does not evaluate it again, and
the run for the final checkpoint can refine around the best as ``train-and-evaluate`` does.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.concurrency.sync import concurrency

from areal_eval.alerts import AlertEngine
from areal_eval.checkpoint_store import is_s3, localize_manifest
from areal_eval.manifest import Manifest
from areal_eval.pipeline_config import load_pipeline_config
from areal_eval.run_dir import RunDir
from areal_eval.scheduler import decide, refine
from tasks.alerts import send_alert
from tasks.evaluate import evaluate
from tasks.tracking import log_evaluation, start_tracking_run, tracker_for


def same_location(a: str, b: str) -> bool:
    if is_s3(a) or is_s3(b):
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).resolve() == Path(b).resolve()


@flow(name="evaluate-checkpoint", log_prints=True)
def evaluate_checkpoint(
    global_step: int,
    manifest: str,
    run_id: str | None = None,
    checkpoint_uri: str | None = None,
    data_path: str | None = None,
    params: dict | None = None,
    use_scheduler: bool = True,
    gpu_slot: str | None = None,
) -> dict:
    """Evaluate the checkpoint at ``global_step`` of ``manifest``.

    Args:
        global_step: the checkpoint's step (from the event payload).
        manifest: the run's manifest.jsonl (a path, or ``s3://.../manifest.jsonl`` mirrored by training),
            which holds the checkpoint's files and hashes.
        run_id: training run id (default: the manifest entry's).
        checkpoint_uri: expected checkpoint location; must match the manifest entry.
        data_path: validation pairs (default: ``data/valid.jsonl`` beside the manifest).
        params: pipeline config sections (eval, scheduler, alerts, tracking, ...).
        use_scheduler: False evaluates whenever the step has no result yet (sweeps).
        gpu_slot: a Prefect global concurrency limit to hold while evaluating (e.g. ``gpu:0``).
    """
    logger = get_run_logger()
    cfg = load_pipeline_config(params=params)
    local_manifest = localize_manifest(manifest, cfg.storage.s3, cfg.work_dir)
    published = Manifest(local_manifest)
    event = published.find(global_step)
    if checkpoint_uri and not same_location(checkpoint_uri, event.uri):
        raise ValueError(f"checkpoint_uri {checkpoint_uri} is not the manifest's {event.uri} for step {global_step}")
    run = RunDir(local_manifest.resolve().parent)
    mlflow_run_id = start_tracking_run(cfg, run_id or event.run_id, str(run.root))
    tracker = tracker_for(cfg)
    history = tracker.scheduler_history(mlflow_run_id, cfg.scheduler.metric, cfg.scheduler.stderr_metric)
    if any(h.step == global_step for h in history):
        logger.info("step %d already evaluated: nothing to do", global_step)
        return {"global_step": global_step, "evaluated": False, "reason": "already evaluated"}
    if use_scheduler:
        offered = [e.global_step for e in published.events() if e.global_step < global_step]
        decision = decide(event, history, cfg.scheduler, offered)
        tags = {f"decision.{global_step}": decision.reason}
        if not decision.evaluate:
            tags[f"skipped.{global_step}"] = decision.reason
        tracker.set_tags(mlflow_run_id, tags)
        if not decision.evaluate:
            logger.info("step %d skipped: %s", global_step, decision.reason)
            return {"global_step": global_step, "evaluated": False, "reason": decision.reason}

    data = Path(data_path) if data_path else run.valid_data
    rules = AlertEngine(cfg.alerts)
    for past in history:  # the alert rules judge against the run's best so far
        rules.check(past.step, {cfg.scheduler.metric: past.metric})
    with concurrency(gpu_slot, occupy=1, strict=True) if gpu_slot else contextlib.nullcontext():
        result = evaluate_and_log(cfg, event, data, run, mlflow_run_id, "triggered", rules)
        refined = []
        if use_scheduler and event.final:  # the run is over: look next to the best
            history = tracker.scheduler_history(mlflow_run_id, cfg.scheduler.metric, cfg.scheduler.stderr_metric)
            skipped = tracker.tagged_steps(mlflow_run_id, "skipped") - {h.step for h in history}
            deleted = tracker.deleted_steps(mlflow_run_id)
            for step, reason in refine(history, sorted(skipped), cfg.scheduler, deleted):
                logger.info("step %d: %s", step, reason)
                evaluate_and_log(cfg, published.find(step), data, run, mlflow_run_id, reason, rules)
                refined.append(step)
    return {"global_step": global_step, "evaluated": True, "metrics": result.metrics, "refined": refined}


def evaluate_and_log(cfg, event, data: Path, run: RunDir, mlflow_run_id: str, reason: str, rules: AlertEngine):
    """Evaluate one checkpoint, log it to MLflow and put it through the alert rules."""
    result = evaluate(event, data, cfg, run.evals)
    log_evaluation(cfg, mlflow_run_id, result, reason)
    for alert in rules.check(event.global_step, result.metrics):
        send_alert(alert, cfg, mlflow_run_id, run)
    return result
