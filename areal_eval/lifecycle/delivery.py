"""Getting results and training metrics to the tracker without ever holding up the loop.

The tracker (MLflow) can be slow or gone for minutes. What must reach it is already durable
elsewhere: every result is in the ledger and every training row in the training log, so these
are the outbox. A :class:`Deliverer` ships them from a thread of its own: results in step order,
training rows in flushes, each retried with backoff while the tracker refuses, and the loop goes
on deciding and evaluating meanwhile. A result counts as delivered once the tracker took it
(``on_delivered`` records that in the ledger); after a restart, results never delivered are
queued again, and the tracker's own idempotence keeps any point from landing twice.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable

from areal_eval.disk import brief
from areal_eval.evaluation.jobs import EvalResult


class Deliverer:
    def __init__(
        self,
        log_result: Callable[[EvalResult, str], None],
        log_training: Callable[[list[dict]], None],
        warn: Callable[[str], None],
        on_delivered: Callable[[EvalResult], None] = lambda result: None,
        flush_every_s: float = 5.0,
        max_backoff_s: float = 30.0,
    ):
        self._log_result, self._log_training, self._warn = log_result, log_training, warn
        self._on_delivered = on_delivered
        self.flush_every_s, self.max_backoff_s = flush_every_s, max_backoff_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self._results: list[tuple[EvalResult, str]] = []
        self._rows: list[dict] = []
        self._flush_now = False
        # The caller's context (a Prefect flow run's, say) goes with the thread: its calls belong to the run.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name="tracker-delivery", daemon=True)
        self._thread.start()

    def add_result(self, result: EvalResult, reason: str) -> None:
        with self._lock:
            self._results.append((result, reason))
        self._wake.set()

    def add_rows(self, rows: list[dict], flush_now: bool = False) -> None:
        with self._lock:
            self._rows += rows
            self._flush_now |= flush_now
        if flush_now:
            self._wake.set()

    def pending(self) -> tuple[int, int]:
        """Results and training rows not delivered yet."""
        with self._lock:
            return len(self._results), len(self._rows)

    def close(self, timeout_s: float = 60.0) -> tuple[int, int]:
        """Deliver what is left, trying for up to ``timeout_s``; returns what could not be delivered
        (it stays in the ledger and the training log for the next run of the same command)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        self._abandon.set()
        self._wake.set()
        self._thread.join(10)
        return self.pending()

    def _run(self) -> None:
        backoff, last_flush = 0.0, time.monotonic()
        while True:
            self._wake.wait(backoff or self.flush_every_s)
            self._wake.clear()
            stopping = self._stop.is_set()
            ok = self._deliver_results()
            if ok and (self._flush_now or stopping or time.monotonic() - last_flush >= self.flush_every_s):
                ok, last_flush = self._deliver_rows(), time.monotonic()
            if stopping and (ok or self._abandon.is_set()):
                return
            backoff = 0.0 if ok else min(self.max_backoff_s, max(1.0, 2 * backoff))

    def _deliver_results(self) -> bool:
        while True:
            with self._lock:
                if not self._results:
                    return True
                self._results.sort(key=lambda item: item[0].global_step)
                result, reason = self._results[0]
            try:
                self._log_result(result, reason)
            except Exception as exc:  # noqa: BLE001 - the tracker is down or refusing: retried with backoff
                self._warn(
                    f"result of step {result.global_step} not delivered yet "
                    f"({len(self._results)} waiting, retried with backoff): {brief(exc)}"
                )
                return False
            with self._lock:
                self._results.pop(0)
            try:
                self._on_delivered(result)
            except OSError as exc:  # a full disk: in the tracker already, and the tracker logs a step once
                self._warn(f"result of step {result.global_step} delivered, not marked so in the ledger: {brief(exc)}")

    def _deliver_rows(self) -> bool:
        with self._lock:
            rows, self._flush_now = list(self._rows), False
        if not rows:
            return True
        try:
            self._log_training(rows)
        except Exception as exc:  # noqa: BLE001 - kept, retried with backoff
            kept = f"{len(rows)} rows kept, retried with backoff"
            self._warn(f"training metrics not delivered yet ({kept}): {brief(exc)}")
            return False
        with self._lock:
            del self._rows[: len(rows)]
        return True


class Notifier:
    """Sends alerts (and other one-off side effects: a failed attempt's record) from threads of
    its own, so a webhook or a tracker that hangs delays only its own call, never the loop's next
    decision, nor another alert (a stop request included)."""

    def __init__(self, send: Callable[[object], None], warn: Callable[[str], None], workers: int = 4):
        from concurrent.futures import ThreadPoolExecutor

        self._send, self._warn = send, warn
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="alert-notifier")
        self._pending: list = []

    def add(self, alert) -> None:
        self.call(f"alert {alert.rule} at step {alert.step} could not be sent", self._send, alert)

    def call(self, failure: str, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on a notifier thread; if it raises, warn ``failure: <error>``."""
        context = contextvars.copy_context()  # the flow run's: its task runs belong to the run
        self._pending.append(self._pool.submit(context.run, self._run, failure, fn, *args))

    def _run(self, failure: str, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - a side fault: warned about, the run goes on
            self._warn(f"{failure}: {brief(exc)}")

    def close(self, timeout_s: float = 60.0) -> int:
        """Wait up to ``timeout_s`` for the calls in flight; returns how many were left unfinished."""
        from concurrent.futures import wait

        _, left = wait(self._pending, timeout=timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return len(left)
