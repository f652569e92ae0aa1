"""Prefect task that evaluates one checkpoint on separate torchrun workers."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.deployments import run_deployment
from prefect.exceptions import MissingContextError

from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.disk import is_disk_full
from areal_eval.evaluation.jobs import EvalResult, EvaluationFailed, cluster_slots, run_evaluation_job
from areal_eval.evaluation.worker_pool import WarmWorkerGroups
from areal_eval.failures import is_permanent
from areal_eval.launchers.devices import DevicePlan, Placement, SlotDevices, plan_here
from areal_eval.launchers.slot_pool import ClusterSlot, SlotPool
from areal_eval.pipeline.config import PipelineConfig
from areal_eval.tracking import EVAL_PREFIX, PROBE_PREFIX
from tasks.mlflow_logging import tracker_for


@task(cache_policy=NO_CACHE, name="evaluate-step", task_run_name="evaluate-step-{event.global_step}")
def evaluate_step(
    event: CheckpointEvent,
    data_path: Path,
    cfg: PipelineConfig,
    work_dir: Path,
    *,
    workers: WarmWorkerGroups | SlotDevices | SlotPool | None = None,
    probe: bool = False,
) -> EvalResult:
    """Fetch the checkpoint, load it on ``cfg.eval.nproc`` ranks (a free group of ``workers``)
    and reduce its metrics (``probe``: on the probe subset only); raises on failure.

    A transient failure is tried again up to ``eval.retries`` times, after 1, 2, 4, ... s (a
    permanent one is not: :mod:`areal_eval.failures`). Each failed try's cause travels with the
    outcome (``retried``), so the ledger and MLflow keep it even when a later try succeeds."""
    logger = get_run_logger()
    retried: list[str] = []
    while True:
        try:
            with (workers or slot_devices(cfg, work_dir)).lease() as slot:
                placement = slot if isinstance(slot, Placement) else None
                group = None if slot is None or placement is not None else slot
                result = run_evaluation_job(
                    event,
                    data_path,
                    cfg.eval,
                    work_dir,
                    max_length=cfg.model.max_length,
                    s3=cfg.storage.s3,
                    cache_dir=cfg.checkpoint_cache,
                    workers=group,
                    probe_fraction=cfg.scheduler.probe_fraction,
                    probe_only=probe,
                    placement=placement,
                )
                notes = result.notes + (slot.wait_note() if isinstance(slot, ClusterSlot) else [])
            return dataclasses.replace(result, retried=retried, notes=notes)
        except Exception as exc:
            if is_permanent(exc) or is_disk_full(exc) or len(retried) >= cfg.eval.retries:
                exc.retried = retried
                raise
            retried.append(str(exc))
            delay = 2 ** (len(retried) - 1)
            logger.warning("step %d: try %d failed, retrying in %d s: %s", event.global_step, len(retried), delay, exc)
            time.sleep(delay)


@functools.cache
def _slot_devices(plan: DevicePlan) -> SlotDevices:
    return SlotDevices(plan.eval_slots)


_cluster_slots: dict[str, SlotPool] = {}


def _process_cluster_slots(cfg: PipelineConfig, work_dir: Path) -> SlotPool:
    key = json.dumps([cfg.run_name, str(work_dir), dataclasses.asdict(cfg.eval)], sort_keys=True, default=str)
    if key not in _cluster_slots:
        if not _cluster_slots:
            atexit.register(close_cluster_slots)  # a cluster's slots are given back when the process ends
        slots = _cluster_slots[key] = worker_groups(cfg, work_dir)
        slots.start()
    return _cluster_slots[key]


def close_cluster_slots() -> None:
    """Give back the cluster slots this process opened for evaluations outside a flow's own."""
    while _cluster_slots:
        _cluster_slots.popitem()[1].close()


def slot_devices(cfg: PipelineConfig, work_dir: Path, training_here: bool = False) -> SlotDevices | SlotPool:
    """This process's lease of the evaluation slots (fresh torchrun jobs on each slot's devices,
    or a cluster's slots, kept until the process ends): shared by every evaluation the process
    runs at once without slots of its flow's."""
    if cfg.eval.launcher != "local":
        return _process_cluster_slots(cfg, work_dir)
    return _slot_devices(plan_here(cfg, training_here))


def run_log(message: str) -> None:
    """Say ``message`` in the flow run's log (the UI), or this module's outside a run."""
    try:
        get_run_logger().info(message)
    except MissingContextError:
        logging.getLogger(__name__).info(message)


