"""Trainers outside the flow publishing to a real `prefect server start` set up as the README's
server section does: their checkpoint events start `evaluate-checkpoint` through the deployment
trigger, or the evaluation service, deciding as the in-flow planner does and recording a run's
end once; bad input fails in one line."""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.checkpoints.publisher import post_event
from areal_eval.lifecycle.planner import EvaluationPlanner
from areal_eval.pipeline.config import load_pipeline_config
from areal_eval.runs.ledger import Ledger
from areal_eval.tracking import Tracker, TrackingConfig
from tests import sink_points
from tests.helpers import assert_best_is_registered, checkpoints_table, copy_trained_run
from tests.prefect_services import (
    PREFECT,
    REPO,
    DelayingProxy,
    api,
    cli_or_fail,
    eval_steps,
    republish,
    stop,
    wait_for_runs,
)

pytestmark = pytest.mark.integration


def test_event_triggers_evaluate_checkpoint_with_its_parameters(server, trained_run, tmp_path):
    _, original = trained_run
    copied = copy_trained_run(original, tmp_path / "triggered", run_id=f"{original.run_id}-triggered")
    manifest = copied.manifest.resolve()
    event = Manifest(manifest).find(12)
    sent = time.time()
    post_event(server["PREFECT_API_URL"], event, manifest)
    deadline, run = time.monotonic() + 240, None
    while time.monotonic() < deadline:
        runs = api(server, "/flow_runs/filter", {"limit": 200})
        run = next(
            (
                r
                for r in runs
                if r["parameters"].get("global_step") == 12 and r["parameters"].get("manifest") == str(manifest)
            ),
            None,
        )
        if run and run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        time.sleep(1)
    assert run is not None, "no evaluate-checkpoint run was started by the event"
    created = api(
        server,
        "/events/filter",
        {
            "filter": {
                "event": {"name": ["prefect.flow-run.Scheduled"]},
                "resource": {"id": [f"prefect.flow-run.{run['id']}"]},
            },
            "limit": 50,
        },
    )
    scheduled = min((e["occurred"] for e in created["events"]), default=None)  # for the log only
    print(f"event to flow run scheduled: {scheduled} (sent {sent:.3f}); started {run['start_time']}")
    assert run["parameters"]["run_id"] == event.run_id and run["parameters"]["checkpoint_uri"] == event.uri
    assert run["state_type"] == "COMPLETED", run["state"]
    assert 12 in eval_steps(server, event.run_id)

    # A second event for the same checkpoint evaluates nothing new.
    post_event(server["PREFECT_API_URL"], event, manifest)
    tracker = Tracker(TrackingConfig(tracking_uri=server["MLFLOW_TRACKING_URI"], experiment="areal-eval"))
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        runs = [
            r
            for r in api(server, "/flow_runs/filter", {"limit": 200})
            if r["parameters"].get("global_step") == 12 and r["parameters"].get("run_id") == event.run_id
        ]
        if len(runs) == 2 and all(r["state_type"] == "COMPLETED" for r in runs):
            break
        time.sleep(1)
    assert len(runs) == 2 and all(r["state_type"] == "COMPLETED" for r in runs)
    history = tracker.client.get_metric_history(tracker.find_run(event.run_id), "eval/accuracy")
    assert [m.step for m in history].count(12) == 1


