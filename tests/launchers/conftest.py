"""Fixtures of the cluster tests: a real Ray cluster (a head and 2 nodes) on loopback.

Ray advertises the host's external address even when told 127.0.0.1, so its tests run only in
a network namespace that has nothing but ``lo`` (``scripts/test.sh`` runs the suite in one when
it can): no test sends anything to another address. Under CI (``CI`` set) an engine that is
missing fails the test; elsewhere it is skipped, saying how to get it.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest

from tests.helpers import LaneService, require

NODE_GPUS = 2
"""Fake GPUs of each Ray node (Ray hands them out as ``CUDA_VISIBLE_DEVICES``; torch runs on CPU)."""


def only_loopback() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def _start_ray_cluster():
    """A Ray head (no GPUs: training's node) and 2 evaluation nodes of :data:`NODE_GPUS` fake
    GPUs and one ``eval_node`` each; this process is connected to it."""
    require(importlib.util.find_spec("ray") is not None, "ray is not installed: bash scripts/setup.sh --ray")
    require(only_loopback(), "the Ray tests need a network namespace with only lo: run them through scripts/test.sh")
    import ray
    from ray.cluster_utils import Cluster

    # No dashboard: test lanes run a cluster each, and every dashboard would want port 8265.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=2, num_gpus=NODE_GPUS, resources={"eval_node": 1}) for _ in range(2)]
    ray.init(address=cluster.address, namespace="areal-eval", log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


RAY_CLUSTER = LaneService("ray_cluster", _start_ray_cluster)
"""Idle, the cluster's daemons take 5.5 CPU-seconds a minute here: a lane stops it once its next
test's file does not use it (a lane runs a file's tests one after another)."""


@pytest.fixture
def ray_cluster():
    """(the cluster, its 2 evaluation nodes): :func:`_start_ray_cluster`, shared by the lane's
    tests that run one after another."""
    return RAY_CLUSTER.get()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A Slurm controller and 2 nodes (``n1``, ``n2``: 2 CPUs and 2 fake GPUs each) on
    127.0.0.1; ``SLURM_CONF`` points this process's Slurm commands at it."""
    from tests import slurm_cluster as slurm

    require(slurm.available() is None, f"no Slurm here: {slurm.available()}")
    require(only_loopback(), "the Slurm tests need a network namespace with only lo: run them through scripts/test.sh")
    cluster = slurm.SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    try:
        yield cluster
    finally:
        cluster.stop()
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


def evaluate_on(slots, event, run, work_dir):
    """Evaluate ``event`` on a slot leased from ``slots``: (its result, the slot)."""
    from areal_eval.evaluation.jobs import run_evaluation_job

    with slots.lease() as slot:
        return run_evaluation_job(event, run.valid_data, slots.cfg, work_dir, workers=slot), slot


def read_items(result) -> dict:
    import pyarrow.parquet as pq

    return {name: pq.read_table(path).to_pylist() for name, path in result.items.items()}


def slot_actors_alive(prefix: str) -> list[str]:
    """Live named actors (from the GCS: the tests' clusters run no dashboard)."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def placement_groups_left(prefix: str) -> list[str]:
    import ray

    table = ray.util.placement_group_table().values()
    return [p["name"] for p in table if p["name"].startswith(prefix) and p["state"] != "REMOVED"]


HERE = Path(__file__).resolve().parent
