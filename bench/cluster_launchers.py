"""Evaluation on each launcher, side by side in one run: local torchrun, Ray slots, Slurm slots.

    .venv/bin/python bench/cluster_launchers.py [--evaluations 5]

Starts what it measures, on loopback only (as root it runs itself in a network namespace that
has only ``lo``): a Ray cluster (a head and 2 nodes) and a Slurm controller with 2 nodes
(``tests/slurm_cluster.py``). On the final checkpoint of a small trained run, for each launcher:

- ``cold_s``: from nothing to the first result (slots acquired, agents and ranks started);
- ``warm_s``: the median of the next evaluations on the same slot;
- ``to_mlflow_s``: the median from the request to the metrics logged in MLflow (SQLite);
- ``idle_rss_mb``: what the slot's processes hold while it waits for the next evaluation
  (node agent and ranks; the cluster's own daemons are not counted);
- ``idle_cpu_s_per_min``: the CPU those processes spend while they wait, per node;
- ``idle_fs_ops_per_min`` (where ``strace`` is installed): the file-system calls (listing a
  directory, opening or stat-ing a file) of the node agent itself while it waits, per node,
  counted by ``strace -c`` over ``IDLE_S``: on Slurm, its load on the shared directory (the
  ranks' own inbox is node-local). Locally, the torchrun agent's.

Ratios are against the local launcher, measured in the same run. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from common import emit, median, trained_tiny_run


def loopback_only() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


IDLE_S = 20.0
"""How long a slot is watched while it waits for its next evaluation."""
FS_CALLS = "openat,newfstatat,statx,stat,lstat,access,getdents64,utimensat"


def family(pids: list[int]) -> list:
    import psutil

    procs = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                procs[proc.pid] = proc
        except psutil.Error:
            continue
    return list(procs.values())


def cpu_s(procs) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except Exception:
            pass
    return total


def tree_rss_mb(pids: list[int]) -> float:
    total = 0
    for proc in family(pids):
        try:
            total += proc.memory_info().rss
        except Exception:
            pass
    return total / 2**20


def idle_load(pids: list[int], nodes: int) -> dict:
    """CPU-s and file-system calls a minute, per node, of a slot's processes while idle."""
    import shutil
    import subprocess

    procs = family(pids)
    tracing = []
    if shutil.which("strace"):
        for pid in pids:  # the agents themselves (their threads): what they do on the shared directory
            tracing.append(
                subprocess.Popen(
                    ["strace", "-c", "-f", "-e", f"trace={FS_CALLS}", "-p", str(pid)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
    before = cpu_s(procs)
    time.sleep(IDLE_S)
    used = cpu_s(procs) - before
    calls = 0
    for trace in tracing:
        trace.terminate()
        summary = trace.communicate(timeout=30)[1]
        total = [line.split() for line in summary.splitlines() if line.strip().endswith("total")]
        calls += int(total[-1][3]) if total and len(total[-1]) >= 5 else 0  # % time, seconds, usecs/call, calls
    per_min = 60.0 / IDLE_S / nodes
    out = {"idle_cpu_s_per_min": round(used * per_min, 3)}
    if tracing:
        out["idle_fs_ops_per_min"] = round(calls * per_min, 1)
    return out


OFFSETS = {"local": 1000, "ray": 2000, "slurm": 3000}
"""Each launcher's results at steps of its own in the one MLflow run."""


def measure(name, pool, event, data, cfg, work: Path, evaluations: int, tracker, mlflow_run, slot_pids) -> dict:
    from areal_eval.evaluation.jobs import run_evaluation_job

    started = time.perf_counter()
    with pool as slots, slots.lease() as slot:
        first = run_evaluation_job(event, data, cfg, work / "cold", workers=slot)
        cold = time.perf_counter() - started
        warm, to_mlflow = [], []
        for i in range(evaluations):
            t = time.perf_counter()
            result = run_evaluation_job(event, data, cfg, work / f"warm-{i}", workers=slot)
            warm.append(time.perf_counter() - t)
            tracker.log_evaluation(mlflow_run, OFFSETS[name] + len(to_mlflow), result.metrics)
            to_mlflow.append(time.perf_counter() - t)
        time.sleep(5.0)  # idle: between two checkpoints (the agents back off to their slowest wake-up)
        idle = tree_rss_mb(slot_pids(slot))
        load = idle_load(slot_pids(slot), cfg.nodes)
    assert result.metrics == first.metrics, name
    return {
        "cold_s": cold,
        "warm_s": median(warm),
        "to_mlflow_s": median(to_mlflow),
        "idle_rss_mb": idle,
        **load,
        "accuracy": first.metrics["accuracy"],
    }


def agent_pids(slot) -> list[int]:
    """A cluster slot's node agents (their torchrun jobs are their children)."""
    return [node["pid"] for node in slot.nodes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluations", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() == 0 and not loopback_only():  # Ray would advertise this machine's external address
        command = 'ip link set lo up && ip addr add 127.0.0.2/8 dev lo && exec "$0" "$@"'
        os.execvp("unshare", ["unshare", "--net", "bash", "-c", command, sys.executable, *sys.argv])

    import ray
    from ray.cluster_utils import Cluster

    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.evaluation.jobs import EvalConfig
    from areal_eval.evaluation.worker_pool import WarmWorkerGroups
    from areal_eval.launchers.ray_slots import RayConfig, RaySlots
    from areal_eval.launchers.slurm_slots import SlurmConfig, SlurmSlots
    from areal_eval.tracking import Tracker, TrackingConfig
    from tests.slurm_cluster import SlurmCluster

    work = Path(tempfile.mkdtemp(prefix="bench-clusters-"))
    cfg, run = trained_tiny_run(work / "trained")
    event = Manifest(run.manifest).events()[-1]
    tracker = Tracker(TrackingConfig(tracking_uri=f"sqlite:///{work}/mlflow.db", experiment="bench"))
    mlflow_run = tracker.start_run("bench", {})

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=2, resources={"eval_node": 1})
    ray.init(address=cluster.address, namespace="areal-eval", log_to_driver=False)
    slurm = SlurmCluster(work / "slurm-cluster").start()
    os.environ["SLURM_CONF"] = slurm.env["SLURM_CONF"]
    base = EvalConfig(nproc=2, batch_size=16)
    ray_cfg = EvalConfig(
        nproc=2,
        batch_size=16,
        launcher="ray",
        ray=RayConfig(address="auto", gpus_per_node=1, resources={"eval_node": 1}),
    )
    slurm_cfg = EvalConfig(
        nproc=2, batch_size=16, launcher="slurm", slurm=SlurmConfig(gpus_per_node=1, time_limit="30:00")
    )
    out: dict = {"evaluations": args.evaluations, "pairs": 101, "ranks": 2}
    try:
        launchers = {  # (slots, eval config, the slot's process ids)
            "local": (lambda: WarmWorkerGroups(1, 2, work / "local"), base, lambda group: [group.job.pid]),
            "ray": (lambda: RaySlots(ray_cfg, work / "ray", run_name="bench"), ray_cfg, agent_pids),
            "slurm": (lambda: SlurmSlots(slurm_cfg, work / "slurm", run_name="bench"), slurm_cfg, agent_pids),
        }
        for name, (slots, cfg, pids) in launchers.items():
            out[name] = measure(
                name, slots(), event, run.valid_data, cfg, work / name, args.evaluations, tracker, mlflow_run, pids
            )
    finally:
        slurm.stop()
        ray.shutdown()
        cluster.shutdown()
    for name in ("ray", "slurm"):
        for key in ("cold_s", "warm_s", "to_mlflow_s", "idle_rss_mb"):
            out[name][f"{key}_vs_local"] = round(out[name][key] / out["local"][key], 3)
    assert out["ray"]["accuracy"] == out["slurm"]["accuracy"] == out["local"]["accuracy"]
    emit(out)


if __name__ == "__main__":
    main()
