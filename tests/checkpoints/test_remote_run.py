"""A run on S3 seen from elsewhere: what a flow on another machine asks of the trainer, and the
results it has, reach the trainer's own directory through moto's S3 server, and the trainer's
answers come back."""

import time

import boto3
import pytest

from areal_eval.checkpoints import remote_run
from areal_eval.checkpoints.publisher import publish_checkpoint
from areal_eval.checkpoints.remote_run import REMOTE, localize_manifest, push_requests, push_results, remote_store
from areal_eval.checkpoints.store import S3Config
from areal_eval.feedback import Directive
from areal_eval.runs.directives import Directives, Inbox, directive_records, evaluation_results
from areal_eval.runs.directory import RunDir, StopSignal
from areal_eval.runs.ledger import Ledger, LedgerEntry
from tests.checkpoints.test_publisher import written_checkpoint


def until(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return found


def test_a_flow_elsewhere_asks_the_trainer_through_s3_and_reads_its_answer(s3_server, s3_bucket, tmp_path):
    s3 = S3Config(endpoint_url=s3_server.url, control_poll_s=0.1)
    trainer = tmp_path / "trainer"  # the trainer's machine: its run directory, nothing shared
    publish_checkpoint(
        written_checkpoint(tmp_path), trainer / "manifest.jsonl", "run-7", 40, store=f"s3://{s3_bucket}/ckpts", s3=s3
    )
    boto3.client("s3", endpoint_url=s3_server.url).put_object(
        Bucket=s3_bucket, Key="ckpts/run-7/data/valid.jsonl", Body=b"{}\n"
    )  # (a bare publish mirrors no validation data; a copy needs it)

    def copy(machine: str):
        local = localize_manifest(f"s3://{s3_bucket}/ckpts/run-7/manifest.jsonl", s3, tmp_path / machine).parent
        return local, remote_store(local, s3)

    # The evaluator's copy knows where the run lives; its result, a stop from an alert and a
    # directive go up.
    local, store = copy("evaluator")
    assert (local / REMOTE).exists() and local.is_relative_to(tmp_path / "evaluator")
    result = {"accuracy": 0.7, "accuracy_stderr": 0.02}
    Ledger(RunDir(local).ledger).append(LedgerEntry(40, "s3://x", "evaluated", "first checkpoint", result))
    push_results(store, local)
    lower = Directive("lr_scale@40", "lr_scale", (40,), "accuracy flat", {"rule": "plateau"}, "act", {"factor": 0.5})
    Directives(local).issue([lower])
    StopSignal(RunDir(local).stop_file).request("alert drop: accuracy fell")
    push_requests(store, local)
    # A second evaluator's copy adds its own; neither loses the other's line.
    other, other_store = copy("second-evaluator")
    assert [d.id for d in Directives(other).all()] == ["lr_scale@40"]
    Directives(other).issue([Directive("stop@40", "stop", (40,), "target reached", mode="shadow")])
    push_requests(other_store, other)
    push_requests(store, local)
    assert [d.id for d in Directives(copy("evaluator")[0]).all()] == ["lr_scale@40", "stop@40"]

    # The trainer's loop finds them in its own directory, as it finds a local request.
    inbox = Inbox(trainer)
    [taken] = until(inbox.take, "the directive in the trainer's directory")
    assert taken == Directives(local).all()[0]
    assert until(lambda: StopSignal(RunDir(trainer).stop_file).requested(), "the stop") == "alert drop: accuracy fell"
    assert until(lambda: evaluation_results(trainer), "the results in the trainer's directory") == [(40, result)]
    inbox.answer(taken, 43)
    # Its answer reaches the evaluator's next copy of the run: the record says what came of it.
    until(lambda: store.read("directive_answers.jsonl"), "the answer on S3")
    records = {r["id"]: r["outcome"] for r in directive_records(copy("evaluator")[0])}
    assert records == {"lr_scale@40": "applied at step 43", "stop@40": "not applied (shadow mode)"}
    publish_checkpoint(  # training ends: its last publish ends the polling
        written_checkpoint(tmp_path / "last"),
        trainer / "manifest.jsonl",
        "run-7",
        43,
        store=f"s3://{s3_bucket}/ckpts",
        s3=s3,
        final=True,
    )
    assert str(trainer.resolve()) not in map(str, remote_run._followed)


def test_answers_made_before_a_publish_are_on_s3_before_its_checkpoint_is_announced(s3_server, s3_bucket, tmp_path):
    s3 = S3Config(endpoint_url=s3_server.url, control_poll_s=3600)  # no poll in this test's time: the publish sends
    trainer, root = tmp_path / "trainer", f"s3://{s3_bucket}/ckpts"
    publish_checkpoint(written_checkpoint(tmp_path), trainer / "manifest.jsonl", "run-8", 40, store=root, s3=s3)
    stop = Directive("stop@40", "stop", (40,), "target reached")
    Directives(trainer).issue([stop])
    Inbox(trainer).answer(stop, 41)
    later = written_checkpoint(tmp_path / "later")
    publish_checkpoint(later, trainer / "manifest.jsonl", "run-8", 41, store=root, s3=s3, final=True)
    body = boto3.client("s3", endpoint_url=s3_server.url).get_object(
        Bucket=s3_bucket, Key="ckpts/run-8/directive_answers.jsonl"
    )["Body"]
    assert '"id": "stop@40"' in body.read().decode()


def test_a_poll_interval_that_is_not_positive_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"storage.s3.control_poll_s: 0 is not a positive number"):
        S3Config(control_poll_s=0)
