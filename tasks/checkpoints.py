"""Prefect tasks about published checkpoints: announcing them, and retention."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.checkpoints.publisher import CHECKPOINT_SAVED, checkpoint_resource, event_payload
from areal_eval.checkpoints.remote_run import SHARED_RUN_FILES
from areal_eval.checkpoints.store import open_store
from areal_eval.pipeline.config import PipelineConfig
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger
from tasks.mlflow_logging import tracker_for


def announce_checkpoint(event: CheckpointEvent, manifest: Path) -> None:
    """Emit ``areal.checkpoint.saved`` so automations and the UI see the durable checkpoint (an
    event, not a task run: the flow's task runs grow with evaluations, not with checkpoints)."""
    emit_event(
        CHECKPOINT_SAVED, resource=checkpoint_resource(event, source="flow"), payload=event_payload(event, manifest)
    )


@task(cache_policy=NO_CACHE, name="apply-retention")
def apply_retention(
    cfg: PipelineConfig, run: RunDir, mlflow_run_id: str, ledger: Ledger, *, doomed: list[CheckpointEvent]
) -> list[int]:
    """Delete the checkpoints retention let go (``retention.checkpoints_to_delete``) and record
    each as an MLflow tag ``deleted.<step>``; returns their steps."""
    store = open_store(cfg.storage.run_root(run.run_id), cfg.storage.s3)
    for event in doomed:
        store.delete(event.uri)
    tracker_for(cfg).set_tags(
        mlflow_run_id,
        {
            f"deleted.{e.global_step}": f"retention: {ledger.status(e.global_step)}, not among the last "
            f"{cfg.storage.retention.keep_last} or best {cfg.storage.retention.keep_best}"
            for e in doomed
        },
    )
    return [e.global_step for e in doomed]


def share_run_files(cfg: PipelineConfig, run: RunDir) -> None:
    """Mirror the run's ledger and record state beside its manifest on S3 (nothing to do for a
    local store), so a sweep elsewhere keeps this flow's decisions."""
    store = open_store(cfg.storage.run_root(run.run_id), cfg.storage.s3)
    for name in SHARED_RUN_FILES:
        if (run.root / name).exists():
            store.mirror(run.root / name, name)
