"""A run on S3 seen from elsewhere: a flow's local copy of it, what evaluation asks of its
trainer and tells it, and the trainer's answers.

A trainer on another machine shares nothing with evaluation but the run's S3 prefix. A flow
that evaluates from its local copy of such a run (the trigger, the service, the sweep: see
:func:`localize_manifest`) sends there, beside the manifest, its requests as it makes them (the
stop request, ``directives.jsonl``) and its ledger with each result. The trainer's rank 0 copies
them into its own run directory from a thread of its own, every ``storage.s3.control_poll_s``
seconds, and its loop reads them there as it reads local ones (one ``stat`` a step: training
never waits for S3; ``evaluation_results`` reads the ledger). Its answers go the other way, at
that pace and before each checkpoint is announced, so the flow that evaluates the checkpoint a
stop ended training with knows what came of the stop.

Directives merge by id (:meth:`~areal_eval.runs.directives.Directives.issue`): a copy never loses
a line another wrote, and one issued twice is one directive. Only the trainer writes answers.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
from pathlib import Path

from areal_eval import jsonl
from areal_eval.checkpoints.manifest import CheckpointError
from areal_eval.checkpoints.store import S3Config, S3Store, is_s3
from areal_eval.feedback import Directive
from areal_eval.runs.directives import ANSWERS, DIRECTIVES, Directives
from areal_eval.runs.directory import RunDir, owned_by_live_process

SHARED_RUN_FILES = ("ledger.jsonl", "evaluation_state.json", "pipeline_config.json")
"""What a flow that owned an S3 run mirrors beside its manifest when it ends, so a sweep on
another machine knows its decisions and judges the run by its settings (training mirrors the
config at its start too). A local record, once there, is the one that counts."""
REMOTE = "remote.json"
"""In a flow's local copy of a run on S3: where the run lives."""
STOP = "control/stop.json"

logger = logging.getLogger(__name__)


def localize_manifest(manifest: str, s3: S3Config, work_dir: str | Path) -> Path:
    """A local copy of a run's manifest and validation data, for an ``s3://.../manifest.jsonl``,
    with what its trainer answered and what was asked of it so far; a local manifest is
    returned as it is."""
    if not is_s3(manifest):
        return Path(manifest)
    root, _, name = manifest.rstrip("/").rpartition("/")
    if name != "manifest.jsonl":
        raise ValueError(f"{manifest}: an S3 manifest must be <run prefix>/manifest.jsonl")
    store = S3Store(root, s3)
    local = Path(work_dir).resolve() / "remote-runs" / store.bucket / store.prefix
    for relative in ("manifest.jsonl", "data/valid.jsonl"):
        try:
            store.download_file(relative, local / relative)
        except Exception as exc:
            raise CheckpointError(f"{root}/{relative}: cannot read the run's mirrored file: {exc}") from exc
    for relative in SHARED_RUN_FILES:  # the record of the flow that owned the run, if it mirrored one
        if not (local / relative).exists():
            with contextlib.suppress(Exception):
                store.download_file(relative, local / relative)
    if jsonl.read_json(local / REMOTE, {}).get("root") != root:
        jsonl.write_json(local / REMOTE, {"root": root})
    try:
        pull_requests(store, local)
        pull_answers(store, local)
    except Exception as exc:  # noqa: BLE001 - evaluating goes on; the record says "waiting for the trainer"
        logger.warning("%s: the trainer's answers are not known here: %r", root, exc)
    return local / "manifest.jsonl"


def remote_store(local_root: str | Path, s3: S3Config) -> S3Store | None:
    """The store of the run this directory is a local copy of (None: it is the run itself)."""
    root = jsonl.read_json(Path(local_root) / REMOTE, {}).get("root")
    return S3Store(root, s3) if root else None


def pull_requests(store: S3Store, local_root: str | Path) -> None:
    """Merge the run's directives on S3 into the local file, and take its stop request."""
    body = store.read(DIRECTIVES)
    if body:
        rows = []
        for line in body.decode().splitlines():
            with contextlib.suppress(ValueError, TypeError):
                rows.append(Directive.from_json(json.loads(line)))
        Directives(local_root).issue(rows)
    stop = RunDir(local_root).stop_file
    if not stop.exists() and (body := store.read(STOP)):
        jsonl.write_atomic(stop, body.decode())


