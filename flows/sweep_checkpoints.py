"""``sweep-checkpoints``: pick up what the event path lost, without undoing its decisions.

Meant for a cron schedule. It finds manifests under ``store`` (a run directory, or a directory
of run directories, or an S3 prefix of them) and, through each shared run, evaluates
(as ``evaluate-checkpoint`` subflows) the checkpoints whose events were lost or whose flow run
died. Idempotent: a second sweep finds nothing to do.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.checkpoints.remote_run import localize_manifest
from areal_eval.checkpoints.store import S3Config, S3Store, is_s3
from areal_eval.lifecycle.shared_run import SharedRun
from areal_eval.pipeline.config import PipelineConfig, deployment_config_path, load_pipeline_config
from areal_eval.pipeline.schema import PipelineParams, set_fields
from areal_eval.pipeline.setup import run_evaluation_config
from areal_eval.runs.directory import RunDir, owned_by_live_process
from flows.evaluate_checkpoint import evaluate_checkpoint
from tasks.evaluation import serve_warm_workers
from tasks.mlflow_logging import tracker_for
from tasks.orchestration import flow_run_alive


def find_manifests(store: str, s3: S3Config) -> list[str]:
    """Manifests of the runs in ``store``: a run directory or prefix, or a directory or prefix of them."""
    if is_s3(store):
        root = store.rstrip("/")
        return [
            f"{root}/{p}/manifest.jsonl" if p else f"{root}/manifest.jsonl" for p in S3Store(root, s3).run_prefixes()
        ]
    if (Path(store) / "manifest.jsonl").exists():
        return [str(Path(store) / "manifest.jsonl")]
    return [str(p) for p in sorted(Path(store).glob("*/manifest.jsonl"))]


def end_if_abandoned(tracker, mlflow_run_id: str, run: RunDir) -> bool:
    """A flow-owned run left RUNNING by a flow that died (its lock is free) is ended KILLED.
    Runs of trainers outside the flow hold no lock file and are left alone."""
    if not run.lock_file.exists() or tracker.client.get_run(mlflow_run_id).info.status != "RUNNING":
        return False
    if owned_by_live_process(run):
        return False  # its flow is alive
    tracker.set_tags(
        mlflow_run_id, {"areal.failure": "its flow died: found RUNNING with no live owner by sweep-checkpoints"}
    )
    tracker.finish(mlflow_run_id, "KILLED")
    return True


def sweep_run(
    manifest: str,
    cfg: PipelineConfig,
    params: PipelineParams | None,
    reevaluate_skipped: bool,
    *,
    config_path: str | None = None,
) -> list[tuple[str, bool]]:
    """Evaluate what no flow run handles in the run of ``manifest``: ``(run@step, completed)`` each
    (``config_path`` and ``params`` as :func:`~flows.evaluate_checkpoint.evaluate_checkpoint` takes them)."""
    logger, tracker = get_run_logger(), tracker_for(cfg)
    local = localize_manifest(manifest, cfg.storage.s3, cfg.work_dir)
    events = Manifest(local).events()
    if not events:
        return []
    run = RunDir(local.resolve().parent)
    mlflow_run = tracker.find_run(events[0].run_id)
    if mlflow_run and not is_s3(manifest) and end_if_abandoned(tracker, mlflow_run, run):
        logger.warning("run %s was RUNNING with no live owner: marked KILLED", events[0].run_id)
    if owned_by_live_process(run):
        logger.info("run %s: its train-and-evaluate flow is live and evaluates it", events[0].run_id)
        return []
    judged = run_evaluation_config(run, set_fields(params), config_path=config_path)  # as evaluate-checkpoint's
    shared = SharedRun(run, Manifest(local), judged.scheduler, judged.alerts, events[0].run_id)
    steps = shared.unhandled(flow_run_alive) + (shared.skipped() if reevaluate_skipped else [])
    steps = sorted(set(steps) - (tracker.deleted_steps(mlflow_run) if mlflow_run else set()))
    work = [(step, "sweep") for step in steps]
    finals = [e.global_step for e in events if e.final]
    if not steps and finals and mlflow_run and tracker.client.get_run(mlflow_run).info.status == "RUNNING":
        # Every checkpoint is handled, but the run's refinement and end never happened. Nothing is
        # forced: a final checkpoint that failed for good stays failed, and the run ends FAILED.
        work = [(finals[-1], None)]
    done = []
    for step, reason in work:
        state = evaluate_checkpoint(
            step,
            manifest,
            run_id=events[0].run_id,
            params=params,
            config_path=config_path,
            reason=reason,
            return_state=True,
        )
        done.append((f"{events[0].run_id}@{step}", state.is_completed()))
    return done


def sweep_run_name() -> str:
    return f"sweep {Path(str(flow_run.parameters.get('store', '?'))).name}"


@flow(name="sweep-checkpoints", flow_run_name=sweep_run_name, log_prints=True)
def sweep_checkpoints(
    store: str, params: PipelineParams | None = None, config_path: str | None = None, reevaluate_skipped: bool = False
) -> dict:
    """Evaluate what no flow run is evaluating, in every run under ``store``.

    That is: checkpoints with no decision yet (their events were lost; they are decided now, by
    the scheduler), and checkpoints decided for evaluation whose flow run died. Checkpoints the
    scheduler skipped stay skipped unless ``reevaluate_skipped``. Runs a live
    ``train-and-evaluate`` owns are left to it.

    Args:
        store: a run directory or a directory of run directories (each with manifest.jsonl), or
            the ``s3://bucket/prefix`` of ``storage.checkpoint_uri`` (training mirrors manifests there).
        params: pipeline config sections, passed on to evaluate-checkpoint.
        config_path: a pipeline config file on the worker (the deployment's, from
            ``AREAL_EVAL_CONFIG`` at deploy time), passed on to evaluate-checkpoint.
        reevaluate_skipped: also evaluate the checkpoints the scheduler skipped or superseded.
    """
    logger = get_run_logger()
    config_path, note = deployment_config_path(config_path)
    if note:
        logger.info(note)
    cfg = load_pipeline_config(config_path, set_fields(params))
    evaluated, failed = [], []
    # One group of ranks, started at the first evaluation, serves every evaluation of the sweep:
    # catching up on many checkpoints pays worker start-up once, as the evaluation service does.
    sweep_dir = Path(cfg.work_dir) / "sweep-checkpoints" / str(flow_run.id or "local")  # sweeps may overlap
    with serve_warm_workers(cfg, sweep_dir) if cfg.eval.warm_workers else contextlib.nullcontext():
        for manifest in find_manifests(store, cfg.storage.s3):
            for name, completed in sweep_run(manifest, cfg, params, reevaluate_skipped, config_path=config_path):
                (evaluated if completed else failed).append(name)
    logger.info("sweep: evaluated %d, failed %d", len(evaluated), len(failed))
    return {"evaluated": evaluated, "failed": failed}
