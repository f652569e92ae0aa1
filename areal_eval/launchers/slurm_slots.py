"""``eval.launcher: slurm``: each slot one job of ``eval.nodes`` nodes, one node agent per node
(``srun``: :mod:`~areal_eval.launchers.slurm_node`), kept for the run or submitted per evaluation.

Jobs, replies and logs pass through ``eval.slurm.shared_dir`` (default: the run's ``evals``
directory), which the flow's machine and the nodes must both see. A slot's job is named
``areal-eval:<run>:<host>.<pid>:slot-<i>`` (its flow's): when the run ends it is cancelled, and
a resume of the run on that host cancels those a killed flow left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import itertools
import re
import shlex
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import ClassVar

from areal_eval import jsonl
from areal_eval.config.parsing import NON_NEGATIVE, POSITIVE, Bounds, ConfigError, Ranges, check_ranges
from areal_eval.evaluation.interpreter import required_modules
from areal_eval.launchers.slot_pool import ClusterSlot, SlotLost, SlotPool, log, rank_env
from areal_eval.launchers.slurm_node import HEARTBEAT, STOP, Backoff, decode_reply, job_dir
from areal_eval.launchers.slurm_queue import (
    OWNER,
    JobState,
    SlurmQueue,
    is_transient,
    left_by_dead_flows,
    run_jobs,
    slurm,
)


@dataclasses.dataclass
class SlurmConfig:
    partition: str | None = None
    """``sbatch --partition``; None: the cluster's default."""
    account: str | None = None
    """``sbatch --account``."""
    gpus_per_node: int = 0
    """GPUs each node of a slot's job asks for (``--gres=gpu:N``); Slurm sets each node's
    ``CUDA_VISIBLE_DEVICES``. 0 on CPU-only partitions."""
    cpus_per_node: int = 1
    """CPUs each node of a slot's job asks for (``--cpus-per-task``)."""
    mem_per_node: str | None = None
    """``sbatch --mem`` of each node (``64G``); None: the partition's default."""
    time_limit: str = "1-00:00:00"
    """``sbatch --time`` of a slot's job. A kept job is renewed (a new job submitted) before its
    limit could cut an evaluation, so the run may outlive it."""
    controller_grace_s: float = 180.0
    """How long the controller may not answer (a restart, a failover) before an evaluation in
    flight is given up; meanwhile the job is kept and its evaluation goes on."""
    orphan_after_s: float = 300.0
    """A job's node agents end once the flow has not touched their heartbeat for this long (a
    flow killed on another host), giving the nodes back before the time limit."""
    sbatch_args: list[str] = dataclasses.field(default_factory=list)
    """More ``sbatch`` options, as given on its command line (``--qos=eval``, ``--exclude=n7``)."""
    keep_jobs: bool = True
    """Keep each slot's job for the whole run (it serves evaluation after evaluation); False
    submits a job per evaluation and frees the nodes in between."""
    shared_dir: str | None = None
    """A directory the flow's machine and every node see (jobs, results, logs); None: the run's
    ``evals`` directory, which must then be on a shared file system."""

    RANGES: ClassVar[Ranges] = {
        "gpus_per_node": NON_NEGATIVE,
        "cpus_per_node": POSITIVE,
        "controller_grace_s": NON_NEGATIVE,
        "orphan_after_s": Bounds(30),  # the flow touches the heartbeat every 10 s
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES)


REPLY_GRACE_S = 60.0
"""How long past ``eval.job_timeout_s`` the flow waits for node 0's reply."""
FOLLOWERS_S = 10.0
"""How long after node 0's reply the flow waits for the other nodes' log lines."""
ENDING_S = 60.0
"""How long a completing job is watched for its final state (the cause) before it is given up."""
HEARTBEAT_S = 10.0
"""How often the flow touches each job's heartbeat (``eval.slurm.orphan_after_s`` reads it)."""
NEVER_RUNS = {
    "PartitionTimeLimit": "time_limit",
    "PartitionNodeLimit": "nodes",
    "BadConstraints": "sbatch_args",
    "InvalidAccount": "account",
    "InvalidQOS": "sbatch_args",
    "AccountNotAllowed": "account",
    "QOSNotAllowed": "sbatch_args",
}
"""Pending reasons no wait can end (the job as asked exceeds what its partition allows), and the
field to change: the job is cancelled and the slot refused in one line."""


