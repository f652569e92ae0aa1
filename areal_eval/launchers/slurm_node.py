"""The node agent of a Slurm slot: ``srun`` starts one per node of the slot's job.

    srun python -m areal_eval.launchers.slurm_node SLOT_DIR --nproc N [--once] ...

Each job the flow posts in ``SLOT_DIR/job-<id>/inbox`` (a directory the flow and every node
see) is run by every node: node 0 runs it and writes the reply, nodes 1..N-1 join it. The
flow touches ``heartbeat`` there while it lives; agents that see no heartbeat for
``--orphan-after`` seconds end the job (a flow killed on another host). SIGTERM (``scancel``,
preemption, the time limit) ends an agent cleanly, its node-local files removed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from areal_eval import jsonl
from areal_eval.launchers.node_agent import NodeAgent, NodeCheckFailed, check_node

STOP = "stop"
HEARTBEAT = "heartbeat"
FIRST_POLL_S, IDLE_POLL_S = 0.1, 1.0
"""Agents and the flow look for a job or its reply on the shared file system every 0.1 s while
busy, backing off to once a second while idle (metadata load a shared file system can bear)."""


class Backoff:
    """Wake-ups that double from ``FIRST_POLL_S`` to ``IDLE_POLL_S`` while nothing happens."""

    def __init__(self, first_s: float = FIRST_POLL_S, most_s: float = IDLE_POLL_S):
        self.first_s, self.most_s, self.next_s = first_s, most_s, first_s

    def wait(self) -> None:
        time.sleep(self.next_s)
        self.next_s = min(self.most_s, self.next_s * 2)

    def reset(self) -> None:
        self.next_s = self.first_s


class Heartbeat:
    """When the flow last touched ``path``, on this node's own clock (nodes' clocks may differ)."""

    def __init__(self, path: Path):
        self.path = path
        self.seen, self.changed = self._mtime(), time.monotonic()

    def _mtime(self) -> float | None:
        try:
            return self.path.stat().st_mtime
        except FileNotFoundError:
            return None

    def silent_s(self) -> float:
        mtime = self._mtime()
        if mtime != self.seen:
            self.seen, self.changed = mtime, time.monotonic()
        return time.monotonic() - self.changed


def job_dir(slot_dir: str | Path, job_id: str) -> Path:
    return Path(slot_dir) / f"job-{job_id}"


def node_dir(tmp: Path, slot_dir: str | Path, job_id: str, rank: int) -> Path:
    """This node's working directory for the job (its warm ranks' inbox, the checkpoint cache).
    A job id names a job of one controller only: two clusters whose jobs share a node's disk (two
    controllers on one machine, a controller whose state was reset) hand out the same ids, so
    the slot's own directory is in the name too."""
    slot = hashlib.sha256(str(Path(slot_dir).resolve()).encode()).hexdigest()[:12]
    return tmp / "areal-eval-slurm" / f"{job_id}-{slot}" / f"node-{rank}"


def node_address(node: str) -> str:
    """The address Slurm reaches ``node`` at (its ``NodeAddr``): node 0's, for the rendezvous."""
    shown = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"NodeAddr=(\S+)", shown)
    return found[1] if found else node


def encode_reply(reply: dict) -> dict:
    """A node's reply as JSON: per-item files in base64."""
    return {**reply, "items": {name: base64.b64encode(b).decode() for name, b in reply.get("items", {}).items()}}


def decode_reply(reply: dict) -> dict:
    return {**reply, "items": {name: base64.b64decode(s) for name, s in reply.get("items", {}).items()}}


def wait_for(path: Path, heartbeat: Heartbeat, orphan_after_s: float) -> dict | None:
    """``path``'s content once it exists; None if the flow went silent first."""
    backoff = Backoff()
    while not path.exists():
        if heartbeat.silent_s() > orphan_after_s:
            return None
        backoff.wait()
    return jsonl.read_json(path)


