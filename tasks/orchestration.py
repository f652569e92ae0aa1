"""What a flow asks of the Prefect API: a concurrency slot, whether a flow run is alive, this
one's tags, and which earlier runs of its training run died without saying so."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator

from prefect import get_run_logger
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
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.concurrency.sync import concurrency
from prefect.exceptions import MissingContextError, ObjectNotFound
from prefect.runtime import flow_run
from prefect.states import Crashed

from areal_eval.config.parsing import ConfigError
from areal_eval.failures import OrchestrationUnavailable


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger (its lines in the UI), or this module's outside a run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


@contextlib.contextmanager
def holding_slot(name: str | None, wait_s: float, max_backoff_s: float = 30.0) -> Iterator[None]:
    """Hold one slot of the global concurrency limit ``name`` (nothing when None) inside the block.

    An API that cannot be reached (a server restarting) is waited for, with backoff, for up to
    ``wait_s``; then :class:`OrchestrationUnavailable` (transient) is raised. A limit that does
    not exist is a :class:`ConfigError`. Only the acquisition is retried, never the block."""
    if name is None:
        yield
        return
    deadline, delay = time.monotonic() + wait_s, 1.0
    with contextlib.ExitStack() as held:
        while True:
            try:
                held.enter_context(concurrency(name, occupy=1, strict=True))
                break
            except ConcurrencySlotAcquisitionError as exc:
                if "must be created" in str(exc):
                    raise ConfigError(f"gpu_slot: {exc} (prefect gcl create {name} --limit 1)") from exc
                if time.monotonic() + delay > deadline:
                    raise OrchestrationUnavailable(f"concurrency slot {name!r}: {exc} (for {wait_s:.0f} s)") from exc
                _logger().warning("concurrency slot %r not acquired (%s); retrying in %.0f s", name, exc, delay)
                time.sleep(delay)
                delay = min(max_backoff_s, 2 * delay)
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
