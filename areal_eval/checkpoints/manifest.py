"""The checkpoint manifest: the durable, append-only log of announced checkpoints.

A checkpoint is appended only after its files are written, hashed and renamed into place, so
anything in the manifest can be evaluated. The manifest survives a flow restart: a follower
re-reads it from the start and the evaluation ledger tells what was already handled.

A line left torn by a writer that crashed mid-append is skipped with a warning naming its line,
and every later entry is still read: the next append starts on a fresh line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import operator
from pathlib import Path

from areal_eval import jsonl

log = logging.getLogger(__name__)


def announcement(run_id, global_step, *, epoch, epoch_step, train_metrics) -> tuple[int, int, int, dict]:
    """``(global_step, epoch, epoch_step, train_metrics)`` as a manifest entry holds them, checked
    before anything is written: the steps non-negative integers (numpy's too); a metric that is
    a one-element tensor or array read as its number (``{"loss": loss}`` straight from the
    training loop). Metrics that are numbers reach MLflow; others JSON can hold (a stop reason)
    stay in the manifest. Anything else raises, naming the argument."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id: a non-empty string names the run, got {run_id!r}")
    steps = []
    for name, value in (("global_step", global_step), ("epoch", epoch), ("epoch_step", epoch_step)):
        try:
            number = operator.index(value) if not isinstance(value, bool) else None
        except TypeError:
            number = None
        if number is None or number < 0:
            raise ValueError(f"{name}: a non-negative integer, got {value!r}")
        steps.append(number)
    metrics = {}
    for key, value in dict(train_metrics or {}).items():
        if not isinstance(key, str):
            raise ValueError(f"train_metrics: metric names are strings, got {key!r}")
        metrics[key] = _metric_value(key, value)
    return steps[0], steps[1], steps[2], metrics


def _metric_value(key: str, value):
    if isinstance(value, float):
        return float(value)  # numpy's float64 too
    if _one_element(value):
        return value.item()
    if hasattr(value, "shape"):
        raise ValueError(
            f"train_metrics[{key!r}]: a tensor or array of {_elements(value)} elements is no metric "
            "(log one number, e.g. its mean)"
        )
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        raise ValueError(
            f"train_metrics[{key!r}]: a metric is a number, a one-element tensor or array, or what JSON "
            f"holds (a string), got {type(value).__name__} {value!r:.80}"
        ) from None
    return value


def _one_element(value) -> bool:
    """A torch tensor or numpy array (or scalar) of exactly one element."""
    return hasattr(value, "item") and hasattr(value, "shape") and _elements(value) == 1


def _elements(value) -> int:
    numel = getattr(value, "numel", None)
    return numel() if callable(numel) else int(value.size)


CHECKPOINT_PREFIX = "global_step_"


def checkpoint_name(global_step: int) -> str:
    """The directory name of the checkpoint at ``global_step`` (sorts by step)."""
    return f"{CHECKPOINT_PREFIX}{global_step:08d}"


def step_of_name(name: str) -> int | None:
    """The step a :func:`checkpoint_name` names (None: ``name`` is not one)."""
    digits = name.removeprefix(CHECKPOINT_PREFIX)
    return int(digits) if name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else None


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


@dataclasses.dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class CheckpointEvent:
    """What training announces about one durable checkpoint."""

    run_id: str
    uri: str
    epoch: int
    epoch_step: int
    global_step: int
    wall_time: float
    train_metrics: dict
    files: tuple[FileEntry, ...] = ()
    final: bool = False
    valid_data: str | None = None
    """Validation data the publisher registered for evaluating this run (a path on the
    evaluation workers' file system); None: ``data/valid.jsonl`` beside the manifest."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, row: dict) -> CheckpointEvent:
        row = dict(row)
        row["files"] = tuple(FileEntry(**f) for f in row.get("files", ()))
        return cls(**row)

    def payload(self) -> dict:
        """The event payload for Prefect and webhooks (file list left out: it can be long)."""
        data = dataclasses.asdict(self)
        data.pop("files")
        return data


@dataclasses.dataclass
class ManifestChunk:
    """What one read of the manifest found."""

    events: list[CheckpointEvent]
    offset: int
    """Byte offset to read on from (after the last complete line)."""
    line: int
    """Number of the next line to read (1-based), for messages."""
    problems: list[str]
    """``path:line: why`` for each complete line that is not an entry (skipped)."""


class Manifest:
    """JSON lines at ``path``; one ``CheckpointEvent`` a line."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, event: CheckpointEvent) -> None:
        jsonl.append(self.path, event.to_json())

    def read(self, offset: int = 0, line: int = 1, run_id: str | None = None) -> ManifestChunk:
        """Complete lines after byte ``offset`` (line number ``line``).

        A line still being written (no newline yet) is left for the next call. A line that is not
        an entry, or whose ``run_id`` is not ``run_id`` (when given), is skipped and reported.
        """
        chunk = jsonl.read_complete(self.path, offset, line)
        events, problems = [], []
        for lineno, raw in chunk.lines:
            try:
                event = CheckpointEvent.from_dict(json.loads(raw))
            except (ValueError, TypeError) as exc:
                problems.append(f"{self.path}:{lineno}: not a manifest entry, skipped (torn or corrupt line): {exc}")
                continue
            if run_id is not None and event.run_id != run_id:
                problems.append(
                    f"{self.path}:{lineno}: entry for run {event.run_id!r}, not this run's {run_id!r}: "
                    f"step {event.global_step} rejected"
                )
                continue
            events.append(event)
        return ManifestChunk(events, chunk.offset, chunk.line, problems)

    def events(self) -> list[CheckpointEvent]:
        """Every entry, in order; lines that are not entries are skipped with a logged warning."""
        chunk = self.read()
        for problem in chunk.problems:
            log.warning(problem)
        return chunk.events

    def find(self, global_step: int) -> CheckpointEvent:
        """The announced checkpoint at ``global_step`` (the last entry wins)."""
        if not self.path.exists():
            raise CheckpointError(f"{self.path}: no such manifest file")
        matches = [e for e in self.events() if e.global_step == global_step]
        if not matches:
            raise CheckpointError(f"{self.path}: no checkpoint at step {global_step} in the manifest")
        return matches[-1]


# A checkpoint's files: hashing them, and verifying a copy against what the manifest recorded.


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def describe_files(directory: Path) -> tuple[FileEntry, ...]:
    return tuple(
        FileEntry(name=p.name, size=p.stat().st_size, sha256=sha256_file(p))
        for p in sorted(directory.iterdir())
        if p.is_file()
    )


def verify_checkpoint(
    directory: str | Path, files: tuple[FileEntry, ...], *, shown_as: str | None = None, hashes: bool = True
) -> None:
    """Raise CheckpointError unless every recorded file is present with its size and sha256
    (without ``hashes``, its size only: a quick look that reads no file).

    ``shown_as`` names the checkpoint in errors (its S3 URI when ``directory`` is a download).
    """
    directory = Path(directory)
    where = shown_as or str(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{where}: checkpoint directory is missing")
    if not files:
        raise CheckpointError(f"{where}: manifest records no files for this checkpoint")
    for entry in files:
        path = directory / entry.name
        name = f"{where}/{entry.name}"
        if not path.is_file():
            raise CheckpointError(f"{name}: file recorded in the manifest is missing")
        size = path.stat().st_size
        if size != entry.size:
            raise CheckpointError(f"{name}: size {size} != recorded {entry.size} (truncated?)")
        if hashes and sha256_file(path) != entry.sha256:
            raise CheckpointError(f"{name}: sha256 differs from the manifest (corrupt)")