def serve(
    slot_dir: Path, agent: NodeAgent, *, nnodes: int, job_id: str, once: bool, orphan_after_s: float = float("inf")
) -> None:
    here = job_dir(slot_dir, job_id)
    inbox = here / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    jsonl.write_json(here / f"node-{agent.node_rank}.json", agent.where())
    heartbeat, backoff = Heartbeat(here / HEARTBEAT), Backoff()
    done: set[str] = set()
    while True:
        jobs = sorted(p for p in inbox.glob("*.json") if p.name not in done)
        if not jobs:
            if heartbeat.silent_s() > orphan_after_s:
                print(f"no heartbeat from the flow for {orphan_after_s:.0f} s: it is gone; ending", flush=True)
                return
            backoff.wait()
            continue
        backoff.reset()
        path = jobs[0]
        done.add(path.name)
        job = jsonl.read_json(path)
        if job is None or job.get("stop"):
            return
        stem = here / path.stem
        if agent.node_rank == 0:  # node 0 posts the rendezvous for the others
            rendezvous = agent.rendezvous() if nnodes > 1 else None
            jsonl.write_json(stem.with_suffix(".rendezvous.json"), {"rendezvous": rendezvous})
            data = Path(job["data"]).read_bytes()
        else:
            posted = wait_for(stem.with_suffix(".rendezvous.json"), heartbeat, orphan_after_s)
            if posted is None:
                return
            rendezvous, data = posted["rendezvous"], None
        reply = agent.take_part(job["spec"], data, nnodes=nnodes, rendezvous=rendezvous, timeout_s=job["timeout_s"])
        answer = ".reply.json" if agent.node_rank == 0 else f".node-{agent.node_rank}.json"
        jsonl.write_json(stem.with_suffix(answer), encode_reply(reply))
        if once:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("slot_dir")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--python", help="the ranks' interpreter (eval.python)")
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("--collective-timeout", type=float, default=300.0)
    parser.add_argument("--cold", action="store_true", help="a fresh torchrun job per evaluation")
    parser.add_argument("--once", action="store_true", help="serve one job, then end (a job per evaluation)")
    parser.add_argument("--needs", default="areal_eval", help="modules the ranks import, comma-separated")
    parser.add_argument("--orphan-after", type=float, default=float("inf"), help="end without a heartbeat this long")
    args = parser.parse_args(argv)
    env = os.environ
    job_id, rank, nnodes = env["SLURM_JOB_ID"], int(env["SLURM_NODEID"]), int(env["SLURM_NNODES"])
    local = node_dir(Path(env.get("TMPDIR") or tempfile.gettempdir()), args.slot_dir, job_id, rank)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        check_node(args.python, tuple(args.needs.split(",")), env.get("SLURMD_NODENAME"))
    except NodeCheckFailed as exc:  # said to the flow, which refuses the slot in this one line
        here = job_dir(args.slot_dir, job_id)
        here.mkdir(parents=True, exist_ok=True)
        jsonl.write_json(here / f"node-{rank}.json", {"host": env.get("SLURMD_NODENAME", ""), "error": str(exc)})
        return 1
    agent = NodeAgent(
        rank,
        local,
        nproc=args.nproc,
        address=node_address(env.get("SLURMD_NODENAME", "")),
        python=args.python,
        nice=args.nice,
        warm=not args.cold,
        collective_timeout_s=args.collective_timeout,
    )
    try:
        serve(
            Path(args.slot_dir),
            agent,
            nnodes=nnodes,
            job_id=job_id,
            once=args.once,
            orphan_after_s=args.orphan_after,
        )
    except Terminated:
        # scancel, preemption, the time limit: Slurm's KillWait may be seconds, so the node-local
        # files go first, before the ranks are stopped.
        shutil.rmtree(local, ignore_errors=True)
        return 143
    finally:
        agent.close()
    return 0


class Terminated(SystemExit):
    """SIGTERM: the job is ending."""


def _terminated(*_) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # srun signals again: the clean-up is not cut short
    raise Terminated(143)


if __name__ == "__main__":
    raise SystemExit(main())
