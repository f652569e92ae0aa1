"""The library's follow loop with plain effects: slots, out-of-order completions, side faults."""

import json
import shutil
import threading
import time
from concurrent.futures import Future

from areal_eval.alerts import AlertEngine, AlertRule, AlertsConfig
from areal_eval.checkpoints.manifest import CheckpointEvent, Manifest
from areal_eval.evaluation.jobs import EvalResult, EvaluationFailed
from areal_eval.lifecycle.follow_loop import FollowLoop, LoopConfig
from areal_eval.lifecycle.planner import EvaluationPlanner
from areal_eval.runs.ledger import FINAL_STATES, Ledger
from areal_eval.scheduling.policy import SchedulerConfig


def accuracy_at(step):
    return 0.5 + step / 1000


class ReversingIO:
    """Completes evaluations newest first whenever two are in flight (out of order)."""

    def __init__(self, fail_steps=(), failing_flushes=1, metric=accuracy_at):
        self.metric = metric
        self.lock = threading.Lock()
        self.pending: list[tuple[int, Future]] = []
        self.most_in_flight = 0
        self.logged: list[EvalResult] = []
        self.rows: list[dict] = []
        self.alerts, self.warnings, self.announced, self.failed_attempts = [], [], [], []
        self.fail_steps, self.failing_flushes = set(fail_steps), failing_flushes
        self.fail_once: set = set()  # steps whose evaluation fails the first time only
        self.lonely_s = 0.05  # how long an evaluation alone in flight waits for one to overtake it
        self.stop = threading.Event()
        threading.Thread(target=self._complete, daemon=True).start()

    def _complete(self):
        lonely_since = None
        while not self.stop.is_set():
            with self.lock:
                self.most_in_flight = max(self.most_in_flight, len(self.pending))
                ready = len(self.pending) >= 2 or (lonely_since and time.monotonic() - lonely_since > self.lonely_s)
                item = self.pending.pop() if ready and self.pending else None
                lonely_since = (lonely_since or time.monotonic()) if len(self.pending) == 1 else None
            if item:
                step, future = item
                if step in self.fail_steps:
                    future.set_exception(EvaluationFailed(f"step {step}: worker died"))
                    if step in self.fail_once:  # its own first failure, whichever step completes first
                        self.fail_steps.discard(step)
                else:
                    future.set_result(
                        EvalResult(step, f"/c/{step}", {"accuracy": self.metric(step), "accuracy_stderr": 0.01}, 0.0)
                    )
            time.sleep(0.005)

    def announce(self, event):
        self.announced.append(event.global_step)

    def submit(self, event, reason):
        future = Future()
        with self.lock:
            self.pending.append((event.global_step, future))
        return future

    def log_result(self, result, reason):
        self.logged.append(result)

    def send_alert(self, alert):
        self.alerts.append(alert)

    def log_failed_attempt(self, step):
        self.failed_attempts.append(step)

    def log_training(self, rows):
        if self.failing_flushes:
            self.failing_flushes -= 1
            raise ConnectionError("MLflow unreachable")
        self.rows += rows

    def delete_checkpoints(self, events):
        raise AssertionError("retention is off")

    def say_directive(self, directive):
        self.warnings.append(directive.line())

    def info(self, message):
        pass

    def warn(self, message):
        self.warnings.append(message)


def write_run(tmp_path, steps):
    manifest = Manifest(tmp_path / "manifest.jsonl")
    for step in steps:
        manifest.append(CheckpointEvent("r", f"/c/{step}", 0, step, step, time.time(), {}, final=step == steps[-1]))
    train_log = tmp_path / "train_log.jsonl"
    train_log.write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / (s + 1)}) + "\n" for s in range(1, steps[-1] + 1))
    )
    return manifest, train_log


