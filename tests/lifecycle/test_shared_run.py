"""The record flow runs share when they evaluate a run from outside: decisions as the in-flow
planner makes them, one claimant per checkpoint, alerts judged by step, one end."""

import threading

import pytest

from areal_eval.alerts import AlertRule, AlertsConfig
from areal_eval.checkpoints.manifest import CheckpointError, CheckpointEvent, Manifest
from areal_eval.evaluation.jobs import EvalResult, EvaluationDataError
from areal_eval.lifecycle.outcome import Attempt
from areal_eval.lifecycle.planner import EvaluationPlanner
from areal_eval.lifecycle.shared_run import SharedRun
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger
from areal_eval.scheduling.policy import SchedulerConfig

SCHED = SchedulerConfig(min_interval_steps=10, max_interval_steps=40)
REGRESSION = AlertsConfig(rules=[AlertRule(name="drop", kind="regression", tolerance=0.05, throttle_secs=3600)])


def publish(tmp_path, steps, final_at=None):
    manifest = Manifest(tmp_path / "manifest.jsonl")
    for step in steps:
        manifest.append(
            CheckpointEvent("r", f"/c/{step}", 0, step, step, 1.0, {"loss": 1.0 / (step + 1)}, final=step == final_at)
        )
    return manifest


def result(event, metrics):
    """An attempt that produced ``metrics``."""
    return Attempt(event, result=EvalResult(event.global_step, event.uri, metrics, 0.0))


def record(tmp_path, alerts=None, sched=SCHED):
    return SharedRun(RunDir(tmp_path), Manifest(tmp_path / "manifest.jsonl"), sched, alerts or AlertsConfig(), "r")