def check_cluster(cfg) -> None:
    """Refuse in one line what no job could get: no Slurm here, a partition that does not
    exist, more GPUs per node than any node has. A controller that does not answer refuses
    nothing: the jobs wait for it."""
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "eval.launcher: slurm needs sbatch, squeue and scancel on PATH (a Slurm login or compute node)"
        )
    s = cfg.slurm
    if s.partition:
        shown = slurm("scontrol", "show", "partition", s.partition)
        if shown.returncode and not is_transient(shown.stderr):
            raise ConfigError(f"eval.slurm.partition: {s.partition!r}: {shown.stderr.strip() or 'no such partition'}")
    if s.gpus_per_node:
        listing = slurm("sinfo", "-h", "-N", "-o", "%G", *(["-p", s.partition] if s.partition else []))
        most = max((int(n) for n in re.findall(r"gpu(?::[^:,()\s]+)?:(\d+)", listing.stdout)), default=0)
        if not listing.returncode and most < s.gpus_per_node:
            raise ConfigError(
                f"eval.slurm.gpus_per_node: {s.gpus_per_node} GPUs per node, but the largest node has {most}"
            )


POOLS = itertools.count()
"""Pools of one process (two flows of a run in one process) name their slots apart: ``slot-0.1``."""


class SlurmSlot(ClusterSlot):
    def __init__(self, index: int, cfg, slot_dir: Path, run_name: str, report, queue: SlurmQueue, pool: str = ""):
        super().__init__(index, slot_dir / "slot.log")
        self.cfg, self.dir, self.report, self.queue = cfg, slot_dir, report, queue
        self.name = f"areal-eval:{run_name}:{OWNER}:slot-{index}{pool}"
        self.job: str | None = None
        self.nodes: list[dict] = []
        self.served = 0
        self.shown = "not submitted"

    def _script(self, once: bool) -> Path:
        e = self.cfg
        agent = [sys.executable, "-m", "areal_eval.launchers.slurm_node", str(self.dir), f"--nproc={e.nproc}"]
        agent += [f"--nice={e.nice}", f"--collective-timeout={e.collective_timeout_s}"]
        agent += [f"--orphan-after={e.slurm.orphan_after_s}"]
        agent += ["--needs=" + ",".join(required_modules(e.evaluator, e.generation))]
        agent += ([f"--python={e.python}"] if e.python else []) + (["--cold"] if not e.warm_workers else [])
        agent += ["--once"] if once else []
        script = self.dir / "slot.sh"
        # srun does not inherit --cpus-per-task from sbatch (Slurm 22.05): without it, where cgroups
        # or affinity are enforced, every rank of a node shares one core.
        srun = f"srun --kill-on-bad-exit=1 --cpus-per-task={e.slurm.cpus_per_node}"
        script.write_text(f"#!/bin/bash\nexec {srun} {shlex.join(agent)}\n")
        return script

    def _options(self) -> list[str]:
        s, e = self.cfg.slurm, self.cfg
        options = [f"--job-name={self.name}", f"--comment=areal-eval slot {self.index} of {self.dir}"]
        options += [f"--nodes={e.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={s.cpus_per_node}"]
        # A requeued job would start fresh agents on an inbox of jobs already done: the flow
        # retries a lost evaluation on a new job instead.
        options += [f"--time={s.time_limit}", f"--output={self.dir}/job-%j.out", "--no-requeue", "--export=ALL"]
        options += [f"--mem={s.mem_per_node}"] if s.mem_per_node else []
        options += [f"--partition={s.partition}"] if s.partition else []
        options += [f"--account={s.account}"] if s.account else []
        options += [f"--gres=gpu:{s.gpus_per_node}"] if s.gpus_per_node else []
        return options + list(s.sbatch_args)

    def submit(self, stop: threading.Event, once: bool = False) -> bool:
        """Submit the slot's job and wait (as long as it is pending) until every node agent is up.
        sbatch refusals that pass (the controller away, a QOS limit) are waited out."""
        self.dir.mkdir(parents=True, exist_ok=True)
        script, wait_s, self.wait_reason = self._script(once), 1.0, ""
        while True:
            submitted = slurm("sbatch", "--parsable", *self._options(), str(script), env=rank_env(self.cfg))
            if not submitted.returncode:
                break
            why = " ".join(submitted.stderr.split()) or f"exit {submitted.returncode}"
            if not is_transient(why):
                raise ConfigError(f"eval.slurm: sbatch refused the slot's job: {why}")
            self.shown = f"sbatch waits: {why}"
            self.report(f"slurm slot {self.index}: sbatch could not submit yet ({why}); trying again in {wait_s:.0f} s")
            if stop.wait(wait_s):
                return False
            wait_s = min(60.0, wait_s * 2)
        self.job, self.served = submitted.stdout.strip().split(";")[0], 0
        self._cancel_strays()
        self.queue.refresh()
        try:
            return self._wait_for_agents(stop)
        except BaseException:
            self.release()  # whatever was submitted is given back
            raise

    def _cancel_strays(self) -> None:
        """An sbatch that timed out may still have reached the controller (queued while it did
        not answer): such jobs of the slot's name, not the one it got, are cancelled."""
        shown = slurm("squeue", "--me", "-h", f"--name={self.name}", "-o", "%i")
        strays = [job for job in shown.stdout.split() if job != self.job] if not shown.returncode else []
        if strays:
            slurm("scancel", *strays)
            twice = f"cancelled job(s) {', '.join(strays)}, submitted twice while the controller did not answer"
            self.report(f"slurm slot {self.index}: {twice}")

    def _wait_for_agents(self, stop: threading.Event) -> bool:
        here, backoff, said = job_dir(self.dir, self.job), Backoff(), None
        while not stop.is_set():
            job = self.queue.job(self.job)
            if job.kind is JobState.PENDING:
                self.wait_reason = job.reason
                if job.reason in NEVER_RUNS:
                    raise ConfigError(
                        f"eval.slurm.{NEVER_RUNS[job.reason]}: job {self.job} can never start ({job.reason})"
                    )
                if job.reason != said:
                    said = job.reason
                    waits = f"job {self.job} is pending; its evaluation waits for nodes: {job.reason}"
                    self.report(f"slurm slot {self.index}: {waits}")
            if job.kind is not JobState.UNKNOWN:  # the controller away: the job is as it was
                self.shown = f"job {self.job} {job.state}" + (f" ({job.reason})" if job.reason else "")
            self.nodes = [jsonl.read_json(p) for p in sorted(here.glob("node-*.json"))]
            refused = [n["error"] for n in self.nodes if n and n.get("error")]
            if refused:  # before the job's end: a node that refused ends it
                raise ConfigError(f"eval.slurm: {refused[0]}")
            if job.kind in (JobState.ENDED, JobState.GONE):
                raise SlotLost(f"{self.describe()} before its node agents started; see {self.dir}/job-{self.job}.out")
            if job.kind is JobState.RUNNING and len(self.nodes) == self.cfg.nodes:
                self.shown = f"job {self.job} running on " + ", ".join(
                    f"{n['host']}/{n['address']} (devices {n['devices']})" for n in self.nodes
                )
                return True
            backoff.wait()
        return False

    def acquire(self, stop: threading.Event) -> bool:
        return self.submit(stop) if self.cfg.slurm.keep_jobs else True

    def stale(self) -> str | None:
        """A kept job that ended while the slot was idle (a node failure, a preemption), or whose
        time limit could cut its next evaluation, is replaced before it serves. (A limit shorter
        than one evaluation's bound renews nothing: a new job would be no better.)"""
        if self.job is None:
            return None
        job, margin = self.queue.job(self.job), self.cfg.job_timeout_s + REPLY_GRACE_S
        if job.kind in (JobState.ENDED, JobState.GONE):
            return f"its job {self.job} is {job.state}: replaced"
        if self.served and None not in (job.left_s, job.limit_s) and job.left_s < margin < job.limit_s:
            return "renewed before its time limit"
        return None

    def beat(self) -> None:
        if self.job is not None:
            with contextlib.suppress(OSError):
                job_dir(self.dir, self.job).joinpath(HEARTBEAT).touch()

    def _lost(self, why: str) -> SlotLost:
        self.broken = True
        return SlotLost(f"{self.describe()}: {why}; log {self.dir}/job-{self.job}.out")

    def call(self, spec: dict, data: bytes, timeout_s: float) -> dict:
        if not self.cfg.slurm.keep_jobs:
            self.submit(threading.Event(), once=True)  # waits while the job is pending: not a failure
        here = job_dir(self.dir, self.job)
        name = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        (here / f"{name}.valid.jsonl").write_bytes(data)
        job = {"spec": spec, "data": str(here / f"{name}.valid.jsonl"), "timeout_s": timeout_s}
        jsonl.write_json(here / "inbox" / f"{name}.json", job)
        reply_path, deadline = here / f"{name}.reply.json", time.monotonic() + timeout_s + REPLY_GRACE_S
        since: dict[JobState, float] = {}  # how long the controller has been away, or the job ending
        backoff = Backoff()
        try:
            while not reply_path.exists():
                state = self.queue.job(self.job)
                for kind in set(since) - {state.kind}:
                    del since[kind]
                waited = time.monotonic() - since.setdefault(state.kind, time.monotonic())
                if state.kind is JobState.UNKNOWN:  # the controller away: the job runs on meanwhile
                    if waited > self.cfg.slurm.controller_grace_s:
                        raise self._lost(f"the controller did not answer for {waited:.0f} s")
                elif state.kind is JobState.ENDING and waited < ENDING_S:
                    pass  # its final state (TIMEOUT, PREEMPTED, NODE_FAIL) names the cause
                elif state.kind is not JobState.RUNNING and not reply_path.exists():
                    raise self._lost(f"its job {self.job} is {state.state}")
                if time.monotonic() > deadline:
                    raise self._lost(f"no reply from node 0 in {timeout_s + REPLY_GRACE_S:.0f} s")
                backoff.wait()
            reply = decode_reply(jsonl.read_json(reply_path))
            self.served += 1
            followers = [here / f"{name}.node-{i}.json" for i in range(1, len(self.nodes))]
            waited = time.monotonic() + FOLLOWERS_S
            while not all(p.exists() for p in followers) and time.monotonic() < waited:
                backoff.wait()
            for follower in followers:
                reply["log"] += (jsonl.read_json(follower) or {}).get("log", "") if follower.exists() else ""
            gone = [i for i, follower in enumerate(followers, start=1) if not follower.exists()]
            if gone and reply.get("code"):  # node 0 failed with a node that never answered: lost with it
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with self.log_path.open("a") as fh:
                    fh.write(reply["log"])
                raise self._lost(f"node(s) {', '.join(map(str, gone))} gone mid-evaluation, and node 0 failed")
            return reply
        finally:  # taken, or given up: nothing of it stays on the shared file system
            for path in [here / "inbox" / f"{name}.json", *here.glob(f"{name}.*")]:
                path.unlink(missing_ok=True)
            if not self.cfg.slurm.keep_jobs:  # its job served this one evaluation
                ran_on = self.nodes
                self.release()
                self.nodes = ran_on  # where it ran stays readable

    def release(self) -> None:
        if self.job is not None:
            if self.queue.job(self.job).kind is JobState.RUNNING:  # a stop ends the agents cleanly (warm ranks too)
                jsonl.write_json(job_dir(self.dir, self.job) / "inbox" / f"{STOP}.json", {"stop": True})
                self._wait_gone(30)
            # By name: a job whose sbatch answer was lost (a timeout) is cancelled too.
            slurm("scancel", f"--name={self.name}", f"--user={getpass.getuser()}")
            self._wait_gone(30)  # gone, not just told to go
            shutil.rmtree(job_dir(self.dir, self.job), ignore_errors=True)
        self.job, self.nodes, self.shown = None, [], "released"

    def _wait_gone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self.queue.refresh()
        alive = (JobState.PENDING, JobState.RUNNING, JobState.ENDING)
        while self.queue.job(self.job).kind in alive and time.monotonic() < deadline:
            time.sleep(0.2)

    def describe(self) -> str:
        return f"slurm slot {self.index} ({self.name}): {self.shown}"


