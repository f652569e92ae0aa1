import dataclasses
import json

from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.lifecycle.planner import CoalescingQueue, EvaluationPlanner
from areal_eval.runs.ledger import FINAL_STATES, Ledger, LedgerEntry
from areal_eval.scheduling.policy import SchedulerConfig


def ev(step, final=False):
    return CheckpointEvent("r", f"/ckpt/{step}", 0, step, step, 0.0, {}, final=final)


CFG = SchedulerConfig(min_interval_steps=0, max_interval_steps=None, max_interval_growth=None, queue_capacity=2)


def test_queue_coalesces_to_newest():
    q = CoalescingQueue(capacity=2)
    assert q.push(ev(1)) == [] and q.push(ev(2)) == []
    assert [e.global_step for e in q.push(ev(3))] == [1]
    newest, older = q.pop()
    assert newest.global_step == 3 and [e.global_step for e in older] == [2]
    assert len(q) == 0


def test_coalescing_starts_only_when_every_slot_is_busy():
    q = CoalescingQueue(capacity=3)
    for step in (1, 2, 3):
        q.push(ev(step))
    newest, older = q.pop(free_slots=2)  # two free slots: 3 and 2 are both served, 1 superseded
    assert newest.global_step == 3 and [e.global_step for e in older] == [1]
    assert q.pop(free_slots=1) == (ev(2), [])
    q.push(ev(4))
    q.push(ev(5))
    assert q.pop(free_slots=3) == (ev(5), [])  # more free slots than waiting: nothing superseded
    assert q.pop(free_slots=2) == (ev(4), [])


def test_pinned_items_are_never_superseded():
    q = CoalescingQueue(capacity=1)
    q.push(ev(0), pinned=True)
    for step in (1, 2, 3):
        q.push(ev(step))
    q.push(ev(9, final=True), pinned=True)
    assert q.pop() == (ev(0), [])
    assert q.pop() == (ev(9, final=True), [])
    newest, older = q.pop()
    assert newest.global_step == 3 and older == []


def test_every_checkpoint_ends_evaluated_or_recorded_with_reason(tmp_path):
    planner = EvaluationPlanner(CFG, Ledger(tmp_path / "ledger.jsonl"))
    for step in range(0, 50, 5):
        planner.offer(ev(step, final=step == 45))
        # evaluation is slow: one finishes every third checkpoint
        if step % 15 == 0 and (nxt := planner.next()):
            planner.evaluated(nxt, {"accuracy": 0.5 + step / 100, "accuracy_stderr": 0.01})
    while nxt := planner.next():
        planner.evaluated(nxt, {"accuracy": 0.9, "accuracy_stderr": 0.01})
    entries = planner.ledger.entries()
    assert [e.step for e in entries] == list(range(0, 50, 5))
    assert all(e.status in FINAL_STATES for e in entries)
    assert all(e.reason for e in entries if e.status != "evaluated")
    assert planner.ledger.status(45) == "evaluated"
    assert planner.ledger.counts().get("superseded", 0) > 0


def test_cover_bound_and_refinement_through_the_planner(tmp_path):
    # A flat metric with a peak at step 50: the cover bound evaluates every third checkpoint,
    # and once the final one is in, refinement evaluates the skipped neighbours of the best.
    accuracy = {step: 0.8 for step in range(0, 100, 10)} | {40: 0.81, 50: 0.83}
    planner = EvaluationPlanner(CFG, Ledger(tmp_path / "ledger.jsonl"))
    for step in range(0, 100, 10):
        planner.offer(ev(step, final=step == 90))
        while nxt := planner.next():
            planner.evaluated(nxt, {"accuracy": accuracy[nxt.global_step], "accuracy_stderr": 0.01})

    def status():
        return {e.step: e.status for e in planner.ledger.entries()}

    assert [s for s, st in status().items() if st == "evaluated"] == [0, 10, 40, 70, 90]
    assert [e.global_step for e in planner.refine(deleted={30, 50})] == []  # retention removed them
    queued = planner.refine()
    assert [e.global_step for e in queued] == [30, 50]
    assert planner.ledger.latest(50).status == "scheduled" and planner.ledger.latest(50).reason.startswith("refine")
    assert [planner.next().global_step, planner.next().global_step] == [30, 50]  # pinned: both served
    assert all(st in FINAL_STATES or st == "scheduled" for st in status().values())


