"""The train-and-evaluate flow against a real Prefect API (test harness), MLflow on SQLite,
torchrun training and evaluation, and a webhook receiver on loopback."""

import dataclasses
import json
import shutil
from pathlib import Path

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.logged_models import file_digest
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import FINAL_STATES, Ledger
from tests import sink_points
from tests.conftest import tiny_config
from tests.helpers import (
    assert_best_is_registered,
    checkpoints_table,
    copy_trained_run,
    mlflow_run,
    sqlite_mlflow_uri,
)

# Tests that use prefect_server or trained_run are marked integration by tests/conftest.py.


SENTINEL = "SENTINEL-7f3a9c"


def test_pipeline_end_to_end(prefect_server, tmp_path, webhook, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter

    from flows.train_and_evaluate import train_and_evaluate

    # The webhook URL is a secret (a token in its path and query): named by an environment variable.
    monkeypatch.setenv("ALERT_HOOK", f"{webhook.url}/{SENTINEL}?token={SENTINEL}")
    always = {
        "name": "accuracy-seen",
        "kind": "threshold",
        "metric": "accuracy",
        "op": ">",
        "value": 0.0,
        "throttle_secs": 3600,
    }
    monkeypatch.setenv("WANDB_MODE", "offline")  # W&B's files only: nothing leaves the machine
    sinks = {"sinks": ["mlflow", "tensorboard", "wandb"], "wandb": {"run_id": "trainer-7"}}
    alerts = {"webhook_url_env": "ALERT_HOOK", "rules": [always]}
    cfg = tiny_config(tmp_path, eval={"nproc": 2}, alerts=alerts, tracking=sinks)
    state = train_and_evaluate(params=json.loads(json.dumps(dataclasses.asdict(cfg))), return_state=True)
    assert state.is_completed(), state
    summary = state.result()

    run = RunDir(cfg.run_root)
    steps = [e.global_step for e in Manifest(run.manifest).events()]
    ledger = Ledger(run.ledger)
    # Every checkpoint ends evaluated or recorded with a reason; the last one evaluated.
    assert [e.step for e in ledger.entries()] == steps
    assert all(e.status in FINAL_STATES and (e.status == "evaluated" or e.reason) for e in ledger.entries())
    assert ledger.status(steps[-1]) == "evaluated" and ledger.status(0) == "evaluated"

    tracker, runs = mlflow_run(cfg)
    assert len(runs) == 1 and runs[0].info.run_id == summary["mlflow_run_id"]
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    history = tracker.client.get_metric_history(runs[0].info.run_id, "eval/accuracy")
    assert sorted(m.step for m in history) == evaluated  # distinct steps, no duplicates, none lost
    assert tracker.client.get_metric_history(runs[0].info.run_id, "train/loss")
    data = runs[0].data
    assert data.params["train.max_steps"] == "12"
    table = checkpoints_table(tracker, runs[0].info.run_id)  # every checkpoint: a row, not two tags
    assert sorted(table) == steps and table[steps[-1]]["checkpoint"].endswith(f"global_step_{steps[-1]:08d}")
    assert {row["status"] for row in table.values()} <= set(FINAL_STATES) and table[0]["status"] == "evaluated"
    artifacts = [a.path for a in tracker.client.list_artifacts(runs[0].info.run_id)]
    assert {"scheduler_decisions.json", "evaluation_curve.png", "alerts"} <= set(artifacts)
    assert_best_is_registered(tracker, f"areal-eval-{run.run_id}", runs[0].info.run_id, ledger)

    # The alert rule fired on every evaluation; throttling let one notification through.
    assert len(webhook.requests) == 1 and SENTINEL in webhook.requests[0]["path"]

    # MLflow 3's records: a LoggedModel per evaluated checkpoint, ranked by its linked metrics,
    # and the validation data as the run's dataset input.
    ranked = tracker.client.search_logged_models(
        [tracker.experiment_id], order_by=[{"field_name": "metrics.eval/accuracy", "ascending": False}]
    )
    assert sorted(int(m.params["global_step"]) for m in ranked) == evaluated
    linked = [{x.key: x.value for x in m.metrics}["eval/accuracy"] for m in ranked]
    assert linked == sorted((m.value for m in history), reverse=True)
    assert {m.source_run_id for m in ranked} == {runs[0].info.run_id}
    [dataset] = tracker.client.get_run(runs[0].info.run_id).inputs.dataset_inputs
    assert dataset.dataset.digest == file_digest(run.valid_data)

    # The other sinks hold what MLflow holds, each point once (tests/sinks/ reads them back).
    train_steps = sorted(m.step for m in tracker.client.get_metric_history(runs[0].info.run_id, "train/loss"))
    sink_points.assert_sinks_hold(run.root, evaluated, train_steps)
    [alert] = sink_points.of_kind(run.root / "sinks", sink_points.wandb_run_id(run.root), "alert")
    assert alert.title == "[areal-eval] accuracy-seen at step 0"
    body = json.loads(webhook.requests[0]["json"]["body"])
    assert body["rule"] == "accuracy-seen" and body["step"] == 0

    with get_client(sync_client=True) as client:
        page = client.read_events(EventFilter(event=EventNameFilter(name=["areal.checkpoint.saved"])), limit=50)
    announced = sorted(e.payload["global_step"] for e in page.events if e.payload.get("run_id") == run.run_id)
    assert announced == steps

    # Task runs grow with evaluations, not with checkpoints or training-metric flushes.
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    names = [t.task_key.rsplit("-", 1)[0] for t in task_runs]
    per_evaluation = {
        "evaluate_step": len(evaluated),
        "log_evaluation": len(evaluated),
        "send_alert": len(evaluated),
    }
    assert {k: names.count(k) for k in per_evaluation} == per_evaluation
    assert len(names) == sum(per_evaluation.values()) + 5  # prepare, start tracking and training, wait, finish

    # The secret reached no record: MLflow's store, the run's files, Prefect's parameters and logs.
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    stored = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert stored and not [p for p in stored if SENTINEL.encode() in p.read_bytes()]
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])), limit=200)
    assert logs and SENTINEL not in json.dumps(flow_run.parameters) + " ".join(log.message for log in logs)


