"""Prefect tasks that publish checkpoint events."""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE
from prefect import task
from prefect.events import emit_event

from areal_eval.manifest import CheckpointEvent

CHECKPOINT_SAVED = "areal.checkpoint.saved"


def checkpoint_resource(event: CheckpointEvent) -> dict[str, str]:
    return {
        "prefect.resource.id": f"areal.checkpoint.{event.run_id}.{event.global_step}",
        "prefect.resource.name": f"{event.run_id} step {event.global_step}",
        "areal.run_id": event.run_id,
    }


@task(cache_policy=NO_CACHE, name="announce-checkpoint")
def announce_checkpoint(event: CheckpointEvent) -> None:
    """Emit ``areal.checkpoint.saved`` so automations and the UI see the durable checkpoint."""
    emit_event(CHECKPOINT_SAVED, resource=checkpoint_resource(event), payload=event.payload())
