"""``eval.launcher: slurm``: each slot one job of ``eval.nodes`` nodes, one node agent per node
(``srun``: :mod:`~areal_eval.launchers.slurm_node`), kept for the run or submitted per evaluation.

Jobs, replies and logs pass through ``eval.slurm.shared_dir`` (default: the run's ``evals``
directory), which the flow's machine and the nodes must both see. A slot's job is named
``areal-eval:<run>:<host>.<pid>:slot-<i>`` (its flow's): when the run ends it is cancelled, and
a resume of the run on that host cancels those a killed flow left behind.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil

from areal_eval import jsonl
from areal_eval.config.parsing import ConfigError
from areal_eval.launchers.reaper import OWNER_ENV
from areal_eval.launchers.slot_pool import ClusterSlot, SlotLost, SlotPool, log
from areal_eval.launchers.slurm_node import POLL_S, STOP, decode_reply, job_dir

ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


def slurm(*command: str) -> subprocess.CompletedProcess:
    # sbatch hands the job this environment: not the flow's reaper token, since a slot's job
    # lives on the cluster, not under the flow (a resume cancels what a killed flow left).
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def job_state(job_id: str) -> str:
    """``PENDING``, ``RUNNING``, ... or ``GONE`` once the controller has forgotten the job."""
    shown = slurm("squeue", "-h", "-j", job_id, "-o", "%T")
    return shown.stdout.strip() or "GONE"


def check_cluster(cfg) -> None:
    """Refuse in one line what no job could get: no Slurm here, a partition that does not
    exist, more GPUs per node than any node has."""
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "eval.launcher: slurm needs sbatch, squeue and scancel on PATH (a Slurm login or compute node)"
        )
    s = cfg.slurm
    if s.partition:
        shown = slurm("scontrol", "show", "partition", s.partition)
        if shown.returncode:
            raise ConfigError(f"eval.slurm.partition: {s.partition!r}: {shown.stderr.strip() or 'no such partition'}")
    if s.gpus_per_node:
        listing = slurm("sinfo", "-h", "-N", "-o", "%G", *(["-p", s.partition] if s.partition else [])).stdout
        most = max((int(n) for n in re.findall(r"gpu(?::[^:,()\s]+)?:(\d+)", listing)), default=0)
        if most < s.gpus_per_node:
            raise ConfigError(
                f"eval.slurm.gpus_per_node: {s.gpus_per_node} GPUs per node, but the largest node has {most}"
            )


OWNER = f"{socket.gethostname()}.{os.getpid()}"
"""Whose slots a job holds: the flow's host and process (``areal-eval:<run>:<host>.<pid>:slot-<i>``)."""


def run_jobs(run_name: str) -> list[tuple[str, str]]:
    """(id, name) of this user's jobs of ``run_name``'s slots still known to the controller."""
    shown = slurm("squeue", "--me", "-h", "-o", "%i %j").stdout.split("\n")
    prefix = f"areal-eval:{run_name}:"
    return [tuple(line.split(" ", 1)) for line in shown if " " in line and line.split(" ", 1)[1].startswith(prefix)]


def left_by_dead_flows(run_name: str) -> list[tuple[str, str]]:
    """The run's jobs whose flow, on this host, is gone (``kill -9``): a live flow of the run (the
    sweep beside the service, two trigger flow runs at once) keeps its own."""
    host = socket.gethostname()
    left = []
    for job, name in run_jobs(run_name):
        owner = name.split(":")[2] if name.count(":") >= 3 else ""
        owner_host, _, pid = owner.rpartition(".")
        if owner_host == host and pid.isdigit() and not psutil.pid_exists(int(pid)):
            left.append((job, name))
    return left


