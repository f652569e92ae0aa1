"""A checkpoint's files: hashing them, and verifying a copy against what the manifest recorded."""

from __future__ import annotations

import hashlib
from pathlib import Path

from areal_eval.manifest import CheckpointError, FileEntry


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


def verify_checkpoint(directory: str | Path, files: tuple[FileEntry, ...], shown_as: str | None = None) -> None:
    """Raise CheckpointError unless every recorded file is present with its size and sha256.

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
        if sha256_file(path) != entry.sha256:
            raise CheckpointError(f"{name}: sha256 differs from the manifest (corrupt)")