def test_a_burst_of_events_decides_as_the_in_flow_planner_and_the_run_ends(server, trained_run, tmp_path):
    _, original = trained_run
    steps = [0, 2, 4, 6, 8]
    manifest = republish(original.root, tmp_path / "burst", "burst", steps)
    events = Manifest(manifest).events()
    reference = EvaluationPlanner(load_pipeline_config().scheduler, Ledger(tmp_path / "reference.jsonl"))
    expected = {e.global_step: reference.offer(e) for e in events}
    for event in events:  # five events at once, as fast as a trainer can post them
        post_event(server["PREFECT_API_URL"], event, manifest)
    runs = wait_for_runs(server, lambda r: r["parameters"].get("run_id") == "burst", len(steps))
    assert all(r["state_type"] == "COMPLETED" for r in runs), [r["state"] for r in runs]
    assert sorted(r["name"] for r in runs) == sorted(f"burst@{s}" for s in steps)

    # Each checkpoint was decided once, as the in-flow planner decides it, then claimed once.
    lines = [json.loads(line) for line in (tmp_path / "burst" / "ledger.jsonl").read_text().splitlines()]
    first = {}
    for line in lines:
        first.setdefault(line["step"], line)
    assert {s: (first[s]["status"] == "scheduled", first[s]["reason"]) for s in steps} == {
        s: (d.evaluate, d.reason) for s, d in expected.items()
    }
    ledger = Ledger(tmp_path / "burst" / "ledger.jsonl")
    assert all(e.status in ("evaluated", "skipped") for e in ledger.entries())
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    assert eval_steps(server, "burst") == evaluated  # each once

    # gpu:0 held every evaluation: no two evaluation task runs overlapped.
    tasks = sorted(
        (r["start_time"], r["end_time"])
        for r in api(server, "/task_runs/filter", {"limit": 200})
        if r["name"].startswith("evaluate-step-") and r["flow_run_id"] in {f["id"] for f in runs}
    )
    assert len(tasks) >= len([e for e in expected.values() if e.evaluate])
    assert all(later[0] >= earlier[1] for earlier, later in zip(tasks, tasks[1:], strict=False)), tasks

    # The run is over: its MLflow run ended with the curve, the decisions and the publisher's train metrics.
    tracker = Tracker(TrackingConfig(tracking_uri=server["MLFLOW_TRACKING_URI"], experiment="areal-eval"))
    mlflow_run = tracker.client.get_run(tracker.find_run("burst"))
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.tags["checkpoints.evaluated"] == str(len(evaluated))
    table = checkpoints_table(tracker, mlflow_run.info.run_id)
    assert sorted(table) == steps and all(row["decision"] for row in table.values())
    assert not [tag for tag in mlflow_run.data.tags if tag.startswith(("decision.", "checkpoint."))]  # no wall of tags
    assert sorted(m.step for m in tracker.client.get_metric_history(mlflow_run.info.run_id, "train/loss")) == steps
    artifacts = {a.path for a in tracker.client.list_artifacts(mlflow_run.info.run_id)}
    assert {"evaluation_curve.png", "scheduler_decisions.json"} <= artifacts
    assert_best_is_registered(tracker, "areal-eval-burst", mlflow_run.info.run_id, ledger)


