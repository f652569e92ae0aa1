"""Where a run keeps its files, and who owns them: one directory per training run, shared by
every stage, owned by one flow at a time."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from areal_eval import jsonl


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    data = property(lambda self: self.root / "data")
    train_data = property(lambda self: self.root / "data" / "train.jsonl")
    valid_data = property(lambda self: self.root / "data" / "valid.jsonl")
    tokenizer = property(lambda self: self.root / "tokenizer")
    checkpoints = property(lambda self: self.root / "checkpoints")
    resume_states = property(lambda self: self.root / "resume")
    """Optimizer, schedule and trigger state beside each checkpoint: training resumes from them;
    never published, never evaluated."""
    manifest = property(lambda self: self.root / "manifest.jsonl")
    train_log = property(lambda self: self.root / "train_log.jsonl")
    train_config = property(lambda self: self.root / "train_config.json")
    config_file = property(lambda self: self.root / "pipeline_config.json")
    """The pipeline config the run was started with (webhook redacted): how it is judged."""
    stop_file = property(lambda self: self.root / "control" / "stop.json")
    ledger = property(lambda self: self.root / "ledger.jsonl")
    evals = property(lambda self: self.root / "evals")
    logs = property(lambda self: self.root / "logs")
    run_id_file = property(lambda self: self.root / "run_id")
    lock_file = property(lambda self: self.root / "owner.lock")
    decisions_lock = property(lambda self: self.root / "decisions.lock")
    """Held while one of the flow runs sharing a run (triggered, manual, sweep) decides or records."""
    registry_lock = property(lambda self: self.root / "registry.lock")
    """Held while a flow run compares its result with the registered best and moves the alias."""
    tracking_lock = property(lambda self: self.root / "tracking.lock")
    """Held while a flow run finds or creates the run's MLflow run: one MLflow run per run."""
    trainer_trackers = property(lambda self: self.root / "sinks" / "trainer.json")
    """Where the trainer logs (its W&B run, its TensorBoard directory), as its callback found
    them: the sinks of ``tracking.sinks`` that name none write beside them."""
    evaluation_state = property(lambda self: self.root / "evaluation_state.json")
    """What those flow runs share beyond the ledger: alert throttling, refinement and the end."""

    @property
    def run_id(self) -> str:
        return self.run_id_file.read_text().strip()

    def exists(self) -> bool:
        """A run was started here (it has an id): running it again resumes it."""
        return self.run_id_file.exists()


class RunBusy(RuntimeError):
    """Another live process owns the run directory; the message names it."""


class RunLock:
    """One owner per run directory: an exclusive ``flock`` on ``owner.lock``, which holds the
    owner's pid, host and start time for the message a second owner gets.

    The kernel drops the lock when its process dies, however it dies (``kill -9`` included), so a
    stale lock never blocks a resume. On a shared file system without ``flock`` support the
    lock is as good as the file system's.
    """

    def __init__(self, run: RunDir):
        self.run = run
        self._fh = None

    def acquire(self) -> RunLock:
        self.run.root.mkdir(parents=True, exist_ok=True)
        fh = self.run.lock_file.open("a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            owner = fh.read().strip() or "{}"
            fh.close()
            info = json.loads(owner)
            raise RunBusy(
                f"run {self.run.root} is in use by pid {info.get('pid', '?')} on {info.get('host', '?')} "
                f"(since {info.get('since', '?')}): wait for it, stop it, or choose another run_name"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(
            json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")})
        )
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # closing drops the flock
            self._fh = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def live_owner(run: RunDir) -> str | None:
    """Who holds the run's owner lock (a live ``train-and-evaluate``), as RunBusy words it; None
    when nobody does."""
    if not run.lock_file.exists():
        return None
    try:
        RunLock(run).acquire().release()
    except RunBusy as exc:
        return str(exc)
    return None


def owned_by_live_process(run: RunDir) -> bool:
    """A live process (a ``train-and-evaluate`` flow) holds the run's owner lock."""
    return live_owner(run) is not None


class StopSignal:
    """A stop request from the orchestrator to training, as a file in the run directory: training
    needs no server, it survives an orchestrator restart, and anyone can see it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def request(self, reason: str) -> None:
        jsonl.write_json(self.path, {"reason": reason, "time": time.time()})

    def requested(self) -> str | None:
        """The stop reason, or None. Cheap enough to call every step (one stat)."""
        if not self.path.exists():
            return None
        try:
            return json.loads(self.path.read_text())["reason"]
        except (OSError, ValueError, KeyError):
            return "stop requested"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing): released when the block
    ends or its process dies, so a crash never leaves it held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield
