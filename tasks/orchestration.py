"""What a flow asks of the Prefect API about flow runs: is one alive, and this one's tags."""

from __future__ import annotations

import uuid

from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run


def flow_run_alive(flow_run_id: str) -> bool:
    """The flow run exists and has not reached a final state (a claim it holds still counts)."""
    try:
        run_uuid = uuid.UUID(flow_run_id)
    except ValueError:  # not a flow run id (a run outside Prefect): nobody to wait for
        return False
    with get_client(sync_client=True) as client:
        try:
            state = client.read_flow_run(run_uuid).state
        except ObjectNotFound:
            return False
    return state is not None and not state.is_final()


def tag_flow_run(*tags: str) -> None:
    """Add ``tags`` to the current flow run, so the UI can filter by run and evaluator."""
    if flow_run.id is None:
        return
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(uuid.UUID(flow_run.id))
        client.update_flow_run(current.id, tags=sorted(set(current.tags) | set(tags)))