def run_loop(
    tmp_path,
    io,
    slots,
    steps=tuple(range(0, 200, 10)),
    alerts=None,
    delivery_timeout_s=60.0,
    cfg=None,
    refined=False,
    max_attempts=1,
    external_timeout_s=None,
):
    alerts = alerts or AlertsConfig()
    if not (tmp_path / "manifest.jsonl").exists():
        write_run(tmp_path, list(steps))
    manifest, train_log = Manifest(tmp_path / "manifest.jsonl"), tmp_path / "train_log.jsonl"
    if slots == 1:
        io.lonely_s = 0.0  # one slot: nothing can overtake an evaluation
    cfg = cfg or SchedulerConfig(policy="fixed", fixed_interval_steps=1, coalesce=False)
    planner = EvaluationPlanner(cfg, Ledger(tmp_path / "ledger.jsonl"))
    loop = FollowLoop(
        planner,
        manifest,
        train_log,
        AlertEngine(alerts),
        io,
        LoopConfig(
            poll_interval_s=0.01,
            train_log_every_s=0.0,
            slots=slots,
            delivery_timeout_s=delivery_timeout_s,
            refined=refined,
            max_attempts=max_attempts,
            external_timeout_s=external_timeout_s,
        ),
    )
    try:
        return loop.run()
    finally:
        io.stop.set()


