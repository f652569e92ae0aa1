"""The alert branch: notify through Prefect notification blocks, log, record, maybe stop."""

from __future__ import annotations

import dataclasses
import json
import os

from prefect import get_run_logger, task
from prefect.blocks.core import Block
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from areal_eval.alerts import Alert, AlertsConfig
from areal_eval.config.parsing import ConfigError
from areal_eval.redaction import redact
from areal_eval.runs.directory import RunDir, StopSignal
from tasks.mlflow_logging import recorder_for


class NotificationFailed(RuntimeError):
    """A notification was not delivered; the message names no secret."""


def webhook_url(cfg: AlertsConfig) -> str | None:
    """The webhook URL from the config, the environment variable it names, or the Prefect Secret
    block it names. Read when needed and never stored, so a secret URL reaches no record."""
    if cfg.webhook_url_env:
        url = os.environ.get(cfg.webhook_url_env)
        if not url:
            raise ConfigError(f"alerts.webhook_url_env: environment variable {cfg.webhook_url_env} is not set")
        return url
    if cfg.webhook_url_secret:
        from prefect.blocks.system import Secret

        return Secret.load(cfg.webhook_url_secret).get()
    return cfg.webhook_url


def notification_blocks(cfg: AlertsConfig) -> list:
    blocks = []
    if url := webhook_url(cfg):
        blocks.append(
            CustomWebhookNotificationBlock(
                name="areal-eval-alerts",
                url=url,
                json_data={"subject": "{{subject}}", "body": "{{body}}"},
            )
        )
    if cfg.notification_block:
        blocks.append(Block.load(cfg.notification_block))
    return blocks


@task(
    cache_policy=NO_CACHE,
    name="send-alert",
    task_run_name="alert-{alert.rule}-step-{alert.step}",
    retries=3,
    retry_delay_seconds=exponential_backoff(backoff_factor=1),
)
def send_alert(alert: Alert, pipeline_cfg, run_id: str, run: RunDir) -> None:
    """Logs the alert, stops training if asked, notifies unless throttled, records it in MLflow.

    Each step is independent of the ones after it: training stops even when no notification
    gets through, and a notification goes out even while MLflow is down (its record is then
    only warned about). A failed notification is recorded and raised, so the task retries it
    with backoff; the stop request and the record are idempotent.
    """
    logger = get_run_logger()
    logger.warning("ALERT %s%s: %s", alert.rule, " (throttled)" if alert.throttled else "", alert.message)
    if alert.stop_training:
        StopSignal(run.stop_file).request(f"alert {alert.rule}: {alert.message}")
        logger.warning("asked training to stop: %s", alert.rule)
    records = {f"alert.{alert.rule}": f"step {alert.step}: {alert.message}"[:5000]}
    failure = None
    if not alert.throttled:
        subject = f"[areal-eval] {alert.rule} at step {alert.step}"
        for block in notification_blocks(pipeline_cfg.alerts):
            try:
                with block.raise_on_failure():
                    block.notify(body=json.dumps(dataclasses.asdict(alert)), subject=subject)
            except Exception as exc:
                cause = redact(repr(exc), webhook_url(pipeline_cfg.alerts))  # an HTTP error names the URL
                records[f"alert.{alert.rule}.notify_failed"] = f"step {alert.step}: {cause}"[:5000]
                failure = NotificationFailed(f"{alert.rule} at step {alert.step}: {cause}")
    recorder_for(pipeline_cfg, run_id, run).alert(alert, records)  # MLflow down: said; the alert went out
    if failure is not None:
        raise failure
