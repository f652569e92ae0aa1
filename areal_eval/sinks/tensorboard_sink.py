"""TensorBoard: evaluation scalars at the training step, and a text summary of answers."""

from __future__ import annotations

import os
from pathlib import Path

from areal_eval.sinks.config import TensorBoardConfig

TEXT = "/text_summary"
"""What TensorBoard's text plugin appends to a text summary's tag."""


def held_points(logdir: str | Path) -> dict[str, dict[int, float | str]]:
    """What TensorBoard shows of the event files under ``logdir``: each tag's value (a scalar, or
    a text summary's Markdown) by step, read as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not Path(logdir).is_dir() or not any(Path(logdir).glob("events.out.tfevents.*")):
        return {}
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    held: dict[str, dict[int, float | str]] = {}
    for tag in events.Tags()["scalars"]:
        held[tag] = {e.step: e.value for e in events.Scalars(tag)}
    for tag in events.Tags()["tensors"]:
        held[tag] = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)}
    return held


class TensorBoardSink:
    """Each tag's points once, in step order as TensorBoard needs them. Results arrive out of
    step order (slots finish when they finish, a look-back comes last), and TensorBoard takes a
    step below one it holds as a restart: its server drops the tag's later points, and its
    ``EventAccumulator`` keeps both. So a late point is written as a restart: a session start at
    its step (every reader then drops what follows it), the point, and every later point again."""

    name = "tensorboard"

    def __init__(self, config: TensorBoardConfig, *, run_dir: str | Path):
        self.config = config
        self.logdir = config.directory(run_dir)
        self._writer = None
        self._held: dict[str, dict[int, float | str]] = {}
        self._last: int | None = None
        """The highest step held in any tag (None: not known yet)."""

    def open(self) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.logdir.mkdir(parents=True, exist_ok=True)
            self._held, self._last = held_points(self.logdir), None  # what earlier processes wrote: never again
            # A file per process: flow runs of one run write side by side, taking turns.
            self._writer = SummaryWriter(str(self.logdir), filename_suffix=f".{os.getpid()}")

    def _add(self, step: int, points: dict[str, float | str]) -> None:
        """``points`` (values by tag) at ``step``, those the tags do not hold yet."""
        new = {tag: value for tag, value in points.items() if step not in self._held.get(tag, {})}
        if not new:
            return
        last = (
            max((max(held, default=-1) for held in self._held.values()), default=-1)
            if self._last is None
            else self._last
        )
        later = [] if step >= last else sorted((s, t) for t, held in self._held.items() for s in held if s > step)
        for tag, value in new.items():
            self._held.setdefault(tag, {})[step] = value
        self._last = max(last, step)
        if not later:
            for tag in sorted(new):
                self._put(tag, step)
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        # A late point: a restart at its step drops the step and all after it, in every tag;
        # then the step's points and every later point again.
        self._writer.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        for tag in sorted(tag for tag, held in self._held.items() if step in held):
            self._put(tag, step)
        for at, tag in later:
            self._put(tag, at)

    def _put(self, tag: str, step: int) -> None:
        value = self._held[tag][step]
        if tag.endswith(TEXT):
            self._writer.add_text(tag.removesuffix(TEXT), value, global_step=step)
        else:
            self._writer.add_scalar(tag, float(value), global_step=step)

    def evaluation(self, step: int, metrics: dict, *, prefix: str, answers: list[dict], uri: str) -> None:
        points = {prefix + name: value for name, value in metrics.items()}
        shown = answers[: self.config.answers_per_summary]
        if shown:
            points[prefix + "answers" + TEXT] = answers_markdown(shown, uri)
        self._add(step, points)
        self._writer.flush()  # on disk before it counts as delivered

    def training(self, rows: list[dict]) -> None:
        for row in rows:
            numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self._add(int(row["step"]), {"train/" + k: v for k, v in numbers.items() if k != "step"})
        self._writer.flush()

    def alert(self, rule: str, step: int, message: str) -> None:
        self._add(step, {f"alerts/{rule}": 1.0})
        self._writer.flush()

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