def test_a_burst_of_events_decides_as_the_in_flow_planner_does(tmp_path):
    steps = [0, 5, 10, 15, 20, 25, 30]
    publish(tmp_path, steps)
    reference = EvaluationPlanner(SCHED, Ledger(tmp_path / "reference.jsonl"))
    expected = {e.global_step: reference.offer(e) for e in Manifest(tmp_path / "manifest.jsonl").events()}

    # Five flow runs for the newest checkpoints start at once, in any order.
    claims = {}
    threads = [
        threading.Thread(target=lambda s=s: claims.__setitem__(s, record(tmp_path).claim(s, f"run-{s}")[0]))
        for s in reversed(steps[2:])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger = Ledger(tmp_path / "ledger.jsonl")
    for step, decision in expected.items():
        assert (ledger.status(step) == "scheduled") == decision.evaluate, step
        assert ledger.latest(step).reason == decision.reason
    for step, claim in claims.items():
        assert claim.evaluate == expected[step].evaluate
        if claim.evaluate:
            assert ledger.latest(step).owner == f"run-{step}"
    decided = [line for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert len(decided) == len(steps) + sum(c.evaluate for c in claims.values())  # each decided once, then claimed


def test_one_claimant_per_checkpoint_and_a_dead_ones_claim_is_taken_over(tmp_path):
    publish(tmp_path, [0])
    first, _ = record(tmp_path).claim(0, "a")
    assert first.evaluate and first.reason == "first checkpoint"
    second, _ = record(tmp_path).claim(0, "b", alive=lambda owner: True)
    assert not second.evaluate and second.reason == "being evaluated by a"
    third, _ = record(tmp_path).claim(0, "c", alive=lambda owner: False)
    assert third.evaluate and Ledger(tmp_path / "ledger.jsonl").latest(0).owner == "c"
    record(tmp_path).record_outcome(result(third.event, {"accuracy": 0.5}))
    again, new = record(tmp_path).claim(0, "d", forced="manual")
    assert not again.evaluate and again.reason.startswith("already evaluated") and new == []


def test_a_forced_evaluation_keeps_the_schedulers_reason(tmp_path):
    publish(tmp_path, [0, 1])
    claim, new = record(tmp_path).claim(1, "a")
    assert not claim.evaluate and claim.reason.startswith("skipped") and [e.global_step for e in new] == [0, 1]
    forced, _ = record(tmp_path).claim(1, "a", forced="manual")
    assert forced.evaluate and forced.reason.startswith("manual; scheduler: skipped")
    record(tmp_path).record_outcome(result(forced.event, {"accuracy": 0.5}))
    assert Ledger(tmp_path / "ledger.jsonl").latest(1).reason == forced.reason


def test_unhandled_and_skipped_steps(tmp_path):
    publish(tmp_path, [0, 5, 10, 50])
    record(tmp_path).claim(0, "live")
    rec = record(tmp_path)
    assert rec.unhandled(alive=lambda owner: owner == "live") == [10, 50]
    assert rec.skipped() == [5]


def test_alerts_judge_by_step_and_throttle_across_flow_runs(tmp_path):
    publish(tmp_path, [0, 10, 20, 30])
    events = {e.global_step: e for e in Manifest(tmp_path / "manifest.jsonl").events()}
    rec = record(tmp_path, REGRESSION)
    assert rec.record_outcome(result(events[30], {"accuracy": 0.9})).alerts == []
    # An old checkpoint evaluated later is judged against steps before it, not against step 30.
    assert rec.record_outcome(result(events[10], {"accuracy": 0.7})).alerts == []
    fired = record(tmp_path, REGRESSION).record_outcome(result(events[20], {"accuracy": 0.6})).alerts
    assert [(a.step, a.throttled) for a in fired] == [(20, False)] and "best 0.7 before it" in fired[0].message
    # Another flow run (a new SharedRun) sees the rule notified an hour's throttle ago.
    fired = record(tmp_path, REGRESSION).record_outcome(result(events[30], {"accuracy": 0.5})).alerts
    assert [(a.step, a.throttled) for a in fired] == [(30, True)]


def test_refinement_then_one_end(tmp_path):
    publish(tmp_path, [0, 10, 20, 30, 40], final_at=40)
    rec = record(tmp_path, sched=SchedulerConfig(min_interval_steps=20, max_interval_steps=40))
    for step in (0, 10, 20, 30, 40):
        claim, _ = rec.claim(step, "a")
        assert rec.refinements("a") == [] and rec.finish() is None  # the run is not over
        if claim.evaluate:
            rec.record_outcome(result(claim.event, {"accuracy": {0: 0.5, 20: 0.9, 40: 0.895}[step]}))
    refined = rec.refinements("a")
    assert [e.global_step for e in refined] == [30] and rec.finish() is None  # refinement still scheduled
    assert rec.refinements("a") == []  # once
    for event in refined:
        rec.record_outcome(result(event, {"accuracy": 0.85}))
    ledger = rec.finish()
    assert ledger is not None and all(e.status != "scheduled" for e in ledger.entries())
    assert rec.finish() is None


def test_a_suspected_regression_looks_back_for_the_flow_run_that_recorded_it(tmp_path):
    # Flat, then down from step 50: 70's result looks back at 60 and 50, claimed by the flow run
    # that recorded 70; a sweep takes them over only once that flow run is gone.
    sched = SchedulerConfig(min_interval_steps=0, max_interval_steps=None, max_interval_growth=None)
    rec = record(tmp_path, sched=sched)
    looked_back = {}
    for step in range(0, 80, 10):  # published one at a time, each claimed as its event arrives
        Manifest(tmp_path / "manifest.jsonl").append(CheckpointEvent("r", f"/c/{step}", 0, step, step, 1.0, {}))
        claim, _ = rec.claim(step, "a")
        if claim.evaluate:
            metrics = {"accuracy": 0.8 if step < 50 else 0.75, "accuracy_stderr": 0.01}
            outcome = rec.record_outcome(result(claim.event, metrics), deleted={20}, owner="a")
            looked_back[step] = [e.global_step for e in outcome.looked_back]
    assert looked_back == {0: [], 10: [], 40: [], 70: [60, 50]}
    entry = Ledger(tmp_path / "ledger.jsonl").latest(60)
    assert (entry.status, entry.owner) == ("scheduled", "a") and entry.reason.startswith("look back: step 70")
    assert rec.unhandled(alive=lambda owner: True) == [] and rec.unhandled(alive=lambda owner: False) == [50, 60]


def test_a_missing_manifest_or_step_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no such manifest file"):
        record(tmp_path).claim(0, "a")
    publish(tmp_path, [0])
    with pytest.raises(CheckpointError, match="no checkpoint at step 7"):
        record(tmp_path).claim(7, "a")


def test_a_transient_failure_is_retried_with_backoff_and_a_permanent_one_ends_the_run(tmp_path):
    from areal_eval.failures import retry_backoff_s

    publish(tmp_path, [0, 10], final_at=10)
    rec = record(tmp_path, AlertsConfig(rules=[AlertRule(name="eval-failed", kind="eval_failed", throttle_secs=0)]))
    claim, decided = rec.claim(0, "a")
    assert [e.global_step for e in decided] == [0, 10] and [e.global_step for e in rec.take_decided()] == [0, 10]
    assert (
        rec.record_outcome(Attempt(claim.event, error=RuntimeError("rank 1 died")), max_attempts=3).alerts == []
    )  # no alert yet
    entry = Ledger(tmp_path / "ledger.jsonl").latest(0)
    assert (entry.status, entry.owner, entry.attempts) == ("scheduled", None, ["transient: rank 1 died"])
    # The sweep picks it up once its backoff is over, not before.
    assert rec.unhandled(alive=lambda o: False, now=lambda: entry.time + 1) == [10]
    assert rec.unhandled(alive=lambda o: False, now=lambda: entry.time + retry_backoff_s(1)) == [0, 10]
    claim, _ = rec.claim(0, "b")
    rec.record_outcome(result(claim.event, {"accuracy": 0.5}))
    entry = Ledger(tmp_path / "ledger.jsonl").latest(0)
    assert entry.status == "evaluated" and entry.attempts == ["transient: rank 1 died"]  # still on record

    claim, _ = rec.claim(10, "b")
    fired = rec.record_outcome(
        Attempt(claim.event, error=EvaluationDataError("no such validation data file")), max_attempts=3
    ).alerts
    assert [a.rule for a in fired] == ["eval-failed"]
    assert Ledger(tmp_path / "ledger.jsonl").latest(10).status == "failed"
    assert rec.unhandled(alive=lambda o: False) == []  # never retried
    assert rec.refinements("b") == [] and rec.finish() is not None  # a failed final still ends the run


def test_the_last_allowed_transient_attempt_fails_the_checkpoint_naming_every_attempt(tmp_path):
    publish(tmp_path, [0])
    rec = record(tmp_path)
    for attempt in range(1, 3):
        claim, _ = rec.claim(0, f"run-{attempt}")
        assert claim.evaluate
        rec.record_outcome(Attempt(claim.event, error=TimeoutError(f"timeout {attempt}")), max_attempts=2)
    entry = Ledger(tmp_path / "ledger.jsonl").latest(0)
    assert entry.status == "failed" and entry.reason == "gave up after 2 attempts: timeout 2"
    assert entry.attempts == ["transient: timeout 1", "transient: timeout 2"]


def test_a_full_disk_fails_the_flow_run_and_leaves_the_checkpoint_claimed_until_its_run_is_gone(tmp_path):
    import errno

    from areal_eval.disk import DiskFull

    publish(tmp_path, [0, 10], final_at=10)
    rec = record(tmp_path)
    claim, _ = rec.claim(0, "a")
    full = DiskFull(tmp_path / "evals", "the evaluation of step 0", OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(DiskFull):
        rec.record_outcome(Attempt(claim.event, error=full), max_attempts=3)
    entry = Ledger(tmp_path / "ledger.jsonl").latest(0)
    assert (entry.status, entry.owner, entry.attempts) == ("scheduled", "a", [])  # no attempt spent on it
    assert rec.unhandled(alive=lambda o: o == "a") == [10]
    assert rec.unhandled(alive=lambda o: False) == [0, 10]  # the sweep takes it once "a" is gone