def test_missing_validation_data_fails_before_any_worker_and_alerts(server, trained_run, tmp_path):
    _, original = trained_run
    manifest = republish(original.root, tmp_path / "nodata", "nodata", [0])
    shutil.rmtree(tmp_path / "nodata" / "data")
    post_event(server["PREFECT_API_URL"], Manifest(manifest).find(0), manifest)
    [run] = wait_for_runs(server, lambda r: r["parameters"].get("run_id") == "nodata", 1)
    assert run["state_type"] == "FAILED"
    entry = Ledger(tmp_path / "nodata" / "ledger.jsonl").latest(0)
    assert entry.status == "failed" and "no such validation data file" in entry.reason and "valid_data" in entry.reason
    assert not list((tmp_path / "nodata").glob("evals/*.log"))  # no torchrun started, none retried
    tracker = Tracker(TrackingConfig(tracking_uri=server["MLFLOW_TRACKING_URI"], experiment="areal-eval"))
    mlflow_run = tracker.client.get_run(tracker.find_run("nodata"))
    assert "no such validation data file" in mlflow_run.data.tags["alert.eval-failed"]
    # Its checkpoint was the final one: the run ends FAILED with the reason, and its report is written.
    assert mlflow_run.info.status == "FAILED"
    assert mlflow_run.data.tags["areal.failure"].startswith("the final checkpoint (step 0) failed: ")
    artifacts = {a.path for a in tracker.client.list_artifacts(mlflow_run.info.run_id)}
    assert {"evaluation_curve.png", "scheduler_decisions.json"} <= artifacts
    # A step the manifest does not hold, run as the README runs one: --watch ends on the reason, in
    # one line, which is also the flow run's state message; the worker logs no traceback for it.
    worker_log = Path(server["PREFECT_HOME"]) / "worker-areal-eval.log"
    logged_before = worker_log.stat().st_size
    params = {"global_step": 110, "manifest": str(manifest)}
    watched = subprocess.run(
        [PREFECT, "deployment", "run", "evaluate-checkpoint/on-checkpoint", "--watch", "--params", json.dumps(params)],
        cwd=REPO,
        env=server,
        capture_output=True,
        text=True,
        timeout=300,
    )
    reason = f"nodata@110 failed: {manifest}: no checkpoint at step 110 in the manifest"
    said = "".join(watched.stdout.split())  # as Rich wrapped it to the terminal's width
    assert watched.returncode == 1 and f"areal.run.failed*{''.join(reason.split())}" in said, watched.stdout[-3000:]
    [bad] = [r for r in api(server, "/flow_runs/filter", {"limit": 200}) if r["parameters"].get("global_step") == 110]
    assert bad["state_type"] == "FAILED" and bad["state"]["message"] == reason
    time.sleep(2)  # the worker relays the flow run's last output
    with worker_log.open() as log:
        log.seek(logged_before)
        assert "Traceback" not in log.read()
    # A cause no retry can fix: the sweep leaves it alone, and alerts nothing again.
    sweep = {"store": str(tmp_path / "nodata")}
    cli_or_fail(
        server, "deployment", "run", "sweep-checkpoints/every-30-minutes", "--watch", "--params", json.dumps(sweep)
    )
    assert (
        len([r for r in api(server, "/flow_runs/filter", {"limit": 200}) if r["parameters"].get("run_id") == "nodata"])
        == 1
    )


def test_the_evaluation_service_evaluates_published_checkpoints_on_warm_workers(server, trained_run, tmp_path):
    _, original = trained_run
    cli_or_fail(server, "automation", "pause", "evaluate-published-checkpoint")  # the service instead of the trigger
    log = tmp_path / "service.log"
    service = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.serve_evaluations",
            "--set",
            f"work_dir={tmp_path / 'work'}",
            "--set",
            "eval.nproc=1",
            "--set",
            "tracking.sinks=[mlflow,tensorboard,wandb]",  # W&B offline (tests/conftest.py)
        ],
        cwd=REPO,
        env=server,
        start_new_session=True,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while "listening" not in log.read_text():
            assert service.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        manifest = republish(original.root, tmp_path / "served", "served", [0, 100, 200])
        for event in Manifest(manifest).events():
            post_event(server["PREFECT_API_URL"], event, manifest)
        runs = wait_for_runs(server, lambda r: r["parameters"].get("run_id") == "served", 3)
    finally:
        stop(service)
        cli_or_fail(server, "automation", "resume", "evaluate-published-checkpoint")
    assert all(r["state_type"] == "COMPLETED" for r in runs) and all(r["deployment_id"] is None for r in runs)
    assert sorted(r["name"] for r in runs) == ["served@0", "served@100", "served@200"]
    ledger = Ledger(tmp_path / "served" / "ledger.jsonl")
    assert (
        eval_steps(server, "served") == [e.step for e in ledger.entries() if e.status == "evaluated"] == [0, 100, 200]
    )
    # The other sinks hold the service's results too, each once.
    served = tmp_path / "served"
    assert sink_points.scalars(served / "tensorboard" / "areal-eval")["eval/accuracy"] == [0, 100, 200]
    wandb_rows = sink_points.history(served / "sinks", sink_points.wandb_run_id(served))
    assert sorted(r["eval/step"] for r in wandb_rows if "eval/accuracy" in r) == [0, 100, 200]
    # One torchrun job served every evaluation: start-up was paid once.
    assert [p.name for p in (tmp_path / "work" / "serve-evaluations").glob("warm-workers-*.log")] == [
        "warm-workers-1.log"
    ]