def test_a_suspected_regression_looks_back_at_the_checkpoints_skipped_before_it(tmp_path):
    # Flat, then down from step 50: the cover bound evaluates 0, 10, 40, 70; 70's result is 5
    # stderr below the best, so 60 and 50, skipped before it, are scheduled pinned and served next.
    accuracy = {step: 0.8 if step < 50 else 0.75 for step in range(0, 100, 10)}
    path = tmp_path / "ledger.jsonl"
    planner = EvaluationPlanner(CFG, Ledger(path))
    looked_back = {}
    for step in range(0, 80, 10):
        planner.offer(ev(step))
        while nxt := planner.next():
            result = {"accuracy": accuracy[nxt.global_step], "accuracy_stderr": 0.01}
            looked_back[nxt.global_step] = [e.global_step for e in planner.evaluated(nxt, result, owner="me")]
    assert looked_back == {0: [], 10: [], 40: [], 70: [60, 50], 50: [], 60: []}  # theirs look back at none
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    [entry] = [e for e in lines if e["step"] == 60 and e["status"] == "scheduled"]
    assert entry["owner"] == "me"
    assert entry["reason"] == "look back: step 70 is 0.05 below best at step 0 (> 2.0 stderr)"
    assert planner.ledger.latest(60).status == "evaluated" and planner.ledger.status(20) == "skipped"
    # Retention removed 60, then 50 too: the one left is looked at, then none.
    for deleted, expected in (({60}, [50]), ({50, 60}, [])):
        again = EvaluationPlanner(CFG, Ledger(tmp_path / f"other-{len(deleted)}.jsonl"))
        for step in range(0, 80, 10):
            again.offer(ev(step))
            while nxt := again.next():
                result = {"accuracy": accuracy[nxt.global_step], "accuracy_stderr": 0.01}
                looked = [e.global_step for e in again.evaluated(nxt, result, deleted=deleted)]
                assert looked == (expected if nxt.global_step == 70 else [])
    # Scheduled when the process died: resumed when the checkpoint is offered again.
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(json.dumps(e) + "\n" for e in lines if (e["step"], e["status"]) != (60, "evaluated")))
    resumed = EvaluationPlanner(CFG, Ledger(cut))
    assert resumed.decide(ev(60)).reason == "resumed: scheduled before restart"


def test_restart_resumes_without_repeating_or_losing(tmp_path):
    path = tmp_path / "ledger.jsonl"
    first = EvaluationPlanner(CFG, Ledger(path))
    first.offer(ev(0))
    first.evaluated(first.next(), {"accuracy": 0.5})
    first.offer(ev(10))  # scheduled, then the flow dies before evaluating it

    second = EvaluationPlanner(CFG, Ledger(path))  # a restarted flow re-reads the manifest
    assert not second.offer(ev(0)).evaluate
    d = second.offer(ev(10))
    assert d.evaluate and "resumed" in d.reason
    assert second.next().global_step == 10


def test_ledger_history_feeds_the_scheduler(tmp_path):
    ledger = Ledger(tmp_path / "l.jsonl")
    ledger.append(LedgerEntry(0, "/a", "evaluated", metrics={"accuracy": 0.5, "accuracy_stderr": 0.02}))
    ledger.append(LedgerEntry(5, "/b", "skipped", "plateau"))
    ledger.append(LedgerEntry(10, "/c", "scheduled", "moving"))
    hist = ledger.history("accuracy", "accuracy_stderr")
    assert [(h.step, h.metric, h.stderr) for h in hist] == [(0, 0.5, 0.02), (10, None, None)]


def test_without_coalescing_every_item_is_served_in_order():
    q = CoalescingQueue(capacity=1, coalesce=False)
    for step in (1, 2, 3):
        assert q.push(ev(step)) == []
    assert [q.pop()[0].global_step for _ in range(3)] == [1, 2, 3]


PROBING = SchedulerConfig(policy="fixed", fixed_interval_steps=100, probe_fraction=0.2, probe_escalate_stderrs=2.0)
FULL = {"accuracy": 0.5, "accuracy_stderr": 0.01}