def push_requests(store: S3Store, local_root: str | Path) -> None:
    """Send what this copy asks of training to S3, with what other copies sent merged in."""
    pull_requests(store, local_root)
    local = Path(local_root)
    for relative in (DIRECTIVES, STOP):
        if (local / relative).exists():
            store.write(relative, (local / relative).read_bytes())


def push_results(store: S3Store, local_root: str | Path) -> None:
    """Send this copy's ledger (what was evaluated, with the results) to S3."""
    ledger = RunDir(local_root).ledger
    if ledger.exists():
        store.write(ledger.name, ledger.read_bytes())


def pull_results(store: S3Store, local_root: str | Path) -> None:
    """The ledger of the flow that evaluates the run elsewhere, unless a live flow here owns the
    run directory (it writes the ledger itself)."""
    run = RunDir(local_root)
    if owned_by_live_process(run) or (body := store.read(run.ledger.name)) is None:
        return
    if not run.ledger.exists() or run.ledger.read_bytes() != body:
        jsonl.write_atomic(run.ledger, body)


def pull_answers(store: S3Store, local_root: str | Path) -> None:
    """The trainer's answers, as it last sent them."""
    if (body := store.read(ANSWERS)) is not None:
        jsonl.write_atomic(Path(local_root) / ANSWERS, body.decode())


class TrainerControl:
    """A trainer's end of the channel, on rank 0: requests in, answers out, every ``poll_s``."""

    def __init__(self, store: S3Store, local_root: str | Path, poll_s: float):
        self.store, self.root, self.poll_s = store, Path(local_root), poll_s
        self._sent: tuple[float, int] | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._failing = False
        threading.Thread(target=self._run, name="evaluation-requests", daemon=True).start()
        atexit.register(self.sync, pull=False)  # answers made since the last send go before the process

    def sync(self, *, pull: bool = True) -> None:
        """Send answers not sent yet and (``pull``) take new requests and results; a fault of S3 is
        a warning, once."""
        if self._done.is_set():
            return
        try:
            with self._lock:
                self.send_answers()
                if pull:
                    pull_requests(self.store, self.root)
                    pull_results(self.store, self.root)
            if self._failing:
                logger.info("evaluation's requests reach this trainer again through %s", self.store.root)
            self._failing = False
        except Exception as exc:  # noqa: BLE001 - a side channel: training goes on, the next poll retries
            if not self._failing:
                logger.warning("cannot reach %s for evaluation's requests (retrying): %r", self.store.root, exc)
            self._failing = True

    def send_answers(self) -> None:
        path = self.root / ANSWERS
        with contextlib.suppress(FileNotFoundError):
            stat = path.stat()
            if (stat.st_mtime, stat.st_size) != self._sent:
                self.store.write(ANSWERS, path.read_bytes())
                self._sent = (stat.st_mtime, stat.st_size)

    def _run(self) -> None:
        while not self._done.wait(self.poll_s):
            self.sync()

    def close(self) -> None:
        self._done.set()


_followed: dict[Path, TrainerControl] = {}
os.register_at_fork(after_in_child=_followed.clear)  # a forked child has no polling thread


def follow_requests(store, local_root: str | Path, *, final: bool = False) -> None:
    """On the trainer's rank 0, at each publish to S3: poll for requests from now on (once per
    run directory), and send answers made so far now, before the checkpoint is announced. The
    ``final`` one ends the polling: training is over."""
    if not isinstance(store, S3Store):
        return  # a local store is the run directory: evaluation writes there directly
    root = Path(local_root).resolve()
    control = _followed.get(root)
    if control is None:
        control = _followed[root] = TrainerControl(store, root, store.control_poll_s)
    control.sync(pull=False)  # the thread takes requests; the publish only waits for the answers
    if final:
        _followed.pop(root).close()
