"""``sweep-checkpoints``: evaluate every checkpoint in a store that was never evaluated.

Meant for a cron schedule. It finds manifests under ``store`` (a run directory, or a directory
of run directories), and for each announced checkpoint without an evaluation in MLflow runs
``evaluate-checkpoint`` (a subflow, scheduler bypassed). Idempotent: a second sweep finds
nothing to do, because MLflow already holds every step.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from areal_eval.manifest import Manifest
from areal_eval.pipeline_config import load_pipeline_config
from flows.evaluate_checkpoint import evaluate_checkpoint
from tasks.tracking import tracker_for


def find_manifests(store: Path) -> list[Path]:
    if (store / "manifest.jsonl").exists():
        return [store / "manifest.jsonl"]
    return sorted(store.glob("*/manifest.jsonl"))


@flow(name="sweep-checkpoints", log_prints=True)
def sweep_checkpoints(store: str, params: dict | None = None) -> dict:
    """Evaluate the never-evaluated checkpoints of every run under ``store``.

    Args:
        store: a run directory or a directory of run directories (each with manifest.jsonl).
        params: pipeline config sections, passed on to evaluate-checkpoint.
    """
    logger = get_run_logger()
    cfg = load_pipeline_config(params=params)
    tracker = tracker_for(cfg)
    evaluated, failed = [], []
    for manifest in find_manifests(Path(store)):
        events = Manifest(manifest).events()
        if not events:
            continue
        mlflow_run = tracker.find_run(events[0].run_id)
        done = tracker.eval_steps(mlflow_run) if mlflow_run else set()
        for event in events:
            if event.global_step in done:
                continue
            state = evaluate_checkpoint(event.global_step, str(manifest), params=params, use_scheduler=False, return_state=True)
            (evaluated if state.is_completed() else failed).append(f"{event.run_id}@{event.global_step}")
    logger.info("sweep: evaluated %d, failed %d", len(evaluated), len(failed))
    return {"evaluated": evaluated, "failed": failed}
