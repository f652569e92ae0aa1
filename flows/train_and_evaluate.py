"""``train-and-evaluate``: train, follow checkpoints, evaluate adaptively, track, alert.

    python -m flows.train_and_evaluate [--config FILE] [--set section.field=value ...]

The flow body is the pipeline diagram: training runs in its own torchrun job; the library's
follow loop announces each durable checkpoint and puts it to the scheduler; chosen ones are
evaluated on separate torchrun workers (``eval.slots`` evaluations in flight, the queue
coalescing when every slot is busy); results go to MLflow and through the alert rules, a firing rule starting
the alert branch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from prefect import flow
from prefect.runtime import deployment, flow_run

from areal_eval.alerts import AlertEngine
from areal_eval.checkpoints.manifest import Manifest
from areal_eval.config.parsing import ConfigError
from areal_eval.data.preference_data import DataError
from areal_eval.disk import is_disk_full
from areal_eval.evaluation.items import run_item_scores
from areal_eval.launchers.devices import plan_here
from areal_eval.launchers.local import TorchrunJob
from areal_eval.launchers.reaper import watch_over_children
from areal_eval.lifecycle.follow_loop import FollowLoop, LoopConfig
from areal_eval.lifecycle.planner import EvaluationPlanner
from areal_eval.lifecycle.shared_run import mark_over, read_state
from areal_eval.pipeline.config import PipelineConfig, load_pipeline_config
from areal_eval.pipeline.schema import PipelineParams, set_fields
from areal_eval.pipeline.setup import check_inputs, total_train_steps
from areal_eval.runs.directory import RunBusy, RunDir, RunLock
from areal_eval.runs.ledger import Ledger
from areal_eval.train import training_finished
from commands.console import stop_cause, stop_line, stop_on_sigterm, tracebacks_to
from commands.local_server import own_prefect_server
from tasks.alerts import webhook_url
from tasks.checkpoints import share_run_files
from tasks.evaluation import warm_workers
from tasks.loop_io import PrefectLoopIO
from tasks.mlflow_logging import finish_tracking, start_tracking
from tasks.orchestration import crash_orphaned_runs, tag_flow_run
from tasks.reports import (
    announce_outcome,
    announce_summary,
    curve_or_none,
    log_known_failures_without_traceback,
    summarize,
)
from tasks.training import prepare_run_dir, start_training, wait_for_training

_taken_by_main: RunLock | None = None
"""The run's owner lock that :func:`main` took before Prefect started; the flow keeps it, so no
other owner can slip in while Prefect starts (15-20 s)."""


log_known_failures_without_traceback()  # a known failure is said in one line; tracebacks are for bugs


@contextlib.contextmanager
def owning_run(run: RunDir) -> Iterator[RunLock]:
    """Own ``run`` for the flow's lifetime: keep the lock ``main`` took for it, else take it."""
    global _taken_by_main
    taken, _taken_by_main = _taken_by_main, None
    if taken is not None and taken.run.root != run.root:
        taken.release()
        taken = None
    lock = taken or RunLock(run).acquire()
    try:
        yield lock
    finally:
        lock.release()


def run_config(params: PipelineParams | dict | None, config_path: str | None, overrides: list[str] | None):
    """This flow run's config, loaded once in this process for the same inputs: the command's
    own check, the flow run's name and its body share it. A deployment run that names no run
    (an unedited form) trains a new one named after the flow run, rather than resuming the
    default ``demo``."""
    own_name = flow_run.name if deployment.id else None
    fields = set_fields(params)
    file = os.stat(config_path) if config_path and os.path.exists(config_path) else None
    written = (file.st_mtime_ns, file.st_size) if file else None
    key = json.dumps([fields, config_path, written, overrides, own_name], sort_keys=True, default=str)
    if key not in _loaded:
        _loaded.clear()  # one run's config at a time: a process runs one flow run, a test many in turn
        _loaded[key] = load_pipeline_config(config_path, fields, overrides, run_name=own_name)
    return _loaded[key]


_loaded: dict[str, PipelineConfig] = {}


def training_run_name() -> str:
    """The run's ``run_name`` (what its directory and MLflow run are called)."""
    params = flow_run.parameters
    try:
        return run_config(params.get("params"), params.get("config_path"), params.get("overrides")).run_name
    except Exception:  # noqa: BLE001 - a bad config fails the run itself, with its message
        return "train-and-evaluate"


