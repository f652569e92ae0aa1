"""What a flow asks of the Prefect API: a concurrency slot, whether a flow run is alive, this
one's tags, and which earlier runs of its training run died without saying so."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run
from prefect.states import Crashed

from tasks.device_slot import DeviceSlot


@contextlib.contextmanager
def holding_slot(name: str | None, wait_s: float) -> Iterator[None]:
    """Hold one slot of the global concurrency limit ``name`` (nothing when None) inside the block,
    waiting at most ``wait_s`` for it (:class:`~tasks.device_slot.DeviceSlot`)."""
    if name is None:
        yield
        return
    with DeviceSlot(name, wait_s=wait_s):
        yield


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


def crash_orphaned_runs(flow_name: str, run_tag: str) -> list[str]:
    """Mark Crashed the earlier ``flow_name`` runs tagged ``run_tag`` that still show as running.

    Call it only while holding the run's lock (``RunLock``): the kernel released their hold on it,
    so their processes are gone (``kill -9``, a lost machine) and nothing else would ever end them
    in the UI. Returns their names.
    """
    if flow_run.id is None:
        return []
    with get_client(sync_client=True) as client:
        stale = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[run_tag]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])),
            ),
        )
        stale = [r for r in stale if str(r.id) != flow_run.id]
        for orphan in stale:
            message = f"its process died; flow run {flow_run.name!r} ({flow_run.id}) resumed the training run"
            client.set_flow_run_state(orphan.id, Crashed(message=message), force=True)
    return [r.name for r in stale]
