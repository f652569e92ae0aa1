"""Reading back what the sinks wrote: TensorBoard's event files, and W&B's offline run files
(read by :mod:`areal_eval.sinks.wandb_files`)."""

from __future__ import annotations

import json
from pathlib import Path

from areal_eval.sinks import wandb_files
from areal_eval.sinks.wandb_files import history_rows, records


def run_files(wandb_dir: str | Path, run_id: str, settle_s: float = 60.0) -> list[Path]:
    """The run's files under a ``wandb`` directory: one per process that opened it, oldest first.
    W&B's service may still be writing a file after ``finish()`` returned: the newest is given up
    to ``settle_s`` to hold its ``exit`` record (older ones are whole, or a process killed with
    -9 left them, which never write one)."""
    import os
    import time

    # The sink honours $WANDB_DIR (tests/conftest.py sets one for the session) over the run's own.
    places = dict.fromkeys(Path(p).resolve() for p in (wandb_dir, os.environ.get("WANDB_DIR")) if p)
    files = sorted({f for place in places for f in wandb_files.run_files(place, run_id)}, key=lambda f: f.parent.name)
    deadline = time.monotonic() + settle_s
    for path in files[-1:]:
        while time.monotonic() < deadline and not any(exited(r) for r in records(path)):
            time.sleep(0.2)
    return files


def exited(record) -> bool:
    return record.WhichOneof("record_type") == "exit"


def history(wandb_dir: str | Path, run_id: str) -> list[dict]:
    """Every history row the run was given, across its files: ``{key: value}`` (JSON-decoded)."""
    return [row for path in run_files(wandb_dir, run_id) for row in history_rows(path)]


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
