"""``evaluate-checkpoint``: decide on one published checkpoint, evaluate it if chosen, log, alert.

Started by the deployment trigger on ``areal.checkpoint.saved`` (parameters templated from the
event payload), by ``prefect deployment run``, by ``sweep-checkpoints``, or by
``train-and-evaluate`` dispatching to the evaluation pool. Flow runs of the same training run
share the run (:class:`~areal_eval.lifecycle.shared_run.SharedRun`): the same planner as the in-flow
loop decides every checkpoint once, in step order, and one flow run evaluates each chosen one.
The flow run that finds the run over (final checkpoint and refinement evaluated) ends its MLflow
run with the curve and the decision log, as ``train-and-evaluate`` does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Failed
from pydantic import Field

from areal_eval.checkpoints.manifest import CheckpointError, CheckpointEvent, Manifest
from areal_eval.checkpoints.remote_run import localize_manifest
from areal_eval.checkpoints.store import is_s3
from areal_eval.evaluation.jobs import EvalResult, check_validation_data
from areal_eval.failures import is_known_failure, one_line
from areal_eval.lifecycle.outcome import Attempt, Outcome, follow_outcome
from areal_eval.lifecycle.shared_run import Claim, SharedRun
from areal_eval.logged_models import log_checkpoints_table
from areal_eval.pipeline.config import PipelineConfig, deployment_config_path, load_pipeline_config
from areal_eval.pipeline.schema import PipelineParams, set_fields
from areal_eval.pipeline.setup import run_evaluation_config
from areal_eval.runs.directory import RunDir, live_owner
from areal_eval.runs.ledger import Ledger
from tasks.after_outcome import FlowRunOutcomes
from tasks.evaluation import evaluation_task, process_workers
from tasks.mlflow_logging import (
    finish_tracking,
    log_evaluation,
    log_published_train_metrics,
    start_tracking_run,
    tracker_for,
)
from tasks.orchestration import flow_run_alive, holding_slot, tag_flow_run
from tasks.reports import (
    announce_outcome,
    announce_summary,
    curve_or_none,
    log_known_failures_without_traceback,
    summarize,
    update_evaluation_table,
)

log_known_failures_without_traceback()  # a known failure is said in one line; tracebacks are for bugs


def same_location(a: str, b: str) -> bool:
    if is_s3(a) or is_s3(b):
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).resolve() == Path(b).resolve()


def evaluation_run_name() -> str:
    """``<run>@<step>`` (with the forced reason, if any), e.g. ``run-7@400`` or ``run-7@25 (sweep)``."""
    params = flow_run.parameters
    run = params.get("run_id") or Path(str(params.get("manifest", "?"))).parent.name
    return f"{run}@{params.get('global_step')}" + (f" ({params['reason']})" if params.get("reason") else "")


@flow(name="evaluate-checkpoint", flow_run_name=evaluation_run_name, log_prints=True)
def evaluate_checkpoint(
    global_step: Annotated[int, Field(ge=0)],
    manifest: str,
    run_id: str | None = None,
    checkpoint_uri: str | None = None,
    data_path: str | None = None,
    params: PipelineParams | None = None,
    config_path: str | None = None,
    reason: str | None = None,
    gpu_slot: str | None = None,
    dispatched: bool = False,
    probe: bool = False,
) -> dict:
    """Decide on the checkpoint at ``global_step`` of ``manifest``; evaluate it if chosen.

    Args:
        global_step: the checkpoint's step (from the event payload).
        manifest: the run's manifest.jsonl (a path, or ``s3://.../manifest.jsonl`` mirrored by
            training), which holds the checkpoint's files and hashes.
        run_id: training run id (default: the manifest's).
        checkpoint_uri: expected checkpoint location; must match the manifest entry.
        data_path: validation data. Default: what the publisher registered with the checkpoint
            (``publish_checkpoint(valid_data=...)``), else ``data/valid.jsonl`` beside the manifest.
        params: pipeline config sections (eval, scheduler, alerts, tracking, ...), over every
            other source of settings.
        config_path: a JSON or YAML pipeline config file on the worker (the deployment's, from
            ``AREAL_EVAL_CONFIG`` at deploy time): the settings of runs that recorded none of
            their own; a run's recorded settings (how it is judged, where its results go) and
            ``params`` go over it.
        reason: evaluate even if the scheduler skipped it, for this reason (e.g. ``manual``); the
            scheduler's own reason is kept next to it. None: the scheduler decides.
        gpu_slot: a Prefect global concurrency limit held while evaluating (e.g. ``gpu:0``).
        dispatched: sent by a ``train-and-evaluate`` flow that decides and records itself: only
            evaluate and log the metrics.
        probe: with ``dispatched``, a probe: evaluate the probe subset only
            (``scheduler.probe_fraction``) and log it as ``eval_probe/*``.
    """
    try:
        return decide_and_evaluate(
            global_step,
            manifest,
            run_id=run_id,
            checkpoint_uri=checkpoint_uri,
            data_path=data_path,
            params=params,
            config_path=config_path,
            reason=reason,
            gpu_slot=gpu_slot,
            dispatched=dispatched,
            probe=probe,
        )
    except Exception as exc:
        if not is_known_failure(exc):
            raise  # a bug: Prefect logs its traceback
        # Bad input or a failed evaluation, already on record: its reason in one line, in the log,
        # as the run's last event (what --watch ends on) and as the state's message; no traceback.
        line = f"{run_id or Path(manifest).parent.name}@{global_step} failed: {one_line(exc)}"
        announce_outcome(run_id or Path(manifest).parent.name, line, failed=True)
        return Failed(message=line, data=exc)


def decide_and_evaluate(
    global_step: int,
    manifest: str,
    *,
    run_id: str | None,
    checkpoint_uri: str | None,
    data_path: str | None,
    params: PipelineParams | None,
    config_path: str | None,
    reason: str | None,
    gpu_slot: str | None,
    dispatched: bool,
    probe: bool,
) -> dict:
    """The flow's body (:func:`evaluate_checkpoint` documents the parameters)."""
    logger = get_run_logger()
    config_path, note = deployment_config_path(config_path)
    if note:
        logger.info(note)
    cfg = load_pipeline_config(config_path, set_fields(params))
    local_manifest = localize_manifest(manifest, cfg.storage.s3, cfg.work_dir)
    run = RunDir(local_manifest.resolve().parent)
    # The run's own evaluators, schedule, rules and sinks, unless these parameters set them.
    cfg = run_evaluation_config(run, set_fields(params), config_path=config_path)
    published = Manifest(local_manifest)
    event = published.find(global_step)  # a missing manifest or step is named before anything else
    if dispatched:
        result = evaluate_one(cfg, event, validation_data(data_path, event, run), run, gpu_slot=gpu_slot, probe=probe)
        mlflow_run_id = start_tracking_run(cfg, event.run_id, str(run.root))
        log_evaluation(cfg, mlflow_run_id, result, reason or "dispatched")
        return {"global_step": global_step, "evaluated": not probe, "metrics": result.metrics}
    owner = owner_of(run)
    if owner:  # e.g. the trigger, for a trainer's event while train-and-evaluate follows its run
        logger.info(f"checkpoint step {global_step}: left to its owner: {owner}")
        return {"global_step": global_step, "evaluated": False, "reason": owner}
    if checkpoint_uri and not same_location(checkpoint_uri, event.uri):
        raise CheckpointError(
            f"checkpoint_uri {checkpoint_uri} is not the manifest's {event.uri} for step {global_step}"
        )
    shared = SharedRun(run, published, cfg.scheduler, cfg.alerts, run_id or event.run_id, feedback=cfg.feedback)
    ctx, claim = claim_checkpoint(cfg, shared, global_step, reason=reason, data_path=data_path, gpu_slot=gpu_slot)
    summary, failures = evaluate_claimed(ctx, claim)
    return report(ctx, claim, summary, failures)


def claim_checkpoint(
    cfg: PipelineConfig,
    shared: SharedRun,
    global_step: int,
    *,
    reason: str | None,
    data_path: str | None,
    gpu_slot: str | None,
) -> tuple[Evaluating, Claim]:
    """Decide what is undecided in the shared run and claim ``global_step`` for this flow run."""
    for problem in Ledger(shared.run.ledger).problems:  # torn by a crash: skipped here as on every path
        get_run_logger().warning(problem)
    claim, _ = shared.claim(global_step, this_flow_run(), reason, flow_run_alive)
    tag_flow_run(f"run:{claim.event.run_id}", f"evaluator:{cfg.eval.evaluator}")
    mlflow_run_id = start_tracking_run(cfg, claim.event.run_id, str(shared.run.root))
    verdict = "evaluate" if claim.evaluate else "nothing to do"
    get_run_logger().info("step %d: %s (%s)", global_step, verdict, claim.reason)
    deleted = frozenset(tracker_for(cfg).deleted_steps(mlflow_run_id))
    return Evaluating(cfg, shared, shared.run, mlflow_run_id, data_path, gpu_slot, deleted), claim


def this_flow_run() -> str:
    return str(flow_run.id or "local")


def evaluate_claimed(ctx: Evaluating, claim: Claim) -> tuple[dict, list[Exception]]:
    """Evaluate (or probe) what was claimed, then the skipped checkpoint its result looked back
    at, if any, then the refinements around the best once the run's checkpoints are handled.
    Failures are recorded already; they are returned, to raise once the run's ledger is up to
    date."""
    event = claim.event
    summary = {"global_step": event.global_step, "evaluated": claim.evaluate, "reason": claim.reason}
    failures: list[Exception] = []
    try:
        if claim.evaluate and claim.probe:
            summary |= probe_and_record(ctx, event)
        elif claim.evaluate:
            summary["metrics"] = evaluate_and_record(ctx, event, claim.reason).metrics
    except Exception as exc:  # noqa: BLE001 - a failed checkpoint does not keep the run from ending
        failures.append(exc)
    summary["looked_back"] = evaluate_more(ctx, list(ctx.looked_back), failures)  # they look back at none
    summary["refined"] = evaluate_more(ctx, ctx.shared.refinements(this_flow_run(), ctx.deleted), failures)
    return summary, failures


def evaluate_more(ctx: Evaluating, events: list[CheckpointEvent], failures: list[Exception]) -> list[int]:
    """Evaluate checkpoints scheduled for this flow run (a look-back, refinements), each with the
    reason in the ledger; returns the steps evaluated, and adds what failed to ``failures``."""
    done = []
    for event in events:
        reason = Ledger(ctx.run.ledger).latest(event.global_step).reason
        get_run_logger().info("step %d: %s", event.global_step, reason)
        try:
            evaluate_and_record(ctx, event, reason)
            done.append(event.global_step)
        except Exception as exc:  # noqa: BLE001 - the others are still evaluated
            failures.append(exc)
    return done


def report(ctx: Evaluating, claim: Claim, summary: dict, failures: list[Exception]) -> dict:
    """End the run in MLflow if this flow run found it over, log the decisions it made and the
    published training metrics, and say how it went in one line (raising the first failure)."""
    cfg, shared, run, mlflow_run_id, event = ctx.cfg, ctx.shared, ctx.run, ctx.mlflow_run_id, claim.event
    if (ledger := shared.finish()) is not None:  # this flow run found the run over: end it
        status, failure = end_status(ledger, shared.manifest.events())
        summary["run"] = report_run(
            cfg, event.run_id, run, mlflow_run_id, ledger=ledger, status=status, failure=failure
        )
        get_run_logger().info("run %s is over: MLflow run %s ended %s", event.run_id, mlflow_run_id, status)
    elif claim.evaluate and shared.ended():  # a late evaluation (manual, sweep): counts and curve stay true
        summary["run"] = report_run(cfg, event.run_id, run, mlflow_run_id, ledger=Ledger(run.ledger), status=None)
    log_decisions(cfg, mlflow_run_id, shared.take_decided(), shared)
    log_published_train_metrics(cfg, mlflow_run_id, shared)
    if failures:  # on record; the flow says it in one line
        raise failures[0]
    if "run" in summary:
        announce_summary(summary["run"], cfg.scheduler.metric)
    return summary


def end_status(ledger: Ledger, events: list[CheckpointEvent]) -> tuple[str, str | None]:
    """How a run that is over ends in MLflow: FAILED, with the reason, when its final checkpoint
    failed (for good: a transient failure is retried before the run is over), else FINISHED."""
    finals = [ledger.latest(e.global_step) for e in events if e.final]
    failed = [e for e in finals if e is not None and e.status == "failed"]
    if failed:
        return "FAILED", f"the final checkpoint (step {failed[-1].step}) failed: {failed[-1].reason}"
    return "FINISHED", None


def report_run(
    cfg: PipelineConfig,
    run_id: str,
    run: RunDir,
    mlflow_run_id: str,
    *,
    ledger: Ledger,
    status: str | None,
    failure: str | None = None,
) -> dict:
    """The curve, the decision log and the counts in MLflow (the run ended with ``status``, and
    ``failure`` as its reason, or left as it is), and the run's summary artifact."""
    plot = curve_or_none(ledger, cfg.scheduler.metric, run, run_id)
    finish_tracking(cfg, mlflow_run_id, ledger, plot, status=status, failure=failure)
    return summarize(cfg, run_id, run, mlflow_run_id, ledger=ledger, plot=plot)


def owner_of(run: RunDir) -> str | None:
    """Who owns ``run``, when a live ``train-and-evaluate`` does (it decides and evaluates its
    checkpoints alone); None when nobody does."""
    owner = live_owner(run)
    return f"{owner}; it evaluates its own checkpoints" if owner else None


def validation_data(data_path: str | None, event: CheckpointEvent, run: RunDir) -> Path:
    """The validation data: the parameter, else what was published with the checkpoint, else
    ``data/valid.jsonl`` beside the manifest; checked now, before any worker starts."""
    chosen = data_path or event.valid_data or run.valid_data
    return check_validation_data(
        chosen,
        "the data_path parameter"
        if data_path
        else "publish_checkpoint(valid_data=...)"
        if event.valid_data
        else "the default beside the manifest",
    )


def log_decisions(cfg: PipelineConfig, mlflow_run_id: str, decided: list[CheckpointEvent], shared: SharedRun) -> None:
    """The decisions this flow run made, whichever of its calls made them, in the run's table of
    checkpoints (``checkpoints.json``)."""
    if decided:
        log_checkpoints_table(tracker_for(cfg).client, mlflow_run_id, Ledger(shared.run.ledger).entries())


def evaluate_one(
    cfg: PipelineConfig, event: CheckpointEvent, data: Path, run: RunDir, *, gpu_slot: str | None, probe: bool = False
) -> EvalResult:
    with holding_slot(gpu_slot, wait_s=cfg.eval.job_timeout_s):
        # A task run now, on the process's warm workers if it keeps some (the service, the sweep).
        return evaluation_task(event, probe)(event, data, cfg, run.evals, workers=process_workers(), probe=probe)


@dataclasses.dataclass(frozen=True)
class Evaluating:
    """What every evaluation of one flow run shares."""

    cfg: PipelineConfig
    shared: SharedRun
    run: RunDir
    mlflow_run_id: str
    data_path: str | None
    """The ``data_path`` parameter (None: the published or default validation data)."""
    gpu_slot: str | None
    deleted: frozenset[int] = frozenset()
    """Steps retention deleted (``deleted.<step>`` tags): never looked back at or refined."""
    looked_back: list[CheckpointEvent] = dataclasses.field(default_factory=list)
    """Skipped checkpoints this flow run's results looked back at (``scheduler.look_back``),
    claimed for it: it evaluates them after what it claimed."""

    def attempt(self, event: CheckpointEvent, probe: bool = False) -> Attempt:
        """Evaluate ``event`` (its probe subset, with ``probe``): its result, or the error."""
        try:
            data = validation_data(self.data_path, event, self.run)
            return Attempt(
                event,
                result=evaluate_one(self.cfg, event, data, self.run, gpu_slot=self.gpu_slot, probe=probe),
                probe=probe,
            )
        except Exception as exc:  # noqa: BLE001 - recorded as the attempt's outcome, then raised
            return Attempt(event, error=exc, probe=probe)


def probe_and_record(ctx: Evaluating, event: CheckpointEvent) -> dict:
    """Probe the checkpoint, as the in-flow loop does: held, the probe is logged as
    ``eval_probe/*`` and the checkpoint stays skipped; escalated, this flow run evaluates it in
    full. A failed probe is recorded and alerted on as a failed evaluation, then raised."""
    attempt = ctx.attempt(event, probe=True)
    outcome = finish_attempt(ctx, attempt, logged=False)  # a held probe is delivered there
    if attempt.error is not None:
        raise attempt.error
    decision, probe_metrics = outcome.decision, attempt.result.probe_metrics
    if decision.evaluate:
        full = evaluate_and_record(ctx, event, decision.reason)
        return {"evaluated": True, "reason": decision.reason, "probe_metrics": probe_metrics, "metrics": full.metrics}
    return {"evaluated": False, "reason": decision.reason, "probe_metrics": probe_metrics}


def evaluate_and_record(ctx: Evaluating, event: CheckpointEvent, reason: str) -> EvalResult:
    """Evaluate, log to MLflow, record in the run's ledger and send what the alert rules fire.
    A failure (missing data included) is recorded and alerted on, then raised."""
    attempt = ctx.attempt(event)
    if attempt.result is not None:
        try:  # logged before it is recorded: an evaluated entry on this path is in MLflow
            log_evaluation(ctx.cfg, ctx.mlflow_run_id, attempt.result, reason, recorded_in=(ctx.run, event.run_id))
        except Exception as exc:  # noqa: BLE001 - a tracker that refuses it fails the attempt (retried)
            attempt = Attempt(event, error=exc)
    finish_attempt(ctx, attempt, logged=True, reason=reason)
    if attempt.error is not None:
        raise attempt.error
    update_evaluation_table(ctx.cfg, event.run_id, Ledger(ctx.run.ledger))
    return attempt.result


def finish_attempt(ctx: Evaluating, attempt: Attempt, *, logged: bool, reason: str = "") -> Outcome:
    """The one outcome step of every path (:func:`areal_eval.lifecycle.outcome.record_outcome`),
    then what follows it, as on every path (:func:`~areal_eval.lifecycle.outcome.follow_outcome`):
    here failed attempts in MLflow, a held probe logged, the alerts sent."""
    outcome = ctx.shared.record_outcome(
        attempt,
        max_attempts=ctx.cfg.eval.max_attempts,
        logged_by_evaluator=logged,
        deleted=ctx.deleted,
        owner=this_flow_run(),
    )
    after = FlowRunOutcomes(ctx.cfg, ctx.mlflow_run_id, ctx.run, ctx.shared, ctx.looked_back)
    follow_outcome(attempt, outcome, after, reason=reason)
    return outcome