class SlurmSlot(ClusterSlot):
    def __init__(self, index: int, cfg, slot_dir: Path, run_name: str, report):
        super().__init__(index, slot_dir / "slot.log")
        self.cfg, self.dir, self.report = cfg, slot_dir, report
        self.name = f"areal-eval:{run_name}:{OWNER}:slot-{index}"
        self.job: str | None = None
        self.nodes: list[dict] = []
        self.state = "not submitted"

    def _script(self, once: bool) -> Path:
        e = self.cfg
        agent = [sys.executable, "-m", "areal_eval.launchers.slurm_node", str(self.dir), f"--nproc={e.nproc}"]
        agent += [f"--nice={e.nice}", f"--collective-timeout={e.collective_timeout_s}"]
        agent += ([f"--python={e.python}"] if e.python else []) + (["--cold"] if not e.warm_workers else [])
        agent += ["--once"] if once else []
        script = self.dir / "slot.sh"
        script.write_text(f"#!/bin/bash\nexec srun --kill-on-bad-exit=1 {shlex.join(agent)}\n")
        return script

    def submit(self, stop: threading.Event, once: bool = False) -> bool:
        """Submit the slot's job and wait (as long as it is pending) until every node agent is up."""
        s, e = self.cfg.slurm, self.cfg
        self.dir.mkdir(parents=True, exist_ok=True)
        options = [f"--job-name={self.name}", f"--comment=areal-eval slot {self.index} of {self.dir}"]
        options += [f"--nodes={e.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={s.cpus_per_node}"]
        options += [f"--time={s.time_limit}", f"--output={self.dir}/job-%j.out"]
        options += [f"--partition={s.partition}"] if s.partition else []
        options += [f"--account={s.account}"] if s.account else []
        options += [f"--gres=gpu:{s.gpus_per_node}"] if s.gpus_per_node else []
        submitted = slurm("sbatch", "--parsable", *options, *s.sbatch_args, str(self._script(once)))
        if submitted.returncode:
            raise ConfigError(f"eval.slurm: sbatch refused the slot's job: {submitted.stderr.strip()}")
        self.job = submitted.stdout.strip().split(";")[0]
        if stop.is_set():  # the pool closed while sbatch ran
            self.release()
            return False
        here = job_dir(self.dir, self.job)
        while True:
            state = job_state(self.job)
            if state == "PENDING" and not self.state.endswith("PENDING"):
                self.report(f"slurm slot {self.index}: job {self.job} is pending; its evaluation waits for nodes")
            self.state = f"job {self.job} {state}"
            if state in ENDED or state == "GONE":
                raise SlotLost(f"{self.describe()} before its node agents started; see {self.dir}/job-{self.job}.out")
            self.nodes = [jsonl.read_json(p) for p in sorted(here.glob("node-*.json"))]
            if state == "RUNNING" and len(self.nodes) == e.nodes:
                break
            if stop.wait(0.2):
                return False
        self.state = f"job {self.job} running on " + ", ".join(
            f"{n['host']}/{n['address']} (devices {n['devices']})" for n in self.nodes
        )
        return True

    def acquire(self, stop: threading.Event) -> bool:
        return self.submit(stop) if self.cfg.slurm.keep_jobs else True

    def call(self, spec: dict, data: bytes, timeout_s: float) -> dict:
        if not self.cfg.slurm.keep_jobs:
            self.submit(threading.Event(), once=True)  # waits while the job is pending: not a failure
        here = job_dir(self.dir, self.job)
        name = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        (here / f"{name}.valid.jsonl").write_bytes(data)
        job = {"spec": spec, "data": str(here / f"{name}.valid.jsonl"), "timeout_s": timeout_s}
        jsonl.write_json(here / "inbox" / f"{name}.json", job)
        reply_path, deadline = here / f"{name}.reply.json", time.monotonic() + timeout_s + 60
        checked = 0.0
        while not reply_path.exists():
            if time.monotonic() - checked > 1:
                checked = time.monotonic()
                state = job_state(self.job)
                if state != "RUNNING" and not reply_path.exists():
                    self.broken = True
                    raise SlotLost(
                        f"{self.describe()}: its job {self.job} is {state}; log {self.dir}/job-{self.job}.out"
                    )
            if time.monotonic() > deadline:
                self.broken = True
                raise SlotLost(f"{self.describe()}: no reply from node 0 in {timeout_s + 60:.0f} s")
            time.sleep(POLL_S)
        reply = decode_reply(jsonl.read_json(reply_path))
        for follower in sorted(here.glob(f"{name}.node-*.json")):
            reply["log"] += jsonl.read_json(follower).get("log", "")
        return reply

    def release(self) -> None:
        if self.job is not None:
            if job_state(self.job) == "RUNNING":  # a stop ends the agents cleanly (warm ranks too)
                jsonl.write_json(job_dir(self.dir, self.job) / "inbox" / f"{STOP}.json", {"stop": True})
                deadline = time.monotonic() + 30
                while job_state(self.job) not in ENDED | {"GONE"} and time.monotonic() < deadline:
                    time.sleep(0.2)
            slurm("scancel", self.job)
            deadline = time.monotonic() + 30  # gone, not just told to go
            while job_state(self.job) not in ENDED | {"GONE"} and time.monotonic() < deadline:
                time.sleep(0.2)
        self.job, self.nodes, self.state = None, [], "released"

    def describe(self) -> str:
        return f"slurm slot {self.index} ({self.name}): {self.state}"


class SlurmSlots(SlotPool):
    """``eval.slots`` Slurm slots for one run; leftovers of a killed flow of the run are cancelled."""

    def __init__(self, cfg, work_dir: str | Path, *, run_name: str, **pool):
        check_cluster(cfg)
        self.cfg = cfg
        shared = Path(cfg.slurm.shared_dir or work_dir) / "slurm-slots"
        report = pool.setdefault("report", log.info)
        left = left_by_dead_flows(run_name)
        if left:
            slurm("scancel", *[job for job, _ in left])
            deadline = time.monotonic() + 60  # gone, not just told to go: their nodes are free for this run
            while {job for job, _ in left} & {job for job, _ in run_jobs(run_name)} and time.monotonic() < deadline:
                time.sleep(0.2)
            report(f"cancelled {len(left)} slot job(s) a killed flow of {run_name} left: {left}")
        slots = [SlurmSlot(i, cfg, shared / f"slot-{i}", run_name, report) for i in range(cfg.slots)]
        super().__init__(slots, **pool)