def test_a_hugging_face_trainer_publishes_and_the_trigger_evaluates_its_checkpoints(server, tmp_path):
    from areal_eval.integrations.hf import PublishCheckpoints
    from examples.hf_trainer import build_trainer

    run_dir = tmp_path / "hf-served"
    callback = PublishCheckpoints(run_dir, valid_data=tmp_path / "valid.jsonl", api_url=server["PREFECT_API_URL"])
    trainer, _ = build_trainer(tmp_path, [callback], max_steps=16)
    trainer.train()
    assert callback.published == [8, 16]
    runs = wait_for_runs(server, lambda r: r["parameters"].get("run_id") == "hf-served", 2)
    assert all(r["state_type"] == "COMPLETED" for r in runs), [r["state"] for r in runs]
    ledger = Ledger(run_dir / "ledger.jsonl")
    assert [e.step for e in ledger.entries()] == [8, 16] and ledger.status(16) == "evaluated"
    assert eval_steps(server, "hf-served") == [e.step for e in ledger.entries() if e.status == "evaluated"]
    tracker = Tracker(TrackingConfig(tracking_uri=server["MLFLOW_TRACKING_URI"], experiment="areal-eval"))
    assert tracker.client.get_run(tracker.find_run("hf-served")).info.status == "FINISHED"  # 16 was final


def test_a_trainer_whose_event_is_lost_is_told_which_sweep_evaluates_its_checkpoint_and_when(
    server, trained_run, tmp_path, caplog
):
    from areal_eval.checkpoints import publisher
    from areal_eval.checkpoints.lost_events import find_sweeps
    from areal_eval.checkpoints.publisher import flush_events, publish_checkpoint

    _, original = trained_run
    store = Path(server["AREAL_EVAL_STORE"])
    [sweep] = find_sweeps(server["PREFECT_API_URL"])
    assert sweep.name == "sweep-checkpoints/every-30-minutes" and sweep.schedules == ("cron */30 * * * *",)
    assert Path(sweep.store) == store
    # Its next run, as the server's scheduler would put it in (the tests' server runs no scheduler).
    [deployment] = api(server, "/deployments/filter", {"deployments": {"name": {"any_": ["every-30-minutes"]}}})
    at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    scheduled = api(
        server,
        f"/deployments/{deployment['id']}/create_flow_run",
        {"state": {"type": "SCHEDULED", "state_details": {"scheduled_time": at.isoformat()}}},
    )
    port = int(server["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0])
    proxy = DelayingProxy(port, delay_s=0.0)
    api_url = f"http://127.0.0.1:{proxy.port}/api"
    trained = {e.global_step: e for e in Manifest(original.manifest).events()}
    run_dir = store / "lost-event"

    def publish(step: int) -> None:
        publish_checkpoint(
            trained[step].uri,
            run_dir / "manifest.jsonl",
            "lost-event",
            step,
            valid_data=original.valid_data,
            api_url=api_url,
            event_timeout_s=1.0,
        )

    try:
        publish(0)  # its event arrives; the publisher learns the server's sweeps meanwhile
        deadline = time.monotonic() + 60
        while api_url not in publisher._events._sweeps:  # (a thread of its own asks)
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proxy.delay_s = 3.0  # the server now answers after the publisher gave up
        publish(4)
        assert flush_events(30) == 0
    finally:
        proxy.close()
        api(server, f"/flow_runs/{scheduled['id']}", method="DELETE")
    [warned] = [r.getMessage() for r in caplog.records if "its event did not reach" in r.getMessage()]
    local = at.astimezone()
    assert warned.startswith("checkpoint step 4 is in the manifest, but its event did not reach"), warned
    assert warned.endswith(
        f"sweep-checkpoints/every-30-minutes evaluates it from the manifest at its next run, {local:%H:%M %Z}"
    )
    wait_for_runs(server, lambda r: r["parameters"].get("run_id") == "lost-event", 2)  # (4's arrived late)
