"""What a run shows in the Prefect UI: its artifacts read back from a real Prefect API, the
summary line, and failures logged in one line or with their traceback."""

from __future__ import annotations

import logging

from areal_eval.config.parsing import ConfigError
from areal_eval.evaluation.jobs import CorruptCheckpoint
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger, LedgerEntry
from tasks.reports import (
    WithoutTraceback,
    artifact_key,
    short_line,
    summarize,
    summary_line,
    summary_link,
    update_evaluation_table,
)
from tests.conftest import tiny_config


def test_artifact_keys_are_lowercase_letters_digits_and_dashes():
    assert artifact_key("evaluations", "My Run_7/b") == "evaluations-my-run-7-b"
    assert len(artifact_key("summary", "x" * 300)) == 100


def test_the_summary_line_holds_the_counts_the_curve_and_the_link():
    summary = {"run_name": "r", "checkpoints": 4, "evaluated": 2, "skipped": 1, "superseded": 1, "failed": 0}
    summary |= {"curve": [(0, 0.5), (8, 0.75)], "mlflow_url": "http://127.0.0.1:5000/#/runs/1"}
    assert summary_line(summary, "accuracy") == (
        "r: 4 checkpoints (evaluated 2, skipped 1, superseded 1, failed 0); accuracy by step: 0:0.5, 8:0.75; "
        "MLflow: http://127.0.0.1:5000/#/runs/1"
    )
    without_mlflow = summary_line(summary | {"mlflow_url": None}, "accuracy")  # tracking.sinks without it
    assert without_mlflow.endswith("accuracy by step: 0:0.5, 8:0.75") and "MLflow" not in without_mlflow
    # What --watch prints: a few words, the rest behind the summary artifact's link.
    assert short_line(summary | {"run_name": "server-demo"}, "accuracy") == (
        "server-demo: 2 of 4 evaluated; accuracy 0.75 at step 8"
    )
    assert short_line(summary | {"evaluated": 0, "curve": []}, "accuracy") == "r: 0 of 4 evaluated"


def test_the_summary_link_opens_the_runs_artifact_in_the_prefect_ui():
    from prefect.settings import PREFECT_UI_URL, temporary_settings

    with temporary_settings({PREFECT_UI_URL: "http://127.0.0.1:4200"}):
        assert summary_link("Server_Demo") == "http://127.0.0.1:4200/artifacts/key/summary-server-demo"


def record_of(exc: BaseException, said: str = "run failed") -> logging.LogRecord:
    return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, said, (), (type(exc), exc, None))


def test_a_known_failure_is_logged_in_one_line_and_a_bug_keeps_its_traceback():
    known = record_of(ConfigError("eval.nproc: must be at least 1\nmore detail"))
    assert WithoutTraceback().filter(known)
    assert known.exc_info is None and known.getMessage() == "run failed: ConfigError: eval.nproc: must be at least 1"
    # Prefect's own words for a run that raised are not "unexpected" for a failure whose cause is named.
    corrupt = CorruptCheckpoint("step 8: model.safetensors is 3 bytes, the manifest says 700")
    engine = record_of(corrupt, "Engine execution exited with unexpected exception")
    task = record_of(corrupt, f"Task run failed with exception: {corrupt!r} - Retries are exhausted")
    assert WithoutTraceback().filter(engine) and WithoutTraceback().filter(task)
    assert engine.getMessage() == f"Flow run failed: CorruptCheckpoint: {corrupt}"
    assert task.getMessage() == f"Task run failed: CorruptCheckpoint: {corrupt} - Retries are exhausted"
    bug = record_of(KeyError("nobody expected this"))
    assert WithoutTraceback().filter(bug)
    assert bug.exc_info is not None and bug.getMessage() == "run failed"


def test_the_evaluation_table_and_the_summary_are_artifacts_that_update_in_place(prefect_server, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.mlflow_logging import start_tracking

    cfg = tiny_config(tmp_path)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.run_id_file.write_text("Reports Run")
    ledger = Ledger(run.ledger)

    @flow
    def reporting() -> dict:
        ledger.append(LedgerEntry(0, "ckpt-0", "evaluated", "first", metrics={"accuracy": 0.5}))
        update_evaluation_table(cfg, run.run_id, ledger)
        ledger.append(LedgerEntry(4, "ckpt-4", "skipped", "too close"))
        ledger.append(LedgerEntry(8, "ckpt-8", "evaluated", "final", metrics={"accuracy": 0.6666666666}))
        update_evaluation_table(cfg, run.run_id, ledger)
        return summarize(cfg, run.run_id, run, start_tracking(cfg, run), ledger=ledger, plot=None)

    summary = reporting()
    assert (summary["checkpoints"], summary["evaluated"], summary["skipped"]) == (3, 2, 1)
    assert summary["curve"] == [(0, 0.5), (8, 0.6667)]

    def latest(key: str):
        with get_client(sync_client=True) as client:
            [artifact] = client.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
        return artifact

    table = latest("evaluations-reports-run").data
    assert '"step": 8' in table and '"accuracy": 0.666667' in table and '"step": 4' not in table
    markdown = latest("summary-reports-run").data
    assert "| evaluated | 2 |" in markdown and "| 8 | 0.6667 |" in markdown and summary["mlflow_url"] in markdown
