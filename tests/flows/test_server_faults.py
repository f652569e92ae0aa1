"""The server path under faults, on a real ``prefect server`` that is stopped and started again:
a trainer publishing through it (the event API down, then slow behind a delaying proxy) is never
stopped by it, the evaluation service outlives the restart, and no training metric is lost."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.checkpoints.publisher import CHECKPOINT_SAVED, publish_checkpoint
from areal_eval.runs.ledger import Ledger
from areal_eval.tracking import Tracker, TrackingConfig
from tests.helpers import checkpoints_table, free_port
from tests.prefect_services import (
    REPO,
    DelayingProxy,
    api,
    api_get,
    cli,
    server_env,
    start_server,
    stop,
    wait_for_runs,
)

pytestmark = pytest.mark.integration

SLOT_WAITER = """
import logging
logging.basicConfig(level=logging.INFO)
from tasks.orchestration import holding_slot
with holding_slot("gpu:0", wait_s=120):
    print("held gpu:0", flush=True)
"""


def test_the_service_outlives_a_server_restart_and_no_publication_or_metric_is_lost(trained_run, tmp_path, caplog):
    _, original = trained_run
    home = tmp_path / "prefect"
    home.mkdir()
    port = free_port()
    env = server_env(home, port)
    server = start_server(env, home)
    cli(env, "gcl", "create", "gpu:0", "--limit", "1")
    log = tmp_path / "service.log"
    work = tmp_path / "work"
    service = subprocess.Popen(
        [sys.executable, "-m", "flows.serve_evaluations", "--set", f"work_dir={work}", "--set", "eval.nproc=1"],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    run_dir = tmp_path / "faulty"
    run_dir.mkdir()
    manifest = run_dir / "manifest.jsonl"
    checkpoints = {e.global_step: e.uri for e in Manifest(original.manifest).events()}
    steps = [0, 100, 200, 300, 400]

    def publish(step: int, api_url: str, timeout_s: float = 5.0) -> None:
        """As a trainer does: after writing step ``step``'s checkpoint (the trained ones, reused)."""
        publish_checkpoint(
            checkpoints[sorted(checkpoints)[steps.index(step) % len(checkpoints)]],
            manifest,
            "faulty",
            step,
            train_metrics={"loss": 1.0 / (step + 1), "lr": 0.001},
            final=step == steps[-1],
            api_url=api_url,
            valid_data=original.valid_data,
            event_timeout_s=timeout_s,
        )

    def runs_of(step: int):
        return lambda r: r["parameters"].get("run_id") == "faulty" and r["parameters"].get("global_step") == step

    proxy = None
    try:
        deadline = time.monotonic() + 180
        while "listening" not in log.read_text():
            assert service.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)

        # Anyone may emit the event: one that names no checkpoint is skipped, and the service lives on.
        malformed = {
            "id": str(uuid.uuid4()),
            "occurred": datetime.datetime.now(datetime.UTC).isoformat(),
            "event": CHECKPOINT_SAVED,
            "resource": {"prefect.resource.id": "areal.checkpoint.faulty.soon", "areal.source": "publisher"},
            "payload": {"run_id": "faulty", "global_step": "soon"},
        }
        urllib.request.urlopen(
            urllib.request.Request(
                env["PREFECT_API_URL"] + "/events",
                data=json.dumps([malformed]).encode(),
                headers={"Content-Type": "application/json"},
            ),
            timeout=10,
        )
        # The server restarts while the first checkpoint's evaluation holds the gpu:0 slot.
        publish(0, env["PREFECT_API_URL"])
        deadline = time.monotonic() + 120
        while api_get(env, "/v2/concurrency_limits/gpu:0")["active_slots"] == 0:
            assert Ledger(run_dir / "ledger.jsonl").status(0) in (None, "scheduled"), "evaluated before it was seen"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        stop(server)
        # The server is down: publishing warns and training goes on; the manifest keeps the checkpoint.
        publish(100, env["PREFECT_API_URL"])
        assert Manifest(manifest).find(100).global_step == 100
        # An evaluation that wants its concurrency slot now waits for the server, it does not fail.
        waiter_log = tmp_path / "slot-waiter.log"
        waiting = subprocess.Popen(
            [sys.executable, "-c", SLOT_WAITER],
            cwd=REPO,
            env=env,
            stdout=waiter_log.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while "did not answer" not in waiter_log.read_text():  # it waits for the server, and says so
            assert waiting.poll() is None and time.monotonic() < deadline, waiter_log.read_text()[-3000:]
            time.sleep(0.2)
        # Back on the same port and database: the service reconnects and catches up from the manifest,
        # and the slot held across the restart is given back.
        server = start_server(env, home)
        assert waiting.wait(timeout=120) == 0 and "held gpu:0" in waiter_log.read_text(), waiter_log.read_text()[-3000:]
        publish(200, env["PREFECT_API_URL"])
        publish(300, env["PREFECT_API_URL"])
        deadline = time.monotonic() + 240
        while any(Ledger(run_dir / "ledger.jsonl").status(s) in (None, "scheduled") for s in steps[:4]):
            assert service.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)

        # A server too slow to answer within the publisher's timeout: a warning again, and the event,
        # which the server did get, is evaluated by the service as any other.
        proxy = DelayingProxy(port, delay_s=3.0)
        publish(400, f"http://127.0.0.1:{proxy.port}/api", timeout_s=1.0)
        wait_for_runs(env, runs_of(400), 1, timeout_s=240)
        deadline = time.monotonic() + 60
        tracker = Tracker(TrackingConfig(tracking_uri=env["MLFLOW_TRACKING_URI"], experiment="areal-eval"))
        while tracker.client.get_run(tracker.find_run("faulty")).info.status == "RUNNING":
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert service.poll() is None, log.read_text()[-3000:]  # it never gave up
        assert api_get(env, "/v2/concurrency_limits/gpu:0")["active_slots"] == 0  # the slot is free again
        runs = [r for r in api(env, "/flow_runs/filter", {"limit": 200}) if r["parameters"].get("run_id") == "faulty"]
        assert {r["state_type"] for r in runs} == {"COMPLETED"}, [(r["name"], r["state_type"]) for r in runs]
    finally:
        if proxy is not None:
            proxy.close()
        stop(service)
        stop(server)

    said = log.read_text()
    assert said.count("listening to") == 2 and "reconnecting in" in said, said[-3000:]
    assert f"event {malformed['id']} skipped: global_step 'soon' is not a non-negative integer" in said
    warned = [
        r.getMessage() for r in caplog.records if "is in the manifest, but its event did not reach" in r.getMessage()
    ]
    assert [w.split()[2] for w in warned] == ["100", "400"], warned
    # Each names what evaluates the checkpoint: the service, which serves this run.
    assert all(w.endswith("evaluates it from the manifest once it reconnects") for w in warned), warned
    assert f"the evaluation service serving this run (pid {service.pid} on " in warned[0], warned
    ledger = Ledger(run_dir / "ledger.jsonl")
    assert [e.step for e in ledger.entries()] == steps
    assert all(e.status in ("evaluated", "skipped") for e in ledger.entries()), [e.reason for e in ledger.entries()]
    mlflow_run = tracker.client.get_run(tracker.find_run("faulty"))
    assert mlflow_run.info.status == "FINISHED"
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    assert (
        sorted(m.step for m in tracker.client.get_metric_history(mlflow_run.info.run_id, "eval/accuracy")) == evaluated
    )
    for name in ("train/loss", "train/lr"):  # every publication's metrics, each once
        assert sorted(m.step for m in tracker.client.get_metric_history(mlflow_run.info.run_id, name)) == steps
    table = checkpoints_table(tracker, mlflow_run.info.run_id)
    assert sorted(table) == steps and all(row["decision"] for row in table.values()), table  # every decision
