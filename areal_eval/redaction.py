"""Secrets kept out of records: a webhook URL reduced to its scheme and host in run files, MLflow
params and error messages."""

from __future__ import annotations

import urllib.parse


def redact_url(url: str) -> str:
    """Scheme and host only: what a record may say about a webhook."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}/<redacted>"


def redact(text: str, secret: str | None) -> str:
    """``text`` with ``secret`` (a URL) replaced by its redacted form, e.g. in an error message."""
    return text.replace(secret, redact_url(secret)) if secret else text


def recorded_config(cfg: dict) -> dict:
    """A pipeline config (as a dict) fit for MLflow params and run files: the webhook redacted."""
    alerts = cfg.get("alerts") or {}
    if alerts.get("webhook_url"):
        return {**cfg, "alerts": {**alerts, "webhook_url": redact_url(alerts["webhook_url"])}}
    return cfg