def test_skipped_checkpoints_are_probed_held_within_their_noise_and_escalated_when_they_move(tmp_path):
    planner = EvaluationPlanner(PROBING, Ledger(tmp_path / "ledger.jsonl"))
    planner.offer(ev(0))
    planner.evaluated(planner.next(), FULL, delivered=True, probe_metrics={"accuracy": 0.5, "accuracy_stderr": 0.02})

    held = planner.offer(ev(10))  # fixed:100 skips it: a probe instead
    assert held.probe and held.reason == "probe: fixed interval: 10 < 100 steps"
    assert planner.next() == ev(10) and planner.is_probe(10)
    assert [h.step for h in planner.history()] == [0]  # a pending probe is not a pending result
    decision = planner.probed(ev(10), {"accuracy": 0.52, "accuracy_stderr": 0.02})
    entry = planner.ledger.latest(10)
    assert not decision.evaluate and (entry.status, entry.probe) == ("skipped", "held")
    assert entry.reason == "fixed interval: 10 < 100 steps; probe 0.52 vs 0.5 on the subset: 0.71 <= 2 stderr"
    assert [e.step for e in planner.undelivered()] == [10]  # logged as a probe, never as a result
    planner.delivered(10)
    assert planner.undelivered() == [] and planner.ledger.latest(10).probe_metrics["accuracy"] == 0.52

    planner.offer(ev(20))
    assert planner.next() == ev(20)
    escalated = planner.probed(ev(20), {"accuracy": 0.4, "accuracy_stderr": 0.02})
    assert escalated.evaluate and escalated.reason.startswith("escalated: probe 0.4 vs 0.5 on the subset: 3.54 >")
    assert planner.next() == ev(20) and not planner.is_probe(20)  # now a full evaluation, queued pinned
    planner.evaluated(ev(20), {"accuracy": 0.41, "accuracy_stderr": 0.01}, probe_metrics={"accuracy": 0.4})
    entry = planner.ledger.latest(20)
    assert (entry.status, entry.probe, entry.reason) == ("evaluated", "escalated", escalated.reason)
    assert [h.step for h in planner.history()] == [0, 20]

    # The newest full evaluation is the reference now; a restart resumes a pending probe as a probe.
    planner.offer(ev(30))
    restarted = EvaluationPlanner(PROBING, Ledger(tmp_path / "ledger.jsonl"))
    resumed = restarted.offer(ev(30))
    assert resumed.probe and resumed.pinned and restarted.next() == ev(30)
    assert not restarted.probed(ev(30), {"accuracy": 0.41, "accuracy_stderr": 0.02}).evaluate

    # Evaluated in full later (a forced run, or refinement): the probe that ran stays on record.
    restarted.claim(ev(10), "manual", owner="me")
    assert not restarted.is_probe(10)
    restarted.evaluated(ev(10), FULL)
    assert (restarted.ledger.latest(10).status, restarted.ledger.latest(10).probe) == ("evaluated", "held")
    assert restarted.ledger.probe_counts() == {"probed": 3, "escalated": 1}  # 10, 20 and 30


def test_a_probe_with_no_full_evaluation_before_it_to_compare_escalates_and_none_without_probes(tmp_path):
    planner = EvaluationPlanner(PROBING, Ledger(tmp_path / "probing.jsonl"))
    planner.offer(ev(0))
    assert planner.offer(ev(10)).probe  # decided before step 0's result: compared once it is done
    planner.evaluated(planner.next(), FULL)  # without its subset part (e.g. evaluated before probes were on)
    assert planner.next() == ev(10)
    escalated = planner.probed(ev(10), {"accuracy": 0.5, "accuracy_stderr": 0.02})
    assert (
        escalated.evaluate
        and escalated.reason == "escalated: no full evaluation before step 10 to compare the probe with"
    )
    plain = EvaluationPlanner(dataclasses.replace(PROBING, probe_fraction=None), Ledger(tmp_path / "plain.jsonl"))
    plain.offer(ev(0))
    plain.evaluated(plain.next(), FULL, probe_metrics={})
    assert not plain.offer(ev(10)).evaluate
    assert all("probe" not in line for line in (tmp_path / "plain.jsonl").read_text().splitlines())


