"""The Kubernetes base job template of the evaluation pool (infra/k8s/eval-pool.json), rendered
the way prefect-kubernetes' worker renders it, checked against the Kubernetes API models, and
its pod command run for two "pods" on loopback: node 0 runs the flow's evaluation, node 1 serves."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import Manifest
from tests.helpers import free_port

TEMPLATE = Path(__file__).resolve().parents[1] / "infra" / "k8s" / "eval-pool.json"


def render(values: dict) -> dict:
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads(TEMPLATE.read_text())
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, values))
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="eval-run"))
    return config.job_manifest


def test_template_is_an_indexed_gpu_job_with_valid_fields(prefect_server):
    from kubernetes_asyncio.client import ApiClient

    job = render({"nnodes": 3, "gpus_per_node": 4, "image": "registry.local/areal-eval:1"})
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}  # done when the flow's pod is
    [container] = pod["containers"]
    assert (
        container["resources"]["limits"]["nvidia.com/gpu"] == 4 == container["resources"]["requests"]["nvidia.com/gpu"]
    )
    assert (
        container["args"] == ["prefect", "flow-run", "execute"] and container["image"] == "registry.local/areal-eval:1"
    )
    assert (
        pod["subdomain"] == "areal-eval-nodes"
        and job["spec"]["template"]["metadata"]["labels"]["areal-eval/role"] == "eval-node"
    )
    assert "AREAL_EVAL_NNODES=3 AREAL_EVAL_NPROC_PER_NODE=4" in container["command"][2]

    # Field names are Kubernetes' own: a round trip through the API models keeps everything
    # (an unknown or misspelled field would be dropped). Prefect's worker requires the pod-level
    # parallelism/completions it checks for, which Kubernetes ignores.
    expected = json.loads(json.dumps(job))
    for key in ("parallelism", "completions"):
        expected["spec"]["template"]["spec"].pop(key)

    class Response:
        data = json.dumps(job)

    async def through_models():
        async with ApiClient() as api:
            return api.sanitize_for_serialization(api.deserialize(Response(), "V1Job"))

    assert asyncio.run(through_models()) == json.loads(
        json.dumps(expected).replace('"nvidia.com/gpu": 4', '"nvidia.com/gpu": "4"')
    )


@pytest.mark.integration
def test_pod_command_runs_torchrun_across_two_nodes(prefect_server, trained_run, tmp_path):
    cfg, run = trained_run
    event = Manifest(run.manifest).events()[-1]
    port = free_port()
    job = render({"nnodes": 2, "gpus_per_node": 1, "master_port": port, "cache_dir": str(tmp_path / "cache")})
    container = job["spec"]["template"]["spec"]["containers"][0]
    flow_side = tmp_path / "flow_run.py"  # stands in for `prefect flow-run execute` on pod 0
    flow_side.write_text(
        textwrap.dedent(f"""
        import json
        from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job
        from areal_eval.checkpoints.manifest import Manifest
        event = Manifest({str(run.manifest)!r}).find({event.global_step})
        cfg = EvalConfig(nproc=1, batch_size=16)
        result = run_evaluation_job(event, {str(run.valid_data)!r}, cfg, {str(tmp_path / "evals")!r})
        print("RESULT", json.dumps(result.metrics))
    """)
    )
    env = {
        **os.environ,
        "JOB_NAME": "eval-run-x7k2p",
        "AREAL_EVAL_MASTER_ADDR": "127.0.0.1",  # no cluster DNS here
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(Path.cwd()),
    }
    pods, logs = {}, {i: tmp_path / f"pod-{i}.log" for i in (0, 1)}
    for index, args in ((1, container["args"]), (0, [sys.executable, str(flow_side)])):
        pods[index] = subprocess.Popen(
            [*container["command"], *args],
            env={**env, "JOB_COMPLETION_INDEX": str(index)},
            stdout=logs[index].open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        pods[0].wait(timeout=180)
        deadline = time.monotonic() + 60  # node 1's agent reports its job's end just after node 0's
        while "evaluation job ended" not in logs[1].read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for pod in pods.values():  # Kubernetes stops the serving pods once pod 0 succeeds
            if pod.poll() is None:
                os.killpg(pod.pid, signal.SIGKILL)
            pod.wait()
    out, served = logs[0].read_text(), logs[1].read_text()
    assert pods[0].returncode == 0, out[-3000:]
    metrics = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert metrics["n_pairs"] == 101
    assert "evaluation job ended with exit 0" in served, served[-3000:]
