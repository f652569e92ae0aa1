"""The Prefect surface against a real `prefect server start` on loopback: work pools, deployments
from infra/prefect.yaml, process workers, `prefect deployment run --watch`, an event trigger."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from areal_eval.manifest import Manifest
from areal_eval.publisher import post_event
from areal_eval.tracking import Tracker
from tests.helpers import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))


def stop(proc: subprocess.Popen) -> None:
    # A Prefect worker needs a second SIGTERM to stop.
    for _ in range(2):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "AREAL_EVAL_HOME": str(REPO),
        "AREAL_EVAL_STORE": str(home / "store"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "PYTHONPATH": str(REPO),
    }
    log = (home / "server.log").open("w")
    proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                stop(proc)
                pytest.fail(f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
    workers = []
    try:
        for pool in ("areal-train", "areal-eval"):
            cli(env, "work-pool", "create", pool, "--type", "process")
        cli(env, "gcl", "create", "gpu:0", "--limit", "1")
        cli(env, "--no-prompt", "deploy", "--prefect-file", "infra/prefect.yaml", "--all")
        for pool in ("areal-train", "areal-eval"):
            workers.append(subprocess.Popen(
                [PREFECT, "worker", "start", "--pool", pool], cwd=REPO, env=env, start_new_session=True,
                stdout=(home / f"worker-{pool}.log").open("w"), stderr=subprocess.STDOUT,
            ))
        yield env
    finally:
        for p in workers + [proc]:
            stop(p)


def cli(env, *args, timeout=300) -> str:
    done = subprocess.run([PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def api_get(env, path: str) -> dict:
    return json.loads(urllib.request.urlopen(env["PREFECT_API_URL"] + path, timeout=10).read())


def eval_steps(env, run_id: str) -> list[int]:
    tracker = Tracker(env["MLFLOW_TRACKING_URI"], "areal-eval")
    mlflow_run = tracker.find_run(run_id)
    return sorted(tracker.eval_steps(mlflow_run)) if mlflow_run else []


@pytest.fixture(scope="module")
def stored_run(server, trained_run):
    _, original = trained_run
    store = Path(server["AREAL_EVAL_STORE"])
    run_dir = store / original.root.name
    shutil.copytree(original.root, run_dir, ignore=shutil.ignore_patterns("ledger.jsonl", "evals", "decisions.lock", "evaluation_state.json"))
    (run_dir / "manifest.jsonl").write_text((original.manifest).read_text().replace(str(original.root), str(run_dir)))
    return run_dir


def test_kubernetes_eval_pool_is_created_from_the_template(server):
    cli(server, "work-pool", "create", "areal-eval-k8s", "--type", "kubernetes",
        "--base-job-template", str(REPO / "infra" / "k8s" / "eval-pool.json"))
    pool = api_get(server, "/work_pools/areal-eval-k8s")
    assert pool["type"] == "kubernetes"
    variables = pool["base_job_template"]["variables"]["properties"]
    assert variables["nnodes"]["default"] == 2 and variables["gpus_per_node"]["default"] == 8
    assert variables["env"]["default"] == {"AREAL_EVAL_HOME": "/opt/areal-eval"}
    manifest = pool["base_job_template"]["job_configuration"]["job_manifest"]
    assert manifest["spec"]["completionMode"] == "Indexed"

    # The README's deploy command for that pool; then evaluate-checkpoint goes back to the process pool.
    deploy = ["--no-prompt", "deploy", "--prefect-file", "infra/prefect.yaml", "-n", "evaluate-checkpoint/default"]
    cli(server, *deploy, "--pool", "areal-eval-k8s", "--job-variable", "image=registry.local/areal-eval:1")
    deployment = api_get(server, "/deployments/name/evaluate-checkpoint/default")
    assert deployment["work_pool_name"] == "areal-eval-k8s"
    assert deployment["job_variables"] == {"image": "registry.local/areal-eval:1"}
    cli(server, *deploy)
    deployment = api_get(server, "/deployments/name/evaluate-checkpoint/default")
    assert deployment["work_pool_name"] == "areal-eval" and not deployment["job_variables"]


def test_deployments_are_declared(server):
    out = cli(server, "deployment", "ls")
    for name in ("train-and-evaluate/default", "evaluate-checkpoint/default", "sweep-checkpoints/scheduled"):
        assert name in out


def test_deployment_run_evaluates_a_checkpoint(server, stored_run):
    manifest = stored_run / "manifest.jsonl"
    run_id = Manifest(manifest).events()[0].run_id
    started = time.monotonic()
    cli(server, "deployment", "run", "evaluate-checkpoint/default", "--watch",
        "--params", json.dumps({"global_step": 4, "manifest": str(manifest), "use_scheduler": False, "gpu_slot": "gpu:0"}))
    print(f"deployment run to completion: {time.monotonic() - started:.1f}s")
    assert 4 in eval_steps(server, run_id)


def api(env, path: str, body: dict | None = None):
    request = urllib.request.Request(env["PREFECT_API_URL"] + path, data=json.dumps(body or {}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read() or b"null")


def test_event_triggers_evaluate_checkpoint_with_its_parameters(server, stored_run):
    manifest = (stored_run / "manifest.jsonl").resolve()
    event = Manifest(manifest).find(12)
    sent = time.time()
    post_event(server["PREFECT_API_URL"], event, manifest)
    deadline, run = time.monotonic() + 240, None
    while time.monotonic() < deadline:
        runs = api(server, "/flow_runs/filter", {"limit": 200})
        run = next((r for r in runs if r["parameters"].get("global_step") == 12
                    and r["parameters"].get("manifest") == str(manifest)), None)
        if run and run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        time.sleep(1)
    assert run is not None, "no evaluate-checkpoint run was started by the event"
    created = api(server, "/events/filter", {"filter": {"event": {"name": ["prefect.flow-run.Scheduled"]}}, "limit": 50})
    print(f"event to flow run scheduled: {min(e['occurred'] for e in created['events'] if run['id'] in e['resource']['prefect.resource.id'])}"
          f" (sent {sent:.3f}); started {run['start_time']}")
    assert run["parameters"]["run_id"] == event.run_id and run["parameters"]["checkpoint_uri"] == event.uri
    assert run["state_type"] == "COMPLETED", run["state"]
    assert 12 in eval_steps(server, event.run_id)

    # A second event for the same checkpoint evaluates nothing new.
    post_event(server["PREFECT_API_URL"], event, manifest)
    tracker = Tracker(server["MLFLOW_TRACKING_URI"], "areal-eval")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        runs = [r for r in api(server, "/flow_runs/filter", {"limit": 200}) if r["parameters"].get("global_step") == 12]
        if len(runs) == 2 and all(r["state_type"] == "COMPLETED" for r in runs):
            break
        time.sleep(1)
    assert len(runs) == 2 and all(r["state_type"] == "COMPLETED" for r in runs)
    history = tracker.client.get_metric_history(tracker.find_run(event.run_id), "eval/accuracy")
    assert [m.step for m in history].count(12) == 1


def test_sweep_evaluates_the_rest_once(server, stored_run):
    run_id = Manifest(stored_run / "manifest.jsonl").events()[0].run_id
    cli(server, "deployment", "run", "sweep-checkpoints/scheduled", "--watch")
    assert eval_steps(server, run_id) == [0, 4, 8, 12]
    cli(server, "deployment", "run", "sweep-checkpoints/scheduled", "--watch")  # idempotent
    tracker = Tracker(server["MLFLOW_TRACKING_URI"], "areal-eval")
    history = tracker.client.get_metric_history(tracker.find_run(run_id), "eval/accuracy")
    assert sorted(m.step for m in history) == [0, 4, 8, 12]


def test_deployment_run_train_and_evaluate(server, tmp_path):
    from tests.conftest import TINY

    params = {**TINY, "work_dir": str(tmp_path), "run_name": "served"}
    started = time.monotonic()
    cli(server, "deployment", "run", "train-and-evaluate/default", "--watch", "--params", json.dumps({"params": params}))
    print(f"train-and-evaluate deployment run to completion: {time.monotonic() - started:.1f}s")
    run_id = (tmp_path / "served" / "run_id").read_text().strip()
    steps = eval_steps(server, run_id)
    assert steps[0] == 0 and steps[-1] == 12


def test_train_and_evaluate_dispatches_evaluations_to_the_eval_pool(server, tmp_path):
    from tests.conftest import TINY

    params = {**TINY, "work_dir": str(tmp_path), "run_name": "dispatched",
              "eval": {**TINY["eval"], "deployment": "evaluate-checkpoint/default"}}
    cli(server, "deployment", "run", "train-and-evaluate/default", "--watch", "--params", json.dumps({"params": params}))
    run_id = (tmp_path / "dispatched" / "run_id").read_text().strip()
    steps = eval_steps(server, run_id)
    # Dispatched evaluate-checkpoint runs, and no trigger-started ones: the flow's own events
    # (areal.source=flow) do not match the trigger.
    children = [r for r in api(server, "/flow_runs/filter", {"limit": 200}) if r["parameters"].get("run_id") == run_id]
    assert children and all(r["parameters"].get("use_scheduler") is False for r in children)
    ledger = (tmp_path / "dispatched" / "ledger.jsonl").read_text()
    assert all(r["state_type"] == "COMPLETED" for r in children), ([r["state"] for r in children], ledger[-3000:])
    assert steps[0] == 0 and steps[-1] == 12
    assert sorted(r["parameters"]["global_step"] for r in children) == steps
