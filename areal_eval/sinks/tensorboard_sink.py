"""TensorBoard: evaluation scalars at the training step, and a text summary of answers."""

from __future__ import annotations

import os
import time
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


def wait_for_a_later_second(directory: Path, *, at_most_s: float = 2.0) -> None:
    """Wait until a file made now sorts after the event files already in ``directory``.
    TensorBoard reads a run's files in name order, and a name holds the second it was made, then
    the host and pid: two files of one second sort by pid, not by age, and a restart written in
    the first would then drop the points of the second."""
    seconds = [int(p.name.split(".")[3]) for p in directory.glob("events.out.tfevents.*") if _stamped(p.name)]
    deadline = time.monotonic() + at_most_s  # a clock of another host far ahead is not waited for
    while seconds and int(time.time()) <= max(seconds) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stamped(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 3 and parts[3].isdigit()


class EventRun:
    """One TensorBoard run (a directory of event files): each tag's points once, in the step
    order TensorBoard needs. TensorBoard takes a step below one it holds as a restart: its server
    drops the tag's later points, and its ``EventAccumulator`` keeps both. So a late point is
    written as a restart: a session start at its step (every reader then drops that step and
    all after it), then the step's points and every later point again."""

    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.held = held_points(directory)  # what earlier processes wrote: never again
        self.last = max((max(points, default=-1) for points in self.held.values()), default=-1)
        # A file per process: flow runs of one run write side by side, taking turns.
        wait_for_a_later_second(directory)
        self.writer = SummaryWriter(str(directory), filename_suffix=f".{os.getpid()}")

    def add(self, step: int, points: dict[str, float | str]) -> None:
        """``points`` (values by tag) at ``step``, those the tags do not hold yet."""
        new = {tag: value for tag, value in points.items() if step not in self.held.get(tag, {})}
        if not new:
            return
        later = [] if step >= self.last else sorted((s, t) for t, held in self.held.items() for s in held if s > step)
        for tag, value in new.items():
            self.held.setdefault(tag, {})[step] = value
        self.last = max(self.last, step)
        if later:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            self.writer.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
            new = {tag: held[step] for tag, held in self.held.items() if step in held}
        for tag in sorted(new):
            self._put(tag, step)
        for at, tag in later:
            self._put(tag, at)
        self.writer.flush()  # on disk before it counts as delivered

    def _put(self, tag: str, step: int) -> None:
        value = self.held[tag][step]
        if tag.endswith(TEXT):
            self.writer.add_text(tag.removesuffix(TEXT), value, global_step=step)
        else:
            self.writer.add_scalar(tag, float(value), global_step=step)

    def close(self) -> None:
        self.writer.close()


class TensorBoardSink:
    """Evaluation results and alerts in ``<logdir>/areal-eval``; training rows in a run of their
    own below it (``areal-eval/train``): results come after the training steps past them, and in
    one run each would be a restart."""

    name = "tensorboard"

    def __init__(self, config: TensorBoardConfig, *, run_dir: str | Path):
        self.config = config
        self.logdir = config.directory(run_dir)
        self._runs: dict[str, EventRun] = {}

    def open(self) -> None:
        pass  # each run opens at its first point: no empty run shows in TensorBoard

    def _run(self, name: str) -> EventRun:
        if name not in self._runs:
            self._runs[name] = EventRun(self.logdir if name == "eval" else self.logdir / name)
        return self._runs[name]

    def evaluation(self, step: int, metrics: dict, *, prefix: str, answers: list[dict], uri: str) -> None:
        points = {prefix + name: value for name, value in metrics.items()}
        shown = answers[: self.config.answers_per_summary]
        if shown:
            points[prefix + "answers" + TEXT] = answers_markdown(shown, uri)
        self._run("eval").add(step, points)

    def training(self, rows: list[dict]) -> None:
        for row in rows:
            numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self._run("train").add(int(row["step"]), {"train/" + k: v for k, v in numbers.items() if k != "step"})

    def alert(self, rule: str, step: int, message: str) -> None:
        self._run("eval").add(step, {f"alerts/{rule}": 1.0})

    def directive(self, action: str, step: int, *, applied: bool, text: str) -> None:
        self._run("eval").add(step, {f"feedback/{action}": float(applied), f"feedback/{action}{TEXT}": text})

    def end(self, status: str, *, plot: Path | None) -> None:
        pass  # TensorBoard draws its own curves

    def close(self) -> None:
        for run in self._runs.values():
            run.close()
        self._runs = {}


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
