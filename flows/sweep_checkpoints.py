"""``sweep-checkpoints``: evaluate every checkpoint in a store that was never evaluated.

Meant for a cron schedule. It finds manifests under ``store`` (a run directory, or a directory
of run directories, or an S3 prefix of them), and for each announced checkpoint without an
evaluation in MLflow (and not deleted by retention) runs ``evaluate-checkpoint`` (a subflow,
scheduler bypassed). Idempotent: a second sweep finds
nothing to do, because MLflow already holds every step.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from areal_eval.checkpoint_store import S3Config, S3Store, is_s3, localize_manifest
from areal_eval.manifest import Manifest
from areal_eval.pipeline_config import load_pipeline_config
from areal_eval.run_dir import RunBusy, RunDir, RunLock
from flows.evaluate_checkpoint import evaluate_checkpoint
from tasks.tracking import tracker_for


def find_manifests(store: str, s3: S3Config) -> list[str]:
    """Manifests of the runs in ``store``: a run directory or prefix, or a directory or prefix of them."""
    if is_s3(store):
        root = store.rstrip("/")
        return [f"{root}/{p}/manifest.jsonl" if p else f"{root}/manifest.jsonl" for p in S3Store(root, s3).run_prefixes()]
    if (Path(store) / "manifest.jsonl").exists():
        return [str(Path(store) / "manifest.jsonl")]
    return [str(p) for p in sorted(Path(store).glob("*/manifest.jsonl"))]


def end_if_abandoned(tracker, mlflow_run_id: str, run: RunDir) -> bool:
    """A flow-owned run left RUNNING by a flow that died (its lock is free) is ended KILLED.
    Runs of trainers outside the flow hold no lock file and are left alone."""
    if not run.lock_file.exists() or tracker.client.get_run(mlflow_run_id).info.status != "RUNNING":
        return False
    try:
        RunLock(run).acquire().release()
    except RunBusy:
        return False  # its flow is alive
    tracker.set_tags(mlflow_run_id, {"areal.failure": "its flow died: found RUNNING with no live owner by sweep-checkpoints"})
    tracker.finish(mlflow_run_id, "KILLED")
    return True


@flow(name="sweep-checkpoints", log_prints=True)
def sweep_checkpoints(store: str, params: dict | None = None) -> dict:
    """Evaluate the never-evaluated checkpoints of every run under ``store``.

    Args:
        store: a run directory or a directory of run directories (each with manifest.jsonl), or
            the ``s3://bucket/prefix`` of ``storage.checkpoint_uri`` (training mirrors manifests there).
        params: pipeline config sections, passed on to evaluate-checkpoint.
    """
    logger = get_run_logger()
    cfg = load_pipeline_config(params=params)
    tracker = tracker_for(cfg)
    evaluated, failed = [], []
    for manifest in find_manifests(store, cfg.storage.s3):
        events = Manifest(localize_manifest(manifest, cfg.storage.s3, cfg.work_dir)).events()
        if not events:
            continue
        mlflow_run = tracker.find_run(events[0].run_id)
        if mlflow_run and not is_s3(manifest) and end_if_abandoned(tracker, mlflow_run, RunDir(Path(manifest).parent)):
            logger.warning("run %s was RUNNING with no live owner: marked KILLED", events[0].run_id)
        done = tracker.eval_steps(mlflow_run) | tracker.deleted_steps(mlflow_run) if mlflow_run else set()
        for event in events:
            if event.global_step in done:
                continue
            state = evaluate_checkpoint(event.global_step, manifest, params=params, use_scheduler=False, return_state=True)
            (evaluated if state.is_completed() else failed).append(f"{event.run_id}@{event.global_step}")
    logger.info("sweep: evaluated %d, failed %d", len(evaluated), len(failed))
    return {"evaluated": evaluated, "failed": failed}