def worker_groups(cfg: PipelineConfig, work_dir: Path, training_here: bool = False) -> WarmWorkerGroups | SlotPool:
    """``eval.slots`` warm groups of ``eval.nproc`` ranks, each on its slot's devices; or, with a
    cluster launcher, the cluster's slots (``eval.nodes`` nodes each)."""
    e = cfg.eval
    if e.launcher != "local":
        return cluster_slots(e, work_dir, run_name=cfg.run_name, report=run_log)
    placements = plan_here(cfg, training_here).eval_slots
    return WarmWorkerGroups(
        e.slots, e.nproc, work_dir, e.nice, e.collective_timeout_s, placements=placements, python=e.python
    )


_process_workers: WarmWorkerGroups | None = None
"""Warm worker groups every evaluation of this process runs on (the evaluation service's)."""


@contextlib.contextmanager
def serve_warm_workers(cfg: PipelineConfig, work_dir: Path) -> Iterator[WarmWorkerGroups]:
    """Warm worker groups (``eval.slots`` of ``eval.nproc`` ranks) for every ``evaluate`` call
    this process makes while inside: a long-lived service pays worker start-up once."""
    global _process_workers
    with worker_groups(cfg, work_dir) as groups:
        _process_workers = groups
        try:
            yield groups
        finally:
            _process_workers = None


def process_workers() -> WarmWorkerGroups | None:
    """The warm worker groups this process keeps for every evaluation (:func:`serve_warm_workers`)."""
    return _process_workers


def evaluation_task(event: CheckpointEvent, probe: bool = False):
    """The one way into ``evaluate-step``: the task for ``event``, shown as ``probe-step-N`` in
    the UI for a probe; call it (a task run now) or ``.submit`` it (a future)."""
    if probe:
        return evaluate_step.with_options(task_run_name=f"probe-step-{event.global_step}")
    return evaluate_step


def warm_workers(cfg: PipelineConfig, work_dir: Path, training_here: bool) -> contextlib.AbstractContextManager:
    """What a flow run's evaluations run on: ranks kept for the whole run (``eval.warm_workers``),
    a group per slot; else each slot's devices for fresh jobs; nothing when a pool evaluates.
    ``training_here``: this flow runs training, whose devices evaluation leaves alone."""
    if cfg.eval.deployment:
        return contextlib.nullcontext()
    if cfg.eval.warm_workers or cfg.eval.launcher != "local":
        return worker_groups(cfg, work_dir, training_here)
    return SlotDevices(plan_here(cfg, training_here).eval_slots)


@task(cache_policy=NO_CACHE, name="dispatch-evaluation", task_run_name="dispatch-step-{event.global_step}")
def dispatch_evaluation(
    event: CheckpointEvent, manifest: Path, pipeline_cfg: PipelineConfig, reason: str, *, probe: bool = False
) -> EvalResult:
    """Run ``evaluate-checkpoint`` on the evaluation pool and wait; it logs the metrics to MLflow
    (read back from there: idempotent, so nothing lands twice). The flow decided, and it records
    and alerts."""
    cfg = pipeline_cfg.eval
    run = run_deployment(
        cfg.deployment,
        timeout=cfg.job_timeout_s,
        poll_interval=1,
        # A retried dispatch reuses the run; a probe and the full evaluation it escalates to are two.
        idempotency_key=f"{event.run_id}:{event.global_step}" + (":probe" if probe else ""),
        parameters={
            "global_step": event.global_step,
            "manifest": str(manifest),
            "run_id": event.run_id,
            "params": dataclasses.asdict(pipeline_cfg),
            "reason": reason,
            "dispatched": True,
            "probe": probe,
        },
    )
    if not run.state or not run.state.is_completed():
        raise EvaluationFailed(
            f"checkpoint step {event.global_step}: {cfg.deployment} run {run.name} ended {run.state}"
        )
    tracker = tracker_for(pipeline_cfg)
    mlflow_run = tracker.find_run(event.run_id)
    logged = tracker.client.get_run(mlflow_run).data.metrics
    probe_metrics = tracker.step_metrics(mlflow_run, event.global_step, logged, PROBE_PREFIX)
    if probe:
        return EvalResult(event.global_step, event.uri, {}, 0.0, probe_metrics=probe_metrics)
    metrics = tracker.step_metrics(mlflow_run, event.global_step, logged, EVAL_PREFIX)
    return EvalResult(event.global_step, event.uri, metrics, 0.0, probe_metrics=probe_metrics)
