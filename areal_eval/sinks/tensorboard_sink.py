"""TensorBoard: evaluation scalars at the training step, and a text summary of answers."""

from __future__ import annotations

import os
from pathlib import Path

from areal_eval.sinks.config import TensorBoardConfig


def held_steps(logdir: str | Path) -> dict[str, set[int]]:
    """The steps each tag holds in the event files under ``logdir`` (scalars and text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not Path(logdir).is_dir() or not any(Path(logdir).glob("events.out.tfevents.*")):
        return {}
    # Every point, none purged: results arrive out of step order (slots finish when they finish).
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0}, purge_orphaned_data=False)
    events.Reload()
    held = {tag: {e.step for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    return held | {tag: {e.step for e in events.Tensors(tag)} for tag in events.Tags()["tensors"]}


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, config: TensorBoardConfig, *, run_dir: str | Path):
        self.config = config
        self.logdir = Path(config.logdir or Path(run_dir) / "tensorboard") / config.subdir
        self._writer = None
        self._held: dict[str, set[int]] | None = None

    def open(self) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.logdir.mkdir(parents=True, exist_ok=True)
            self._held = held_steps(self.logdir)  # what an earlier process wrote: never again
            # A file per process: flow runs of one run write side by side.
            self._writer = SummaryWriter(str(self.logdir), filename_suffix=f".{os.getpid()}")

    def _write(self, points: dict[str, float], step: int) -> None:
        for tag, value in sorted(points.items()):
            if step not in self._held.setdefault(tag, set()):
                self._writer.add_scalar(tag, float(value), global_step=step)
                self._held[tag].add(step)
        self._writer.flush()  # on disk before it counts as delivered

    def evaluation(self, step: int, metrics: dict, *, prefix: str, answers: list[dict], uri: str) -> None:
        self._write({prefix + k: v for k, v in metrics.items()}, step)
        shown = answers[: self.config.answers_per_summary]
        tag = prefix + "answers"
        if shown and step not in self._held.setdefault(tag + "/text_summary", set()):
            self._writer.add_text(tag, answers_markdown(shown, uri), global_step=step)
            self._held[tag + "/text_summary"].add(step)
            self._writer.flush()

    def training(self, rows: list[dict]) -> None:
        for row in rows:
            self._write({"train/" + k: v for k, v in row.items() if k != "step"}, int(row["step"]))

    def alert(self, rule: str, step: int, message: str) -> None:
        self._write({f"alerts/{rule}": 1.0}, step)

    def end(self, status: str, *, plot: Path | None) -> None:
        pass  # TensorBoard draws its own curves

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


MAX_COLUMNS = 8
"""Columns of a text summary (an item's first ones: evaluator, item, then what it holds)."""


def answers_markdown(answers: list[dict], uri: str) -> str:
    """A sample of answers as a Markdown table (TensorBoard's text plugin renders it)."""
    columns = list(dict.fromkeys(k for a in answers for k in a))[:MAX_COLUMNS]

    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")[:300]

    lines = [f"checkpoint `{uri}`", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(a.get(c, "")) for c in columns) + " |" for a in answers]
    return "\n".join(lines)
