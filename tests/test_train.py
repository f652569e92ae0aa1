"""Real DDP training over torchrun (2 ranks, gloo)."""

import json
import re
from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import Manifest, verify_checkpoint
from areal_eval.launchers.local import TorchrunJob
from areal_eval.models.reward_model import load_model
from areal_eval.pipeline.setup import prepare_run
from areal_eval.runs.directory import StopSignal
from tests.conftest import tiny_config

pytestmark = pytest.mark.integration


def test_training_publishes_durable_checkpoints(trained_run):
    cfg, run = trained_run
    events = Manifest(run.manifest).events()
    # eval_before_train: the untrained model is checkpoint 0; then every 4 steps; the final one.
    assert [e.global_step for e in events] == [0, 4, 8, 12]
    assert [e.final for e in events] == [False, False, False, True]
    assert len({e.run_id for e in events}) == 1 and events[0].run_id == run.run_id
    for event in events:
        verify_checkpoint(event.uri, event.files)  # sizes and sha256 recorded after writing
        assert any(f.name == "model.safetensors" for f in event.files)
    assert events[2].train_metrics["loss"] > 0
    model = load_model(events[-1].uri)  # from_pretrained on a local path
    assert model.config.num_labels == 1


def test_training_log_has_loss_at_global_steps(trained_run):
    _, run = trained_run
    rows = [json.loads(line) for line in run.train_log.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6, 8, 10, 12]
    done = rows[-1]
    assert done["done"] and done["blocked_s"] < done["train_s"] and done["cpu_s"] > 0  # the ranks' CPU, summed


def test_stop_request_ends_training_at_the_next_step_and_no_ddp_model_outlives_the_group(tmp_path):
    cfg = tiny_config(tmp_path, train={"max_steps": 1000, "epochs": 50, "save": {"eval_before_train": False}})
    run = prepare_run(cfg)
    StopSignal(run.stop_file).request("alert accuracy-regression")
    # areal_eval.train, counting the DDP models alive as each rank leaves the group.
    job = TorchrunJob("tests.train_counting_ddp", ["--config", str(run.train_config)], 2, run.logs / "train.log")
    job.wait(300)
    job.raise_for_status("training")
    [final] = Manifest(run.manifest).events()
    assert final.final and final.global_step == 1
    assert final.train_metrics["stopped"] == "alert accuracy-regression"
    log = (run.logs / "train.log").read_text()
    assert sorted(re.findall(r"rank (\d) leaves the group with (\d+) DDP", log)) == [("0", "0"), ("1", "0")], log[
        -2000:
    ]


def run_training(run, timeout_s=300):
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], 2, run.logs / "train.log")
    job.wait(timeout_s)
    job.raise_for_status("training")


def test_a_killed_job_resumes_from_its_newest_checkpoint_as_if_never_stopped(tmp_path):
    # The same run trained straight through, and killed once its step-6 checkpoint is out then run
    # again: model, optimizer, schedule, trigger state and data position come back, so the final
    # weights agree and every checkpoint is announced once; log-spaced early saves included.
    import time

    import torch

    sections = {"train": {"max_steps": 24, "epochs": 3, "save": {"freq_steps": 6, "at_steps": [1, 2, 4]}}}
    straight = prepare_run(tiny_config(tmp_path / "straight", **sections))
    run_training(straight)
    resumed = prepare_run(tiny_config(tmp_path / "resumed", **sections))
    job = TorchrunJob("areal_eval.train", ["--config", str(resumed.train_config)], 2, resumed.logs / "train.log")
    deadline = time.monotonic() + 300
    # Killed at once (no SIGTERM grace) as soon as step 6 is seen: 18 steps and 3 saves remain
    # before the end, which a loaded machine once ran between a later poll and the kill.
    while 6 not in [e.global_step for e in Manifest(resumed.manifest).events()] and time.monotonic() < deadline:
        time.sleep(0.01)
    job.kill(grace_s=0)
    stopped_at = max(e.global_step for e in Manifest(resumed.manifest).events())
    assert 6 <= stopped_at < 24  # killed mid-run
    again = prepare_run(tiny_config(tmp_path / "resumed", **sections))  # the same command: resumes, never wipes
    assert again.run_id == resumed.run_id
    run_training(again)
    steps = [e.global_step for e in Manifest(resumed.manifest).events()]
    assert steps == [0, 1, 2, 4, 6, 12, 18, 24] and Manifest(resumed.manifest).events()[-1].final
    a = load_model(straight.checkpoints / "global_step_00000024").state_dict()
    b = load_model(resumed.checkpoints / "global_step_00000024").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    run_training(again)  # once training is over, running it again does nothing
    assert [e.global_step for e in Manifest(resumed.manifest).events()] == steps


