"""Publish checkpoints from any training loop: your own script, or AReaL's trainer.

    from areal_eval.checkpoints.publisher import publish_checkpoint
    publish_checkpoint("/ckpt/run-7/global_step_400", manifest="/ckpt/run-7/manifest.jsonl",
                       run_id="run-7", global_step=400, epoch=1, epoch_step=150, train_metrics={"loss": 0.41})

Call it after the checkpoint's files are written. It records sizes and sha256, uploads and
verifies the files when ``store`` is an ``s3://`` prefix, appends the checkpoint to the manifest
(the durable log; mirrored beside the checkpoints on S3), then posts an
``areal.checkpoint.saved`` event to the Prefect API at ``$PREFECT_API_URL`` if one is set.
Plain HTTP: the training process needs no Prefect client and starts no temporary server. A
deployment trigger on that event starts ``evaluate-checkpoint``.

The manifest is the source of truth, the event only a fast path: events go out from a thread
of their own, in publish order, so an event API that is down, slow or hung never holds up the
trainer, and a failed one is a warning, never an error raised into the trainer. At exit the
process waits at most one event timeout for events not yet sent. The evaluation service's
catch-up and the cron sweep evaluate every checkpoint of the manifest whose event was lost; the
warning names which one will (:mod:`areal_eval.checkpoints.lost_events`).
"""

from __future__ import annotations

import atexit
import collections
import datetime
import json
import logging
import os
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from areal_eval.checkpoints.lost_events import Sweep, find_sweeps, who_evaluates
from areal_eval.checkpoints.manifest import CheckpointError, CheckpointEvent, Manifest, announcement, describe_files
from areal_eval.checkpoints.remote_run import follow_requests
from areal_eval.checkpoints.store import S3Config, StorageConfig, is_s3, open_store

CHECKPOINT_SAVED = "areal.checkpoint.saved"
EVENT_TIMEOUT_S = 5.0
"""How long a publish waits for the event API before it warns and lets training go on."""
SWEEPS_FRESH_S = 300.0
"""How long what a server said of its sweeps is taken as still true."""

logger = logging.getLogger(__name__)


def checkpoint_resource(event: CheckpointEvent, source: str = "publisher") -> dict[str, str]:
    """The event's resource. ``areal.source`` tells who announced it: the evaluate-checkpoint
    trigger answers ``publisher`` (training outside the flow) and ignores ``flow``, whose
    checkpoints the flow evaluates itself."""
    return {
        "prefect.resource.id": f"areal.checkpoint.{event.run_id}.{event.global_step}",
        "prefect.resource.name": f"{event.run_id} step {event.global_step}",
        "areal.run_id": event.run_id,
        "areal.source": source,
    }


def event_payload(event: CheckpointEvent, manifest: str | Path) -> dict:
    return {**event.payload(), "manifest": str(manifest) if is_s3(manifest) else str(Path(manifest).resolve())}


def payload_problem(payload) -> str | None:
    """Why an ``areal.checkpoint.saved`` payload names no checkpoint to evaluate (None: it does):
    anyone may emit the event, and an evaluator must not die of a malformed one."""
    if not isinstance(payload, dict):
        return f"the payload is {type(payload).__name__}, not an object"
    step = payload.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"global_step {step!r} is not a non-negative integer"
    if not isinstance(payload.get("manifest"), str) or not payload["manifest"]:
        return f"manifest {payload.get('manifest')!r} is not a path or URI"
    return None


def post_event(api_url: str, event: CheckpointEvent, manifest: str | Path, timeout_s: float = EVENT_TIMEOUT_S) -> None:
    """POST one ``areal.checkpoint.saved`` event to a Prefect API (``.../api``)."""
    body = [
        {
            "id": str(uuid.uuid4()),
            "occurred": datetime.datetime.now(datetime.UTC).isoformat(),
            "event": CHECKPOINT_SAVED,
            "resource": checkpoint_resource(event),
            "related": [],
            "payload": event_payload(event, manifest),
        }
    ]
    request = urllib.request.Request(
        api_url.rstrip("/") + "/events",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        if response.status >= 300:
            raise RuntimeError(f"Prefect API {api_url} refused the event: HTTP {response.status}")


class EventSender:
    """Posts events from a daemon thread, one after another in the order they were sent."""

    def __init__(self):
        self.reset()
        os.register_at_fork(after_in_child=self.reset)  # a forked child has no sending thread

    def reset(self) -> None:
        self._changed = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._unsent = 0
        self._longest = 0.0
        """The longest event timeout asked for: how long the process waits at exit."""
        self._owner: int | None = None
        """The process whose thread sends."""
        self._last = ("", "")
        """The server and manifest of the last event sent."""
        self._sweeps: dict[str, tuple[float, list[Sweep]]] = {}
        self._asking: set[str] = set()
        """What each server said of its sweeps, and when: named when it stops answering."""

    def send(self, api_url: str, event: CheckpointEvent, manifest: str | Path, timeout_s: float) -> None:
        with self._changed:
            if self._owner != os.getpid():
                self._owner = os.getpid()
                threading.Thread(target=self._run, name="checkpoint-events", daemon=True).start()
                atexit.register(self._at_exit, os.getpid())
            self._waiting.append((api_url, event, manifest, timeout_s))
            self._last = (api_url, str(manifest))
            self._unsent += 1
            self._longest = max(self._longest, timeout_s)
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting)
                api_url, event, manifest, timeout_s = self._waiting.popleft()
            try:
                post_event(api_url, event, manifest, timeout_s)
                self._learn_sweeps(api_url)
            except Exception as exc:  # noqa: BLE001 - a side fault: training goes on, the manifest has the checkpoint
                logger.warning(
                    "checkpoint step %d is in the manifest, but its event did not reach %s (%r): %s",
                    event.global_step,
                    api_url,
                    exc,
                    who_evaluates(str(manifest), self._sweeps.get(api_url, (0, None))[1]),
                )
            with self._changed:
                self._unsent -= 1
                self._changed.notify_all()

    def _learn_sweeps(self, api_url: str) -> None:
        """Ask the server that answered for its sweeps, at most every few minutes, from a thread
        of its own: a slow answer never holds up the next event."""
        learned_at = self._sweeps.get(api_url, (-SWEEPS_FRESH_S, None))[0]
        if time.monotonic() - learned_at < SWEEPS_FRESH_S or api_url in self._asking:
            return
        self._asking.add(api_url)

        def ask() -> None:
            try:
                self._sweeps[api_url] = (time.monotonic(), find_sweeps(api_url))
            except Exception as exc:  # noqa: BLE001 - only the warning's words depend on it
                logger.debug("the sweeps of %s are unknown: %r", api_url, exc)
            finally:
                self._asking.discard(api_url)

        threading.Thread(target=ask, name="checkpoint-events-sweeps", daemon=True).start()

    def flush(self, timeout_s: float = EVENT_TIMEOUT_S) -> int:
        """Wait until every event sent so far is posted or has failed, at most ``timeout_s``;
        returns how many are still unsent."""
        with self._changed:
            if self._owner != os.getpid():
                return 0
            self._changed.wait_for(lambda: self._unsent == 0, timeout_s)
            return self._unsent

    def _at_exit(self, pid: int) -> None:
        if pid == os.getpid() and (left := self.flush(self._longest)):
            api_url, manifest = self._last
            logger.warning(
                "%d checkpoint event(s) not sent before exit: %s",
                left,
                who_evaluates(manifest, self._sweeps.get(api_url, (0, None))[1]),
            )


