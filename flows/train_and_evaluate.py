"""``train-and-evaluate``: train, follow checkpoints, evaluate adaptively, track, alert.

    python -m flows.train_and_evaluate [--config FILE] [--set section.field=value ...]

The flow body is the pipeline diagram: training runs in its own torchrun job; each durable
checkpoint is announced and put to the scheduler; chosen ones are evaluated on separate
torchrun workers (one evaluation in flight, the queue coalescing when training is faster);
results go to MLflow and through the alert rules, a firing rule starting the alert branch.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import time
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from areal_eval.alerts import AlertEngine
from areal_eval.launcher import TorchrunJob
from areal_eval.ledger import Ledger
from areal_eval.manifest import Manifest
from areal_eval.pipeline_config import PipelineConfig, load_pipeline_config
from areal_eval.plot import plot_curve
from areal_eval.planner import DecisionThread, EvaluationPlanner, JsonlFollower, ManifestFollower
from areal_eval.run_dir import RunDir
from areal_eval.run_setup import total_train_steps
from areal_eval.tracking import resolve_tracking_uri
from tasks.alerts import send_alert
from tasks.checkpoints import announce_checkpoint, apply_retention
from tasks.evaluate import dispatch_evaluation, submit_evaluation, warm_workers
from tasks.tracking import finish_tracking, log_evaluation, log_training_metrics, start_tracking, tracker_for
from tasks.training import prepare_run_dir, start_training, wait_for_training

TRAIN_LOG_EVERY_S = 5.0


@dataclasses.dataclass
class InFlight:
    event: object
    future: object
    reason: str


@flow(name="train-and-evaluate", log_prints=True)
def train_and_evaluate(params: dict | None = None, config_path: str | None = None, overrides: list[str] | None = None) -> dict:
    """Run the whole pipeline for one training run; returns a summary."""
    cfg = load_pipeline_config(config_path, params, overrides)
    run = prepare_run_dir(cfg)
    mlflow_run_id = start_tracking(cfg, run)
    training = start_training(cfg, run)
    try:
        ledger = follow_and_evaluate(cfg, run, mlflow_run_id, training)
        wait_for_training(training)
    finally:
        if training.poll() is None:
            training.kill()
    plot = plot_curve(ledger.entries(), cfg.scheduler.metric, run.root / "evaluation_curve.png", run.run_id)
    finish_tracking(cfg, mlflow_run_id, ledger, plot)
    return summarize(cfg, run, mlflow_run_id, ledger, plot)


def follow_and_evaluate(cfg: PipelineConfig, run: RunDir, mlflow_run_id: str, training: TorchrunJob | None) -> Ledger:
    """Follow the run's manifest until its final checkpoint is handled (call inside a flow).

    Each checkpoint is announced and decided on; one evaluation runs at a time while training
    goes on; finished ones are logged and checked by the alert rules. ``training`` None follows
    a run whose training is already over (or happens elsewhere).
    """
    logger = get_run_logger()
    planner = EvaluationPlanner(cfg.scheduler, Ledger(run.ledger))
    alert_rules = AlertEngine(cfg.alerts)
    train_log = JsonlFollower(run.train_log)
    total_steps = total_train_steps(run, cfg)
    progress = create_progress_artifact(0.0, description=f"{run.run_id}: training steps done (%)")
    in_flight: InFlight | None = None
    final_seen, refined, pending_rows, last_train_log, decided = False, False, [], 0.0, []
    retention_on, deleted = cfg.storage.retention.keep_last is not None, set()
    # Decisions are made in their own thread the moment the manifest grows; this loop announces them.
    decision_thread = DecisionThread(planner, ManifestFollower(Manifest(run.manifest)))
    with decision_thread as decisions, warm_workers(cfg, run.evals) as workers:
        while True:
            settled = False
            for event, decision in decided:
                announce_checkpoint(event, run.manifest)
                logger.info("checkpoint step %d: %s (%s)", event.global_step, "evaluate" if decision.evaluate else "skip", decision.reason)
                final_seen, settled = final_seen | event.final, True

            pending_rows += train_log.poll()
            if pending_rows and (final_seen or time.monotonic() - last_train_log > TRAIN_LOG_EVERY_S):
                log_training_metrics(cfg, mlflow_run_id, pending_rows)
                update_progress_artifact(progress, 100.0 * min(1.0, pending_rows[-1]["step"] / total_steps))
                pending_rows, last_train_log = [], time.monotonic()

            if in_flight and in_flight.future.state.is_final():
                collect_evaluation(cfg, run, mlflow_run_id, planner, alert_rules, in_flight)
                in_flight, settled = None, True
            if retention_on and settled:
                deleted.update(apply_retention(cfg, run, mlflow_run_id, planner.ledger, deleted))
            if in_flight is None and (event := planner.next()):
                reason = planner.ledger.latest(event.global_step).reason
                if cfg.eval.deployment:  # on a server: the evaluation pool's workers run it
                    future = dispatch_evaluation.submit(event, run.manifest, cfg)
                else:
                    future = submit_evaluation(event, run.valid_data, cfg, run.evals, workers)
                in_flight = InFlight(event, future, reason)

            if final_seen and in_flight is None and not planner.waiting:
                if refined:
                    break
                refined = True  # once: the skipped neighbours of the best, now that the run is over
                for event in planner.refine(deleted):
                    logger.info("checkpoint step %d: evaluate (%s)", event.global_step, planner.ledger.latest(event.global_step).reason)
            if training is not None and training.poll() not in (None, 0):
                wait_for_training(training)  # raises with the training log tail
            nothing_left = in_flight is None and not planner.waiting and not decided and decisions.idle()
            if training is None and not final_seen and nothing_left:
                raise RuntimeError(f"{run.manifest}: no final checkpoint and no training job to wait for")
            decided = decisions.drain(timeout_s=cfg.poll_interval_s)
    update_progress_artifact(progress, 100.0)
    return planner.ledger


def collect_evaluation(cfg: PipelineConfig, run: RunDir, mlflow_run_id: str, planner: EvaluationPlanner,
                       alert_rules: AlertEngine, done: InFlight) -> None:
    """Record a finished evaluation (or its failure), log it, and branch into alerts."""
    step = done.event.global_step
    if done.future.state.is_completed():
        result = done.future.result()
        planner.evaluated(done.event, result.metrics)
        if cfg.eval.deployment:  # the dispatched run logged it and ran the alert rules itself
            return
        log_evaluation(cfg, mlflow_run_id, result, done.reason)
        alerts = alert_rules.check(step, result.metrics)
    else:
        error = str(done.future.result(raise_on_failure=False))
        planner.failed(done.event, error)
        alerts = alert_rules.check(step, None, error)
    for alert in alerts:
        send_alert(alert, cfg, mlflow_run_id, run)


def summarize(cfg: PipelineConfig, run: RunDir, mlflow_run_id: str, ledger: Ledger, plot: Path) -> dict:
    evaluated = [e for e in ledger.entries() if e.status == "evaluated"]
    counts = ledger.counts()
    summary = {
        "run_name": run.run_id,
        "mlflow_run_id": mlflow_run_id,
        "tracking_uri": resolve_tracking_uri(cfg.tracking, cfg.work_dir),
        "run_dir": str(run.root),
        "checkpoints": sum(counts.values()),
        **{k: counts.get(k, 0) for k in ("evaluated", "skipped", "superseded", "failed")},
        "curve": [(e.step, round(e.metrics.get(cfg.scheduler.metric, float("nan")), 4)) for e in evaluated],
    }
    table = "\n".join(f"| {s} | {v} |" for s, v in summary["curve"])
    link = mlflow_run_link(summary["tracking_uri"], tracker_for(cfg).experiment_id, mlflow_run_id)
    image = base64.b64encode(plot.read_bytes()).decode()
    create_markdown_artifact(
        key="evaluation-summary",
        markdown=(f"# {run.run_id}\n\nMLflow run: {link} (tracking URI `{summary['tracking_uri']}`)\n\n"
                  f"Checkpoints: {summary['checkpoints']} ({counts})\n\n![evaluation curve](data:image/png;base64,{image})\n\n"
                  f"| step | {cfg.scheduler.metric} |\n|---|---|\n{table}\n"),
    )
    return summary


def mlflow_run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """A link to the run in the MLflow UI (served at the tracking URI, or by ``mlflow ui`` locally)."""
    base = tracking_uri.rstrip("/") if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return f"[{run_id}]({base}/#/experiments/{experiment_id}/runs/{run_id})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the train-and-evaluate flow (Prefect, MLflow, torchrun).")
    parser.add_argument("--config", help="JSON or YAML pipeline config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args(argv)
    load_pipeline_config(args.config, None, args.overrides)  # fail on bad config before Prefect starts
    start = time.monotonic()
    summary = train_and_evaluate(config_path=args.config, overrides=args.overrides)
    minutes = (time.monotonic() - start) / 60
    curve = ", ".join(f"{s}:{v}" for s, v in summary["curve"])
    print(f"\nDone in {minutes:.1f} min. Checkpoints: {summary['checkpoints']} "
          f"(evaluated {summary['evaluated']}, skipped {summary['skipped']}, superseded {summary['superseded']}, failed {summary['failed']})")
    print(f"Accuracy by step: {curve}")
    print(f"MLflow run name: {summary['run_name']} (id {summary['mlflow_run_id']})")
    print(f"See it in MLflow:  .venv/bin/mlflow ui --backend-store-uri {summary['tracking_uri']}   then open http://127.0.0.1:5000")
    print(f"Run files: {summary['run_dir']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