def test_prepare_validates_data_before_touching_an_existing_run(tmp_path):
    from areal_eval.data.preference_data import DataError

    run = prepare_run(tiny_config(tmp_path))
    before = sorted(p.name for p in run.root.iterdir())
    bad = tmp_path / "malformed.jsonl"
    bad.write_text('{"chosen": "a", "rejected": "b"}\n' * 50 + "{not json\n")
    with pytest.raises(DataError, match=r"malformed.jsonl:51: not valid JSON"):
        prepare_run(tiny_config(tmp_path, data={"train_path": str(bad)}))
    assert sorted(p.name for p in run.root.iterdir()) == before and run.run_id_file.exists()


def test_checkpoints_carry_no_truncation_or_padding_from_training(trained_run):
    _, run = trained_run
    for event in Manifest(run.manifest).events():
        saved = json.loads((Path(event.uri) / "tokenizer.json").read_text())
        assert saved["truncation"] is None and saved["padding"] is None


def test_wrote_done_reads_only_a_complete_done_row_at_the_end(tmp_path):
    from areal_eval.train import wrote_done

    log = tmp_path / "train_log.jsonl"
    assert not wrote_done(log)
    log.write_text('{"step": 1, "loss": 0.5}\n')
    assert not wrote_done(log)
    log.write_text('{"step": 1, "loss": 0.5}\n{"step": 1, "done": true}\n')
    assert wrote_done(log)
    log.write_text('{"step": 1, "loss": 0.5}\n{"step": 1, "do')
    assert not wrote_done(log)


def test_a_training_job_that_finished_but_does_not_exit_is_killed_with_its_stacks_in_the_log(tmp_path):
    import time

    from areal_eval.launchers.local import group_alive
    from areal_eval.train import wait_for_exit

    log = tmp_path / "train_log.jsonl"
    job = TorchrunJob("tests.hang_after_done", [str(log)], 2, tmp_path / "train.log")
    started = time.monotonic()
    warning = wait_for_exit(job, log, timeout_s=600, done_grace_s=1)
    assert warning and "says done" in warning and str(tmp_path / "train.log") in warning
    assert time.monotonic() - started < 300  # the grace, not the timeout, ended the wait
    assert not group_alive(job.proc.pid)
    # Both ranks and the agent printed where they were (faulthandler's stacks read "most recent
    # call first", a traceback "last"), the ranks naming the stuck line.
    dumped = (tmp_path / "train.log").read_text()
    assert dumped.count("(most recent call first)") >= 3, dumped[-3000:]
    assert re.search(r'hang_after_done\.py", line \d+ in main', dumped), dumped[-3000:]  # no comma: not a traceback