@flow(name="train-and-evaluate", flow_run_name=training_run_name, log_prints=True)
def train_and_evaluate(
    params: PipelineParams | None = None, config_path: str | None = None, overrides: list[str] | None = None
) -> dict:
    """Run the whole pipeline for one training run, or resume it (same ``run_name``); returns a summary.

    The flow owns the run directory while it runs (a second flow on it is refused, naming this
    one). Every exit ends the MLflow run: FINISHED, FAILED (with the reason as the tag
    ``areal.failure``) or KILLED; the evaluation curve and the summary are written in every case.

    Args:
        params: pipeline config sections (run_name, data, model, train, eval, scheduler, storage,
            tracking, alerts); only the fields set override the config file and the defaults.
        config_path: a JSON or YAML pipeline config file on the worker.
        overrides: ``section.field=value`` strings, applied last.
    """
    cfg = run_config(params, config_path, overrides)
    webhook_url(cfg.alerts)  # a webhook named but not set fails now, not at the first alert
    watch_over_children()  # training and evaluation workers end with this process, however it ends
    with owning_run(RunDir(cfg.run_root)):
        run = prepare_run_dir(cfg)
        tag_flow_run(f"run:{run.run_id}", f"evaluator:{cfg.eval.evaluator}")
        for orphan in crash_orphaned_runs("train-and-evaluate", f"run:{run.run_id}"):
            print(f"flow run {orphan!r} of this run had died without ending: marked Crashed")
        external = cfg.train.external  # your own trainer publishes to this run's manifest
        # Training first: it never waits for MLflow (a new store's set-up, a server retried).
        training = None if external or training_finished(run, run.run_id) else start_training(cfg, run)
        failure: BaseException | None = None
        mlflow_run_id = None
        try:
            mlflow_run_id = start_tracking(cfg, run)
            follow_and_evaluate(cfg, run, mlflow_run_id, training)
            if training is not None:
                wait_for_training(training, run.train_log)
        except BaseException as exc:  # recorded in MLflow below, then raised
            failure = exc
        finally:
            if training is not None and training.poll() is None:
                training.kill()
        ledger = Ledger(run.ledger)
        plot = curve_or_none(ledger, cfg.scheduler.metric, run, run.run_id)
        if failure is None:
            try:
                finish_tracking(cfg, mlflow_run_id, ledger, plot, status="FINISHED")
                mark_over(run)
                share_run_files(cfg, run)
                summary = summarize(cfg, run.run_id, run, mlflow_run_id, ledger=ledger, plot=plot)
            except Exception as exc:  # noqa: BLE001 - e.g. a full disk: the run ends failed, as below
                failure = exc
            else:
                announce_summary(summary, cfg.scheduler.metric)
                return summary
        announce_outcome(run.run_id, f"{run.run_id} stopped: {stop_cause(failure)}", failed=True)
        if mlflow_run_id is not None:  # None: MLflow could not be reached to start with
            end_tracking_failed(cfg, run, mlflow_run_id, ledger, plot=plot, failure=failure)
        raise failure


def end_tracking_failed(
    cfg: PipelineConfig, run: RunDir, mlflow_run_id: str, ledger: Ledger, *, plot: Path | None, failure: BaseException
) -> None:
    """End the MLflow run FAILED or KILLED with the cause, or say loudly that it could not be
    ended and what the next command does about it (the run's own failure is what gets raised)."""
    status = "FAILED" if isinstance(failure, Exception) else "KILLED"
    try:
        finish_tracking(cfg, mlflow_run_id, ledger, plot, status=status, failure=stop_cause(failure))
        summarize(cfg, run.run_id, run, mlflow_run_id, ledger=ledger, plot=plot)
    except Exception as exc:  # noqa: BLE001 - e.g. MLflow down as well, or its store on the full disk
        where = "its store is on the full disk" if is_disk_full(exc) else f"{stop_cause(exc)}"
        print(
            f"error: the MLflow run {mlflow_run_id} could not be marked {status} ({where}): it shows RUNNING "
            "until the same command runs again"
            + (" with space freed" if is_disk_full(exc) or is_disk_full(failure) else "")
            + ", which resumes the run and ends it",
            file=sys.stderr,
            flush=True,
        )


