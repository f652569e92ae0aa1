"""What the Slurm controller says of a run's jobs, and which of its refusals a retry can change.

A controller that does not answer (restarted, failed over, overloaded) is not a lost job: squeue
then exits non-zero and prints nothing, and the slots wait it out. Only an answer that no longer
lists a job says it is gone. One ``squeue`` serves every slot of the run.

A slot's job is named ``areal-eval:<run>:<host>.<pid>:slot-<i>`` (its flow's: :data:`OWNER`), so
the run's jobs that a killed flow left behind can be found and cancelled.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import socket
import subprocess
import threading
import time

import psutil

from areal_eval.launchers.reaper import OWNER_ENV

QUEUE_EVERY_S = 1.0
"""How often the run's slots ask the controller for their jobs' states (one squeue for all)."""

TRANSIENT = re.compile(
    r"unable to contact slurm controller|socket timed out|timed out|connection refused|"
    r"temporarily|try again|zero bytes were transmitted|communication connection failure|"
    r"transport endpoint|qosmax|assocmax|maxsubmit|job submit limit|accounting/qos policy|"
    r"slurmctld.*(down|not responding)",
    re.IGNORECASE,
)
"""sbatch's refusals that pass: the controller away or busy, a QOS or association limit reached."""


class JobState(enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    ENDING = "ENDING"
    """Completing: its processes are being ended; its final state (``TIMEOUT``, ...) follows."""
    ENDED = "ENDED"
    """Completed, failed, cancelled, timed out, preempted, node failure: ``Job.state`` says which."""
    GONE = "GONE"
    """The controller answered and no longer knows the job."""
    UNKNOWN = "UNKNOWN"
    """The controller did not answer."""


ENDED_STATES = {
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


@dataclasses.dataclass(frozen=True)
class Job:
    state: str
    """Slurm's own word (``RUNNING``, ``TIMEOUT``, ...), ``GONE`` or ``UNKNOWN``."""
    reason: str = ""
    """Why it pends (``Resources``, ``PartitionTimeLimit``, ...): squeue's ``%r``."""
    left_s: float | None = None
    """Seconds before its time limit (None: no limit, or not yet set)."""
    limit_s: float | None = None
    """Its time limit in seconds (None: none)."""

    @property
    def kind(self) -> JobState:
        if self.state in ("GONE", "UNKNOWN"):
            return JobState[self.state]
        if self.state in ENDED_STATES:
            return JobState.ENDED
        if self.state in ("COMPLETING", "SIGNALING", "STAGE_OUT"):
            return JobState.ENDING
        return JobState.PENDING if self.state in ("PENDING", "CONFIGURING", "REQUEUED") else JobState.RUNNING


GONE, UNKNOWN = Job("GONE"), Job("UNKNOWN")


def slurm(*command: str, timeout_s: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a Slurm command (``env``: variables added to this process's); one that hangs past
    ``timeout_s`` reads as a controller that did not answer (exit 124)."""
    # sbatch hands the job this environment: not the flow's reaper token, since a slot's job
    # lives on the cluster, not under the flow (a resume cancels what a killed flow left).
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != OWNER_ENV}
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(command, 124, "", f"{command[0]}: Socket timed out ({timeout_s:.0f} s)")


def is_transient(stderr: str) -> bool:
    return bool(TRANSIENT.search(stderr))


def seconds_left(text: str) -> float | None:
    """squeue's ``%L`` and ``%l`` (``[days-]hours:minutes:seconds``, ``minutes:seconds``) in seconds."""
    found = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if not found:
        return None  # UNLIMITED, NOT_SET, INVALID
    days, hours, minutes, seconds = (int(g or 0) for g in found.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def parse_queue(text: str) -> dict[str, Job]:
    jobs = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) == 5:
            reason = "" if parts[2] == "None" else parts[2]
            jobs[parts[0]] = Job(parts[1], reason, seconds_left(parts[3]), seconds_left(parts[4]))
    return jobs


class SlurmQueue:
    """This user's jobs as the controller last told them, asked at most every ``every_s``."""

    def __init__(self, every_s: float = QUEUE_EVERY_S):
        self.every_s = every_s
        self._lock = threading.Lock()
        self._asked = -float("inf")
        self._jobs: dict[str, Job] | None = None

    def jobs(self) -> dict[str, Job] | None:
        """None while the controller does not answer."""
        with self._lock:
            if time.monotonic() - self._asked >= self.every_s:
                shown = slurm("squeue", "--me", "-h", "--states=all", "-o", "%i|%T|%r|%L|%l")
                self._jobs = None if shown.returncode else parse_queue(shown.stdout)
                self._asked = time.monotonic()
            return self._jobs

    def job(self, job_id: str) -> Job:
        jobs = self.jobs()
        return UNKNOWN if jobs is None else jobs.get(job_id, GONE)

    def refresh(self) -> None:
        """The next question goes to the controller (a job was just submitted or cancelled)."""
        with self._lock:
            self._asked = -float("inf")


OWNER = f"{socket.gethostname()}.{os.getpid()}"
"""Whose slots a job holds: the flow's host and process (``areal-eval:<run>:<host>.<pid>:slot-<i>``)."""


def run_jobs(run_name: str) -> list[tuple[str, str]]:
    """(id, name) of this user's jobs of ``run_name``'s slots still known to the controller."""
    shown = slurm("squeue", "--me", "-h", "-o", "%i %j").stdout.split("\n")
    prefix = f"areal-eval:{run_name}:"
    return [tuple(line.split(" ", 1)) for line in shown if " " in line and line.split(" ", 1)[1].startswith(prefix)]


def alive(pid: int) -> bool:
    """A process that runs (a killed flow whose parent has not reaped it yet is a zombie: dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def left_by_dead_flows(run_name: str) -> list[tuple[str, str]]:
    """The run's jobs whose flow, on this host, is gone (``kill -9``): a live flow of the run (the
    sweep beside the service, two trigger flow runs at once) keeps its own."""
    host = socket.gethostname()
    left = []
    for job, name in run_jobs(run_name):
        owner = name.split(":")[2] if name.count(":") >= 3 else ""
        owner_host, _, pid = owner.rpartition(".")
        if owner_host == host and pid.isdigit() and not alive(int(pid)):
            left.append((job, name))
    return left
