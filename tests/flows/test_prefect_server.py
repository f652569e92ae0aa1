"""The flows on a real `prefect server start` on loopback, set up as the README's server section
does: work pools, deployments from infra/prefect.yaml, process workers, `prefect deployment run
--watch`, the sweep. Trainers outside the flow publishing to it: test_published_checkpoints.py."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.pipeline.config import load_pipeline_config
from areal_eval.runs.ledger import Ledger
from areal_eval.tracking import Tracker, TrackingConfig
from tests.prefect_services import (
    PREFECT,
    REPO,
    api,
    api_get,
    cli_or_fail,
    eval_steps,
)

pytestmark = pytest.mark.integration


def test_kubernetes_eval_pool_is_created_from_the_template(server):
    cli_or_fail(
        server,
        "work-pool",
        "create",
        "areal-eval-k8s",
        "--type",
        "kubernetes",
        "--base-job-template",
        str(REPO / "infra" / "k8s" / "eval-pool.json"),
    )
    pool = api_get(server, "/work_pools/areal-eval-k8s")
    assert pool["type"] == "kubernetes"
    variables = pool["base_job_template"]["variables"]["properties"]
    assert variables["nnodes"]["default"] == 2 and variables["gpus_per_node"]["default"] == 8
    assert variables["env"]["default"] == {"AREAL_EVAL_HOME": "/opt/areal-eval"}
    manifest = pool["base_job_template"]["job_configuration"]["job_manifest"]
    assert manifest["spec"]["completionMode"] == "Indexed"

    # The README's deploy command for that pool; then evaluate-checkpoint goes back to the process pool.
    deploy = [
        "--no-prompt",
        "deploy",
        "--prefect-file",
        "infra/prefect.yaml",
        "-n",
        "evaluate-checkpoint/on-checkpoint",
    ]
    cli_or_fail(server, *deploy, "--pool", "areal-eval-k8s", "--job-variable", "image=registry.local/areal-eval:1")
    deployment = api_get(server, "/deployments/name/evaluate-checkpoint/on-checkpoint")
    assert deployment["work_pool_name"] == "areal-eval-k8s"
    assert deployment["job_variables"] == {"image": "registry.local/areal-eval:1"}
    cli_or_fail(server, *deploy)
    deployment = api_get(server, "/deployments/name/evaluate-checkpoint/on-checkpoint")
    assert deployment["work_pool_name"] == "areal-eval" and not deployment["job_variables"]


def test_deployments_and_the_automation_are_named(server):
    for name in (
        "train-and-evaluate/pipeline",
        "train-and-evaluate/sft-math",
        "evaluate-checkpoint/on-checkpoint",
        "sweep-checkpoints/every-30-minutes",
    ):
        assert api_get(server, f"/deployments/name/{name}")["tags"]
    for name in ("train-and-evaluate/pipeline", "train-and-evaluate/sft-math"):  # the form opens on the typed section
        assert api_get(server, f"/deployments/name/{name}")["parameters"]["params"] == {}
    on_checkpoint = api_get(server, "/deployments/name/evaluate-checkpoint/on-checkpoint")
    assert on_checkpoint["parameters"]["gpu_slot"] == "gpu:0" and "evaluation" in on_checkpoint["tags"]
    sft = api_get(server, "/deployments/name/train-and-evaluate/sft-math")
    preset = load_pipeline_config(REPO / sft["parameters"]["config_path"])
    assert preset.eval.evaluator == "generation,lm_loss" and preset.model.objective == "sft"
    automations = api(server, "/automations/filter", {})
    assert [a["name"] for a in automations] == ["evaluate-published-checkpoint"]


def test_bad_parameters_are_refused_before_a_run_starts(server):
    cases = (
        ({"eval": {"nprocs": 2}}, "params.eval", "nprocs"),
        # Prefect lets a property without a schema default be null too: "integer or null".
        ({"eval": {"nproc": True}}, "params.eval.nproc", "True is not valid under any of the given schemas"),
        ({"eval": {"nproc": 0}}, "params.eval.nproc", "0 is less than the minimum of 1"),  # its range
        (
            {"scheduler": {"probe_fraction": 1.0}},
            "params.scheduler.probe_fraction",
            "greater than or equal to the maximum",
        ),
    )
    for bad, field, why in cases:
        done = subprocess.run(
            [PREFECT, "deployment", "run", "train-and-evaluate/pipeline", "--params", json.dumps({"params": bad})],
            cwd=REPO,
            env=server,
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = " ".join((done.stdout + done.stderr).split())  # the CLI wraps long lines
        assert done.returncode != 0 and f"Validation failed for field '{field}'" in said, said[-2000:]
        assert why in said, said[-2000:]
    refused = [bad for bad, _, _ in cases]
    assert not [r for r in api(server, "/flow_runs/filter", {"limit": 200}) if r["parameters"].get("params") in refused]


def test_deployment_run_evaluates_a_checkpoint(server, stored_run):
    manifest = stored_run / "manifest.jsonl"
    run_id = Manifest(manifest).events()[0].run_id
    started = time.monotonic()
    cli_or_fail(
        server,
        "deployment",
        "run",
        "evaluate-checkpoint/on-checkpoint",
        "--watch",
        "--params",
        json.dumps({"global_step": 4, "manifest": str(manifest), "reason": "manual"}),
    )
    print(f"deployment run to completion: {time.monotonic() - started:.1f}s")
    assert 4 in eval_steps(server, run_id)
    assert Ledger(stored_run / "ledger.jsonl").latest(4).reason.startswith("manual; scheduler: ")
    runs = api(server, "/flow_runs/filter", {"limit": 200})
    run = next(
        r for r in runs if r["parameters"].get("manifest") == str(manifest) and r["parameters"]["global_step"] == 4
    )
    assert run["name"] == f"{stored_run.name}@4 (manual)" and f"run:{run_id}" in run["tags"]


def test_the_sweep_evaluates_only_what_no_flow_run_handles(server, stored_run):
    run_id = Manifest(stored_run / "manifest.jsonl").events()[0].run_id
    cli_or_fail(server, "deployment", "run", "sweep-checkpoints/every-30-minutes", "--watch")
    ledger = Ledger(stored_run / "ledger.jsonl")
    assert all(e.status in ("evaluated", "skipped", "superseded") for e in ledger.entries())
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    assert eval_steps(server, run_id) == evaluated  # skipped checkpoints stay skipped
    tracker = Tracker(TrackingConfig(tracking_uri=server["MLFLOW_TRACKING_URI"], experiment="areal-eval"))
    assert tracker.client.get_run(tracker.find_run(run_id)).info.status == "FINISHED"
    cli_or_fail(server, "deployment", "run", "sweep-checkpoints/every-30-minutes", "--watch")  # idempotent
    history = tracker.client.get_metric_history(tracker.find_run(run_id), "eval/accuracy")
    assert sorted(m.step for m in history) == evaluated


def run_pipeline(server, params: dict) -> None:
    """``prefect deployment run train-and-evaluate/pipeline --watch`` with ``params``."""
    run = ["deployment", "run", "train-and-evaluate/pipeline", "--watch", "--params", json.dumps({"params": params})]
    cli_or_fail(server, *run)


def test_deployment_run_train_and_evaluate_dispatches_evaluations_to_the_eval_pool(server, tmp_path):
    """The README's ``prefect deployment run train-and-evaluate/pipeline`` on the train pool's
    worker, its evaluations dispatched as evaluate-checkpoint runs to the eval pool's."""
    from tests.conftest import TINY

    params = {
        **TINY,
        "work_dir": str(tmp_path),
        "run_name": "dispatched",
        "eval": {**TINY["eval"], "deployment": "evaluate-checkpoint/on-checkpoint"},
        "scheduler": {"min_interval_steps": 12, "max_interval_steps": 12},  # fewer dispatches: 0, the final 12
    }
    started = time.monotonic()
    run_pipeline(server, params)
    print(f"train-and-evaluate deployment run to completion: {time.monotonic() - started:.1f}s")
    run_id = (tmp_path / "dispatched" / "run_id").read_text().strip()
    steps = eval_steps(server, run_id)
    [flow_run] = [r for r in api(server, "/flow_runs/filter", {"limit": 200}) if r["name"] == "dispatched"]
    assert f"run:{run_id}" in flow_run["tags"] and "training" in flow_run["tags"]  # its own and the deployment's
    # Dispatched evaluate-checkpoint runs, and no trigger-started ones: the flow's own events
    # (areal.source=flow) do not match the trigger.
    children = [r for r in api(server, "/flow_runs/filter", {"limit": 200}) if r["parameters"].get("run_id") == run_id]
    assert children and all(r["parameters"].get("dispatched") is True for r in children)
    ledger = (tmp_path / "dispatched" / "ledger.jsonl").read_text()
    assert all(r["state_type"] == "COMPLETED" for r in children), ([r["state"] for r in children], ledger[-3000:])
    assert steps[0] == 0 and steps[-1] == 12  # (refinement may add a skipped neighbour of the best)
    assert sorted(r["parameters"]["global_step"] for r in children) == steps
