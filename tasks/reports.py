"""What a run shows in the Prefect UI: keyed artifacts that update in place, one set per run."""

from __future__ import annotations

import base64
import dataclasses
import logging
import re
import threading
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.events import emit_event
from prefect.events.worker import EventsWorker
from prefect.settings import PREFECT_UI_URL

from areal_eval.curve_plot import plot_curve
from areal_eval.failures import is_known_failure, one_line
from areal_eval.feedback import Directive
from areal_eval.lifecycle.outcome import directive_line
from areal_eval.pipeline.config import PipelineConfig
from areal_eval.runs.directives import directive_records
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger
from areal_eval.tracking import mlflow_run_url, resolve_tracking_uri
from tasks.mlflow_logging import tracker_for

COUNTED = ("evaluated", "skipped", "superseded", "failed", "scheduled")


def artifact_key(kind: str, run_id: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for one run's ``kind``."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{kind}-{run_id}".lower()).strip("-")[:100]


def update_evaluation_table(cfg: PipelineConfig, run_id: str, ledger: Ledger) -> None:
    """The run's evaluations so far, one row each, as one artifact that each result updates."""
    rows = [
        {"step": e.step, **{k: round(v, 6) for k, v in sorted(e.metrics.items())}, "decision": e.reason}
        for e in ledger.entries()
        if e.status == "evaluated"
    ]
    create_table_artifact(
        key=artifact_key("evaluations", run_id),
        table=rows,
        description=f"Evaluations of {run_id} ({cfg.scheduler.metric} and the rest, by step)",
    )


def curve_or_none(ledger: Ledger, metric: str, run: RunDir, run_id: str) -> Path | None:
    """The evaluation curve's plot, or None (warned about) where it cannot be written: a run's
    end must not depend on disk space it does not need."""
    try:
        return plot_curve(ledger.entries(), metric, run.root / "evaluation_curve.png", run_id)
    except OSError as exc:
        get_run_logger().warning("the evaluation curve was not plotted: %s", exc)
        return None


def summarize(
    cfg: PipelineConfig, run_id: str, run: RunDir, mlflow_run_id: str, *, ledger: Ledger, plot: Path | None
) -> dict:
    """The run's summary: returned, and shown as the run's ``summary-<run>`` artifact."""
    counts = ledger.counts()
    evaluated = [e for e in ledger.entries() if e.status == "evaluated"]
    tracking_uri = resolve_tracking_uri(cfg.tracking, cfg.work_dir)
    summary = {
        "run_name": run_id,
        "mlflow_run_id": mlflow_run_id,
        "tracking_uri": tracking_uri,
        "run_dir": str(run.root),
        "checkpoints": sum(counts.values()),
        **{k: counts.get(k, 0) for k in ("evaluated", "skipped", "superseded", "failed")},
        **ledger.probe_counts(),
        "curve": [(e.step, round(e.metrics.get(cfg.scheduler.metric, float("nan")), 4)) for e in evaluated],
    }
    url = None  # the run's record only: nothing to open
    if cfg.tracking.to_mlflow:
        url = mlflow_run_url(cfg.tracking, tracking_uri, tracker_for(cfg).experiment_id, mlflow_run_id)
    summary["mlflow_url"] = url  # the demo prints it
    where = f"MLflow run: [{mlflow_run_id}]({url}) (tracking URI `{tracking_uri}`)\n\n" if url else ""
    counts_table = "\n".join(
        [f"| {k} | {counts.get(k, 0)} |" for k in COUNTED if counts.get(k)]
        + [f"| {k} (probes) | {n} |" for k, n in ledger.probe_counts().items()]
    )
    summary["directives"] = [f"{r['id']}: {r['reason']}; {r['outcome']}" for r in directive_records(run.root)]
    directives = "".join(f"- {line}\n" for line in summary["directives"])
    curve_table = "\n".join(f"| {s} | {v} |" for s, v in summary["curve"])
    image = f"![evaluation curve](data:image/png;base64,{base64.b64encode(plot.read_bytes()).decode()})" if plot else ""
    create_markdown_artifact(
        key=artifact_key("summary", run_id),
        description=f"Summary of {run_id}",
        markdown=(
            f"# {run_id}\n\n{where}"
            f"| checkpoints | {summary['checkpoints']} |\n|---|---|\n{counts_table}\n\n"
            f"{image}\n\n"
            f"| step | {cfg.scheduler.metric} |\n|---|---|\n{curve_table}\n"
            + (f"\n## What evaluation asked of training\n\n{directives}" if directives else "")
        ),
    )
    return summary


def announce_outcome(run_id: str, line: str, failed: bool = False, *, log: bool = True) -> None:
    """The flow run's last word, in its log (unless ``log`` is false) and as an event
    (``areal.run.finished`` or ``areal.run.failed``, the line as the resource's name):
    ``prefect deployment run --watch`` prints it before Prefect's own last lines."""
    if log:
        get_run_logger().log(logging.ERROR if failed else logging.INFO, line)
    emit_event(
        "areal.run.failed" if failed else "areal.run.finished",
        resource={"prefect.resource.id": f"areal.run.{run_id}", "prefect.resource.name": line[:2000]},
    )
    send_queued(timeout_s=10)


def announce_directive(run_id: str, directive: Directive) -> None:
    """A directive issued: in the flow run's log, and as an ``areal.feedback.directive`` event of
    the run (the UI's event feed; an automation may notify on it), its line as the name."""
    get_run_logger().info(directive_line(directive))
    emit_event(
        "areal.feedback.directive",
        resource={"prefect.resource.id": f"areal.run.{run_id}", "prefect.resource.name": directive.line()[:2000]},
        payload=dataclasses.asdict(directive),
    )


def send_queued(timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the events emitted so far to reach the server: queued, a flow
    run's last word would arrive after its final state, which ends ``--watch``. (Logs are sent in
    batches whose queue is never joined; ``--watch`` shows events.)"""
    sender = threading.Thread(target=EventsWorker.instance().wait_until_empty, daemon=True)
    sender.start()
    sender.join(timeout_s)


def announce_summary(summary: dict, metric: str) -> None:
    """A finished run's last word: the whole summary (counts, the curve, the MLflow link) and the
    link to its summary artifact in the log, then its short line as the run's event, which
    ``--watch`` prints on one line where the terminal is wide enough."""
    logger = get_run_logger()
    logger.info(summary_line(summary, metric))
    if link := summary_link(summary["run_name"]):
        logger.info(f"summary: {link}")
    announce_outcome(summary["run_name"], short_line(summary, metric), log=False)


def short_line(summary: dict, metric: str) -> str:
    """The run's outcome in a few words: what was evaluated and its metric at the last one."""
    line = f"{summary['run_name']}: {summary['evaluated']} of {summary['checkpoints']} evaluated"
    if summary["curve"]:
        step, value = summary["curve"][-1]
        line += f"; {metric} {value} at step {step}"
    return line


def summary_link(run_id: str) -> str | None:
    """The run's summary artifact in the Prefect UI (None where there is no UI to open)."""
    ui = PREFECT_UI_URL.value()
    return f"{ui.rstrip('/')}/artifacts/key/{artifact_key('summary', run_id)}" if ui else None


def summary_line(summary: dict, metric: str) -> str:
    """A run's summary in one line: counts, the curve and the MLflow link (where MLflow is a sink)."""
    counts = ", ".join(f"{k} {summary[k]}" for k in ("evaluated", "skipped", "superseded", "failed"))
    curve = ", ".join(f"{s}:{v}" for s, v in summary["curve"])
    line = f"{summary['run_name']}: {summary['checkpoints']} checkpoints ({counts}); {metric} by step: {curve}"
    return line + (f"; MLflow: {summary['mlflow_url']}" if summary.get("mlflow_url") else "")


class WithoutTraceback(logging.Filter):
    """Prefect's engines log a failed run's exception with its traceback ("Engine execution exited
    with unexpected exception"); for a known failure (:func:`~areal_eval.failures.is_known_failure`),
    which the flow says in one line, that line is kept and the traceback dropped: tracebacks in
    a worker's log are for bugs."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and is_known_failure(exc):
            said = record.getMessage()
            tail = said.split(repr(exc), 1)[1] if repr(exc) in said else ""  # e.g. " - Retry 1/2 will start ..."
            for prefect_words, ours in UNEXPECTED:  # not unexpected: its cause is named
                if said.startswith(prefect_words):
                    said = ours
            record.msg, record.args = f"{said}: {type(exc).__name__}: {one_line(exc)}{tail}", ()
            record.exc_info, record.exc_text = None, None
        return True


UNEXPECTED = (
    ("Engine execution exited with unexpected exception", "Flow run failed"),
    ("Task run failed with exception", "Task run failed"),
)
"""Prefect's words for a run that raised, and ours for a known failure's."""


def log_known_failures_without_traceback() -> None:
    """Install :class:`WithoutTraceback` on the flow-run and task-run loggers (once)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, WithoutTraceback) for f in logger.filters):
            logger.addFilter(WithoutTraceback())