def test_a_training_job_that_hangs_before_its_done_row_times_out_with_its_stacks_in_the_log(tmp_path):
    import time

    from areal_eval.launchers.local import WorkerError, group_alive
    from areal_eval.train import wait_for_exit

    log, job_log = tmp_path / "train_log.jsonl", tmp_path / "train.log"
    job = TorchrunJob("tests.hang_after_done", [str(log), "--no-done"], 1, job_log)
    deadline = time.monotonic() + 120
    while "hanging" not in (job_log.read_text() if job_log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(WorkerError, match="timed out after 1s"):
        wait_for_exit(job, log, timeout_s=1)
    assert not group_alive(job.proc.pid)
    dumped = job_log.read_text()
    assert re.search(r'hang_after_done\.py", line \d+ in main', dumped), dumped[-3000:]


def test_a_training_job_that_fails_after_its_done_row_still_fails(tmp_path):
    from areal_eval.launchers.local import WorkerError
    from areal_eval.train import wait_for_exit

    log = tmp_path / "train_log.jsonl"
    job = TorchrunJob("tests.hang_after_done", [str(log), "--exit", "3"], 1, tmp_path / "train.log")
    with pytest.raises(WorkerError, match="training failed"):
        wait_for_exit(job, log, timeout_s=600)


def test_a_full_disk_under_the_training_log_names_the_file_and_the_step(tmp_path):
    import contextlib

    from areal_eval.disk import DiskFull
    from areal_eval.train import TrainLog
    from tests.helpers import tmpfs

    with tmpfs(tmp_path / "disk", "64k") as disk:
        log = TrainLog(disk / "train_log.jsonl")
        (disk / "filler").write_bytes(b"x" * ((64 << 10) - 4096))
        named = rf"no space left on the disk of {disk}/train_log.jsonl while writing the training log \(step 7\)"
        with pytest.raises(DiskFull, match=named):
            for _ in range(100):
                log.write({"step": 7, "loss": 0.5, "text": "y" * 4096})
        with contextlib.suppress(OSError):  # the unwritten buffer fails again
            log.close()


def test_a_directive_answered_then_lost_with_a_kill_is_applied_once_in_the_training_that_goes_on(tmp_path):
    # A lower learning rate asked before training starts: applied at step 1, answered, then the job
    # is killed with -9 before the checkpoint after it, and run again from the one before. The
    # answer went with the state it changed: the directive is applied again, once, so the final
    # weights agree with a run that applied it once and was never stopped.
    import time

    import torch

    from areal_eval.checkpoints.saving import read_resume_state
    from areal_eval.feedback import Directive
    from areal_eval.runs.directives import Directives

    sections = {"train": {"max_steps": 24, "epochs": 3, "save": {"freq_steps": 12}}}
    lower = Directive("lr_scale@0", "lr_scale", (0,), "flat", {}, "act", {"factor": 0.5})
    straight = prepare_run(tiny_config(tmp_path / "straight", **sections))
    Directives(straight.root).issue([lower])
    run_training(straight)
    killed = prepare_run(tiny_config(tmp_path / "killed", **sections))
    box = Directives(killed.root)
    box.issue([lower])
    job = TorchrunJob("areal_eval.train", ["--config", str(killed.train_config)], 2, killed.logs / "train.log")
    deadline = time.monotonic() + 300
    while not box.answers() and time.monotonic() < deadline:
        time.sleep(0.005)
    job.kill(grace_s=0)
    [answered] = box.answers()
    assert answered.applied and answered.step == 1
    saved = [e.global_step for e in Manifest(killed.manifest).events()]
    run_training(prepare_run(tiny_config(tmp_path / "killed", **sections)))
    answers = [(a.id, a.step) for a in box.answers()]
    # Killed before step 12's checkpoint (the usual case): answered again at step 1 of the rerun.
    assert answers == ([("lr_scale@0", 1), ("lr_scale@0", 1)] if max(saved, default=0) < 12 else [("lr_scale@0", 1)])
    a = load_model(straight.checkpoints / "global_step_00000024").state_dict()
    b = load_model(killed.checkpoints / "global_step_00000024").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    once = read_resume_state(straight.resume_states, 12)  # the step-12 checkpoint's schedule
    assert once["schedule"]["base_lrs"] == [tiny_config(tmp_path).train.lr * 0.5]


def test_a_rollback_restores_the_best_checkpoints_weights_optimizer_schedule_and_data_position(tmp_path):
    # Asked once step 8 is out: at the next step boundary every rank goes back to step 4 and saves
    # at once (global steps go on counting): that checkpoint's weights are step 4's, tensor for
    # tensor, with step 4's optimizer state, schedule and data position, the learning rate halved.
    # A rollback whose target is gone is refused, with the reason on record.
    import time

    import torch

    from areal_eval.checkpoints.saving import read_resume_state
    from areal_eval.feedback import Directive
    from areal_eval.runs.directives import Directives, directive_records

    sections = {"train": {"max_steps": 160, "epochs": 20, "save": {"freq_steps": 4}}}
    run = prepare_run(tiny_config(tmp_path / "run", **sections))
    box = Directives(run.root)
    box.issue([Directive("rollback@0", "rollback", (0,), "test", {}, "act", {"to_step": 1000, "factor": 0.5})])
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], 2, run.logs / "train.log")
    deadline = time.monotonic() + 300
    while 8 not in [e.global_step for e in Manifest(run.manifest).events()] and time.monotonic() < deadline:
        time.sleep(0.005)
    box.issue([Directive("rollback@8", "rollback", (4, 8), "test", {}, "act", {"to_step": 4, "factor": 0.5})])
    job.wait(300)
    job.raise_for_status("training")
    refused, applied = box.answers()
    assert not refused.applied and refused.reason.startswith("its target, checkpoint 1000, is gone")
    assert applied.applied and 8 < applied.step < 160
    at = applied.step
    events = {e.global_step: e for e in Manifest(run.manifest).events()}
    assert events[at].train_metrics["weights_from_step"] == 4 and "weights_from_step" not in events[8].train_metrics
    assert events[160].final and events[160].train_metrics["weights_from_step"] == 4  # steps counted on to the end
    back = load_model(run.checkpoints / f"global_step_{at:08d}").state_dict()
    best = load_model(run.checkpoints / "global_step_00000004").state_dict()
    assert all(torch.equal(back[k], best[k]) for k in best)
    then, now = read_resume_state(run.resume_states, 4), read_resume_state(run.resume_states, at)
    assert (now["next_epoch"], now["next_epoch_step"]) == (then["next_epoch"], then["next_epoch_step"])
    assert now["global_step"] == at and now["schedule"]["last_epoch"] == then["schedule"]["last_epoch"]
    assert now["schedule"]["base_lrs"] == [b * 0.5 for b in then["schedule"]["base_lrs"]]
    moments = zip(then["optimizer"]["state"].values(), now["optimizer"]["state"].values(), strict=True)
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["step"], b["step"]) for a, b in moments)
    outcomes = {r["id"]: r["outcome"] for r in directive_records(run.root)}
    assert outcomes["rollback@8"] == f"applied at step {at}" and outcomes["rollback@0"].startswith("refused: its")