class SlurmSlots(SlotPool):
    """``eval.slots`` Slurm slots for one run; leftovers of a killed flow of the run are cancelled.
    One squeue serves all of them, and a thread touches each job's heartbeat."""

    Config = SlurmConfig

    def __init__(self, cfg, work_dir: str | Path, *, run_name: str, **pool):
        check_cluster(cfg)
        self.cfg = cfg
        shared = Path(cfg.slurm.shared_dir or work_dir) / "slurm-slots"
        report = pool.setdefault("report", log.info)
        self.run_name, self._report, self.shared = run_name, report, shared
        self._cancel_left(wait_s=60)  # gone, not just told to go: their nodes are free for this run
        queue, nth = SlurmQueue(), next(POOLS)
        slots = [
            SlurmSlot(i, cfg, shared / f"slot-{i}", run_name, report, queue, f".{nth}" if nth else "")
            for i in range(cfg.slots)
        ]
        super().__init__(slots, **pool)
        self._beating = threading.Thread(target=self._beat, name="slurm-heartbeat", daemon=True)

    def _cancel_left(self, wait_s: float) -> None:
        left = left_by_dead_flows(self.run_name)
        if left:
            cancelled = {job for job, _ in left}
            slurm("scancel", *cancelled)
            deadline = time.monotonic() + wait_s
            while cancelled & {job for job, _ in run_jobs(self.run_name)} and time.monotonic() < deadline:
                time.sleep(0.2)
            for job in cancelled:  # and what they left on the shared file system
                for directory in self.shared.glob(f"slot-*/job-{job}"):
                    shutil.rmtree(directory, ignore_errors=True)
            self._report(f"cancelled {len(left)} slot job(s) a killed flow of {self.run_name} left: {left}")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for slot in self.slots:
                slot.beat()
            # A killed flow's process that outlived the check at the start (its reaper ends it
            # later): its jobs are cancelled once it is gone, not at their heartbeat's timeout.
            self._cancel_left(wait_s=0)

    def start(self) -> None:
        super().start()
        self._beating.start()
