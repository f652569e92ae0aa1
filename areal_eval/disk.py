"""A full disk, named: which path, and what was being written to it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)
FULL_SIGNS = ("database or disk is full", "No space left on device", "no space left on the disk of")
"""How a full disk reads where it reaches us as text: SQLite's error, a job's last output."""


class DiskFull(OSError):
    """No space left where ``path`` is, while writing ``what``."""

    def __init__(self, path: str | Path, what: str, cause: OSError):
        message = f"no space left on the disk of {path}" + (f" while writing {what}" if what else "")
        super().__init__(cause.errno, message, str(path))
        self.path, self.what = Path(path), what

    def __str__(self) -> str:
        return self.strerror


def is_disk_full(exc: BaseException | None) -> bool:
    """``exc``, or an exception it was raised from, is a full disk (a file system's ENOSPC or
    EDQUOT, or SQLite's "database or disk is full")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL:
            return True
        if any(sign in str(exc) for sign in FULL_SIGNS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def brief(exc: BaseException, limit: int = 300) -> str:
    """``exc`` in one short line: its class and the first line that says what failed (a full
    disk first; a database error's SQL and parameters left out)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    full = [line for line in lines if any(sign in line for sign in FULL_SIGNS)]
    telling = next(iter(full + [line for line in lines if "Error" in line] + lines), "")
    return f"{type(exc).__name__}: {telling}"[:limit]


def named_if_disk_full(exc: BaseException, directory: str | Path, what: str) -> BaseException:
    """``exc`` as :class:`DiskFull` where the disk of ``directory`` has under 1 MiB left, else
    ``exc``: torch and safetensors report a full disk as an opaque stream error ("unexpected
    pos", "iostream error"), and a job whose log could not be written says nothing at all."""
    if isinstance(exc, DiskFull):
        return exc
    try:
        full = shutil.disk_usage(directory).free < 1 << 20
    except OSError:
        full = False
    if full or (isinstance(exc, OSError) and exc.errno in FULL):
        error = DiskFull(directory, f"{what} ({exc})", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        error.__cause__ = exc
        return error
    return exc


@contextlib.contextmanager
def writing(path: str | Path, what: str = "") -> Iterator[None]:
    """Raise a full disk met inside as :class:`DiskFull`, naming ``path`` and ``what``."""
    try:
        yield
    except DiskFull:
        raise
    except OSError as exc:
        if exc.errno in FULL:
            raise DiskFull(path, what, exc) from exc
        raise