def test_bad_checkpoint_fails_alerts_and_the_flow_goes_on(prefect_server, trained_run, tmp_path, webhook):
    from prefect import flow

    from flows.train_and_evaluate import follow_and_evaluate
    from tasks.mlflow_logging import start_tracking

    cfg, original = trained_run
    cfg = dataclasses.replace(
        cfg,
        work_dir=str(tmp_path),
        scheduler=dataclasses.replace(cfg.scheduler, policy="fixed", fixed_interval_steps=1, coalesce=False),
        tracking=dataclasses.replace(cfg.tracking, tracking_uri=sqlite_mlflow_uri(tmp_path)),
        alerts=dataclasses.replace(cfg.alerts, webhook_url=webhook.url),
    )
    run = copy_trained_run(original, cfg.run_root)
    weights = run.checkpoints / "global_step_00000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    shutil.rmtree(run.checkpoints / "global_step_00000008")  # missing

    @flow(name="evaluate-existing-run")
    def evaluate_existing():
        return follow_and_evaluate(cfg, run, start_tracking(cfg, run), training=None)

    ledger = evaluate_existing()
    assert {s: ledger.status(s) for s in (0, 4, 8, 12)} == {0: "evaluated", 4: "failed", 8: "failed", 12: "evaluated"}
    assert "truncated" in ledger.latest(4).reason and "missing" in ledger.latest(8).reason
    failed = [json.loads(r["json"]["body"]) for r in webhook.requests]
    assert [(a["rule"], a["step"]) for a in failed] == [("eval-failed", 4), ("eval-failed", 8)]


