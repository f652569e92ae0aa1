"""Reading back what the sinks wrote: TensorBoard's event files, and W&B's offline run files.

W&B ships no reader for its offline run files (``run-<id>.wandb``).

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
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
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


def run_files(wandb_dir: str | Path, run_id: str, settle_s: float = 15.0) -> list[Path]:
    """The run's files under a ``wandb`` directory: one per process that opened it, oldest first.
    W&B's service may still be writing a file after ``finish()`` returned: each is given up to
    ``settle_s`` to hold its ``exit`` record (a process killed with -9 never writes one)."""
    import time

    runs = sorted(d for d in Path(wandb_dir).rglob(f"*-run-*-{run_id}") if d.is_dir())  # offline-run-<time>-<id>
    runs += sorted(d for d in Path(wandb_dir).rglob(f"run-*-{run_id}") if d.is_dir() and d not in runs)
    deadline = time.monotonic() + settle_s
    for run in runs:
        path = run / f"run-{run_id}.wandb"
        while time.monotonic() < deadline and not (path.exists() and any(exited(r) for r in records(path))):
            time.sleep(0.2)
    return sorted(Path(wandb_dir).rglob(f"run-{run_id}.wandb"))


def exited(record) -> bool:
    return record.WhichOneof("record_type") == "exit"


def history(wandb_dir: str | Path, run_id: str) -> list[dict]:
    """Every history row the run was given, across its files: ``{key: value}`` (JSON-decoded)."""
    rows = []
    for path in run_files(wandb_dir, run_id):
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def of_kind(wandb_dir: str | Path, run_id: str, kind: str) -> list:
    """The run's records of one kind (``alert``, ``run``, ``summary``, ``metric``, ...)."""
    return [
        getattr(r, kind)
        for p in run_files(wandb_dir, run_id)
        for r in records(p)
        if r.WhichOneof("record_type") == kind
    ]


def wandb_run_id(run_dir: str | Path) -> str:
    """The W&B run id the run's evaluation records under (kept in the run directory)."""
    return json.loads((Path(run_dir) / "sinks" / "wandb.json").read_text())["id"]


def scalars(logdir: str | Path) -> dict[str, list[int]]:
    """The scalar points TensorBoard shows of a ``logdir``, by tag: their steps, a step written
    twice in a row twice (a point before a lower step is taken back, as TensorBoard takes it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: sorted(e.step for e in events.Scalars(tag)) for tag in events.Tags()["scalars"]}


def assert_sinks_hold(run_root: str | Path, evaluated: list[int], train_steps: list[int]) -> None:
    """The run's TensorBoard and W&B hold what MLflow holds: ``eval/accuracy`` at each evaluated
    step and ``train/loss`` at each training step, each once."""
    run_root = Path(run_root)
    tensorboard = scalars(run_root / "tensorboard" / "areal-eval")
    assert tensorboard["eval/accuracy"] == sorted(evaluated), tensorboard["eval/accuracy"]
    assert scalars(run_root / "tensorboard" / "areal-eval" / "train")["train/loss"] == sorted(train_steps)
    rows = history(run_root / "sinks", wandb_run_id(run_root))
    assert sorted(r["eval/step"] for r in rows if "eval/accuracy" in r) == sorted(evaluated)
    assert sorted(r["train/step"] for r in rows if "train/loss" in r) == sorted(train_steps)


def every_sink(run_dir: str | Path, run_name: str, said: list, **configs):
    """The sinks besides MLflow, W&B (offline in the tests) and TensorBoard, on their defaults
    unless ``configs`` (``wandb=``, ``tensorboard=``) says; their failures appended to ``said``."""
    from areal_eval.sinks import TensorBoardConfig, WandbConfig, open_sinks

    return open_sinks(
        ["mlflow", "wandb", "tensorboard"],
        wandb=configs.get("wandb", WandbConfig()),
        tensorboard=configs.get("tensorboard", TensorBoardConfig()),
        run_dir=run_dir,
        run_name=run_name,
        on_failure=lambda sink, message: said.append(message),
    )
