"""The one recording step: what a result, training rows and the run's end leave in MLflow (the
run's record) and in the other sinks of ``tracking.sinks`` (W&B, TensorBoard).

Every path records through a :class:`Recorder`: the in-flow loop, ``evaluate-checkpoint`` (the
trigger, the service, the sweep), as the thin Prefect tasks of ``tasks/mlflow_logging.py`` wrap
it, and the benchmarks. MLflow refusing a result raises (the caller retries it: the result is
in the ledger meanwhile); a side record (per-item files, the registered best, the table of
checkpoints, another sink) that fails is said in one line and never stops the rest.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from areal_eval.compare import versus_previous_best
from areal_eval.disk import brief
from areal_eval.evaluation.items import stored_items
from areal_eval.evaluation.jobs import EvalResult
from areal_eval.logged_models import TABLE_EVERY_S, checkpoint_model, log_checkpoints_table
from areal_eval.runs.directives import WAITING, directive_records
from areal_eval.runs.directory import RunDir, file_lock
from areal_eval.runs.ledger import Ledger
from areal_eval.sinks import Sinks
from areal_eval.tracking import BEST_ALIAS, FAILURE_TAG, PROBE_PREFIX, Tracker, attempt_tags

_log = logging.getLogger("areal_eval.recording")


@dataclasses.dataclass
class Recorder:
    """Records one training run's results in its MLflow run and its other sinks."""

    tracker: Tracker
    mlflow_run_id: str
    run: RunDir | None = None
    """Where the run's ledger and evaluations are; None: a result recorded by whoever evaluated
    it, not the run's owner (a dispatched evaluation: its owner records it in full)."""
    training_run_id: str | None = None
    ledger: Ledger | None = None
    """The run's ledger as this process keeps it (the in-flow loop's, current in memory); None:
    read from the run directory at each result (flow runs that share the run)."""
    sinks: Sinks | None = None
    to_mlflow: bool = True
    """MLflow is one of the run's sinks: what its users see there is written too (per-item
    results, LoggedModels, the table of checkpoints, the curve plot, the registered best). False:
    the MLflow run is only the run's own record (metrics, tags, decisions), which nothing shows."""
    registered_model: str | None = None
    """The registered model's name (``{run_id}`` filled in) whose ``best`` alias follows the
    best checkpoint by ``metric``; None: none."""
    metric: str = "accuracy"
    higher_is_better: bool = True
    warn: Callable[[str], None] = _log.warning
    info: Callable[[str], None] = _log.info

    def result(self, result: EvalResult) -> bool:
        """A result's metrics at its training step (a probe's as ``eval_probe/*``), linked to the
        checkpoint's LoggedModel, its items, the registered best and the table of checkpoints,
        then the other sinks; False if MLflow had the step already."""
        step, tracker, run_id = result.global_step, self.tracker, self.mlflow_run_id
        ledger = self.ledger or (Ledger(self.run.ledger) if self.run is not None else None)
        entry = ledger.latest(step) if ledger is not None else None
        tags = attempt_tags(entry) if entry is not None else {}  # attempts that failed before this one
        logged = False
        if result.probe_metrics:
            logged = tracker.log_evaluation(run_id, step, result.probe_metrics, tags=tags, prefix=PROBE_PREFIX)
        items = result.items or (stored_items(self.run.evals, step) if self.run is not None else {})
        if result.metrics:
            no_model = f"step {step}: no MLflow LoggedModel for the checkpoint"
            args = (tracker.client, tracker.experiment_id, run_id, step)
            model_id = self._side(no_model, checkpoint_model, *args, uri=result.uri) if self.to_mlflow else None
            tags |= {"last_evaluated_step": step}
            logged = tracker.log_evaluation(run_id, step, result.metrics, tags=tags, model_id=model_id)
            if items and self.to_mlflow:
                self._side(
                    f"step {step}: per-item results not copied to MLflow", tracker.log_items, run_id, step, items
                )
            if self.run is not None and self.registered_model and self.to_mlflow:
                self._register_best(result)
        if ledger is not None and self.to_mlflow:  # its decision, in the run's table of checkpoints
            not_table = f"step {step}: the table of checkpoints not updated in MLflow"
            entries = ledger.entries()
            self._side(not_table, log_checkpoints_table, tracker.client, run_id, entries, at_most_every_s=TABLE_EVERY_S)
        if self.sinks is not None and self.run is not None:
            self.sinks.record_evaluation(step, result.probe_metrics, prefix=PROBE_PREFIX, uri=result.uri)
            self.sinks.record_evaluation(step, result.metrics, items=items, uri=result.uri)
        return logged

    def training(self, rows: list[dict], *, lock: Path | None = None) -> int:
        """Training rows (``{"step": .., "loss": ..}``), each once in every sink; returns the
        points MLflow took. ``lock``: other processes log to this run too (the watermark is then
        read fresh under it)."""
        if lock is None:
            logged = self.tracker.log_train_metrics(self.mlflow_run_id, rows)
        else:
            with file_lock(lock):
                logged = self.tracker.log_train_metrics(self.mlflow_run_id, rows, reread_watermark=True)
        if self.sinks is not None:
            self.sinks.record_training(rows)
        return logged

    def alert(self, alert, records: dict[str, str]) -> None:
        """An alert: in MLflow as an artifact and the tags ``records`` (what fired, what could
        not be notified), a side record said in one line when MLflow refuses it (the alert went
        out already); in the other sinks unless throttled (a W&B alert notifies too)."""
        tracker, run_id = self.tracker, self.mlflow_run_id

        def record():
            tracker.log_dict(run_id, dataclasses.asdict(alert), f"alerts/step_{alert.step:08d}_{alert.rule}.json")
            tracker.set_tags(run_id, records)

        self._side(f"alert {alert.rule} at step {alert.step} not recorded in MLflow", record)
        if self.sinks is not None and self.run is not None and not alert.throttled:
            self.sinks.record_alert(alert.rule, alert.step, alert.message)

    def end(self, ledger: Ledger, plot: Path | None, *, status: str | None, failure: str | None = None) -> None:
        """The decisions, the table of checkpoints, the curve plot and the counts; the run ended
        with ``status`` (``failure`` its cause); None refreshes a run that already ended. The
        other sinks then get what they missed on the way (a failure, a process that died) and
        the end."""
        tracker, run_id, entries = self.tracker, self.mlflow_run_id, ledger.entries()
        tracker.log_dict(run_id, [dataclasses.asdict(e) for e in entries], "scheduler_decisions.json")
        if self.to_mlflow:
            log_checkpoints_table(tracker.client, run_id, entries)
            if plot is not None:
                tracker.log_artifact(run_id, plot)
        tags = {f"checkpoints.{k}": v for k, v in (ledger.counts() | ledger.probe_counts()).items()}
        tags["checkpoints.failed_attempts"] = sum(len(e.attempts) for e in entries)
        for entry in entries:
            tags |= attempt_tags(entry)
        tracker.set_tags(run_id, tags | ({FAILURE_TAG: failure[:5000]} if failure else {}))
        self._side("the directives not recorded in MLflow", self._directives, ledger.path.parent)
        if status == "FINISHED":
            tracker.supersede_failure(run_id)
        if status is not None:
            tracker.finish(run_id, status)
        if self.sinks is not None:
            self.sinks.catch_up(entries, RunDir(ledger.path.parent).evals)
            for r in directive_records(ledger.path.parent):  # once settled, an event at its step
                if r["outcome"] != WAITING:
                    text = f"{r['id']} ({r['mode']}): {r['reason']}; {r['outcome']}"
                    applied = r["outcome"].startswith("applied")
                    self.sinks.record_directive(r["id"], r["steps"][-1], applied=applied, text=text)
            self.sinks.record_end(status or "RUNNING", plot=plot)
            self.sinks.close()

    def _directives(self, run_root: Path) -> None:
        """What evaluation asked of training and what came of it: a table (``directives.json``)
        and a tag each (``directive.lr_scale_at_40``: ``applied at step 43``, ``not applied (shadow
        mode)``, ...)."""
        rows = directive_records(run_root)
        if not rows:
            return
        columns = {key: [str(r[key]) if key == "steps" else r[key] for r in rows] for key in rows[0]}
        self.tracker.client.log_table(self.mlflow_run_id, data=columns, artifact_file="directives.json")
        tags = {f"directive.{r['id'].replace('@', '_at_')}": r["outcome"][:5000] for r in rows}
        self.tracker.set_tags(self.mlflow_run_id, tags)

    def _register_best(self, result: EvalResult) -> None:
        """Move the registered model's ``best`` alias to this checkpoint if it beats the best so
        far. Flow runs of one run take turns (a lock in the run directory)."""
        run, step = self.run, result.global_step
        name = self.registered_model.format(run_id=self.training_run_id)

        def register():
            with file_lock(run.registry_lock):
                return self.tracker.register_if_best(
                    name,
                    self.mlflow_run_id,
                    step,
                    source=result.uri,
                    metrics=result.metrics,
                    metric=self.metric,
                    higher_is_better=self.higher_is_better,
                    versus=lambda previous: versus_previous_best(run.evals, previous, step, self.metric),
                )

        version = self._side(f"step {step}: not registered in model {name!r}", register)
        if version is not None:
            self.info(f"step {step}: the best so far: model {name!r} version {version} (alias {BEST_ALIAS!r})")

    def _side(self, failure: str, fn: Callable, *args, **kwargs):
        """A side record: its failure is said in one line (``failure: cause``), never raised."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. an artifact store or registry that refuses
            self.warn(f"{failure}: {brief(exc)}")
            return None
