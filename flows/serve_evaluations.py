"""``serve-evaluations``: a long-lived evaluation service for trainers that publish on their own.

    PREFECT_API_URL=... python -m flows.serve_evaluations [--config FILE] [--set section.field=value ...]

The deployment trigger pays for every checkpoint a worker poll, a subprocess, importing the
flow (Prefect, MLflow, torch) and a fresh torchrun job. This process pays them once: it
subscribes to the server's ``areal.checkpoint.saved`` events from publishers and runs
``evaluate-checkpoint`` in-process for each one (a flow run per checkpoint, in the UI as any
other), ``eval.slots`` at a time, on warm worker groups kept for its whole life. Decisions go
through the shared run (its ledger under one lock), so the deployment trigger, the sweep and manual runs agree with
it. Use it instead of the ``evaluate-published-checkpoint`` automation (pause that one), or beside
it: then each checkpoint is evaluated once, by whichever flow run claims it first.

It outlives a server restart: the event stream is reconnected with backoff, the events sent
meanwhile are replayed, and checkpoints whose events never reached the server (published while
it was down) are caught up from the manifests of the runs it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefect import flow
from prefect.events.clients import get_events_subscriber
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
from prefect.events.schemas.events import ResourceSpecification
from prefect.settings import PREFECT_API_URL
from websockets.exceptions import WebSocketException

from areal_eval.checkpoints.lost_events import ServedRuns
from areal_eval.checkpoints.publisher import CHECKPOINT_SAVED, payload_problem
from areal_eval.config.parsing import ConfigError, parse_overrides
from areal_eval.launchers.reaper import watch_over_children
from areal_eval.pipeline.config import PipelineConfig, load_pipeline_config
from areal_eval.pipeline.schema import PipelineParams, set_fields
from flows.evaluate_checkpoint import evaluate_checkpoint
from flows.sweep_checkpoints import sweep_run
from tasks.device_slot import leases_kept_in_memory
from tasks.evaluation import serve_warm_workers

PUBLISHED = EventFilter(
    event=EventNameFilter(name=[CHECKPOINT_SAVED]),
    resource=EventResourceFilter(labels=ResourceSpecification({"areal.source": "publisher"})),
)
"""Checkpoints announced by trainers outside the flow (the flow evaluates its own)."""


@dataclasses.dataclass(frozen=True)
class Given:
    """The settings the service was started with, passed on to every evaluation as the trigger's
    deployment passes its own: a run's recorded settings go over the file, the overrides over both."""

    config_path: str | None = None
    """``--config``."""
    overrides: dict = dataclasses.field(default_factory=dict)
    """``--set``, as config sections."""


def evaluate_published(given: Given, payload: dict, gpu_slot: str | None) -> None:
    """One checkpoint, as the deployment trigger would start it; a failure is the flow run's."""
    state = evaluate_checkpoint(
        global_step=int(payload["global_step"]),
        manifest=payload["manifest"],
        run_id=payload.get("run_id"),
        checkpoint_uri=payload.get("uri"),
        params=given.overrides,
        config_path=given.config_path,
        gpu_slot=gpu_slot,
        return_state=True,
    )
    if state.is_failed() and state.message:  # the failure's one line, which names the checkpoint
        print(state.message, flush=True)
    else:
        print(f"{payload.get('run_id')}@{payload['global_step']}: {state.name}", flush=True)


@flow(name="catch-up-evaluations", log_prints=True)
def catch_up(manifests: list[str], params: PipelineParams | None = None, config_path: str | None = None) -> dict:
    """After a lost connection: what the events missed in the runs this service has seen
    (checkpoints published while the server was down, claims of flow runs that died), through
    the sweep's own per-run step, on this process's warm workers."""
    cfg = load_pipeline_config(config_path, set_fields(params))
    done = [
        name
        for manifest in manifests
        for name, _ in sweep_run(manifest, cfg, params, reevaluate_skipped=False, config_path=config_path)
    ]
    return {"evaluated": done}