def test_alert_can_stop_training(prefect_server, tmp_path):
    from flows.train_and_evaluate import train_and_evaluate

    stop_rule = {
        "name": "good-enough",
        "kind": "threshold",
        "op": ">",
        "value": 0.0,
        "min_step": 1,
        "stop_training": True,
    }
    cfg = tiny_config(
        tmp_path,
        alerts={"rules": [stop_rule]},
        train={"max_steps": 100000, "epochs": 100000, "save": {"freq_steps": 10, "eval_before_train": False}},
    )
    summary = train_and_evaluate(params=json.loads(json.dumps(dataclasses.asdict(cfg))))
    final = Manifest(RunDir(cfg.run_root).manifest).events()[-1]
    assert final.final and final.global_step < 100000
    assert final.train_metrics["stopped"].startswith("alert good-enough")
    assert summary["evaluated"] >= 2


def test_a_feedback_target_reached_stops_training_and_the_trainer_answers(prefect_server, tmp_path):
    """The in-flow path end to end: the rules judge a result, the directive is issued in the run
    directory, the demo's trainer takes it at a step boundary on both ranks and answers; a
    plateau rule left in shadow mode records what it would have done and changes nothing."""
    from areal_eval.runs.directives import Directives
    from flows.train_and_evaluate import train_and_evaluate

    cfg = tiny_config(
        tmp_path,
        feedback={"stop": "act", "target": 0.0, "min_step": 1, "patience": 1, "max_lr_scales": 10},
        train={"max_steps": 100000, "epochs": 100000, "save": {"freq_steps": 10, "eval_before_train": False}},
    )
    summary = train_and_evaluate(params=json.loads(json.dumps(dataclasses.asdict(cfg))))
    run = RunDir(cfg.run_root)
    box = Directives(run.root)
    [stop] = [d for d in box.all() if d.action == "stop"]
    assert stop.mode == "act" and stop.evidence["rule"] == "target" and stop.reason.startswith("accuracy ")
    [answer] = [a for a in box.answers() if a.id == stop.id]
    final = Manifest(run.manifest).events()[-1]
    assert answer.applied and final.final and final.global_step == answer.step < 100000
    assert final.train_metrics["stopped"].startswith(f"{stop.id}: accuracy ")
    # The lr_scale rule stayed in shadow mode: recorded, never answered, the rate untouched.
    assert all(d.mode == "shadow" for d in box.all() if d.action == "lr_scale")
    assert {a.id for a in box.answers()} == {stop.id}
    # On record: the summary (the Prefect UI's artifact, the demo's last lines) and MLflow.
    assert f"{stop.id}: {stop.reason}; applied at step {answer.step}" in summary["directives"]
    tracker, [recorded] = mlflow_run(cfg)
    assert recorded.data.tags[f"directive.{stop.id.replace('@', '_at_')}"] == f"applied at step {answer.step}"
    table = json.loads(
        Path(tracker.client.download_artifacts(recorded.info.run_id, "directives.json", str(tmp_path))).read_text()
    )
    assert stop.id in [row[table["columns"].index("id")] for row in table["data"]]


def test_killed_worker_is_retried_and_metrics_land_once(prefect_server, trained_run, tmp_path, monkeypatch):
    from prefect import flow

    from flows.train_and_evaluate import follow_and_evaluate
    from tasks.mlflow_logging import start_tracking

    cfg, original = trained_run
    cfg = dataclasses.replace(
        cfg,
        work_dir=str(tmp_path),
        eval=dataclasses.replace(cfg.eval, nproc=2, retries=1),
        tracking=dataclasses.replace(cfg.tracking, tracking_uri=sqlite_mlflow_uri(tmp_path)),
    )
    run = copy_trained_run(original, cfg.run_root)
    marker = tmp_path / "fault-fired"
    monkeypatch.setenv("AREAL_EVAL_INJECT_FAULT", f"1:exit:{marker}")  # the first evaluation's rank 1 dies

    @flow(name="evaluate-existing-run")
    def evaluate_existing():
        return follow_and_evaluate(cfg, run, start_tracking(cfg, run), training=None)

    ledger = evaluate_existing()
    assert marker.exists()
    assert all(e.status in ("evaluated", "skipped", "superseded") for e in ledger.entries())
    tracker, runs = mlflow_run(cfg)
    steps = [m.step for m in tracker.client.get_metric_history(runs[0].info.run_id, "eval/accuracy")]
    assert sorted(steps) == sorted(set(steps)) == [e.step for e in ledger.entries() if e.status == "evaluated"]
    # The attempt that failed before the retry succeeded is on record: the ledger and MLflow.
    [retried] = [e for e in ledger.entries() if e.attempts]
    assert retried.status == "evaluated" and retried.failed_attempts == 0  # tried again within its attempt
    [attempt] = retried.attempts
    assert attempt.startswith("retried: ") and "code 17" in attempt
    tags = tracker.client.get_run(runs[0].info.run_id).data.tags
    assert tags[f"attempts.{retried.step}.failed"] == "1" and "code 17" in tags[f"attempts.{retried.step}.last_cause"]


