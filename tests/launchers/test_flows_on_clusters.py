"""The flows on a cluster launcher: ``kill -9`` of the demo's command mid-run leaves no actor,
placement group or Slurm job behind once it is run again, and the run resumes to the end with
each evaluation in MLflow once."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from areal_eval.launchers.slurm_queue import run_jobs
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import FINAL_STATES, Ledger
from areal_eval.tracking import Tracker, TrackingConfig
from tests.conftest import TINY
from tests.flows.test_train_and_evaluate_resume import ROOT, clean_env, flow_command
from tests.helpers import sqlite_mlflow_uri, wait_for
from tests.launchers.conftest import placement_groups_left, slot_actors_alive

pytestmark = pytest.mark.integration


def cluster_eval(engine: str, request) -> dict:
    if engine == "ray":
        cluster, _ = request.getfixturevalue("ray_cluster")
        return {
            "launcher": "ray",
            "ray": {"address": cluster.address, "gpus_per_node": 1, "resources": {"eval_node": 1}},
        }
    request.getfixturevalue("slurm_cluster")
    return {"launcher": "slurm", "slurm": {"gpus_per_node": 1, "time_limit": "10:00"}}


def left_on(engine: str, run_name: str) -> list:
    if engine == "ray":
        return slot_actors_alive(f"areal-eval-{run_name}") + placement_groups_left(f"areal-eval-{run_name}")
    return run_jobs(run_name)


@pytest.mark.parametrize("engine", [pytest.param("ray", marks=pytest.mark.uses("ray_cluster")), "slurm"])
def test_kill_9_of_the_flow_then_the_same_command_leaves_nothing_on_the_cluster_and_resumes(engine, request, tmp_path):
    run_name = f"killed-{engine}"
    params = {
        **TINY,
        "run_name": run_name,
        "work_dir": str(tmp_path),
        "tracking": {"tracking_uri": sqlite_mlflow_uri(tmp_path)},
        "train": {**TINY["train"], "max_steps": 24, "epochs": 40},
        "eval": {**TINY["eval"], **cluster_eval(engine, request)},
    }
    config = tmp_path / "config.json"
    config.write_text(json.dumps(params))
    run = RunDir(tmp_path / run_name)
    env = clean_env(tmp_path / "prefect")
    with (tmp_path / "flow.log").open("w") as log:
        flow = subprocess.Popen(
            flow_command(config), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_for(
                lambda: run.ledger.exists() and Ledger(run.ledger).status(0) == "evaluated", 300, "a first evaluation"
            )
            assert left_on(engine, run_name)  # the run's slots are on the cluster
            os.kill(flow.pid, signal.SIGKILL)
            flow.wait(10)
        finally:
            if flow.poll() is None:
                os.killpg(flow.pid, signal.SIGKILL)
    if engine == "ray":  # the driver is gone: Ray removes what it owned
        wait_for(
            lambda: not left_on(engine, run_name), 60, "Ray to remove the killed flow's actors and placement groups"
        )
    else:
        assert left_on(engine, run_name)  # a batch job outlives its submitter: the next flow cancels it

    again = subprocess.run(flow_command(config), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert left_on(engine, run_name) == []
    if engine == "slurm":
        said = " ".join((again.stdout + again.stderr).split())  # the console wraps long lines
        assert f"cancelled 1 slot job(s) a killed flow of {run_name} left" in said, said
    ledger = Ledger(run.ledger)
    assert all(e.status in FINAL_STATES for e in ledger.entries()) and ledger.status(24) == "evaluated"
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    tracker = Tracker(TrackingConfig(tracking_uri=params["tracking"]["tracking_uri"], experiment="areal-eval"))
    [mlflow_run] = tracker.client.search_runs([tracker.experiment_id])
    assert mlflow_run.info.status == "FINISHED"
    history = tracker.client.get_metric_history(mlflow_run.info.run_id, "eval/accuracy")
    assert sorted(m.step for m in history) == evaluated  # none twice, none lost
