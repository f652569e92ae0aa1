"""The flow's side of cluster slots: leasing them, and landing what a node sends back.

A slot becomes free once the cluster has given it its nodes. Until then an evaluation that
needs it waits (its checkpoint stays queued: waiting is not failing), and says so in the log
every ``report_s``. A slot whose node was lost is rebuilt, and is free again once the cluster
has nodes for it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

from areal_eval import jsonl
from areal_eval.config.parsing import ConfigError
from areal_eval.evaluation.items import items_dir
from areal_eval.evaluation.job_spec import EvalJobSpec, to_json
from areal_eval.launchers.local import WorkerError

log = logging.getLogger(__name__)

PASS_ENV = ["AWS_*", "HF_*", "HUGGING_FACE_*", "NCCL_*", "GLOO_*", "WANDB_*", "MLFLOW_*"]
"""The flow's variables that reach every rank on a cluster by default (``eval.pass_env``):
credentials for ``s3://`` checkpoints, the model hub's cache, the collectives' network settings."""

WAIT_NOTED_S = 5.0
"""A lease that waited this long for its slot says so on the result."""
START_TRIES = 3
"""Once every slot has failed to start this many times in a row, a lease fails (transient, with
the last reason) rather than wait on: the checkpoint is retried, then decided."""


def rank_env(cfg) -> dict[str, str]:
    """What a cluster's ranks get of the flow's environment: its variables that match
    ``cfg.pass_env``, then ``cfg.env`` (``cfg``: the ``eval`` section)."""
    passed = {k: v for k, v in os.environ.items() if any(fnmatch.fnmatchcase(k, p) for p in cfg.pass_env)}
    return {**passed, **{k: str(v) for k, v in cfg.env.items()}}


class SlotLost(WorkerError):
    """A node of the slot was lost (its agent, its machine, its job): transient, retried, and
    the slot is rebuilt."""


class ClusterSlot:
    """One slot: the nodes an evaluation runs on, as the cluster gave them."""

    def __init__(self, index: int, log_path: Path):
        self.index, self.log_path = index, log_path
        self.broken = False
        """A node was lost: the slot is rebuilt before it serves again."""
        self.waited_s = 0.0
        """How long its current lease waited for it (the cluster had no nodes for a free slot)."""
        self.wait_reason = ""
        """Why the cluster last kept it waiting (Slurm's pending reason)."""
        self.shown = "not started"
        """What it is doing, for the log only (``describe``): decisions read the engine's state."""

    def wait_note(self) -> list[str]:
        """The lease's wait, as a note on the evaluation's result (the log and the ledger keep
        it), where it was long enough to matter."""
        if self.waited_s < WAIT_NOTED_S:
            return []
        why = f": {self.wait_reason}" if self.wait_reason else ""
        return [f"waited {self.waited_s:.0f} s for a free evaluation slot{why}"]

    def stale(self) -> str | None:
        """Why it must be replaced before it serves (its nodes gone while it was idle, a time limit
        that could cut the next evaluation), or None."""
        return None

    def acquire(self, stop: threading.Event) -> bool:
        """Get the slot's nodes from the cluster (blocks while it has none free); False if ``stop``."""
        raise NotImplementedError

    def call(self, spec: dict, data: bytes, timeout_s: float) -> dict:
        """Run ``spec`` on the slot's nodes: node 0's reply (see ``NodeAgent.evaluate``)."""
        raise NotImplementedError

    def release(self) -> None:
        """Give the nodes back to the cluster."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def run(self, spec: EvalJobSpec | dict, timeout_s: float) -> tuple[int, Path]:
        """Evaluate ``spec`` as a local warm worker group would: the result and per-item files
        land where ``spec`` says; returns the exit code and the local copy of node 0's log."""
        raw = spec if isinstance(spec, dict) else to_json(spec)
        reply = self.call(raw, Path(raw["data"]).read_bytes(), timeout_s)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as fh:
            fh.write(reply.get("log", ""))
        out, result = Path(raw["out"]), dict(reply.get("result") or {})
        if reply.get("items"):
            directory = items_dir(out)
            directory.mkdir(parents=True, exist_ok=True)
            landed = {}
            for name, content in reply["items"].items():
                path = directory / Path(result["items"][name]).name
                path.write_bytes(content)
                landed[name] = str(path)
            result["items"] = landed
        if result:
            jsonl.write_json(out, result)
        if reply.get("error"):
            raise WorkerError(f"{self.describe()}: {reply['error']}")
        return reply["code"], self.log_path


