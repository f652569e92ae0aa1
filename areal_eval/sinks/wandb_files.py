"""What W&B made durable: reading back its own run files (``run-<id>.wandb``).

W&B ships no reader for them. ``run.log()`` returns before W&B's service writes the point, and
the service writes its file in blocks: a process killed with ``-9`` can leave a segment holding
only its header, while points it logged earlier did land. So the W&B sink acknowledges a point
only once its run is finished, and a resumed run first reads what earlier segments hold (see
:meth:`WandbSink.landed`), so what did land is not sent twice and what did not is sent again.

The file is a 7-byte header (``:W&B``, a magic number, a version) and then a LevelDB-style log:
32 KiB blocks of chunks, each ``crc32 (4) | length (2) | type (1) | data``, where type 1 is a
whole record and 2, 3, 4 its first, middle and last parts; a block's tail too short for a chunk
header is zero padding. Each record is a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator:
    """Every complete record of one ``.wandb`` file, in order (a torn tail is left out)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        return
    pos, parts = HEADER, b""
    while True:
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        if pos + HEADER > len(data):
            return
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        if len(chunk) < length or kind not in (FULL, FIRST, MIDDLE, LAST):
            return
        pos += HEADER + length
        parts = chunk if kind in (FULL, FIRST) else parts + chunk
        if kind in (FULL, LAST):
            yield wandb_internal_pb2.Record.FromString(parts)


def history_rows(path: str | Path) -> Iterator[dict]:
    """The history rows of one ``.wandb`` file: ``{key: value}`` (JSON-decoded)."""
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            yield {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}


def run_files(wandb_dir: str | Path, run_id: str) -> list[Path]:
    """Every segment file of run ``run_id`` under a ``wandb`` directory, oldest first."""
    return sorted(Path(wandb_dir).rglob(f"run-{run_id}.wandb"), key=lambda p: p.parent.name)
