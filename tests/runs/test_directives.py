"""The directive channel: kept in the run directory, issued once by id, answered by the trainer,
applied once in the training that goes on (a resume from before an answer applies it again),
and taken at the same step by every rank of a real torchrun job."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.feedback import Directive
from areal_eval.runs.directives import (
    Answer,
    Directives,
    Inbox,
    directive_records,
    evaluation_results,
    scale_learning_rate,
)
from areal_eval.runs.ledger import Ledger, LedgerEntry

ROOT = Path(__file__).resolve().parents[2]


def lr_scale(step, mode="act", factor=0.5):
    return Directive(f"lr_scale@{step}", "lr_scale", (step,), "flat", {"rule": "plateau"}, mode, {"factor": factor})


def test_a_directive_is_issued_once_by_id_and_pending_until_answered(tmp_path):
    box = Directives(tmp_path)
    assert box.issue([lr_scale(40), lr_scale(60, mode="shadow")]) == [lr_scale(40), lr_scale(60, mode="shadow")]
    assert box.issue([lr_scale(40)]) == []  # another path, the same results: nothing new
    assert [d.id for d in box.all()] == ["lr_scale@40", "lr_scale@60"] and box.all()[0].made_at > 0
    assert [d.id for d in box.pending()] == ["lr_scale@40"]  # shadow: recorded, never applied
    box.answer(Answer("lr_scale@40", 57, applied=True))
    assert box.pending() == []
    # The trainer resumed from its checkpoint at step 50: what it applied at 57 is gone with the
    # state it changed, so it is applied again; at step 60 it still holds.
    assert [d.id for d in box.pending(resumed_at=50)] == ["lr_scale@40"] and box.pending(resumed_at=60) == []
    box.answer(Answer("lr_scale@40", 52, applied=False, reason="no scheduler"))
    assert box.pending(resumed_at=50) == []  # a refusal holds whatever the state
    with (tmp_path / "directives.jsonl").open("a") as torn:  # a crash mid-append
        torn.write('{"id": "stop@')
    assert [d.id for d in box.all()] == ["lr_scale@40", "lr_scale@60"]


def test_the_record_says_what_came_of_each_directive(tmp_path):
    box = Directives(tmp_path)
    box.issue([lr_scale(40), lr_scale(60, mode="shadow"), lr_scale(80)])
    box.answer(Answer("lr_scale@40", 43, applied=True))
    box.answer(Answer("lr_scale@40", 45, applied=False, reason="no optimizer"))  # the latest answer holds
    assert [(r["id"], r["outcome"]) for r in directive_records(tmp_path)] == [
        ("lr_scale@40", "refused: no optimizer"),
        ("lr_scale@60", "not applied (shadow mode)"),
        ("lr_scale@80", "waiting for the trainer"),
    ]


def test_an_applied_rollback_names_the_checkpoints_it_abandoned(tmp_path):
    from areal_eval.runs.directory import RunDir

    ledger = Ledger(RunDir(tmp_path).ledger)
    for step in (0, 25, 50, 75, 100, 125):
        ledger.append(LedgerEntry(step, f"/c/{step}", "evaluated" if step != 75 else "skipped", "", {}))
    box = Directives(tmp_path)
    args = {"to_step": 25, "factor": 0.5}
    box.issue([Directive("rollback@100", "rollback", (25, 75, 100), "worse", {}, "act", args)])
    box.answer(Answer("rollback@100", 112, applied=True))
    [row] = directive_records(tmp_path)
    assert row["outcome"] == "applied at step 112; abandoned (on record): checkpoints 50, 75, 100"


def test_an_inbox_hands_each_directive_once_and_looks_only_when_the_file_changed(tmp_path):
    inbox = Inbox(tmp_path)
    assert inbox.take() == []
    Directives(tmp_path).issue([lr_scale(40)])
    [taken] = inbox.take()
    assert taken.id == "lr_scale@40" and inbox.take() == []  # taken, not yet answered: not again
    assert inbox.answer(taken, 41).line() == "lr_scale@40: applied at step 41"
    assert [a.step for a in Directives(tmp_path).answers()] == [41]


def test_a_trainer_reads_the_evaluated_results_in_step_order(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.append(LedgerEntry(20, "/ckpt/20", "evaluated", "r", metrics={"accuracy": 0.7}))
    ledger.append(LedgerEntry(10, "/ckpt/10", "evaluated", "r", metrics={"accuracy": 0.6}))
    ledger.append(LedgerEntry(15, "/ckpt/15", "skipped", "plateau"))
    assert evaluation_results(tmp_path) == [(10, {"accuracy": 0.6}), (20, {"accuracy": 0.7})]
    assert evaluation_results(tmp_path / "nothing-yet") == []


def test_a_learning_rate_scale_reaches_the_optimizer_and_the_schedule():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    optimizer.step()  # a training step, then the schedule's
    schedule.step()
    assert scale_learning_rate(lr_scale(10), optimizer, schedule) is None
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0025)
    optimizer.step()
    schedule.step()  # the schedule goes on from the lower base
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.005 / 3)
    assert schedule.state_dict()["base_lrs"] == [pytest.approx(0.005)]  # a checkpoint keeps it
    assert scale_learning_rate(lr_scale(10, factor=-1), optimizer) == "factor -1 is not a positive number"


@pytest.mark.integration
def test_every_rank_of_a_torchrun_loop_applies_a_directive_at_the_same_step(tmp_path):
    run_dir = tmp_path / "ddp"
    run_dir.mkdir()
    box = Directives(run_dir)
    box.issue([lr_scale(0)])  # waiting before training starts
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
    job = subprocess.Popen(
        [*torchrun, "-m", "examples.ddp_loop", "--run-dir", str(run_dir), "--steps", "400", "--save-every", "4"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def stop_once_step_8_is_published():  # as the pipeline would, from another process's view
        while not (run_dir / "manifest.jsonl").exists() or 8 not in [
            e.global_step for e in Manifest(run_dir / "manifest.jsonl").events()
        ]:
            time.sleep(0.05)
        box.issue([Directive("stop@8", "stop", (8,), "accuracy past the target", {"rule": "target"}, "act")])

    threading.Thread(target=stop_once_step_8_is_published, daemon=True).start()
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out[-3000:]
    answers = {a.id: a for a in box.answers()}
    assert answers["lr_scale@0"].applied and answers["lr_scale@0"].step == 1
    stopped = answers["stop@8"].step
    assert 8 <= stopped < 400 and answers["stop@8"].applied
    for rank in (0, 1):  # every rank said it at the same step
        assert (
            f"rank {rank}: lr_scale@0: applied at step 1" in out
            and f"rank {rank}: stop@8: applied at step {stopped}" in out
        )
    final = Manifest(run_dir / "manifest.jsonl").events()[-1]
    assert final.final and final.global_step == stopped
    assert len((run_dir / "directive_answers.jsonl").read_text().splitlines()) == 2  # rank 0 answered, once each
    assert json.loads((run_dir / "directives.jsonl").read_text().splitlines()[1])["id"] == "stop@8"
