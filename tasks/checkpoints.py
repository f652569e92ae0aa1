"""Prefect tasks that publish checkpoint events."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from areal_eval.manifest import CheckpointEvent
from areal_eval.publisher import CHECKPOINT_SAVED, checkpoint_resource, event_payload


@task(cache_policy=NO_CACHE, name="announce-checkpoint")
def announce_checkpoint(event: CheckpointEvent, manifest: Path) -> None:
    """Emit ``areal.checkpoint.saved`` so automations and the UI see the durable checkpoint."""
    emit_event(CHECKPOINT_SAVED, resource=checkpoint_resource(event, source="flow"), payload=event_payload(event, manifest))