def follow_and_evaluate(cfg: PipelineConfig, run: RunDir, mlflow_run_id: str, training: TorchrunJob | None) -> Ledger:
    """Follow the run's manifest until its final checkpoint is handled (call inside a flow).

    The library's :class:`FollowLoop` with Prefect behind its effects. ``training`` None follows
    a run whose training is already over (or happens elsewhere).
    """
    items = run_item_scores(run.evals)
    feedback = cfg.feedback_judge(items)
    planner = EvaluationPlanner(cfg.scheduler, Ledger(run.ledger), items, feedback=feedback)
    loop_cfg = LoopConfig(
        poll_interval_s=cfg.poll_interval_s,
        slots=cfg.eval.slots,
        max_attempts=cfg.eval.max_attempts,
        results_logged_by_evaluator=bool(cfg.eval.deployment),
        retention=cfg.storage.retention,
        external_timeout_s=cfg.train.external_timeout_s if cfg.train.external else None,
        refined=bool(read_state(run).get("refined")) and training is None and not cfg.train.external,
    )
    with warm_workers(cfg, run.evals, training_here=training is not None) as workers:
        io = PrefectLoopIO(cfg, run, mlflow_run_id, planner.ledger, total_train_steps(run, cfg), workers)
        ledger = FollowLoop(
            planner,
            Manifest(run.manifest),
            run.train_log,
            AlertEngine(cfg.alerts, items=items),
            io,
            loop_cfg,
            training,
            run_id=run.run_id,
            feedback=feedback,
        ).run()
        io.set_progress(1.0)
    return ledger


PRESETS = {path.stem: path for path in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")}
"""Configs shipped with the project, by name (``configs/NAME.yaml``)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the train-and-evaluate flow (Prefect, MLflow, torchrun).")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", help="JSON or YAML pipeline config")
    source.add_argument("--preset", choices=sorted(PRESETS), help="a config shipped in configs/ (e.g. sft-math)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args(argv)
    if args.preset:
        args.config = str(PRESETS[args.preset])
    global _taken_by_main
    try:  # bad input is reported once, first, in one line, before Prefect or training starts
        cfg = run_config(None, args.config, args.overrides)
        check_inputs(cfg)
        plan_here(cfg)  # a device this machine lacks is named now
        webhook_url(cfg.alerts)
        _taken_by_main = RunLock(RunDir(cfg.run_root)).acquire()  # handed to the flow
    except (ConfigError, DataError, RunBusy) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that cannot be read, a run directory that cannot be made (work_dir=/proc/1)
        print(f"error: {exc.filename or 'work_dir ' + repr(cfg.work_dir)}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    watch_over_children()  # before the Prefect server starts, so that it is reaped too
    start = time.monotonic()
    tracebacks = cfg.run_root / "logs" / "tracebacks.log"
    stop_on_sigterm()
    try:
        with own_prefect_server(Path(cfg.work_dir) / "prefect-server.log") as ui:
            if ui:
                print(f"Prefect UI for this run (up while it lasts): {ui}/runs", flush=True)
            with tracebacks_to(tracebacks):
                summary = train_and_evaluate(config_path=args.config, overrides=args.overrides)
    except BaseException as exc:  # noqa: BLE001 - one line, first: the cause and what to run next
        typed = shlex.split(os.environ.get("AREAL_EVAL_COMMAND", "python -m flows.train_and_evaluate"))
        line, status = stop_line(exc, [*typed, *(argv if argv is not None else sys.argv[1:])], tracebacks)
        print(line, file=sys.stderr, flush=True)
        return status
    minutes = (time.monotonic() - start) / 60
    curve = ", ".join(f"{s}:{v}" for s, v in summary["curve"])
    print(
        f"\nDone in {minutes:.1f} min. Checkpoints: {summary['checkpoints']} "
        f"(evaluated {summary['evaluated']}, skipped {summary['skipped']}, "
        f"superseded {summary['superseded']}, failed {summary['failed']})"
        + (f"; probes {summary['probed']} (escalated {summary['escalated']})" if "probed" in summary else "")
    )
    print(f"{cfg.scheduler.metric} by step: {curve}")
    for directive in summary.get("directives", []):  # what evaluation asked of training
        print(f"feedback: {directive}")
    if cfg.tracking.to_mlflow:
        print(f"MLflow run name: {summary['run_name']} (id {summary['mlflow_run_id']})")
        print(f"See it in MLflow:  .venv/bin/mlflow ui --backend-store-uri {summary['tracking_uri']}")
        print(f"  then open {summary['mlflow_url']}")
    if "tensorboard" in cfg.tracking.sinks:
        logdir = cfg.tracking.tensorboard.directory(summary["run_dir"]).parent
        print(f"See it in TensorBoard:  .venv/bin/tensorboard --logdir {logdir} --host 127.0.0.1")
        print("  then open http://127.0.0.1:6006")
    if "wandb" in cfg.tracking.sinks:
        print(f"W&B run files (offline: .venv/bin/wandb sync them): {Path(summary['run_dir']) / 'sinks' / 'wandb'}")
    print(f"Run files: {summary['run_dir']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
