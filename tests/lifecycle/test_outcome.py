"""The outcome step every path shares: what an attempt's result or error does to the ledger, which
alerts it fires, and what is left to the caller; the in-flow loop and the shared record agree."""

import pytest

from areal_eval.alerts import AlertEngine, AlertRule, AlertsConfig
from areal_eval.checkpoints.manifest import CheckpointEvent, Manifest
from areal_eval.evaluation.jobs import CorruptCheckpoint, EvalResult, EvaluationDataError
from areal_eval.feedback import FeedbackConfig, FeedbackJudge
from areal_eval.lifecycle.outcome import Attempt, follow_outcome, record_outcome
from areal_eval.lifecycle.planner import EvaluationPlanner
from areal_eval.lifecycle.shared_run import SharedRun
from areal_eval.runs.directives import Directives
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger
from areal_eval.scheduling.policy import SchedulerConfig

EVERY = SchedulerConfig(policy="fixed", fixed_interval_steps=1, coalesce=False)
RULES = AlertsConfig(
    rules=[
        AlertRule(name="drop", kind="regression", tolerance=0.05, throttle_secs=0),
        AlertRule(name="failed", kind="eval_failed", throttle_secs=0),
    ]
)


def ev(step):
    return CheckpointEvent("r", f"/ckpt/{step}", 0, step, step, 0.0, {})


def result(step, accuracy=None, probe=None, stderr=None):
    metrics = {} if accuracy is None else {"accuracy": accuracy}
    if stderr is not None:
        metrics["accuracy_stderr"] = stderr
    return EvalResult(step, f"/ckpt/{step}", metrics, 0.0, probe_metrics=probe or {})


def scheduled(tmp_path, cfg=EVERY, steps=(0,)):
    planner = EvaluationPlanner(cfg, Ledger(tmp_path / "ledger.jsonl"))
    for step in steps:
        planner.offer(ev(step))
        assert planner.next() == ev(step)
    return planner


def test_a_result_is_recorded_judged_and_left_to_deliver(tmp_path):
    planner, engine = scheduled(tmp_path, steps=(0, 10)), AlertEngine(RULES)
    first = record_outcome(planner, Attempt(ev(0), result=result(0, 0.9)), engine)
    assert first.alerts == [] and first.deliver and first.retry is None
    second = record_outcome(planner, Attempt(ev(10), result=result(10, 0.5)), engine, logged_by_evaluator=True)
    assert [a.rule for a in second.alerts] == ["drop"] and not second.deliver
    assert [(e.status, e.delivered) for e in planner.ledger.entries()] == [("evaluated", False), ("evaluated", True)]


def test_a_transient_failure_is_queued_again_until_the_last_attempt_fails_it_and_alerts(tmp_path):
    planner, engine = scheduled(tmp_path), AlertEngine(RULES)
    outcome = record_outcome(planner, Attempt(ev(0), error=RuntimeError("rank 1 died")), engine, max_attempts=2)
    assert outcome.retry == "rank 1 died" and outcome.alerts == [] and planner.ledger.status(0) == "scheduled"
    assert planner.next() == ev(0)
    outcome = record_outcome(planner, Attempt(ev(0), error=RuntimeError("rank 0 died")), engine, max_attempts=2)
    assert outcome.retry is None and [a.rule for a in outcome.alerts] == ["failed"]
    assert planner.ledger.latest(0).reason == "gave up after 2 attempts: rank 0 died"


@pytest.mark.parametrize("error", [CorruptCheckpoint("bad hash"), EvaluationDataError("no such file")])
def test_a_permanent_failure_or_a_bad_checkpoint_fails_at_once(tmp_path, error):
    planner = scheduled(tmp_path)
    outcome = record_outcome(planner, Attempt(ev(0), error=error), AlertEngine(RULES), max_attempts=5)
    assert outcome.retry is None and [a.rule for a in outcome.alerts] == ["failed"]
    assert planner.ledger.status(0) == "failed"


