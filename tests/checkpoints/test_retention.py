from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.checkpoints.retention import RetentionConfig, checkpoints_to_delete
from areal_eval.runs.ledger import LedgerEntry


def ckpt(step, final=False):
    return CheckpointEvent("run", f"s3://b/run/global_step_{step:08d}", 0, step, step, 0.0, {}, final=final)


def entry(step, status, accuracy=None):
    return LedgerEntry(
        step, f"s3://b/run/global_step_{step:08d}", status, "", {"accuracy": accuracy} if accuracy is not None else {}
    )


def deletable(ledger, cfg, checkpoints=None, **kw):
    checkpoints = checkpoints or [ckpt(s) for s in range(0, 80, 10)]
    return [
        c.global_step
        for c in checkpoints_to_delete(checkpoints, {e.step: e for e in ledger}, cfg, metric="accuracy", **kw)
    ]


def test_keeps_last_k_and_best_n_and_deletes_the_rest_oldest_first():
    ledger = [
        entry(0, "evaluated", 0.5),
        entry(10, "skipped"),
        entry(20, "evaluated", 0.9),
        entry(30, "superseded"),
        entry(40, "evaluated", 0.7),
        entry(50, "failed"),
        entry(60, "evaluated", 0.8),
        entry(70, "evaluated", 0.6),
    ]
    # 10 and 30 are the skipped neighbours of the best (20): kept for the end-of-run refinement.
    assert deletable(ledger, RetentionConfig(keep_last=2, keep_best=1)) == [0, 40, 50]
    assert deletable(ledger, RetentionConfig(keep_last=2, keep_best=2)) == [0, 40, 50]  # 60 is in last 2
    assert deletable(ledger, RetentionConfig(keep_last=1, keep_best=0)) == [0, 20, 40, 50, 60]
    assert deletable(ledger, RetentionConfig(keep_last=2, keep_best=1), higher_is_better=False) == [20, 30, 40, 50]
    assert deletable(ledger, RetentionConfig()) == []  # off by default
    assert deletable(ledger, RetentionConfig(keep_last=2), deleted={0}) == [40, 50]
    refined = [e if e.step != 10 else entry(10, "evaluated", 0.4) for e in ledger]  # 10 was evaluated
    assert deletable(refined, RetentionConfig(keep_last=2, keep_best=1)) == [0, 10, 40, 50]


def test_never_deletes_a_checkpoint_waiting_for_evaluation():
    # 10 is scheduled (queued or in flight); 30 and later were never offered to the scheduler yet.
    ledger = [entry(0, "evaluated", 0.5), entry(10, "scheduled"), entry(20, "skipped")]
    assert deletable(ledger, RetentionConfig(keep_last=1, keep_best=0)) == [0, 20]


def test_keeps_the_final_checkpoint():
    checkpoints = [ckpt(0), ckpt(10, final=True), ckpt(20)]  # a resumed run may publish past a "final"
    ledger = [entry(0, "evaluated", 0.9), entry(10, "evaluated", 0.1), entry(20, "evaluated", 0.2)]
    assert deletable(ledger, RetentionConfig(keep_last=1, keep_best=0), checkpoints=checkpoints) == [0]


def test_never_deletes_a_rollback_target_training_has_not_answered(tmp_path):
    from areal_eval.feedback import Directive
    from areal_eval.runs.directives import Answer, Directives, rollback_targets

    box = Directives(tmp_path)
    box.issue([Directive("rollback@70", "rollback", (0, 60, 70), "test", {}, "act", {"to_step": 0, "factor": 0.5})])
    box.issue([Directive("rollback@40", "rollback", (20, 30, 40), "shadow", {}, "shadow", {"to_step": 20})])
    assert rollback_targets(tmp_path) == {0}  # a shadow one is never acted on
    ledger = [entry(s, "evaluated", 0.9 if s == 20 else 0.5) for s in range(0, 80, 10)]
    assert deletable(ledger, RetentionConfig(keep_last=1, keep_best=1), kept=rollback_targets(tmp_path)) == [
        10,
        30,
        40,
        50,
        60,
    ]
    box.answer(Answer("rollback@70", 75, applied=True))
    assert rollback_targets(tmp_path) == set()