class SlotPool:
    """Cluster slots leased one evaluation at a time, each acquired in a thread of its own.

    A cluster launcher is one module: its settings (``eval.<launcher>``, named by ``EvalConfig``),
    what the flow's environment needs for it, and its pool of slots, a subclass of this."""

    Config: ClassVar[type]
    """The launcher's section of ``eval``."""
    EXTRA: ClassVar[tuple[str, str] | None] = None
    """The package the launcher needs in the flow's environment, and how to get it."""

    def __init__(self, slots: list[ClusterSlot], *, report: Callable[[str], None] = log.info, report_s: float = 30.0):
        self.slots, self.report, self.report_s = slots, report, report_s
        self._free: queue.Queue[ClusterSlot] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.refused: ConfigError | None = None
        """Why the cluster refused a slot as configured (a permanent failure for every lease)."""
        self._failed_starts: dict[int, str] = {}
        self._failures: dict[int, int] = {}

    def start(self) -> None:
        for slot in self.slots:
            self._acquire_in_background(slot)

    def _acquire_in_background(self, slot: ClusterSlot) -> None:
        def acquire():
            try:
                if slot.acquire(self._stop):
                    self._failures.pop(slot.index, None)
                    self._free.put(slot)
            except ConfigError as exc:  # the cluster refuses the slot as asked: every lease fails, saying why
                self.refused = exc
            except Exception as exc:  # said, then tried again: a cluster that comes back serves again
                self._failures[slot.index] = self._failures.get(slot.index, 0) + 1
                self._failed_starts[slot.index] = str(exc)
                self.report(f"{slot.describe()}: not acquired ({exc}); trying again in {self.report_s:.0f} s")
                if not self._stop.wait(self.report_s):
                    self._acquire_in_background(slot)

        thread = threading.Thread(target=acquire, name=f"acquire-slot-{slot.index}", daemon=True)
        self._threads.append(thread)
        thread.start()

    @contextlib.contextmanager
    def lease(self) -> Iterator[ClusterSlot]:
        started = reported = time.monotonic()
        while True:
            if self.refused is not None:
                raise self.refused
            if all(self._failures.get(s.index, 0) >= START_TRIES for s in self.slots):
                why = self._failed_starts[self.slots[-1].index]
                raise SlotLost(f"every evaluation slot failed to start {START_TRIES} times in a row; the last: {why}")
            try:
                slot = self._free.get(timeout=min(self.report_s, 1.0))  # a refusal is seen within a second
                if (why := slot.stale()) is None:
                    break
                self.report(f"{slot.describe()}: {why}")
                self._rebuild(slot)
            except queue.Empty:
                if time.monotonic() - reported < self.report_s:
                    continue
                reported = time.monotonic()
                waiting = ", ".join(s.describe() for s in self.slots)
                self.report(f"waiting {time.monotonic() - started:.0f} s for a free evaluation slot: {waiting}")
        slot.waited_s = time.monotonic() - started
        try:
            yield slot
        finally:
            if slot.broken:
                self._rebuild(slot)
            else:
                self._free.put(slot)

    def _rebuild(self, slot: ClusterSlot) -> None:
        slot.release()
        slot.broken = False
        self._acquire_in_background(slot)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:  # an acquisition under way gives back what it got
            thread.join(timeout=90)
        for slot in self.slots:
            with contextlib.suppress(Exception):
                slot.release()

    def __enter__(self) -> SlotPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
