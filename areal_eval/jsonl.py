"""JSON lines and small JSON files, written durably and read with file:line errors.

The manifest, the ledger, the training log, the curves and the data files are JSON lines; run
state is small JSON files. Every one of them is written and read here, so each keeps the same
promises: an append is on disk when it returns, a whole-file write is seen whole or not at all,
a reader of a growing file takes only complete lines, and a bad line is named by file and line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from areal_eval.disk import writing


class JsonlError(ValueError):
    """A line that is not what it should be; the message starts with ``path:line:``."""


def fsync_dir(path: str | Path) -> None:
    """Make a file's creation or rename in ``path`` survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append(path: str | Path, row: Any, sort_keys: bool = False) -> None:
    """Append ``row`` (JSON-encoded unless already a ``str``) as one line, on disk when this returns.

    After a writer died mid-line the new row starts a fresh line, so the torn one stays a single
    bad line that readers report and skip, never glued to a good one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = row if isinstance(row, str) else json.dumps(row, sort_keys=sort_keys)
    new = not path.exists()
    with writing(path, "a line of it"), path.open("ab+") as fh:
        torn = False
        if fh.seek(0, os.SEEK_END) > 0:
            fh.seek(-1, os.SEEK_END)
            torn = fh.read(1) != b"\n"
        fh.write((b"\n" if torn else b"") + text.encode() + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    if new:
        fsync_dir(path.parent)


@dataclasses.dataclass
class Lines:
    """The complete lines one read of a growing file found, and where to read on."""

    lines: list[tuple[int, bytes]]
    """(line number, raw line) for each complete, non-blank line."""
    offset: int
    """Byte offset after the last complete line."""
    line: int
    """Number of the next line (1-based)."""


def read_complete(path: str | Path, offset: int = 0, line: int = 1) -> Lines:
    """Complete lines after byte ``offset`` (which is line number ``line``); a line still being
    written (no newline yet) is left for the next call."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return Lines([], offset, line)
    end = data.rfind(b"\n") + 1
    raw = data[:end].split(b"\n")[:-1]
    found = [(n, text) for n, text in enumerate(raw, start=line) if text.strip()]
    return Lines(found, offset + end, line + len(raw))


def loads(raw: str | bytes, path: str | Path, lineno: int) -> Any:
    """One line's JSON, or a :class:`JsonlError` naming the file and line."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise JsonlError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc


def loads_skipping_torn(lines: list[tuple[int, bytes]], path: str | Path) -> tuple[list[tuple[int, Any]], list[str]]:
    """(line number, parsed row) for each of ``lines`` (from :func:`read_complete`) that is JSON,
    and a ``path:line: why`` for each that is not: a line torn by a writer that crashed mid-append
    (closed by the next append) is skipped, not fatal, in a file a run appends to."""
    parsed, problems = [], []
    for lineno, raw in lines:
        try:
            parsed.append((lineno, loads(raw, path, lineno)))
        except JsonlError as exc:
            problems.append(f"{exc}: skipped (torn or corrupt line)")
    return parsed, problems


def rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed row) for every non-blank line of a whole file, the last one too. A
    line that is not UTF-8 is a :class:`JsonlError` naming it."""
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise JsonlError(
                    f"{path}:{lineno}: not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})"
                ) from None
            if text.strip():
                yield lineno, loads(text, path, lineno)


def _write_temporary(path: Path, content: str | bytes) -> Path:
    """``content`` on disk in a new file beside ``path``, named for this writer alone: two threads
    of one process (a flow following its trainer in-process) must not share a temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing(path, "it"):
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(content.encode() if isinstance(content, str) else content)
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            Path(name).unlink(missing_ok=True)  # no half-written file left to fill the disk
            raise
    return Path(name)


def write_atomic(path: str | Path, content: str | bytes) -> None:
    """Replace ``path`` whole: readers see the old file or the new one, never a part."""
    path = Path(path)
    _write_temporary(path, content).replace(path)
    fsync_dir(path.parent)


def create_atomic(path: str | Path, content: str | bytes) -> bool:
    """Write ``path`` whole unless it exists; False when another writer was first.

    For a value that writers must agree on (the run id): the first one wins, and no reader or
    later writer ever sees a part of it.
    """
    path = Path(path)
    tmp = _write_temporary(path, content)
    try:
        os.link(tmp, path)  # fails if path exists, unlike a rename
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    fsync_dir(path.parent)
    return True


def write_json(path: str | Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def read_json(path: str | Path, default: Any = None) -> Any:
    """A small JSON file written by :func:`write_json`, or ``default`` when there is none."""
    path = Path(path)
    if not path.exists():
        return default
    return loads(path.read_bytes(), path, 1)


def write_rows(path: str | Path, items: Iterable[Any]) -> None:
    write_atomic(path, "".join(json.dumps(item) + "\n" for item in items))