_events = EventSender()


def flush_events(timeout_s: float = EVENT_TIMEOUT_S) -> int:
    """Wait, at most ``timeout_s``, for the events :func:`publish_checkpoint` has not posted yet
    (posted or failed); returns how many are still unsent. The process does this at exit."""
    return _events.flush(timeout_s)


WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.distcp")
"""Model weight files: ``save_pretrained`` (whole or sharded) and torch.distributed.checkpoint."""


def check_has_weights(directory: Path) -> None:
    """A checkpoint without model weights is refused before anything is announced."""
    if not any(next(directory.glob(pattern), None) for pattern in WEIGHTS):
        raise CheckpointError(f"{directory}: no model weights ({', '.join(WEIGHTS)}) to publish")


def publish_checkpoint(
    checkpoint_dir: str | Path,
    manifest: str | Path,
    run_id: str,
    global_step: int,
    *,
    epoch: int = 0,
    epoch_step: int = 0,
    train_metrics: dict | None = None,
    final: bool = False,
    api_url: str | None = None,
    store: str | None = None,
    s3: S3Config | None = None,
    valid_data: str | Path | None = None,
    event_timeout_s: float = EVENT_TIMEOUT_S,
) -> CheckpointEvent:
    """Announce a written checkpoint: upload (with ``store``), manifest (durable), then the event.

    With ``store="s3://bucket/prefix"`` the files go to ``prefix/<run_id>/<directory name>/``,
    the event's manifest is the mirrored ``s3://.../<run_id>/manifest.jsonl``, and evaluation
    workers on other machines need nothing but S3.

    ``valid_data``: the validation data to evaluate this run on (a path the evaluation workers
    can read); without it they look for ``data/valid.jsonl`` beside the manifest. A path that is
    not a file is refused here, before anything is written.

    Bad arguments raise; a fault of the event API (down, slow, refusing) only warns: the manifest
    line stands. The event is posted from a thread of its own (training does not wait for it),
    each waited for at most ``event_timeout_s``; :func:`flush_events` waits for those not yet
    posted, as the process does at exit and a ``final`` publish does before it returns.
    """
    global_step, epoch, epoch_step, train_metrics = announcement(
        run_id, global_step, epoch=epoch, epoch_step=epoch_step, train_metrics=train_metrics
    )
    directory = Path(checkpoint_dir).resolve()
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: checkpoint directory does not exist")
    check_has_weights(directory)
    if valid_data is not None and not Path(valid_data).is_file():
        raise FileNotFoundError(f"valid_data: {Path(valid_data).resolve()}: no such validation data file")
    files = describe_files(directory)
    root = StorageConfig(checkpoint_uri=store).run_root(run_id)
    checkpoint_store = open_store(root, s3)
    event = CheckpointEvent(
        run_id=run_id,
        uri=checkpoint_store.publish(directory, files),
        epoch=epoch,
        epoch_step=epoch_step,
        global_step=global_step,
        wall_time=time.time(),
        train_metrics=train_metrics,
        files=files,
        final=final,
        valid_data=str(Path(valid_data).resolve()) if valid_data else None,
    )
    follow_requests(checkpoint_store, Path(manifest).parent, final=final)  # answers sent before the announcement
    Manifest(manifest).append(event)
    checkpoint_store.mirror(Path(manifest), "manifest.jsonl")
    api_url = api_url or os.environ.get("PREFECT_API_URL")
    if api_url:
        _events.send(api_url, event, f"{root}/manifest.jsonl" if root else manifest, event_timeout_s)
        if final:  # training is over: wait here, since some launchers end a process without its exit hooks
            flush_events(event_timeout_s)
    return event
