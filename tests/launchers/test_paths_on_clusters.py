"""Every path runs on a cluster launcher as it does locally: the event trigger's
``evaluate-checkpoint`` (slots of its process's own) on Ray, the sweep (slots for the sweep) on
Slurm; each gives the local launcher's metrics, and MLflow holds each evaluation once."""

from __future__ import annotations

import dataclasses
import json

import pytest

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job
from areal_eval.launchers.ray_slots import RayConfig
from areal_eval.launchers.slurm_queue import run_jobs
from areal_eval.launchers.slurm_slots import SlurmConfig
from areal_eval.runs.ledger import Ledger
from tests.helpers import copy_trained_run, mlflow_run, sqlite_mlflow_uri
from tests.launchers.conftest import placement_groups_left, slot_actors_alive

pytestmark = pytest.mark.integration


def on(cfg, tmp_path, run_name, **eval_changes):
    return dataclasses.replace(
        cfg,
        run_name=run_name,
        eval=dataclasses.replace(cfg.eval, **eval_changes),
        tracking=dataclasses.replace(cfg.tracking, tracking_uri=sqlite_mlflow_uri(tmp_path)),
    )


def test_the_event_path_on_ray_and_the_sweep_on_slurm(
    prefect_server, trained_run, ray_cluster, slurm_cluster, tmp_path
):
    from flows.evaluate_checkpoint import evaluate_checkpoint
    from flows.sweep_checkpoints import sweep_checkpoints
    from tasks.evaluation import close_cluster_slots

    cfg, trained = trained_run
    final = 12
    [event] = [e for e in Manifest(trained.manifest).events() if e.global_step == final]
    local = run_evaluation_job(event, trained.valid_data, EvalConfig(nproc=1, batch_size=16), tmp_path / "local")

    cluster, _ = ray_cluster
    ray = RayConfig(address=cluster.address, gpus_per_node=1, resources={"eval_node": 1})
    on_ray = on(cfg, tmp_path, "event-ray", launcher="ray", ray=ray)
    run = copy_trained_run(trained, tmp_path / "event-ray")
    result = evaluate_checkpoint(final, str(run.manifest), params=json.loads(json.dumps(dataclasses.asdict(on_ray))))
    assert result["evaluated"] and result["metrics"] == pytest.approx(local.metrics, abs=1e-9)
    assert slot_actors_alive("areal-eval-event-ray")  # the process keeps its slots for its next evaluation
    close_cluster_slots()
    assert slot_actors_alive("areal-eval-event-ray") == [] and placement_groups_left("areal-eval-event-ray") == []

    slurm = SlurmConfig(gpus_per_node=1, time_limit="10:00")
    on_slurm = on(cfg, tmp_path, "sweep-slurm", launcher="slurm", slurm=slurm)
    run = copy_trained_run(trained, tmp_path / "sweep-slurm")
    swept = sweep_checkpoints(store=str(run.root), params=json.loads(json.dumps(dataclasses.asdict(on_slurm))))
    assert swept["failed"] == [] and swept["evaluated"]
    assert run_jobs("sweep-slurm") == []  # the sweep's end cancelled its slot's job
    ledger = Ledger(run.ledger)
    assert ledger.status(final) == "evaluated"
    tracker, runs = mlflow_run(on_slurm)
    [mlflow] = runs
    history = tracker.client.get_metric_history(mlflow.info.run_id, "eval/accuracy")
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    assert sorted(m.step for m in history) == evaluated
    assert {m.step: m.value for m in history}[final] == pytest.approx(local.metrics["accuracy"], abs=1e-9)