def test_triggered_runs_skip_then_the_final_one_refines_next_to_the_best(prefect_server, trained_run, tmp_path):
    # evaluate-checkpoint as the event trigger runs it, once per checkpoint in order: 4 and 8 are
    # skipped (min interval 9), and the run for the final checkpoint evaluates the skipped
    # neighbour of the best (8 if 12 is best, 4 if 0 is: either has nothing evaluated beyond it).
    # On warm ranks, as the evaluation service runs it (the server tests start a job per run).
    from flows.evaluate_checkpoint import evaluate_checkpoint
    from tasks.evaluation import serve_warm_workers

    cfg, trained = trained_run
    run = RunDir(tmp_path / "run")  # the run's record is written beside its manifest: a copy of its own
    shutil.copytree(
        trained.root, run.root, ignore=shutil.ignore_patterns("checkpoints", "resume", "evals", "ledger.jsonl")
    )
    cfg = dataclasses.replace(
        cfg,
        scheduler=dataclasses.replace(cfg.scheduler, min_interval_steps=9, max_interval_steps=None),
        tracking=dataclasses.replace(cfg.tracking, tracking_uri=sqlite_mlflow_uri(tmp_path)),
    )
    params = json.loads(json.dumps(dataclasses.asdict(cfg)))
    with serve_warm_workers(cfg, tmp_path / "warm"):
        results = {s: evaluate_checkpoint(s, str(run.manifest), params=params) for s in (0, 4, 8, 12)}
        assert [results[s]["evaluated"] for s in (0, 4, 8, 12)] == [True, False, False, True]
        assert "min interval" in results[4]["reason"] and "min interval" in results[8]["reason"]
        refined = results[12]["refined"]
        assert refined in ([4], [8])
        tracker, runs = mlflow_run(cfg)
        steps = sorted(m.step for m in tracker.client.get_metric_history(runs[0].info.run_id, "eval/accuracy"))
        assert steps == sorted([0, 12] + refined)  # each once
        table = checkpoints_table(tracker, runs[0].info.run_id)
        assert table[refined[0]]["decision"].startswith("refine: next to the best")
        # The run that found the run over ended it, as train-and-evaluate does.
        assert runs[0].info.status == "FINISHED" and runs[0].data.tags["checkpoints.evaluated"] == "3"
        assert "min interval" in table[4]["decision"]
        published_loss = {e.global_step for e in Manifest(run.manifest).events() if "loss" in e.train_metrics}
        assert {m.step for m in tracker.client.get_metric_history(runs[0].info.run_id, "train/loss")} == published_loss
        again = evaluate_checkpoint(12, str(run.manifest), params=params)
        assert again["reason"].startswith("already evaluated") and "run" not in again
        # A manual evaluation after the end keeps the run's counts (and curve) true; the run stays ended.
        [other] = {4, 8} - set(refined)
        manual = evaluate_checkpoint(other, str(run.manifest), params=params, reason="manual")
        assert manual["evaluated"] and manual["reason"].startswith("manual; scheduler: skipped")
        tracker, runs = mlflow_run(cfg)
        assert runs[0].info.status == "FINISHED" and runs[0].data.tags["checkpoints.evaluated"] == "4"


