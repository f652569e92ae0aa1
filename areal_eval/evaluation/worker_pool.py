"""Warm evaluation workers: one torchrun job that serves evaluation after evaluation.

A fresh torchrun job per evaluation pays interpreter, torch and transformers start-up every
time (about 4 s of the feedback path on this machine). ``WarmEvalWorkers`` keeps the ranks
alive: each evaluation is a job file in the pool's inbox, which every rank reads itself (idle
ranks wait on the file system, not in a collective that would time out); rank 0 writes the
result file just as a one-shot job would. A failure still ends the
torchrun job (a rank that saw an error cannot know what its peers are doing), and the next
evaluation starts a new one, so failures behave exactly as without the pool.
"""

from __future__ import annotations

import contextlib
import json
import queue
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from areal_eval import jsonl
from areal_eval.evaluation.job_spec import COLLECTIVE_TIMEOUT_S, EvalJobSpec, to_json
from areal_eval.launchers.devices import Placement
from areal_eval.launchers.local import TorchrunJob, WorkerError

STOP = "stop"
"""Name of the job file that ends the ranks; it sorts after the time-stamped jobs before it."""


class WarmEvalWorkers:
    """Evaluation ranks kept between evaluations (single node). Close it when done."""

    def __init__(
        self,
        nproc: int,
        work_dir: str | Path,
        nice: int = 0,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
        poll_s: float = 0.01,
        placement: Placement | None = None,
        python: str | None = None,
    ):
        self.nproc, self.nice, self.poll_s = nproc, nice, poll_s
        self.placement, self.python = placement, python
        """The devices its ranks run on (None: not pinned)."""
        self.collective_timeout_s = collective_timeout_s
        self.work_dir = Path(work_dir)
        self.inbox = self.work_dir / "inbox"
        self.job: TorchrunJob | None = None
        self.started_jobs = 0
        """torchrun jobs started so far: 1 while the same ranks serve every evaluation."""

    def start(self) -> None:
        """Start the ranks now, so the first evaluation does not wait for them."""
        self._ensure_running()

    def _ensure_running(self) -> TorchrunJob:
        if self.job is None or self.job.poll() is not None:
            if self.job is not None:
                self.job.kill()
            self.inbox.mkdir(parents=True, exist_ok=True)
            for stale in self.inbox.glob("*.json"):
                stale.unlink()
            self.started_jobs += 1
            args = ["--serve", str(self.inbox), "--timeout", str(self.collective_timeout_s)]
            self.job = TorchrunJob(
                "areal_eval.evaluation.worker",
                args,
                self.nproc,
                self.work_dir / f"warm-workers-{self.started_jobs}.log",
                nice=self.nice,
                placement=self.placement,
                python=self.python,
            )
        return self.job

    def run(self, spec: EvalJobSpec | dict, timeout_s: float) -> tuple[int, Path]:
        """Evaluate ``spec`` (as a one-shot job would; a dict is posted as it is); returns the
        torchrun exit code (0 while the ranks live on) and the log to read on failure."""
        job = self._ensure_running()
        raw = spec if isinstance(spec, dict) else to_json(spec)
        result_path = Path(raw["out"])
        self._post(f"{time.time_ns()}-{uuid.uuid4().hex[:8]}.json", raw)
        deadline = time.monotonic() + timeout_s
        while not result_path.exists():
            if job.poll() is not None:
                job.wait(10)
                return job.proc.returncode or 1, job.log_path
            if time.monotonic() > deadline:
                job.kill()
                raise WorkerError(
                    f"warm evaluation workers timed out after {timeout_s:.0f}s and were killed; "
                    f"log {job.log_path}:\n{job.tail()}"
                )
            time.sleep(self.poll_s)
        if "error" in json.loads(result_path.read_text()):
            job.wait(30)  # a failed evaluation ends the ranks; the next one starts fresh ones
            return job.proc.returncode or 1, job.log_path
        return 0, job.log_path

    def _post(self, name: str, spec: dict | None) -> None:
        """Put a job in the inbox whole (ranks glob for ``*.json``); ``None`` stops the ranks."""
        jsonl.write_json(self.inbox / name, {"spec": spec})

    def close(self, timeout_s: float = 30.0) -> None:
        if self.job is not None and self.job.poll() is None:
            try:
                self._post(f"{STOP}.json", None)
                self.job.wait(timeout_s)
            except WorkerError:
                pass  # wait() killed it
            except OSError:  # the stop job cannot be written (a full disk): stopped the hard way
                self.job.kill()
        self.job = None

    def __enter__(self) -> WarmEvalWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WarmWorkerGroups:
    """One warm worker group per evaluation slot (``eval.slots``): an evaluation leases a free
    group for its duration, so N evaluations run at once on N groups of ranks, each on the
    devices of its slot (``placements``). Group 0 works in ``work_dir`` itself, group i in
    ``work_dir/slot-i``."""

    def __init__(
        self,
        slots: int,
        nproc: int,
        work_dir: str | Path,
        nice: int = 0,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
        placements: Sequence[Placement | None] = (),
        python: str | None = None,
    ):
        work_dir = Path(work_dir)
        placements = list(placements) or [None] * slots
        self.groups = [
            WarmEvalWorkers(
                nproc,
                work_dir / f"slot-{i}" if i else work_dir,
                nice,
                collective_timeout_s,
                placement=placements[i],
                python=python,
            )
            for i in range(slots)
        ]
        self._free: queue.Queue[WarmEvalWorkers] = queue.Queue()
        for group in self.groups:
            self._free.put(group)

    @contextlib.contextmanager
    def lease(self) -> Iterator[WarmEvalWorkers]:
        group = self._free.get()
        try:
            yield group
        finally:
            self._free.put(group)

    @property
    def started_jobs(self) -> int:
        return sum(g.started_jobs for g in self.groups)

    def start(self) -> None:
        for group in self.groups:
            group.start()

    def close(self) -> None:
        for group in self.groups:
            group.close()

    def __enter__(self) -> WarmWorkerGroups:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
