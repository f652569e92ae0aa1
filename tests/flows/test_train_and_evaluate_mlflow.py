"""The train-and-evaluate flow when MLflow is not there: down mid-run for longer than its client
retries, or unreachable when the run starts (real ``mlflow server``, Prefect test API, torchrun)."""

import dataclasses
import json
import time

from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger
from areal_eval.tracking import Tracker, TrackingConfig
from tests.conftest import tiny_config
from tests.helpers import copy_trained_run, sqlite_mlflow_uri, start_mlflow_server
from tests.prefect_services import stop


def test_mlflow_server_down_longer_than_its_client_retries_loses_nothing(
    prefect_server, trained_run, tmp_path, monkeypatch
):
    import threading

    from prefect import flow

    from flows.train_and_evaluate import follow_and_evaluate
    from tasks.mlflow_logging import start_tracking
    from tests.helpers import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the client gives up at once
    port = free_port()
    sqlite_mlflow_uri(tmp_path / "server")  # a store with its tables: the server starts without migrating
    server = start_mlflow_server(tmp_path / "server" / "mlflow.db", tmp_path / "artifacts", port)
    cfg, original = trained_run
    cfg = dataclasses.replace(
        cfg,
        work_dir=str(tmp_path),
        tracking=dataclasses.replace(cfg.tracking, tracking_uri=f"http://127.0.0.1:{port}"),
        scheduler=dataclasses.replace(cfg.scheduler, policy="fixed", fixed_interval_steps=1, coalesce=False),
    )
    run = copy_trained_run(original, cfg.run_root)
    mlflow_run_id = start_tracking(cfg, run)
    stop(server)  # MLflow is down from here on
    outcome = {}

    @flow(name="evaluate-existing-run")
    def evaluate_existing():
        return follow_and_evaluate(cfg, run, mlflow_run_id, training=None)

    thread = threading.Thread(target=lambda: outcome.update(ledger=evaluate_existing()))
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and Ledger(run.ledger).counts().get("evaluated", 0) < 4:
            time.sleep(0.2)
        assert Ledger(run.ledger).counts()["evaluated"] == 4  # evaluation went on without MLflow
        assert not any(e.delivered for e in Ledger(run.ledger).entries())
        # Back at once: the flow, its run handled, keeps trying for LoopConfig.delivery_timeout_s,
        # and a loaded machine can take much of that to start a server.
        server = start_mlflow_server(tmp_path / "server" / "mlflow.db", tmp_path / "artifacts", port)
        thread.join(300)
        tracker = Tracker(TrackingConfig(tracking_uri=cfg.tracking.tracking_uri, experiment=cfg.tracking.experiment))
        eval_steps = [m.step for m in tracker.client.get_metric_history(mlflow_run_id, "eval/accuracy")]
        train_steps = [m.step for m in tracker.client.get_metric_history(mlflow_run_id, "train/loss")]
    finally:
        stop(server)
    assert all(e.delivered for e in outcome["ledger"].entries())
    assert eval_steps == [0, 4, 8, 12]  # in step order, each once
    assert train_steps == [2, 4, 6, 8, 10, 12]


def test_training_starts_before_mlflow_is_reached_and_ends_with_the_flow_when_it_cannot_be(
    prefect_server, tmp_path, monkeypatch
):
    import psutil

    from flows.train_and_evaluate import train_and_evaluate
    from tests.helpers import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the client gives up at once
    cfg = tiny_config(tmp_path, tracking={"tracking_uri": f"http://127.0.0.1:{free_port()}"})  # nothing there
    state = train_and_evaluate(params=json.loads(json.dumps(dataclasses.asdict(cfg))), return_state=True)
    assert state.is_failed() and "127.0.0.1" in str(state.message) + repr(state.result(raise_on_failure=False))
    run = RunDir(cfg.run_root)
    assert (run.logs / "train.log").exists()  # training was started, not held back by MLflow
    config = str(run.train_config)
    assert not [p for p in psutil.process_iter(["cmdline"]) if config in " ".join(p.info["cmdline"] or [])]