def test_a_run_on_s3_keeping_no_local_copies_rolls_back_and_resumes_from_the_store(s3_server, s3_bucket, tmp_path):
    # Checkpoints live on S3 only (the staging copies go once uploaded): a rollback to step 4 fetches
    # its weights from there; killed with -9 after it and run again, the job resumes from its
    # newest checkpoint, fetched from there too, and ends as announced.
    import time

    import torch

    from areal_eval.checkpoints.store import S3Config, S3Store
    from areal_eval.feedback import Directive
    from areal_eval.runs.directives import Directives

    storage = {"checkpoint_uri": f"s3://{s3_bucket}/ckpt", "s3": {"endpoint_url": s3_server.url}}
    sections = {"storage": storage, "train": {"max_steps": 400, "epochs": 50, "save": {"freq_steps": 4}}}
    run = prepare_run(tiny_config(tmp_path / "run", **sections))
    box = Directives(run.root)
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], 2, run.logs / "train.log")
    deadline = time.monotonic() + 300
    while 8 not in [e.global_step for e in Manifest(run.manifest).events()] and time.monotonic() < deadline:
        time.sleep(0.005)
    box.issue([Directive("rollback@8", "rollback", (4, 8), "test", {}, "act", {"to_step": 4, "factor": 0.5})])
    while not box.answers() and time.monotonic() < deadline:
        time.sleep(0.005)
    [applied] = box.answers()
    events = {e.global_step: e for e in Manifest(run.manifest).events()}
    while applied.step not in events and time.monotonic() < deadline:  # its checkpoint, saved at once
        time.sleep(0.005)
        events = {e.global_step: e for e in Manifest(run.manifest).events()}
    job.kill(grace_s=0)
    assert applied.applied, applied.reason
    assert not Manifest(run.manifest).events()[-1].final  # killed mid-run
    assert not list(run.checkpoints.glob("global_step_*"))  # nothing to roll back to but S3's copies
    store = S3Store(f"s3://{s3_bucket}/ckpt", S3Config(endpoint_url=s3_server.url))

    def weights(step: int) -> dict:
        event = events[step]
        return load_model(store.fetch(event.uri, event.files, tmp_path / "check")).state_dict()

    back, best = weights(applied.step), weights(4)
    assert events[applied.step].train_metrics["weights_from_step"] == 4
    assert all(torch.equal(back[k], best[k]) for k in best)
    run_training(prepare_run(tiny_config(tmp_path / "run", **sections)))  # the same command: resumes
    final = Manifest(run.manifest).events()[-1]
    assert final.final and final.global_step == 400 and final.train_metrics["weights_from_step"] == 4
    assert list((run.root / "checkpoint-cache").iterdir())  # what it resumed from came from S3
    assert [a.id for a in box.answers()] == ["rollback@8"]  # applied once: its step was saved before the kill
