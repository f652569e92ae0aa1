"""Webhook secrets never reach a record."""

from areal_eval.redaction import recorded_config, redact


def test_recorded_config_names_the_webhook_host_only():
    recorded = recorded_config({"alerts": {"webhook_url": "https://hooks.slack.com/services/T0/B0/secret"}})
    assert recorded["alerts"]["webhook_url"] == "https://hooks.slack.com/<redacted>"


def test_an_error_message_keeps_the_host_and_loses_the_secret():
    url = "https://hooks.example.com/services/T0/B0/secret?token=1"
    assert redact(f"POST {url} refused", url) == "POST https://hooks.example.com/<redacted> refused"
    assert redact("nothing to hide", None) == "nothing to hide"