def test_a_suspected_regression_looks_back_and_the_confirming_alert_fires_on_that_result(tmp_path):
    # Flat, then down from step 140 (skipped): 160's result is the first to show it and looks
    # back at 150 and 140; the default rule, confirming on two results in a row, fires at once.
    from areal_eval.alerts import NOISE_AWARE_REGRESSION

    io = ReversingIO(metric=lambda step: 0.8 if step < 140 else 0.75)
    rules = AlertsConfig(rules=[AlertRule(name="drop", kind="regression", **NOISE_AWARE_REGRESSION)])
    cfg = SchedulerConfig(max_interval_growth=None, refine_stderrs=None)
    steps = list(range(0, 200, 10))
    write_run(tmp_path, steps)
    published = (tmp_path / "manifest.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "manifest.jsonl").write_text(published[0])

    def handled(step):
        ledger = Ledger(tmp_path / "ledger.jsonl")
        return ledger.status(step) in ("evaluated", "skipped") and all(
            e.status != "scheduled" for e in ledger.entries()
        )

    def train():  # the next checkpoint once every one so far is handled, as a slow trainer saves
        for line, step in zip(published[1:], steps, strict=False):
            while not handled(step):
                time.sleep(0.005)
            with open(tmp_path / "manifest.jsonl", "a") as f:
                f.write(line)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    ledger = run_loop(tmp_path, io, slots=1, alerts=rules, cfg=cfg, external_timeout_s=60)
    trainer.join(10)
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    # 170 too when it is decided before their results are in (160 is then a fresh regression).
    assert evaluated[:9] == [0, 10, 40, 70, 100, 130, 140, 150, 160] and evaluated[-1] == 190
    assert ledger.latest(150).reason.startswith("look back: step 160 is 0.05 below best")
    # Fired once 140's result, the first served and the second in a row, is in (without: at 170's).
    first = io.alerts[0]
    assert first.rule == "drop" and first.step == 140
    assert "at step 160" in first.message and "2 evaluations in a row" in first.message


def test_two_slots_with_out_of_order_completions_land_at_their_own_step(tmp_path):
    io = ReversingIO()
    ledger = run_loop(tmp_path, io, slots=2)
    assert io.most_in_flight == 2
    completion_order = [r.global_step for r in io.logged]
    assert completion_order != sorted(completion_order)  # they did finish out of order
    assert all(r.metrics["accuracy"] == accuracy_at(r.global_step) for r in io.logged)
    entries = ledger.entries()
    assert all(e.status in FINAL_STATES for e in entries)
    evaluated = {e.step: e.metrics["accuracy"] for e in entries if e.status == "evaluated"}
    assert sorted(evaluated) == sorted(completion_order)  # each evaluation recorded once
    assert all(value == accuracy_at(step) for step, value in evaluated.items())
    assert io.announced == list(range(0, 200, 10))


def test_a_failed_flush_is_retried_and_a_failed_evaluation_alerts(tmp_path):
    io = ReversingIO(fail_steps={50}, failing_flushes=1)
    rules = AlertsConfig(rules=[AlertRule(name="eval-failed", kind="eval_failed", throttle_secs=0)])
    ledger = run_loop(tmp_path, io, slots=1, alerts=rules)
    assert io.warnings and "MLflow unreachable" in io.warnings[0]
    assert [r["step"] for r in io.rows] == list(range(1, 191))  # every row once, in order
    assert ledger.status(50) == "failed" and "worker died" in ledger.latest(50).reason
    assert [a.rule for a in io.alerts] == ["eval-failed"] and io.alerts[0].step == 50
    assert ledger.status(190) == "evaluated"


def test_a_transient_failure_is_queued_again_and_every_attempt_stays_on_record(tmp_path):
    io = ReversingIO(fail_steps={50, 100}, failing_flushes=0)
    io.fail_once = {50}
    rules = AlertsConfig(rules=[AlertRule(name="eval-failed", kind="eval_failed", throttle_secs=0)])
    ledger = run_loop(tmp_path, io, slots=2, alerts=rules, max_attempts=2)
    io.stop.set()
    first, twice = ledger.latest(50), ledger.latest(100)
    assert first.status == "evaluated" and first.attempts == ["transient: step 50: worker died"]
    assert twice.status == "failed" and twice.reason == "gave up after 2 attempts: step 100: worker died"
    assert [a.step for a in io.alerts] == [100]  # alerted once, when it failed for good
    assert sorted(io.failed_attempts) == [50, 100, 100]  # each failed attempt went to the tracker


class HangingWebhookIO(ReversingIO):
    """Every notification hangs until all ``expected`` results were logged (a loop the webhook
    held up never gets there)."""

    def __init__(self, expected: int):
        super().__init__(failing_flushes=0)
        self.release = threading.Event()
        self.logged_while_hanging, self.expected = 0, expected

    def log_result(self, result, reason):
        super().log_result(result, reason)
        self.logged_while_hanging += not self.release.is_set()
        if self.logged_while_hanging == self.expected:
            self.release.set()

    def send_alert(self, alert):
        self.release.wait(60)
        super().send_alert(alert)


def test_a_hanging_webhook_never_holds_up_the_loop(tmp_path):
    io = HangingWebhookIO(expected=20)
    rules = AlertsConfig(rules=[AlertRule(name="seen", kind="threshold", op=">", value=0.0, throttle_secs=0)])
    backstop = threading.Timer(60.0, io.release.set)  # a loop held up by the webhook: the count below fails
    backstop.start()
    try:
        ledger = run_loop(tmp_path, io, slots=1, alerts=rules)
    finally:
        io.release.set()
        backstop.cancel()
    assert io.logged_while_hanging == 20 == len([e for e in ledger.entries() if e.status == "evaluated"])
    assert len(io.alerts) == 20  # sent once the webhook answered, before the loop returned


class NotedIO(ReversingIO):
    def submit(self, event, reason):
        future = Future()
        note = "3 of 41 prompts were longer than max_prompt_tokens (8 tokens) and kept their end"
        future.set_result(EvalResult(event.global_step, "/c", {"accuracy": 0.5}, 0.0, notes=[note]))
        return future


def test_what_went_wrong_without_failing_an_evaluation_is_warned_and_in_the_ledger_reason(tmp_path):
    io = NotedIO(failing_flushes=0)
    ledger = run_loop(tmp_path, io, slots=1, steps=(0, 10))
    assert ledger.latest(10).reason.endswith(
        "; 3 of 41 prompts were longer than max_prompt_tokens (8 tokens) and kept their end"
    )
    assert sum("longer than max_prompt_tokens" in w for w in io.warnings) == 2


class FlakySideEffectsIO(ReversingIO):
    """The tracker refuses the first results; every notification fails."""

    def __init__(self, refused_logs=3):
        super().__init__(failing_flushes=0)
        self.refused_logs = refused_logs

    def log_result(self, result, reason):
        if self.refused_logs:
            self.refused_logs -= 1
            raise ConnectionError("MLflow unreachable")
        super().log_result(result, reason)

    def send_alert(self, alert):
        raise ConnectionError("webhook refused")


def test_unreachable_tracker_and_refusing_webhook_never_stop_the_loop(tmp_path):
    io = FlakySideEffectsIO()
    rules = AlertsConfig(rules=[AlertRule(name="seen", kind="threshold", op=">", value=0.0, throttle_secs=0)])
    ledger = run_loop(tmp_path, io, slots=1, alerts=rules)
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    assert evaluated == list(range(0, 200, 10))
    assert sorted(r.global_step for r in io.logged) == evaluated  # each logged once, none lost
    assert any("not delivered yet" in w for w in io.warnings)
    assert all(e.delivered for e in ledger.entries() if e.status == "evaluated")
    assert sum("could not be sent" in w for w in io.warnings) == len(evaluated)


class TrackerDownIO(ReversingIO):
    def __init__(self):
        super().__init__(failing_flushes=10**6)

    def log_result(self, result, reason):
        raise ConnectionError("MLflow unreachable")


def test_results_a_run_could_not_deliver_are_delivered_by_the_next_run_once(tmp_path):
    down = TrackerDownIO()
    ledger = run_loop(tmp_path, down, slots=1, delivery_timeout_s=1.0)
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    assert evaluated and not any(e.delivered for e in ledger.entries())
    assert any("the same command delivers them" in w for w in down.warnings)
    back = ReversingIO(failing_flushes=0)
    ledger = run_loop(tmp_path, back, slots=1)  # the same command again, the tracker back
    assert sorted(r.global_step for r in back.logged) == evaluated  # each delivered once, in the end
    assert [r.global_step for r in back.logged] == sorted(r.global_step for r in back.logged)  # in step order
    assert [r["step"] for r in back.rows] == list(range(1, 191))
    assert all(e.delivered for e in ledger.entries() if e.status == "evaluated")


def test_a_re_run_of_a_refined_run_evaluates_nothing_more(tmp_path):
    """A run refined and ended before only reports when run again. Refining again is not a no-op:
    a refined neighbour that ties the best becomes the best (the earliest wins), with a skipped
    neighbour of its own, so each re-run walked one checkpoint further down a plateau."""

    def plateau(step):
        return min(0.5 + step / 200, 0.8)  # best first reached at step 60; 70 was skipped

    every_other = SchedulerConfig(policy="fixed", fixed_interval_steps=20, coalesce=False)
    run_loop(tmp_path / "run", ReversingIO(failing_flushes=0, metric=plateau), slots=1, cfg=every_other)
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    adaptive = SchedulerConfig(coalesce=False)

    again = ReversingIO(failing_flushes=0, metric=plateau)
    ledger = run_loop(tmp_path / "run", again, slots=1, cfg=adaptive, refined=True)
    assert again.logged == [] and ledger.status(70) == "skipped"

    unflagged = ReversingIO(failing_flushes=0, metric=plateau)  # what every re-run did before
    ledger = run_loop(tmp_path / "copy", unflagged, slots=1, cfg=adaptive)
    assert [r.global_step for r in unflagged.logged] == [70] and ledger.latest(70).reason.startswith("refine")


def test_lines_torn_by_a_crash_in_the_ledger_and_training_log_are_skipped_and_named(tmp_path):
    io = ReversingIO(failing_flushes=0)
    first = run_loop(tmp_path, io, slots=1, steps=(0, 10, 20))
    assert [e.status for e in first.entries()] == ["evaluated"] * 3
    ledger_path, train_log = tmp_path / "ledger.jsonl", tmp_path / "train_log.jsonl"
    lines = ledger_path.read_bytes().splitlines(keepends=True)
    ledger_path.write_bytes(b"".join(lines[:-1]) + lines[-1][:25])  # the last entry torn mid-write
    with train_log.open("ab") as fh:
        fh.write(b'{"step": 21, "lo')  # training killed mid-line; the next append closes it
    from areal_eval import jsonl

    jsonl.append(train_log, {"step": 21, "loss": 0.5})

    again = ReversingIO(failing_flushes=0)
    ledger = run_loop(tmp_path, again, slots=1, steps=(0, 10, 20))  # the same command again
    torn_at = len(lines)
    assert any(w.startswith(f"{ledger_path}:{torn_at}: skipped (torn") for w in again.warnings), again.warnings
    assert any(f"{train_log}:21: not valid JSON" in w for w in again.warnings), again.warnings
    assert [e.status for e in ledger.entries()] == ["evaluated"] * 3
    assert [r["step"] for r in again.rows][-1] == 21
