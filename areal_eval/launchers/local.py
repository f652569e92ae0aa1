"""Starting and stopping torchrun jobs (training and evaluation workers) as subprocesses.

Each job runs in its own session (process group) so that a timeout or cancel can kill torchrun
and every rank it started: nothing is left behind, whatever state the ranks are in.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from areal_eval.launchers import fork_server
from areal_eval.launchers.devices import Placement
from areal_eval.launchers.process_control import STACKS_SIGNAL, die_with_parent, libc_prctl, lower_priority

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}
"""Models and tokenizers load from local paths only (nothing is fetched from a hub at run time),
nothing reports usage home, and progress bars would not flood the job logs."""


def stay_offline(env: dict | None = None) -> dict:
    """Set :data:`OFFLINE_ENV` in ``env`` (default: this process's) where not already set."""
    env = os.environ if env is None else env
    for key, value in OFFLINE_ENV.items():
        env.setdefault(key, value)
    return env


class WorkerError(RuntimeError):
    """A torchrun job failed or timed out; the message carries its reason and log tail."""


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """Where this torchrun agent sits in a multi-node job (static rendezvous: node 0 hosts the
    store, so global rank 0, which writes results, is always on node 0)."""

    nnodes: int = 1
    """Nodes in the job."""
    node_rank: int = 0
    """This node's index (a Kubernetes Indexed Job's ``JOB_COMPLETION_INDEX``)."""
    master_addr: str = "127.0.0.1"
    """Node 0's address, reachable from every node."""
    master_port: int = 29500
    """Node 0's rendezvous port."""
    nproc_per_node: int | None = None
    """Ranks per node the pool's hardware calls for (its GPUs); None: the evaluation config's."""

    @classmethod
    def from_env(cls, prefix: str = "AREAL_EVAL_") -> NodeLayout:
        """Set by the work pool's job template (``infra/k8s``); unset means one node."""
        env = os.environ
        nproc = env.get(prefix + "NPROC_PER_NODE")
        return cls(
            int(env.get(prefix + "NNODES", 1)),
            int(env.get(prefix + "NODE_RANK", 0)),
            env.get(prefix + "MASTER_ADDR", "127.0.0.1"),
            int(env.get(prefix + "MASTER_PORT", 29500)),
            int(nproc) if nproc else None,
        )

    def torchrun_args(self) -> list[str]:
        if self.nnodes == 1:
            return ["--standalone"]
        return [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
        ]


FORK_RANKS_ENV = "AREAL_EVAL_FORK_RANKS"
"""``0``: plain torchrun, each rank a fresh interpreter (the way out if forking ever misbehaves)."""


def torchrun_command(
    module: str, args: list[str], nproc: int, *, nodes: NodeLayout = NodeLayout(), python: str | None = None
) -> list[str]:
    """torchrun's command line, run by :mod:`areal_eval.launchers.forked_ranks` (ranks forked from an agent
    that imported torch and transformers once, instead of each importing them again) unless
    :data:`FORK_RANKS_ENV` is ``0``; by ``python`` (default: this interpreter)."""
    forked = os.environ.get(FORK_RANKS_ENV, "1") != "0"
    return [
        python or sys.executable,
        "-m",
        "areal_eval.launchers.forked_ranks" if forked else "torch.distributed.run",
        *nodes.torchrun_args(),
        f"--nproc-per-node={nproc}",
        # A failing rank brings the job down at once instead of being restarted.
        "--max-restarts=0",
        "--monitor-interval=0.05",  # a failed rank is seen in time to name it first (forked_ranks)
        "-m",
        module,
        *args,
    ]


TEARDOWN_NOISE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|GLHF|ChildFailedError|DistBackendError"
    r"|ProcessGroupGloo|NCCL communicator was aborted|elastic\.multiprocessing"
)
"""What the other ranks say when one rank fails and the process group comes down around it."""


def failure_summary(path: Path, lines: list[str] | None = None) -> str:
    """Which ranks failed and how, from torchrun's log (or its ``lines``): each rank's own error
    line, the first real one first (the process group's teardown noise only when nothing else
    was said), and exit code (torchrun's "Failures" report lists every failed rank, not just the
    first seen)."""
    if lines is None:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
    errors = [line.split("] ", 1)[-1] for line in lines if "evaluation failed" in line or "Error:" in line]
    found = [e for e in errors if not TEARDOWN_NOISE.search(e)] or errors
    rank = None
    for line in lines:
        field = line.strip()
        report = re.fullmatch(r"(rank|exitcode)\s*:\s*(.+)", field)  # "rank      : 0 (local_rank: 0)"
        if report and report[1] == "rank":
            rank = report[2]
        elif report and rank is not None:
            found.append(f"rank {rank} exit code {report[2]}")
            rank = None
    return "\n".join(dict.fromkeys(found))  # keep order, drop repeats


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(text[-lines:])


def _start_job(nice: int, cpus: set[int] | None = None) -> None:
    """In the child, before exec: die with the flow, pin its CPU cores and lower its priority
    if asked."""
    die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)
    if nice:
        lower_priority(nice)


# glibc serves every allocation over its dynamic mmap threshold with a fresh mmap and gives it
# back at free, so each forward pass page-faults its activations in again. Fixed thresholds
# keep them in the heap: a fresh evaluation worker scores 35% more pairs/s on CPU, with a lower
# peak RSS (Trainer gains 19-29%: bench/eval_throughput.py). Other allocators ignore these.
HEAP_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}