def test_when_the_checkpoint_waiting_ones_coalesced_to_is_corrupt_the_newest_good_one_is_evaluated(tmp_path):
    planner = EvaluationPlanner(dataclasses.replace(CFG, queue_capacity=8), Ledger(tmp_path / "ledger.jsonl"))
    planner.offer(ev(0))
    planner.evaluated(planner.next(), {"accuracy": 0.5, "accuracy_stderr": 0.01})
    for step in (10, 20, 30, 40):
        planner.offer(ev(step))
    newest = planner.next()
    assert newest.global_step == 40 and planner.ledger.status(30) == "superseded"
    planner.attempt_failed(newest, "sha256 differs", permanent=True, max_attempts=3, bad_checkpoint=True)
    assert planner.ledger.status(40) == "failed"
    fallback = planner.next()
    assert fallback.global_step == 30 and planner.ledger.latest(30).reason == "fallback: step 40 failed verification"
    planner.attempt_failed(fallback, "sha256 differs", permanent=True, max_attempts=3, bad_checkpoint=True)
    assert planner.next().global_step == 20  # bad again: the next newest
    assert (
        planner.ledger.status(10) == "superseded" and "step 30 failed verification" in planner.ledger.latest(10).reason
    )
    # A data or config error is no checkpoint's fault: nothing falls back.
    other = EvaluationPlanner(dataclasses.replace(CFG, queue_capacity=8), Ledger(tmp_path / "other.jsonl"))
    other.offer(ev(0))
    other.evaluated(other.next(), {"accuracy": 0.5, "accuracy_stderr": 0.01})
    for step in (10, 20):
        other.offer(ev(step))
    other.attempt_failed(other.next(), "DataError: valid.jsonl:3", permanent=True, max_attempts=3)
    assert other.next() is None and other.ledger.status(10) == "superseded"


def test_the_training_metric_each_checkpoint_carries_reaches_the_scheduler(tmp_path):
    cfg = dataclasses.replace(CFG, train_metric="loss", max_interval_checkpoints=None)
    planner = EvaluationPlanner(cfg, Ledger(tmp_path / "ledger.jsonl"))
    for step in range(0, 70, 10):
        loss = 0.30 + 0.01 * (-1) ** (step // 10) if step < 60 else 0.60  # a collapse at step 60
        decision = planner.offer(dataclasses.replace(ev(step), train_metrics={"loss": loss}))
        if decision.evaluate:
            planner.evaluated(planner.next(), {"accuracy": 0.8, "accuracy_stderr": 0.01})
        if step == 50:
            assert not decision.evaluate and decision.reason.startswith("plateau")
    assert decision.evaluate and decision.reason.startswith("training moved: loss")


def test_an_acting_feedback_rule_has_the_checkpoints_a_plateau_would_skip_evaluated_while_it_counts(tmp_path):
    # A flat curve: the scheduler skips most of it; with the plateau rule acting, each checkpoint
    # after the best is evaluated until the rule stops training, and in shadow mode none is.
    from areal_eval.feedback import FeedbackConfig, FeedbackJudge

    cfg = dataclasses.replace(CFG, max_interval_checkpoints=None)

    def evaluated_steps(feedback: FeedbackConfig, name: str) -> list[int]:
        judge = FeedbackJudge(feedback, metric="accuracy")
        planner = EvaluationPlanner(cfg, Ledger(tmp_path / f"{name}.jsonl"), feedback=judge)
        for step in range(0, 200, 10):
            value = min(0.7, 0.5 + 0.1 * step / 10)
            if planner.offer(ev(step)).evaluate:
                planner.evaluated(planner.next(), {"accuracy": value, "accuracy_stderr": 0.01})
        return [e.step for e in planner.ledger.entries() if e.status == "evaluated"]

    acting = FeedbackConfig(stop="act", max_lr_scales=0, patience=3)
    assert evaluated_steps(acting, "acting") == [0, 10, 20, 30, 40, 50]  # the best at 20, 3 more: stop@50
    shadow = evaluated_steps(FeedbackConfig(max_lr_scales=0, patience=3), "shadow")
    assert shadow[:3] == [0, 10, 20] and len([s for s in shadow if 20 < s <= 50]) < 3
    ledger = Ledger(tmp_path / "acting.jsonl")
    assert ledger.latest(40).reason == "feedback: 1 evaluation(s) since the best (step 20) without a better one"
