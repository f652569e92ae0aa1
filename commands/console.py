"""What a flow command prints when it stops: one line first, the cause and what to run next;
the tracebacks go to a file (and stay in the Prefect UI's logs)."""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import traceback
from collections.abc import Iterator
from pathlib import Path

from prefect.exceptions import TerminationSignal
from prefect.logging.handlers import PrefectConsoleHandler

from areal_eval.disk import brief, is_disk_full


class TracebacksToFile(logging.Filter):
    """On the console handler: a record's traceback is appended to ``path`` and the console shows
    the record's line with where its traceback went. Prefect's API handler (the UI's logs) sits on
    the loggers below and has taken the whole record already."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[0] is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as out:
                    out.write(f"--- {record.name}: {record.getMessage()}\n")
                    out.write("".join(traceback.format_exception(*record.exc_info)))
                where = f"traceback in {self.path}"
            except OSError as exc:  # a full disk: the traceback stays in the Prefect UI's logs
                where = f"traceback not written to {self.path}: {exc.strerror}"
            record.msg, record.args = f"{record.getMessage()} ({where})", None
            record.exc_info, record.exc_text = None, None
        return True


@contextlib.contextmanager
def tracebacks_to(path: Path) -> Iterator[None]:
    """Tracebacks that Prefect logs to the console go to ``path`` instead, while this lasts."""
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    keep = TracebacksToFile(path)
    for handler in handlers:
        handler.addFilter(keep)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(keep)


def stop_on_sigterm() -> None:
    """SIGTERM stops this command as Ctrl-C does, through the flow's own clean-up (training and
    evaluation stopped, MLflow KILLED), instead of ending the process where it stands."""

    def raise_termination(signum, frame):
        raise TerminationSignal(signum)

    signal.signal(signal.SIGTERM, raise_termination)


def stop_cause(exc: BaseException) -> str:
    """Why a run stopped, in a few words: a signal by its name, an error by its first line."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if isinstance(exc, TerminationSignal):
        return f"terminated by {signal.Signals(exc.signal).name}"
    if is_disk_full(exc):
        return f"out of disk space: {brief(exc, 500)}"
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:500]}"


def stop_line(exc: BaseException, command: list[str], tracebacks: Path) -> tuple[str, int]:
    """The line a stopped command prints (the cause, then what to run next) and its exit status."""
    again = f"the same command resumes the run: {shlex.join(command)}"
    if isinstance(exc, (KeyboardInterrupt, TerminationSignal)):
        return f"stopped: {stop_cause(exc)}; {again}", 128 + getattr(exc, "signal", signal.SIGINT)
    kept = f" (traceback in {tracebacks})"
    try:
        tracebacks.parent.mkdir(parents=True, exist_ok=True)
        with tracebacks.open("a") as out:
            out.write(f"--- stopped\n{''.join(traceback.format_exception(exc))}")
    except OSError:  # a full disk, say: the line still goes out
        kept = ""
    if is_disk_full(exc):
        again = f"free space there, then {again}"
    return f"stopped: {stop_cause(exc)}; {again}{kept}", 1