class OutputTee(threading.Thread):
    """Copies a job's output to its log file and keeps the last ``keep`` lines in memory, so the
    job's last error is known even when its log cannot be written (a full disk)."""

    def __init__(self, pipe, log_path: Path, keep: int = 500):
        super().__init__(name=f"output-of-{log_path.name}", daemon=True)
        self.pipe, self.log_path = pipe, log_path
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.write_error: OSError | None = None

    def run(self) -> None:
        log = None
        try:
            log = self.log_path.open("ab", buffering=0)
        except OSError as exc:
            self.write_error = exc
        for raw in iter(self.pipe.readline, b""):
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))
            if log is not None and self.write_error is None:
                try:
                    log.write(raw)
                except OSError as exc:  # kept in memory from here on
                    self.write_error = exc
        self.pipe.close()
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()


class TorchrunJob:
    """A running torchrun job; its output goes to ``log_path`` (and its last lines stay in
    memory: :meth:`tail`)."""

    def __init__(
        self,
        module: str,
        args: list[str],
        nproc: int,
        log_path: str | Path,
        env: dict | None = None,
        nice: int = 0,
        nodes: NodeLayout = NodeLayout(),
        placement: Placement | None = None,
        python: str | None = None,
    ):
        """``placement``: the devices its ranks run on (``CUDA_VISIBLE_DEVICES``, CPU affinity);
        ``python``: the interpreter of an environment of their own (default: this one)."""
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        full_env = {**os.environ, **(placement.env() if placement else {}), **(env or {})}
        cpus = placement.cpus if placement else None
        full_env.setdefault("OMP_NUM_THREADS", "1")
        for key, value in HEAP_SETTINGS.items():
            full_env.setdefault(key, value)
        stay_offline(full_env)
        libc_prctl()  # resolved here, before the fork
        command = self.command = torchrun_command(module, args, nproc, nodes=nodes, python=python)
        self.dumps_stacks = command[2] == "areal_eval.launchers.forked_ranks"
        """Its processes print their Python stacks to the log on :data:`STACKS_SIGNAL`."""
        # Forked by this process's fork server where it can (its imports done once for all jobs).
        self.proc = fork_server.spawn(command, full_env, nice=nice, cpus=cpus) if self.dumps_stacks else None
        if self.proc is None:
            self.proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
                preexec_fn=lambda: _start_job(nice, cpus),
            )
        self.output = OutputTee(self.proc.stdout, self.log_path)
        self.output.start()

    def tail(self, lines: int = 15) -> str:
        """The job's last output lines; where its log could not be written, from memory, saying so."""
        self.output.join(timeout=5 if self.proc.poll() is not None else 0)
        if self.output.write_error is None:
            return log_tail(self.log_path, lines)
        kept = "\n".join(list(self.output.lines)[-lines:])
        return f"(its log could not be written: {self.output.write_error.strerror}; its last output:)\n{kept}"

    def summary(self) -> str:
        """Which ranks failed and how (:func:`failure_summary`), else the last lines."""
        self.output.join(timeout=5 if self.proc.poll() is not None else 0)
        lines = list(self.output.lines) if self.output.write_error is not None else None
        return failure_summary(self.log_path, lines) or self.tail()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left after ``grace_s``."""
        if self.proc.pid is None:  # a fork server that died before forking it: nothing ran
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not group_alive(self.proc.pid):
                break
        self._reap_group()

    def _reap_group(self) -> None:
        # Ranks may outlive torchrun briefly; make sure the group is gone.
        deadline = time.monotonic() + 5
        while self.proc.pid is not None and group_alive(self.proc.pid) and time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.05)

    def dump_stacks(self) -> None:
        """Have every process of the job print its threads' Python stacks to the log, to show
        where a job that should have ended is stuck (forked-rank jobs only: in a plain torchrun
        job the signal would kill the ranks)."""
        if not self.dumps_stacks or self.proc.poll() is not None or self.proc.pid is None:
            return
        try:
            import psutil  # the flow's side only: the workers need nothing beyond torch and transformers

            agent = psutil.Process(self.proc.pid)
            processes = [agent, *agent.children(recursive=True)]
        except psutil.Error:
            return
        for process in processes:  # one at a time: dumps written at once interleave in the shared log
            try:
                process.send_signal(STACKS_SIGNAL)
            except psutil.Error:
                continue
            time.sleep(0.2)  # faulthandler writes from the signal handler itself, in a few milliseconds

    def wait(self, timeout_s: float | None) -> int:
        """Wait for exit; on timeout dump the stacks to the log, kill the group and raise WorkerError."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.time_out(timeout_s)
        self._reap_group()
        return code

    def time_out(self, timeout_s: float) -> None:
        """The job ran past ``timeout_s``: dump its stacks to the log, kill it, raise WorkerError."""
        self.dump_stacks()
        self.kill()
        raise WorkerError(
            f"torchrun job timed out after {timeout_s:.0f}s and was killed; log {self.log_path}:\n{self.tail()}"
        ) from None  # the subprocess.TimeoutExpired it may be raised from says nothing more

    def raise_for_status(self, what: str) -> None:
        code = self.proc.returncode
        if code:
            raise WorkerError(f"{what} failed (torchrun exit {code}); log {self.log_path}:\n{self.summary()}")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still counts as a group; look for a live member.
    import psutil

    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False
