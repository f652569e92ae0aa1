"""The alert branch's task: notified through a real webhook on loopback, training asked to stop,
the alert recorded in MLflow; and where the webhook's URL comes from."""

from __future__ import annotations

import pytest

from areal_eval.alerts import Alert, AlertsConfig
from areal_eval.config.parsing import ConfigError
from areal_eval.runs.directory import RunDir, StopSignal
from tasks.alerts import send_alert, webhook_url
from tests.conftest import tiny_config


def test_the_webhook_url_comes_from_the_config_or_the_variable_it_names(monkeypatch):
    assert webhook_url(AlertsConfig()) is None
    assert webhook_url(AlertsConfig(webhook_url="http://alerts:8080")) == "http://alerts:8080"
    monkeypatch.setenv("ALERTS_URL", "http://from-env:9")
    assert webhook_url(AlertsConfig(webhook_url_env="ALERTS_URL")) == "http://from-env:9"
    monkeypatch.delenv("ALERTS_URL")
    with pytest.raises(ConfigError, match="alerts.webhook_url_env: environment variable ALERTS_URL is not set"):
        webhook_url(AlertsConfig(webhook_url_env="ALERTS_URL"))


def test_an_alert_is_sent_recorded_and_stops_training_and_a_throttled_one_is_only_recorded(
    prefect_server, webhook, tmp_path
):
    from prefect import flow

    from tasks.mlflow_logging import start_tracking, tracker_for

    cfg = tiny_config(tmp_path, alerts={"webhook_url": webhook.url})
    run = RunDir(tmp_path / "run")
    (run.root / "control").mkdir(parents=True)
    run.run_id_file.write_text("alerting-run")

    @flow
    def alerting() -> str:
        mlflow_run_id = start_tracking(cfg, run)
        send_alert(Alert("drop", 40, "accuracy fell", stop_training=True), cfg, mlflow_run_id, run)
        send_alert(Alert("stall", 60, "no progress", stop_training=False, throttled=True), cfg, mlflow_run_id, run)
        return mlflow_run_id

    mlflow_run_id = alerting()
    [sent] = webhook.requests  # the throttled one is not sent
    assert sent["json"]["subject"] == "[areal-eval] drop at step 40" and '"accuracy fell"' in sent["json"]["body"]
    assert StopSignal(run.stop_file).requested() == "alert drop: accuracy fell"
    tracker = tracker_for(cfg)
    tags = tracker.client.get_run(mlflow_run_id).data.tags
    assert tags["alert.drop"] == "step 40: accuracy fell" and tags["alert.stall"] == "step 60: no progress"
    logged = {a.path for a in tracker.client.list_artifacts(mlflow_run_id, "alerts")}
    assert logged == {"alerts/step_00000040_drop.json", "alerts/step_00000060_stall.json"}
