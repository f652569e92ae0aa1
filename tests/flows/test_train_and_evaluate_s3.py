"""The whole pipeline with checkpoints on S3: moto's server in its own process behind a proxy
that injects 5xx and connection resets, MLflow artifacts on the same endpoint, retention on,
then the sweep of the S3 store."""

import dataclasses
import json

import boto3
import pytest

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import FINAL_STATES, Ledger
from areal_eval.tracking import Tracker, TrackingConfig
from tests.conftest import tiny_config
from tests.helpers import sqlite_mlflow_uri
from tests.s3_servers import TEST_CREDENTIALS, FaultProxy

pytestmark = pytest.mark.integration


def test_pipeline_on_s3_with_faults_retention_and_sweep(prefect_server, s3_server, s3_bucket, tmp_path, monkeypatch):
    from flows.sweep_checkpoints import sweep_checkpoints
    from flows.train_and_evaluate import train_and_evaluate

    proxy = FaultProxy(s3_server.url, kinds=("503", "reset", "500"), every=4, limit=9)
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3_server.url)
    store = f"s3://{s3_bucket}/checkpoints"
    cfg = tiny_config(
        tmp_path,
        storage={
            "checkpoint_uri": store,
            "s3": {"endpoint_url": proxy.url},
            "retention": {"keep_last": 2, "keep_best": 1},
        },
        tracking={"artifact_location": f"s3://{s3_bucket}/mlflow"},
    )
    params = json.loads(json.dumps(dataclasses.asdict(cfg)))
    state = train_and_evaluate(params=params, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    assert summary["failed"] == 0 and proxy.injected  # faults were injected, and retried away

    run = RunDir(cfg.run_root)
    events = Manifest(run.manifest).events()
    assert [e.uri for e in events] == [f"{store}/{run.run_id}/global_step_{e.global_step:08d}" for e in events]
    assert not list(run.checkpoints.glob("global_step_*"))  # local staging copies removed once verified

    ledger = Ledger(run.ledger)
    assert all(e.status in FINAL_STATES for e in ledger.entries())
    tracker = Tracker(TrackingConfig(tracking_uri=cfg.tracking.tracking_uri, experiment=cfg.tracking.experiment))
    mlflow_run = summary["mlflow_run_id"]
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    assert sorted(m.step for m in tracker.client.get_metric_history(mlflow_run, "eval/accuracy")) == evaluated

    # Retention: the last 2 and the best 1 kept, the rest deleted and recorded; objects agree.
    client = boto3.client("s3", endpoint_url=s3_server.url)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    present = {
        e.global_step
        for e in events
        if any(k.startswith(f"checkpoints/{run.run_id}/global_step_{e.global_step:08d}/") for k in keys)
    }
    deleted = tracker.deleted_steps(mlflow_run)
    steps = [e.global_step for e in events]
    best = max((e for e in ledger.entries() if e.status == "evaluated"), key=lambda e: e.metrics["accuracy"]).step
    assert deleted and present == set(steps) - deleted
    assert set(steps[-2:]) | {best} <= present
    assert f"checkpoints/{run.run_id}/manifest.jsonl" in keys and f"checkpoints/{run.run_id}/data/valid.jsonl" in keys

    # MLflow artifacts live on the same endpoint.
    assert any(k.startswith("mlflow/") and k.endswith("evaluation_curve.png") for k in keys)

    # The sweep reads the mirrored manifest and the flow's mirrored ledger from S3: every
    # checkpoint was decided, so it evaluates nothing. Asked to re-evaluate skipped ones, it
    # evaluates those still there (not what retention deleted), once.
    assert sweep_checkpoints(store=store, params=params) == {"evaluated": [], "failed": []}
    first = sweep_checkpoints(store=store, params=params, reevaluate_skipped=True)
    assert first["failed"] == []
    assert {int(s.split("@")[1]) for s in first["evaluated"]} == set(steps) - set(evaluated) - deleted
    # One torchrun job served every evaluation of that sweep (and the sweeps with nothing to do started none).
    logs = [p.name for p in tmp_path.glob("sweep-checkpoints/*/warm-workers-*.log")]
    assert logs == (["warm-workers-1.log"] if first["evaluated"] else [])
    assert sweep_checkpoints(store=store, params=params, reevaluate_skipped=True) == {"evaluated": [], "failed": []}

    # Credentials appear in no file the pipeline wrote: run files, logs, the MLflow store.
    secret = TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"].encode()
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert leaks == []
    proxy.stop()


def test_corrupt_s3_objects_fail_alert_and_the_flow_goes_on(
    prefect_server, trained_run, s3_server, s3_bucket, tmp_path, webhook
):
    import shutil

    from prefect import flow

    from areal_eval.checkpoints.store import S3Config, S3Store
    from flows.train_and_evaluate import follow_and_evaluate
    from tasks.mlflow_logging import start_tracking

    cfg, original = trained_run
    cfg = dataclasses.replace(
        cfg,
        work_dir=str(tmp_path),
        scheduler=dataclasses.replace(cfg.scheduler, policy="fixed", fixed_interval_steps=1, coalesce=False),
        tracking=dataclasses.replace(cfg.tracking, tracking_uri=sqlite_mlflow_uri(tmp_path)),
        alerts=dataclasses.replace(cfg.alerts, webhook_url=webhook.url),
        storage=dataclasses.replace(
            cfg.storage, checkpoint_uri=f"s3://{s3_bucket}/ckpt", s3=S3Config(endpoint_url=s3_server.url)
        ),
    )
    run = RunDir(cfg.run_root)
    shutil.copytree(original.root, run.root, ignore=shutil.ignore_patterns("ledger.jsonl", "evals"))
    store = S3Store(cfg.storage.run_root(run.run_id), cfg.storage.s3)
    manifest = run.manifest.read_text()
    for event in Manifest(run.manifest).events():  # publish the trained run's checkpoints to S3
        uri = store.publish(run.checkpoints / f"global_step_{event.global_step:08d}", event.files)
        manifest = manifest.replace(event.uri, uri)
    run.manifest.write_text(manifest)
    client = boto3.client("s3", endpoint_url=s3_server.url)
    key = f"ckpt/{run.run_id}/global_step_00000004/model.safetensors"
    client.put_object(
        Bucket=s3_bucket, Key=key, Body=client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()[:-100]
    )
    client.delete_object(Bucket=s3_bucket, Key=f"ckpt/{run.run_id}/global_step_00000008/config.json")

    @flow(name="evaluate-existing-run")
    def evaluate_existing():
        return follow_and_evaluate(cfg, run, start_tracking(cfg, run), training=None)

    ledger = evaluate_existing()
    assert {s: ledger.status(s) for s in (0, 4, 8, 12)} == {0: "evaluated", 4: "failed", 8: "failed", 12: "evaluated"}
    assert f"s3://{s3_bucket}/{key}: size" in ledger.latest(4).reason and "truncated" in ledger.latest(4).reason
    assert "config.json: download failed" in ledger.latest(8).reason
    failed = [json.loads(r["json"]["body"]) for r in webhook.requests]
    assert [(a["rule"], a["step"]) for a in failed] == [("eval-failed", 4), ("eval-failed", 8)]
