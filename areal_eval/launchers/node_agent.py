"""One node of a cluster slot: that node's torchrun agent for each evaluation.

The flow sends the job (its spec and validation data) and gets back the result, its per-item
files and the new lines of the node's log, so the flow's machine and the node need share no
file system; only the checkpoint must be reachable (``s3://``, or a path every node sees).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
from pathlib import Path

from areal_eval import jsonl
from areal_eval.config.parsing import FieldError
from areal_eval.evaluation.interpreter import missing_modules
from areal_eval.evaluation.items import items_dir
from areal_eval.evaluation.job_spec import COLLECTIVE_TIMEOUT_S
from areal_eval.evaluation.worker_pool import WarmEvalWorkers
from areal_eval.launchers.local import NodeLayout, TorchrunJob, WorkerError

WORKER = "areal_eval.evaluation.worker"


def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class NodeCheckFailed(RuntimeError):
    """This node cannot run the ranks as configured (no ``eval.python``, no ``areal_eval`` in it)."""


def check_node(python: str | None, modules: tuple[str, ...] = ("areal_eval",), node: str | None = None) -> None:
    """Before a slot serves: the ranks' interpreter exists on this node and finds ``modules``
    (the package, and what the evaluators import). Raises :class:`NodeCheckFailed` in one line
    naming the node."""
    interpreter = python or sys.executable
    where = f"node {node or socket.gethostname()}"
    try:
        missing = missing_modules(interpreter, tuple(modules))
    except FieldError as exc:
        raise NodeCheckFailed(f"{where}: eval.python {exc.message}") from None
    if missing:
        raise NodeCheckFailed(f"{where}: eval.python {interpreter!r} cannot import {', '.join(missing)}")


class NodeAgent:
    """Runs one node's share of a slot's evaluations in ``work_dir`` (node-local).

    Node 0 runs the job and writes the result; nodes 1..N-1 join it (``worker --follow``). A
    one-node slot keeps its ranks warm between evaluations (``warm``), as the local launcher does.
    """

    def __init__(
        self,
        node_rank: int,
        work_dir: str | Path,
        *,
        nproc: int,
        address: str = "127.0.0.1",
        python: str | None = None,
        nice: int = 0,
        warm: bool = True,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ):
        self.node_rank, self.nproc, self.address = node_rank, nproc, address
        self.python, self.nice = python, nice
        self.dir = Path(work_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.workers = (
            WarmEvalWorkers(nproc, self.dir / "warm", nice, collective_timeout_s, python=python) if warm else None
        )
        self._read_up_to: dict[Path, int] = {}
        self._job: TorchrunJob | None = None

    def where(self) -> dict:
        """What this node's ranks run on, for the log and for tests."""
        return {
            "host": socket.gethostname(),
            "address": self.address,
            "pid": os.getpid(),
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def rendezvous(self) -> dict:
        """Node 0's address and a free port on it, for a multi-node job's static rendezvous."""
        return {"master_addr": self.address, "master_port": free_port()}

    def take_part(
        self, spec: dict, data: bytes | None, *, nnodes: int, rendezvous: dict | None, timeout_s: float
    ) -> dict:
        """This node's part in one evaluation, the same on every cluster: node 0 runs ``spec`` on
        ``data`` and its reply holds the result; the others (``data`` None) join it at node 0's
        ``rendezvous`` (from :meth:`rendezvous`) and reply with their log lines."""
        if self.node_rank == 0:
            return self.evaluate(spec, data, nnodes=nnodes, rendezvous=rendezvous, timeout_s=timeout_s)
        return self.follow(nnodes, rendezvous, timeout_s=timeout_s)

    def evaluate(
        self, spec: dict, data: bytes, *, nnodes: int = 1, rendezvous: dict | None = None, timeout_s: float
    ) -> dict:
        """Run the job ``spec`` on ``data`` as node 0; returns its exit code, result, per-item
        files (bytes, by evaluator) and the log lines it wrote (``error``: it timed out)."""
        job = self.dir / "job"
        job.mkdir(exist_ok=True)
        out = job / "result.json"
        out.unlink(missing_ok=True)
        shutil.rmtree(items_dir(out), ignore_errors=True)
        (job / "valid.jsonl").write_bytes(data)
        local = {
            **spec,
            "data": str(job / "valid.jsonl"),
            "out": str(out),
            "cache_dir": str(self.dir / "checkpoint-cache"),
        }
        reply: dict = {}
        log = self.dir / "job.log"
        try:
            if nnodes == 1 and self.workers is not None:
                code, log = self.workers.run(local, timeout_s)
            else:
                jsonl.write_json(job / "spec.json", local)
                layout = NodeLayout(nnodes, 0, **(rendezvous or {}))
                code = self._torchrun(["--spec", str(job / "spec.json")], layout, log).wait(timeout_s)
        except WorkerError as exc:
            code, reply["error"] = -1, str(exc)
        result = jsonl.read_json(out) if out.exists() else {}
        items = {name: Path(path).read_bytes() for name, path in result.get("items", {}).items()}
        return {**reply, "code": code, "result": result, "items": items, "log": self._new_lines(log)}

    def follow(self, nnodes: int, rendezvous: dict, *, timeout_s: float) -> dict:
        """Join node 0's job as node ``node_rank``; returns its exit code and log lines."""
        log = self.dir / "follow.log"
        layout = NodeLayout(nnodes, self.node_rank, **rendezvous)
        try:
            code, error = (
                self._torchrun(["--follow", "--cache-dir", str(self.dir / "checkpoint-cache")], layout, log).wait(
                    timeout_s
                ),
                None,
            )
        except WorkerError as exc:
            code, error = -1, str(exc)
        return {"code": code, "error": error, "log": self._new_lines(log)}

    def _torchrun(self, args: list[str], layout: NodeLayout, log: Path) -> TorchrunJob:
        self._job = TorchrunJob(WORKER, args, self.nproc, log, nice=self.nice, nodes=layout, python=self.python)
        return self._job

    def interrupt(self) -> str:
        """Another node of the job was lost: end this node's multi-node job now rather than at
        its collective timeout; returns the log lines it wrote so far (they stay on record)."""
        logs = {log: self._read_up_to.get(log, 0) for log in (self.dir / "job.log", self.dir / "follow.log")}
        job = self._job
        if job is not None and job.poll() is None:
            job.kill()
            job.output.join(timeout=5)  # its last lines reach the log
        said = []
        for log, start in logs.items():  # read from where it stood: the evaluation's own call may read on
            with contextlib.suppress(FileNotFoundError), log.open("rb") as fh:
                fh.seek(start)
                said.append(fh.read().decode(errors="replace"))
        return "".join(said)

    def _new_lines(self, log: Path) -> str:
        """What ``log`` gained since the last call (a warm job's log grows across evaluations)."""
        try:
            with log.open("rb") as fh:
                fh.seek(self._read_up_to.get(log, 0))
                text = fh.read()
        except FileNotFoundError:
            return ""
        self._read_up_to[log] = self._read_up_to.get(log, 0) + len(text)
        return text.decode(errors="replace")

    def close(self) -> None:
        """Stop the warm ranks and remove the node-local files (jobs, logs, downloaded checkpoints)."""
        try:
            if self.workers is not None:
                self.workers.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