CONNECTION_FAULTS = (OSError, WebSocketException)
"""What a server that is restarting or gone raises at the event stream: waited out, never fatal."""


async def serve(
    cfg: PipelineConfig,
    gpu_slot: str | None,
    ready: asyncio.Event | None = None,
    max_backoff_s: float = 30.0,
    *,
    given: Given = Given(),
) -> None:
    """Evaluate each published checkpoint until cancelled. A lost connection to the server is
    retried with backoff, forever; once back, events sent meanwhile are replayed by the server
    (each handled once), and the runs seen so far are caught up from their manifests."""
    loop = asyncio.get_running_loop()
    manifests: dict[str, None] = {}  # the runs seen, in order
    seen: set = set()  # event ids: a replay after a reconnect is not evaluated again
    backoff, connected_before = 1.0, False
    with (
        serve_warm_workers(cfg, Path(cfg.work_dir) / "serve-evaluations") as workers,
        ThreadPoolExecutor(cfg.eval.slots, thread_name_prefix="evaluate") as pool,
        ServedRuns() as served,  # what a trainer whose event is lost is told will catch it up
    ):
        workers.start()  # up before the first checkpoint arrives
        while True:
            try:
                # No reconnection inside the subscriber: every drop comes here, to be caught up on.
                async with get_events_subscriber(filter=PUBLISHED, reconnection_attempts=0) as events:
                    print(
                        f"serve-evaluations: listening to {PREFECT_API_URL.value()} for {CHECKPOINT_SAVED} "
                        f"({cfg.eval.slots} slot(s))",
                        flush=True,
                    )
                    if gpu_slot and (warning := await loop.run_in_executor(None, leases_kept_in_memory)):
                        print(f"serve-evaluations: warning: {warning}", flush=True)
                    if connected_before and manifests:
                        loop.run_in_executor(pool, catch_up_quietly, list(manifests), given)
                    connected_before, backoff = True, 1.0
                    if ready is not None:
                        ready.set()
                    async for event in events:
                        if event.id in seen:
                            continue
                        seen.add(event.id)
                        if problem := payload_problem(event.payload):
                            print(f"serve-evaluations: event {event.id} skipped: {problem}", flush=True)
                            continue
                        manifests.setdefault(event.payload["manifest"])
                        served.add(event.payload["manifest"])
                        loop.run_in_executor(pool, evaluate_published, given, dict(event.payload), gpu_slot)
                why = "the server closed the event stream"
            except CONNECTION_FAULTS as exc:
                why = repr(exc)
            print(
                f"serve-evaluations: lost {PREFECT_API_URL.value()} ({why}); reconnecting in {backoff:.0f} s",
                flush=True,
            )
            await asyncio.sleep(backoff)
            backoff = min(max_backoff_s, 2 * backoff)


def catch_up_quietly(manifests: list[str], given: Given) -> None:
    """:func:`catch_up` in the pool; a failure is the catch-up flow run's, not the service's."""
    state = catch_up(manifests, given.overrides, given.config_path, return_state=True)
    print(f"serve-evaluations: caught up on {len(manifests)} run(s): {state.name}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Evaluate checkpoints published to a Prefect server, warm.")
    parser.add_argument("--config", help="JSON or YAML pipeline config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument(
        "--gpu-slot", default="gpu:0", help="global concurrency limit held while evaluating ('' for none)"
    )
    args = parser.parse_args(argv)
    if not PREFECT_API_URL.value():
        print("error: set PREFECT_API_URL to the server the trainers publish to", file=sys.stderr)
        return 2
    try:
        cfg = load_pipeline_config(args.config, None, args.overrides)
        given = Given(args.config and str(Path(args.config).resolve()), parse_overrides(args.overrides))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    watch_over_children()  # the warm workers end with this process, however it ends
    try:
        asyncio.run(serve(cfg, args.gpu_slot or None, given=given))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
