"""The sweep ends runs whose flow died: a real MLflow store, a real lock holder, a real SIGKILL."""

import os
import signal
import subprocess
import sys

import pytest

from areal_eval.runs.directory import RunDir, RunLock
from areal_eval.tracking import Tracker, TrackingConfig
from tests.helpers import HOLD_RUN_LOCK, sqlite_mlflow_uri

pytestmark = pytest.mark.integration


def test_a_run_left_running_by_a_dead_flow_is_ended_killed_and_a_live_one_is_not(tmp_path):
    from flows.sweep_checkpoints import end_if_abandoned

    tracker = Tracker(TrackingConfig(tracking_uri=sqlite_mlflow_uri(tmp_path), experiment="sweep"))
    run = RunDir(tmp_path / "run")
    mlflow_run = tracker.start_run("r-1", {})
    assert not end_if_abandoned(tracker, mlflow_run, run)  # no lock file: a trainer outside the flow
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_LOCK, str(run.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not end_if_abandoned(tracker, mlflow_run, run)  # its flow is alive
        assert tracker.client.get_run(mlflow_run).info.status == "RUNNING"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        assert end_if_abandoned(tracker, mlflow_run, run)
    finally:
        holder.kill()
        holder.wait()
    info = tracker.client.get_run(mlflow_run)
    assert info.info.status == "KILLED" and "no live owner" in info.data.tags["areal.failure"]
    with RunLock(run):
        pass  # the sweep left the lock free
    assert not end_if_abandoned(tracker, mlflow_run, run)  # ended once