def test_refusing_webhook_is_recorded_and_the_run_goes_on(prefect_server, trained_run, tmp_path):
    import socket

    from prefect import flow

    from flows.train_and_evaluate import follow_and_evaluate
    from tasks.mlflow_logging import start_tracking

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    cfg, original = trained_run
    always = {"name": "seen", "kind": "threshold", "metric": "accuracy", "op": ">", "value": 0.0, "throttle_secs": 3600}
    cfg = dataclasses.replace(
        cfg,
        work_dir=str(tmp_path),
        alerts=dataclasses.replace(cfg.alerts, webhook_url=closed, rules=[]),
        tracking=dataclasses.replace(cfg.tracking, tracking_uri=sqlite_mlflow_uri(tmp_path)),
    )
    from areal_eval.alerts import AlertRule

    cfg.alerts.rules.append(AlertRule(**always))
    run = copy_trained_run(original, cfg.run_root)

    @flow(name="evaluate-existing-run")
    def evaluate_existing():
        return follow_and_evaluate(cfg, run, start_tracking(cfg, run), training=None)

    ledger = evaluate_existing()
    assert ledger.status(12) == "evaluated"  # the final checkpoint, after the failed notification
    tracker, runs = mlflow_run(cfg)
    tags = runs[0].data.tags
    assert tags["alert.seen.notify_failed"].startswith("step 0: ConnectError") and "alert.seen" in tags


def test_train_and_evaluate_follows_a_hugging_face_trainer_while_it_trains(prefect_server, tmp_path):
    import threading

    from areal_eval.integrations.hf import PublishCheckpoints
    from examples.hf_trainer import build_trainer
    from flows.train_and_evaluate import train_and_evaluate

    cfg = tiny_config(tmp_path, run_name="hf-followed", train={"external": True, "external_timeout_s": 300})
    outcome = {}

    def follow():
        state = train_and_evaluate(params=json.loads(json.dumps(dataclasses.asdict(cfg))), return_state=True)
        outcome["state"] = state

    flow_thread = threading.Thread(target=follow)
    flow_thread.start()  # before the trainer: the flow waits for its checkpoints
    callback = PublishCheckpoints(cfg.run_root, valid_data=tmp_path / "hf-work" / "valid.jsonl")
    trainer, _ = build_trainer(tmp_path / "hf-work", [callback], max_steps=16)
    trainer.train()
    flow_thread.join(300)
    assert outcome["state"].is_completed(), outcome["state"]

    run = RunDir(cfg.run_root)
    assert run.run_id == "hf-followed" and callback.published == [8, 16]
    ledger = Ledger(run.ledger)
    assert [e.step for e in ledger.entries()] == [8, 16] and ledger.status(16) == "evaluated"
    tracker, runs = mlflow_run(cfg)
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    history = tracker.client.get_metric_history(runs[0].info.run_id, "eval/accuracy")
    assert sorted(m.step for m in history) == evaluated and runs[0].info.status == "FINISHED"
    # The trainer's loss, published with each checkpoint, at the checkpoint's step.
    assert [m.step for m in tracker.client.get_metric_history(runs[0].info.run_id, "train/loss")] == [8, 16]


def test_a_checkpoint_of_a_run_another_flow_owns_is_left_to_it(prefect_server, trained_run, tmp_path):
    import subprocess
    import sys

    from flows.evaluate_checkpoint import evaluate_checkpoint
    from tests.helpers import HOLD_RUN_LOCK

    _, original = trained_run
    run = copy_trained_run(original, tmp_path / "owned")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_LOCK, str(run.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # as train-and-evaluate following the run holds it
        result = evaluate_checkpoint(12, str(run.manifest))
    finally:
        holder.kill()
        holder.wait()
    assert result["evaluated"] is False and f"in use by pid {holder.pid}" in result["reason"]
    assert not run.ledger.exists()  # nothing decided or evaluated behind the owner's back