def test_a_full_disk_stops_the_attempt_with_nothing_recorded_and_the_checkpoint_still_scheduled(tmp_path):
    import errno

    from areal_eval.disk import DiskFull

    planner = scheduled(tmp_path)
    before = planner.ledger.latest(0)
    full = DiskFull(tmp_path / "evals", "the evaluation of step 0", OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(DiskFull, match="no space left on the disk of .*evals"):
        record_outcome(planner, Attempt(ev(0), error=full), AlertEngine(RULES), max_attempts=5)
    assert planner.ledger.latest(0) == before and planner.ledger.status(0) == "scheduled"


def test_a_drop_at_the_final_checkpoint_fires_unconfirmed_with_the_default_rule(tmp_path):
    import dataclasses

    from areal_eval.alerts import NOISE_AWARE_REGRESSION

    rules = AlertsConfig(rules=[AlertRule(name="drop", kind="regression", throttle_secs=0, **NOISE_AWARE_REGRESSION)])
    for final in (False, True):
        planner, engine = scheduled(tmp_path / str(final), steps=(0, 10, 20, 30)), AlertEngine(rules)
        for step in (0, 10, 20):
            record_outcome(planner, Attempt(ev(step), result=result(step, 0.8, stderr=0.01)), engine)
        last = dataclasses.replace(ev(30), final=final)
        outcome = record_outcome(planner, Attempt(last, result=result(30, 0.755, stderr=0.01)), engine)
        assert [a.rule for a in outcome.alerts] == (["drop"] if final else [])  # 3.9 errors below the level


def test_a_probe_is_held_or_escalated_and_never_alerted_on(tmp_path):
    cfg = SchedulerConfig(policy="fixed", fixed_interval_steps=20, probe_fraction=0.2)
    planner = scheduled(tmp_path, cfg, steps=(0,))
    first = result(0, 0.5, {"accuracy": 0.5, "accuracy_stderr": 0.01})
    record_outcome(planner, Attempt(ev(0), result=first), AlertEngine(RULES))

    def probe(step, accuracy):
        planner.offer(ev(step))
        assert planner.next() == ev(step) and planner.is_probe(step)
        probed = result(step, probe={"accuracy": accuracy, "accuracy_stderr": 0.01})
        return record_outcome(planner, Attempt(ev(step), result=probed, probe=True), AlertEngine(RULES))

    held = probe(10, 0.5)
    assert not held.decision.evaluate and held.deliver and held.alerts == [] and planner.ledger.status(10) == "skipped"
    moved = probe(15, 0.1)
    assert moved.decision.evaluate and not moved.deliver and moved.alerts == []
    assert planner.ledger.status(15) == "scheduled"


def test_an_attempt_has_a_result_or_an_error():
    with pytest.raises(ValueError, match="a result or an error"):
        Attempt(ev(0))


def test_the_in_flow_loop_and_the_shared_record_come_to_the_same_outcomes(tmp_path):
    """The same attempts, recorded as the in-flow loop records them (one planner and alert engine
    in memory) and as flow runs do (SharedRun, from the ledger on disk, one call each)."""
    attempts = [
        Attempt(ev(0), result=result(0, 0.8)),
        Attempt(ev(10), error=RuntimeError("rank 1 died")),
        Attempt(ev(10), result=result(10, 0.6)),
        Attempt(ev(20), error=CorruptCheckpoint("bad hash")),
        Attempt(ev(30), result=result(30, 0.9)),
    ]
    in_flow = tmp_path / "in-flow"
    planner, engine, fired = EvaluationPlanner(EVERY, Ledger(in_flow / "ledger.jsonl")), AlertEngine(RULES), []
    for attempt in attempts:
        if planner.ledger.status(attempt.event.global_step) is None:
            planner.offer(attempt.event)
        assert planner.next() == attempt.event
        fired += [(a.step, a.rule) for a in record_outcome(planner, attempt, engine, max_attempts=3).alerts]

    shared = RunDir(tmp_path / "shared")
    manifest = Manifest(shared.root / "manifest.jsonl")
    shared_run, fired_shared = SharedRun(shared, manifest, EVERY, RULES, "r"), []
    for attempt in attempts:  # each checkpoint published when the in-flow loop saw it
        if attempt.event not in manifest.events():
            manifest.append(attempt.event)
        claim, _ = shared_run.claim(attempt.event.global_step, "a")
        assert claim.evaluate
        outcome = shared_run.record_outcome(attempt, max_attempts=3, logged_by_evaluator=False)
        fired_shared += [(a.step, a.rule) for a in outcome.alerts]

    def ledger_of(path):
        return [(e.step, e.status, e.reason, e.attempts) for e in Ledger(path).entries()]

    assert fired == fired_shared == [(10, "drop"), (20, "failed")]
    assert ledger_of(in_flow / "ledger.jsonl") == ledger_of(shared.ledger)


class Said:
    """What follows an outcome, as a path would do it: each call, in order."""

    def __init__(self):
        self.calls = []

    def look_back_at(self, event):
        self.calls.append(("look back", event.global_step))

    def record_failed_attempt(self, step):
        self.calls.append(("failed attempt", step))

    def warn(self, message):
        self.calls.append(("warn", message))

    def say_decision(self, event, decision):
        self.calls.append(("decision", event.global_step, decision.evaluate))

    def deliver(self, event, result, reason):
        self.calls.append(("deliver", event.global_step, reason))

    def send(self, alert):
        self.calls.append(("alert", alert.rule))

    def say_directive(self, directive):
        self.calls.append(("directive", directive.id))


def followed(planner, attempt, engine, **options) -> list:
    said = Said()
    follow_outcome(attempt, record_outcome(planner, attempt, engine, **options), said, reason="its decision")
    return said.calls


def test_what_follows_an_outcome_is_the_same_sequence_on_every_path(tmp_path):
    planner, engine = scheduled(tmp_path, steps=(0, 10, 20)), AlertEngine(RULES)
    first = EvalResult(0, "/ckpt/0", {"accuracy": 0.9}, 0.0, notes=["3 prompts cut"], retried=["rank 1 died"])
    assert followed(planner, Attempt(ev(0), result=first), engine) == [
        ("failed attempt", 0),  # retried within its attempt: on record
        ("warn", "checkpoint step 0: 3 prompts cut"),
        ("deliver", 0, "its decision"),
    ]
    assert followed(planner, Attempt(ev(10), result=result(10, 0.5)), engine) == [
        ("deliver", 10, "its decision"),
        ("alert", "drop"),
    ]
    assert followed(planner, Attempt(ev(20), error=RuntimeError("rank 0 died")), engine, max_attempts=2) == [
        ("failed attempt", 20),
        ("warn", "checkpoint step 20: evaluation attempt failed, queued again: rank 0 died"),
    ]
    # A held probe: its verdict said, then the probe delivered under the verdict's reason.
    cfg = SchedulerConfig(policy="fixed", fixed_interval_steps=20, probe_fraction=0.2)
    probing = scheduled(tmp_path / "probes", cfg, steps=(0,))
    record_outcome(probing, Attempt(ev(0), result=result(0, 0.5, {"accuracy": 0.5, "accuracy_stderr": 0.01})), engine)
    probing.offer(ev(10))
    assert probing.next() == ev(10) and probing.is_probe(10)
    probe = Attempt(ev(10), result=result(10, probe={"accuracy": 0.5, "accuracy_stderr": 0.01}), probe=True)
    [decision, deliver] = followed(probing, probe, AlertEngine(RULES))
    assert decision == ("decision", 10, False) and deliver[:2] == ("deliver", 10) and deliver[2] != "its decision"


def test_the_in_flow_loop_and_the_shared_record_issue_the_same_directives_once(tmp_path):
    """The feedback rules judge the results in step order on both paths: the same directives,
    issued once each in the run directory, said once by the path that issued them."""
    feedback = FeedbackConfig(lr_scale="act", target=0.85, patience=1, cooldown=0)
    attempts = [  # arriving out of step order, as from two slots
        Attempt(ev(10), result=result(10, 0.6)),
        Attempt(ev(0), result=result(0, 0.8)),
        Attempt(ev(30), result=result(30, 0.9)),
    ]
    in_flow = tmp_path / "in-flow"
    planner, engine = EvaluationPlanner(EVERY, Ledger(in_flow / "ledger.jsonl")), AlertEngine(RULES)
    judge = FeedbackJudge(feedback, metric="accuracy")
    for attempt in attempts:
        planner.offer(attempt.event)
    said = []
    for attempt in attempts:
        said += [c for c in followed(planner, attempt, engine, feedback=judge) if c[0] == "directive"]
    assert said == [("directive", "lr_scale@10"), ("directive", "stop@30")]

    shared = RunDir(tmp_path / "shared")
    manifest = Manifest(shared.root / "manifest.jsonl")
    shared_run = SharedRun(shared, manifest, EVERY, RULES, "r", feedback=feedback)
    for attempt in sorted(attempts, key=lambda a: a.event.global_step):
        manifest.append(attempt.event)
    issued = []
    for attempt in attempts:
        shared_run.claim(attempt.event.global_step, "a")
        issued += [d.id for d in shared_run.record_outcome(attempt, logged_by_evaluator=False).directives]
    assert issued == ["lr_scale@10", "stop@30"]

    def kept(root):
        return [(d.id, d.mode, d.steps, d.args) for d in Directives(root).all()]

    assert (
        kept(in_flow)
        == kept(shared.root)
        == [("lr_scale@10", "act", (0, 10), {"factor": 0.5}), ("stop@30", "shadow", (30,), {})]
    )


def test_a_late_result_of_an_older_checkpoint_and_a_finished_run_steer_nothing(tmp_path):
    judge = FeedbackJudge(FeedbackConfig(lr_scale="act", rollback="off", patience=1, cooldown=0), metric="accuracy")
    planner, engine = scheduled(tmp_path, steps=(0, 10, 20)), AlertEngine(RULES)
    issued = []
    for step, accuracy in ((0, 0.8), (20, 0.6), (10, 0.6)):  # 10 is a look-back, evaluated last
        attempt = Attempt(ev(step), result=result(step, accuracy))
        issued += [d.id for d in record_outcome(planner, attempt, engine, feedback=judge).directives]
    assert issued == ["lr_scale@20"]  # not lr_scale@10: training moved past it
    final = CheckpointEvent("r", "/ckpt/30", 0, 30, 30, 0.0, {}, final=True)
    planner.offer(final)
    assert planner.next() == final
    late = record_outcome(planner, Attempt(final, result=result(30, 0.5)), engine, feedback=judge)
    assert late.directives == [] and [d.id for d in Directives(tmp_path).all()] == ["lr_scale@20"]
