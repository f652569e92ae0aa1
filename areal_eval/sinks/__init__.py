"""The sinks a run's results go to besides MLflow (``tracking.sinks``), behind one recording step.

:class:`Sinks` takes every record (a result and its answers, training rows, an alert, the run's
end) and hands it to each sink that has not acknowledged it yet (:mod:`.outbox`). A sink that
fails is said in one line and left alone for a while; it never stops training or another sink,
and a later turn, the run's end or the next run of the same command (:meth:`Sinks.catch_up`
from the ledger) gives it what it missed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from areal_eval import jsonl
from areal_eval.disk import brief
from areal_eval.runs.directory import RunDir
from areal_eval.sinks.config import SINKS, TensorBoardConfig, WandbConfig, check_sinks
from areal_eval.sinks.outbox import SinkOutbox

__all__ = ["SINKS", "Sinks", "TensorBoardConfig", "WandbConfig", "check_sinks", "open_sinks"]


RETRY_AFTER_S = 60.0
"""How long a sink that failed is left alone before it is tried again."""


class Sinks:
    def __init__(
        self, sinks: list, *, run_dir: str | Path, on_failure: Callable[[str, str], None], single_writer: bool = False
    ):
        self.sinks, self.run_dir, self.on_failure = sinks, Path(run_dir), on_failure
        self.single_writer = single_writer
        """This process is the run's only writer (the in-flow loop that owns it): its sinks stay
        open between records. Otherwise each record opens and closes them, so flow runs of one
        run that record side by side never write one W&B run at once, and each TensorBoard
        writer starts from what the others wrote."""
        self.outbox = SinkOutbox(self.run_dir / "sinks")
        self._failed_at: dict[str, float] = {}
        self._reconciled: set[str] = set()

    def record_evaluation(
        self, step: int, metrics: dict, *, prefix: str = "eval/", items: dict[str, str] | None = None, uri: str = ""
    ) -> None:
        """One checkpoint's metrics at ``step`` (``prefix``: ``eval/``, or ``eval_probe/`` for a
        probe) with a sample of its per-item answers."""
        if not metrics:
            return
        key = f"{prefix}{step}"
        self._turn(
            f"step {step}'s result",
            lambda sink: not self.outbox.has(sink.name, key),
            lambda sink: sink.evaluation(step, metrics, prefix=prefix, answers=answer_rows(items or {}), uri=uri),
            lambda sink: self.outbox.ack(sink.name, key, held=_held(sink)),
        )

    def record_training(self, rows: list[dict]) -> None:
        """Training rows (``{"step": .., "loss": ..}``), each once, past what each sink took."""
        rows = sorted((r for r in rows if "step" in r), key=lambda r: int(r["step"]))
        if not rows:
            return
        last = int(rows[-1]["step"])
        self._turn(
            f"training rows through step {last}",
            lambda sink: self.outbox.through(sink.name) < last,
            lambda sink: sink.training(rows_past(rows, self.outbox.through(sink.name))),
            lambda sink: self.outbox.ack_through(sink.name, last, held=_held(sink)),
        )

    def record_alert(self, rule: str, step: int, message: str) -> None:
        key = f"alert/{rule}/{step}"
        self._turn(
            f"alert {rule} at step {step}",
            lambda sink: not self.outbox.has(sink.name, key),
            lambda sink: sink.alert(rule, step, message),
            lambda sink: self.outbox.ack(sink.name, key, held=_held(sink)),
        )

    def record_directive(self, directive_id: str, step: int, *, applied: bool, text: str) -> None:
        """What evaluation asked of training (``<action>@<step>``), at the step it rests on, once
        its outcome is settled: 1 where training applied it, 0 where not (shadow, refused)."""
        key = f"directive/{directive_id}"
        action = directive_id.split("@", 1)[0]
        self._turn(
            f"directive {directive_id}",
            lambda sink: not self.outbox.has(sink.name, key),
            lambda sink: sink.directive(action, step, applied=applied, text=text),
            lambda sink: self.outbox.ack(sink.name, key, held=_held(sink)),
        )

    def record_end(self, status: str, *, plot: Path | None = None) -> None:
        """The run's end (or a refresh of it): the summary plot, the status."""
        self._turn(f"the run's end ({status})", lambda sink: True, lambda sink: sink.end(status, plot=plot), None)

    def catch_up(self, entries: Iterable, evals_dir: str | Path) -> None:
        """What the ledger holds and a sink missed (it failed, or the process died before it
        acknowledged): results, and the probe metrics of held probes."""
        from areal_eval.evaluation.items import stored_items

        for entry in sorted(entries, key=lambda e: e.step):
            if entry.status == "evaluated":
                items = stored_items(evals_dir, entry.step)
                self.record_evaluation(entry.step, entry.metrics, items=items, uri=entry.uri)
            if entry.probe_metrics and entry.status in ("evaluated", "skipped"):
                self.record_evaluation(entry.step, entry.probe_metrics, prefix="eval_probe/", uri=entry.uri)

    def _turn(self, what: str, wanted, deliver, ack) -> None:
        with self.outbox.turn():
            for sink in self.sinks:
                if not wanted(sink) or self._resting(sink):
                    continue
                try:
                    self._open(sink)
                    if not wanted(sink):  # it had landed before a crash: now acknowledged
                        continue
                    deliver(sink)
                    if ack is not None:
                        ack(sink)
                    self._failed_at.pop(sink.name, None)
                except Exception as exc:  # noqa: BLE001 - a sink's fault is its own: said, and retried later
                    self._failed_at[sink.name] = time.monotonic()
                    self.on_failure(sink.name, f"{what} not recorded in {sink.name} (retried later): {brief(exc)}")
                    self._close(sink)
            if not self.single_writer:  # other flow runs of the run take their turns: each reads what they wrote
                for sink in self.sinks:
                    self._close(sink)

    def _open(self, sink) -> None:
        """Open ``sink``; one that can say what earlier processes left in it (W&B's own files)
        has that acknowledged first, so nothing that landed is sent twice."""
        sink.open()
        if hasattr(sink, "landed") and sink.name not in self._reconciled:
            keys, through = sink.landed()
            for key in sorted(keys):
                if not self.outbox.has(sink.name, key):
                    self.outbox.ack(sink.name, key)
            if through > self.outbox.through(sink.name):
                self.outbox.ack_through(sink.name, through)
            self._reconciled.add(sink.name)

    def _resting(self, sink) -> bool:
        """A sink that failed is left alone for :data:`RETRY_AFTER_S` (a W&B that does not answer
        would hold up every record for its timeout); what it misses meanwhile is caught up later."""
        return time.monotonic() - self._failed_at.get(sink.name, -RETRY_AFTER_S) < RETRY_AFTER_S

    def _close(self, sink) -> None:
        self._reconciled.discard(sink.name)
        try:
            sink.close()
            self.outbox.commit(sink.name)  # closed: what it was given is durable
        except Exception as exc:  # noqa: BLE001
            self.outbox.drop(sink.name)
            self.on_failure(sink.name, f"{sink.name} did not close: {brief(exc)}")

    def close(self) -> None:
        with self.outbox.turn():
            for sink in self.sinks:
                self._close(sink)


