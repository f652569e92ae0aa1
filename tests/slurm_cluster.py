"""A real Slurm cluster on this machine for the tests: munged, one slurmctld and two slurmd
(``n1``, ``n2``), all on 127.0.0.1 with ports of their own, started here and stopped by PID.

Each node offers 2 CPUs and 2 fake GPUs (gres backed by ``/dev/tty0`` and ``/dev/tty1``, files
that exist everywhere), so Slurm sets ``CUDA_VISIBLE_DEVICES`` as it would on GPU nodes
(``TaskPlugin=task/affinity``: with ``task/none`` it does not).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers import free_port

NODES = ("n1", "n2")
GPUS_PER_NODE = 2


def available() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    missing = [c for c in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(c) is None]
    if missing:
        return f"{', '.join(missing)} not installed: apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "slurmd must run as root here"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (apt-get install munge makes one)"
    return None


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def start(self, timeout_s: float = 60) -> SlurmCluster:
        r = self.root
        for d in ("state", "spool-n1", "spool-n2", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        socket_path = r / "munge" / "munge.sock"
        self._daemon(
            [
                "munged",
                "-F",
                "--force",
                f"--socket={socket_path}",
                f"--pid-file={r}/munge/munged.pid",
                f"--log-file={r}/munge/munged.log",
                f"--seed-file={r}/munge/munged.seed",
            ],
            r / "munged.out",
        )
        ports = [free_port() for _ in range(3)]
        nodes = "\n".join(
            f"NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs=2 RealMemory=4000 "
            f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
            for name, port in zip(NODES, ports[1:], strict=True)
        )
        (r / "gres.conf").write_text("Name=gpu File=/dev/tty[0-1]\n")
        (r / "slurm.conf").write_text(
            f"""ClusterName=areal-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports[0]}
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
GresTypes=gpu
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
{nodes}
PartitionName=eval Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes={",".join(NODES)} MaxTime=1 State=UP
"""
        )
        deadline = time.monotonic() + 10
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._daemon(self._controller_command(), r / "slurmctld.out")
        for name in NODES:
            self._daemon(self._node_command(name), r / f"slurmd-{name}.out")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-p", "eval", "-o", "%N %t", check=False).stdout.split()
            if states.count("idle") == len(NODES):
                return self
            time.sleep(0.3)
        raise RuntimeError(f"slurm nodes not idle after {timeout_s} s: {states}\n" + self.logs())

    def _controller_command(self) -> list[str]:
        return ["slurmctld", "-D", "-i", "-f", str(self.root / "slurm.conf")]

    def _daemon(self, command: list[str], out: Path) -> None:
        self.procs.append(
            subprocess.Popen(
                command, env=self.env, stdout=out.open("a"), stderr=subprocess.STDOUT, start_new_session=True
            )
        )

    @property
    def controller(self) -> subprocess.Popen:
        return next(p for p in self.procs if p.args == self._controller_command())

    def stop_controller(self) -> None:
        """SIGTERM slurmctld and wait for it to exit (it saves its state; the jobs run on)."""
        proc = self.controller
        proc.terminate()
        proc.wait(30)
        self.procs.remove(proc)

    def start_controller(self) -> None:
        """Start slurmctld again on its saved state."""
        self._daemon(self._controller_command(), self.root / "slurmctld.out")

    def _node_command(self, name: str) -> list[str]:
        return ["slurmd", "-D", "-N", name, "-f", str(self.root / "slurm.conf")]

    def kill_node(self, name: str) -> list[int]:
        """The node ``name`` lost, as a machine that dies: its slurmd, the job steps it runs
        (``slurmstepd``) and their tasks, all with SIGKILL. Returns the killed PIDs."""
        import psutil

        tasks, here = [], {"SLURMD_NODENAME": name, "SLURM_CONF": self.env["SLURM_CONF"]}
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                env = proc.environ()  # this cluster's node only: other lanes run clusters with nodes of that name
                if all(env.get(k) == v for k, v in here.items()) and not proc.name().startswith("slurmstepd"):
                    tasks.append(proc)
        steps = {p for t in tasks for p in t.parents() if p.name().startswith("slurmstepd")}
        daemon = next(p for p in self.procs if p.args == self._node_command(name))
        doomed = [psutil.Process(daemon.pid), *steps, *tasks]
        for proc in doomed:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        daemon.wait(10)
        self.procs.remove(daemon)
        return [p.pid for p in doomed]

    def start_node(self, name: str) -> None:
        """Start ``name``'s slurmd again (``ReturnToService=2``: the controller takes it back)."""
        if not any(p.args == self._node_command(name) and p.poll() is None for p in self.procs):
            self._daemon(self._node_command(name), self.root / f"slurmd-{name}.out")

    def restore_nodes(self, timeout_s: float = 120) -> None:
        """Every node's slurmd running and the node back in service (after a test killed one)."""
        for name in NODES:
            self.start_node(name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-p", "eval", "-o", "%t", check=False).stdout.split()
            if len(states) == len(NODES) and not any(s.startswith(("down", "drain", "unk")) for s in states):
                return
            time.sleep(0.5)
        raise RuntimeError(f"slurm nodes not back after {timeout_s} s: {states}")

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.root.glob("*.log")))

    def jobs(self) -> list[str]:
        """Every job the controller still holds, as ``id name state``."""
        return self.run("squeue", "-h", "-o", "%i %j %T").stdout.splitlines()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
