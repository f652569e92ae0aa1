"""The alert branch: notify through Prefect notification blocks, log, record, maybe stop."""

from __future__ import annotations

import dataclasses
import json

from prefect.cache_policies import NO_CACHE
from prefect import get_run_logger, task
from prefect.tasks import exponential_backoff
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.blocks.core import Block

from areal_eval.alerts import Alert, AlertsConfig
from areal_eval.control import StopSignal
from areal_eval.run_dir import RunDir
from tasks.tracking import tracker_for


def notification_blocks(cfg: AlertsConfig) -> list:
    blocks = []
    if cfg.webhook_url:
        blocks.append(CustomWebhookNotificationBlock(
            name="areal-eval-alerts", url=cfg.webhook_url,
            json_data={"subject": "{{subject}}", "body": "{{body}}"},
        ))
    if cfg.notification_block:
        blocks.append(Block.load(cfg.notification_block))
    return blocks


@task(cache_policy=NO_CACHE, name="send-alert", task_run_name="alert-{alert.rule}-step-{alert.step}",
      retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=1))
def send_alert(alert: Alert, pipeline_cfg, run_id: str, run: RunDir) -> None:
    """Always logs and records the alert in MLflow; notifies unless throttled; stops training if asked.

    Stopping comes first, so a notification that fails (and is retried with backoff, the record
    rewritten in place) never keeps training from stopping. Failures are recorded in MLflow.
    """
    logger = get_run_logger()
    logger.warning("ALERT %s%s: %s", alert.rule, " (throttled)" if alert.throttled else "", alert.message)
    tracker = tracker_for(pipeline_cfg)
    tracker.log_dict(run_id, dataclasses.asdict(alert), f"alerts/step_{alert.step:08d}_{alert.rule}.json")
    tracker.set_tags(run_id, {f"alert.{alert.rule}": f"step {alert.step}: {alert.message}"[:5000]})
    if alert.stop_training:
        StopSignal(run.stop_file).request(f"alert {alert.rule}: {alert.message}")
        logger.warning("asked training to stop: %s", alert.rule)
    if not alert.throttled:
        subject = f"[areal-eval] {alert.rule} at step {alert.step}"
        for block in notification_blocks(pipeline_cfg.alerts):
            try:
                with block.raise_on_failure():
                    block.notify(body=json.dumps(dataclasses.asdict(alert)), subject=subject)
            except Exception as exc:
                tracker.set_tags(run_id, {f"alert.{alert.rule}.notify_failed": f"step {alert.step}: {exc!r}"[:5000]})
                raise