def _held(sink) -> bool:
    """Its acknowledgements wait for its close (see :mod:`.outbox`)."""
    return getattr(sink, "durable_on_close", False)


def rows_past(rows: list[dict], through: int) -> list[dict]:
    """The rows (in step order) past step ``through``, the first of each step only: resumed
    training logs again the steps after its checkpoint, and MLflow keeps the first too."""
    kept = []
    for row in rows:
        if int(row["step"]) > through:
            kept.append(row)
            through = int(row["step"])
    return kept


def answer_rows(items: dict[str, str], limit: int = 256) -> list[dict]:
    """The first ``limit`` per-item rows of each evaluator's file, tagged with the evaluator."""
    from areal_eval.evaluation.items import read_items

    rows: list[dict] = []
    for name, path in sorted(items.items()):
        if Path(path).exists():
            rows += [{"evaluator": name, **row} for row in read_items(path)[:limit]]
    return rows


def open_sinks(
    names: list[str],
    *,
    wandb: WandbConfig,
    tensorboard: TensorBoardConfig,
    run_dir,
    run_name: str,
    on_failure,
    single_writer: bool = False,
) -> Sinks:
    """The sinks named in ``tracking.sinks`` other than MLflow (the tracker keeps that one);
    what their configs leave open is where the trainer logs, as its callback found it."""
    found = jsonl.read_json(RunDir(run_dir).trainer_trackers, {}) or {}
    if "wandb" in names:
        trainer = found.get("wandb") or {}
        wandb = dataclasses.replace(
            wandb,
            project=wandb.project or trainer.get("project") or os.environ.get("WANDB_PROJECT") or "areal-eval",
            entity=wandb.entity or trainer.get("entity") or os.environ.get("WANDB_ENTITY"),
            run_id=wandb.run_id or trainer.get("run_id"),
            group=wandb.group or trainer.get("group"),
        )
    if "tensorboard" in names and tensorboard.logdir is None and found.get("tensorboard_logdir"):
        tensorboard = dataclasses.replace(tensorboard, logdir=found["tensorboard_logdir"])
    made = []
    if "tensorboard" in names:
        from areal_eval.sinks.tensorboard_sink import TensorBoardSink

        made.append(TensorBoardSink(tensorboard, run_dir=run_dir))
    if "wandb" in names:
        from areal_eval.sinks.wandb_sink import WandbSink

        made.append(WandbSink(wandb, run_dir=run_dir, run_name=run_name))
    return Sinks(made, run_dir=run_dir, on_failure=on_failure, single_writer=single_writer)
