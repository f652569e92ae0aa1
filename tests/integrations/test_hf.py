"""The Hugging Face Trainer callback on a real ``Trainer.train()``: a tiny Llama reward model
trained as a regression on single responses (chosen 1, rejected 0), saving every 8 steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import CheckpointError, Manifest
from areal_eval.integrations.hf import PublishCheckpoints, evaluation_files
from areal_eval.runs.directory import RunDir, StopSignal
from examples.common import tiny_reward_model


def hf_trainer(*args, **kwargs):
    """``examples/hf_trainer.py``'s Trainer, its module imported when a test runs, not when the
    file is collected: ``transformers.Trainer`` takes seconds to import, in every lane."""
    from examples.hf_trainer import build_trainer

    return build_trainer(*args, **kwargs)


@pytest.fixture(scope="module")
def published_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("hf")
    callback = PublishCheckpoints(work / "run", run_id="hf-run", valid_data=work / "valid.jsonl", api_url=None)
    trainer, _ = hf_trainer(work, [callback])
    trainer.train()
    return work, callback


def test_every_save_is_published_with_what_evaluation_needs_and_no_training_state(published_run):
    work, callback = published_run
    events = Manifest(work / "run" / "manifest.jsonl").events()
    # save_steps 8 of 20: 8 and 16, then the last step, saved because training ended, marked final.
    assert [(e.global_step, e.final) for e in events] == [(8, False), (16, False), (20, True)]
    assert callback.published == [8, 16, 20]
    for event in events:
        names = {f.name for f in event.files}
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
        assert not [n for n in names if n.startswith(("optimizer", "scheduler", "rng_state", "trainer_state"))]
        assert "training_args.bin" not in names
        assert Path(event.uri) == (work / "run" / "checkpoints" / f"global_step_{event.global_step:08d}").resolve()
        assert event.run_id == "hf-run" and event.valid_data == str((work / "valid.jsonl").resolve())
    assert "loss" in events[-1].train_metrics
    # The Trainer's own checkpoint keeps its resume state; the published copy shares the weights.
    trainer_checkpoint = work / "trainer" / "checkpoint-16"
    assert (trainer_checkpoint / "optimizer.pt").exists()
    published = Path(events[1].uri) / "model.safetensors"
    assert published.stat().st_ino == (trainer_checkpoint / "model.safetensors").stat().st_ino


def test_published_checkpoints_load_and_score_as_reward_models(published_run):
    from tests.helpers import single_process_metrics

    work, _ = published_run
    final = Manifest(work / "run" / "manifest.jsonl").events()[-1]
    metrics = single_process_metrics(final, work / "valid.jsonl")
    assert metrics["n_pairs"] == 41 and 0.0 <= metrics["accuracy"] <= 1.0


def test_a_stop_request_ends_training_at_the_next_step_with_a_final_checkpoint(tmp_path):
    from transformers import TrainerCallback

    run = RunDir(tmp_path / "run")

    class RequestStopAtStep5(TrainerCallback):  # what an alert rule with stop_training does
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                StopSignal(run.stop_file).request("alert good-enough: test")

    callback = PublishCheckpoints(run.root, api_url=None)
    trainer, _ = hf_trainer(tmp_path, [RequestStopAtStep5(), callback], max_steps=40)
    trainer.train()
    assert trainer.state.global_step == 5
    events = Manifest(run.manifest).events()
    assert [(e.global_step, e.final) for e in events] == [(5, True)]
    assert events[0].run_id == "run"  # the run directory's name by default


def test_directives_lower_the_learning_rate_then_stop_training_and_are_answered(tmp_path):
    from transformers import TrainerCallback

    from areal_eval.feedback import Directive
    from areal_eval.runs.directives import Directives

    run = RunDir(tmp_path / "run")
    box = Directives(run.root)
    rates = {}

    class AsEvaluationWould(TrainerCallback):  # issued mid-run, as the pipeline's feedback rules do
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            rates[state.global_step] = optimizer.param_groups[0]["lr"]
            if state.global_step == 3:
                box.issue([Directive("lr_scale@3", "lr_scale", (3,), "flat", {}, "act", {"factor": 0.25})])
            if state.global_step == 6:
                box.issue([Directive("stop@6", "stop", (6,), "target reached", {}, "act")])
                box.issue([Directive("rollback@6", "rollback", (6,), "collapsed", {}, "act", {"to_step": 0})])

    callback = PublishCheckpoints(run.root, api_url=None)
    trainer, _ = hf_trainer(tmp_path, [AsEvaluationWould(), callback], max_steps=40)
    trainer.train()
    assert trainer.state.global_step == 6  # asked at the end of 6, before the callback looked
    answers = {a.id: a for a in box.answers()}
    assert answers["lr_scale@3"].applied and answers["lr_scale@3"].step == 3
    assert rates[5] == pytest.approx(rates[3] * 0.25, rel=0.1)  # (the schedule moves it a little too)
    assert answers["stop@6"].applied and answers["stop@6"].step == 6
    assert not answers["rollback@6"].applied and "checkpoint-0, is gone" in answers["rollback@6"].reason
    assert [(e.global_step, e.final) for e in Manifest(run.manifest).events()] == [(6, True)]


def test_a_rollback_restores_the_trainers_checkpoint_and_publishes_it_at_once(tmp_path):
    # Asked at step 12: back to checkpoint-8's weights, optimizer and schedule, the learning rate
    # halved; the Trainer saves at once and the callback publishes step 12 as descending from 8.
    import torch
    from transformers import TrainerCallback

    from areal_eval.feedback import Directive
    from areal_eval.models.reward_model import load_model
    from areal_eval.runs.directives import Directives

    run = RunDir(tmp_path / "run")
    box = Directives(run.root)

    class AsEvaluationWould(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 12:
                box.issue(
                    [Directive("rollback@12", "rollback", (8, 12), "worse", {}, "act", {"to_step": 8, "factor": 0.5})]
                )

    callback = PublishCheckpoints(run.root, api_url=None)
    trainer, _ = hf_trainer(tmp_path, [AsEvaluationWould(), callback], max_steps=20)
    trainer.train()
    [answer] = box.answers()
    assert answer.applied and answer.step == 12
    events = {e.global_step: e for e in Manifest(run.manifest).events()}
    assert sorted(events) == [8, 12, 16, 20] and events[12].train_metrics["weights_from_step"] == 8
    assert "weights_from_step" not in events[8].train_metrics
    back, best = (load_model(Path(events[s].uri)).state_dict() for s in (12, 8))
    assert all(torch.equal(back[k], best[k]) for k in best)
    then, now = (torch.load(tmp_path / "trainer" / f"checkpoint-{s}" / "scheduler.pt") for s in (8, 12))
    assert now["last_epoch"] == then["last_epoch"] and now["base_lrs"] == [b * 0.5 for b in then["base_lrs"]]
    moments = [torch.load(tmp_path / "trainer" / f"checkpoint-{s}" / "optimizer.pt")["state"] for s in (8, 12)]
    assert all(torch.equal(moments[0][i]["exp_avg"], moments[1][i]["exp_avg"]) for i in moments[0])


def test_a_checkpoint_without_weights_is_refused_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({}))
    (tmp_path / "optimizer.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=f"{tmp_path}: no model weights"):
        evaluation_files(tmp_path)


def test_trls_reward_trainer_publishes_reward_models_the_pipeline_scores(tmp_path):
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from tests.helpers import single_process_metrics

    pairs, valid_path, tokenizer, model = tiny_reward_model(tmp_path)
    callback = PublishCheckpoints(tmp_path / "run", api_url=None, valid_data=valid_path)
    args = RewardConfig(
        output_dir=str(tmp_path / "trainer"),
        max_steps=16,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        save_steps=8,
        logging_steps=4,
        max_length=64,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    RewardTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tokenizer, callbacks=[callback]
    ).train()
    events = Manifest(tmp_path / "run" / "manifest.jsonl").events()
    assert [(e.global_step, e.final) for e in events] == [(8, False), (16, True)]
    metrics = single_process_metrics(events[-1], valid_path)
    assert metrics["n_pairs"] == 41 and 0.0 <= metrics["accuracy"] <= 1.0


def test_a_callback_without_a_run_directory_fails_when_training_begins(tmp_path, monkeypatch):
    monkeypatch.delenv("AREAL_EVAL_RUN_DIR", raising=False)
    trainer, _ = hf_trainer(tmp_path, [PublishCheckpoints(api_url=None)], max_steps=4)
    with pytest.raises(
        ValueError, match="no run directory for the manifest: pass run_dir=... or set AREAL_EVAL_RUN_DIR"
    ):
        trainer.train()
    assert not list((tmp_path / "trainer").glob("checkpoint-*"))  # before any step or save


def test_training_goes_on_while_a_saved_checkpoint_is_hashed_and_published(tmp_path, monkeypatch):
    """The publish of step 8 is held until training has reached step 10: a callback that
    published in on_save would wait there for good (here: give up after a minute)."""
    import threading

    from transformers import TrainerCallback

    from areal_eval.integrations import hf

    reached, held_too_long, publish = threading.Event(), [], hf.publish_checkpoint

    def held_publish(checkpoint_dir, manifest, run_id, global_step, **kwargs):
        if global_step == 8:
            held_too_long.append(not reached.wait(60))
        return publish(checkpoint_dir, manifest, run_id, global_step, **kwargs)

    class Reach10(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 10:
                reached.set()

    monkeypatch.setattr(hf, "publish_checkpoint", held_publish)
    callback = PublishCheckpoints(tmp_path / "run", api_url=None)
    trainer, _ = hf_trainer(tmp_path, [Reach10(), callback], max_steps=16)
    trainer.train()
    assert held_too_long == [False]
    assert [(e.global_step, e.final) for e in Manifest(tmp_path / "run" / "manifest.jsonl").events()] == [
        (8, False),
        (16, True),
    ]
    assert callback.published == [8, 16]


def test_a_publish_that_fails_raises_into_training(tmp_path):
    callback = PublishCheckpoints(tmp_path / "run", api_url=None, valid_data=tmp_path / "nowhere.jsonl")
    trainer, _ = hf_trainer(tmp_path, [callback], max_steps=16)
    with pytest.raises(FileNotFoundError, match="valid_data: .*nowhere.jsonl: no such validation data file"):
        trainer.train()
    assert not (tmp_path / "run" / "manifest.jsonl").exists()


@pytest.mark.integration  # W&B starts its service process
def test_the_callback_finds_the_trainers_wandb_run_and_tensorboard_directory_and_the_sinks_write_beside_them(
    tmp_path, monkeypatch
):
    from tests import sink_points

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "reward-models")
    callback = PublishCheckpoints(tmp_path / "run", run_id="hf-run", api_url=None)
    trainer, _ = hf_trainer(tmp_path, [callback], max_steps=8, report_to=("tensorboard", "wandb"))
    trainer.train()
    import wandb

    trainer_run = wandb.run.id
    wandb.finish()
    found = json.loads(RunDir(tmp_path / "run").trainer_trackers.read_text())
    assert found["wandb"]["run_id"] == trainer_run and found["wandb"]["project"] == "reward-models"
    assert found["tensorboard_logdir"] == str((tmp_path / "trainer" / "runs").resolve())

    said: list = []
    sinks = sink_points.every_sink(tmp_path / "run", "hf-run", said)  # what they leave open: the trainer's
    sinks.record_evaluation(8, {"accuracy": 0.75}, uri="checkpoint-8")
    sinks.close()
    assert said == []
    # Beside the trainer's own event files, in a directory of its own: one tensorboard --logdir shows both.
    assert sink_points.scalars(tmp_path / "trainer" / "runs" / "areal-eval") == {"eval/accuracy": [8]}
    [trainers] = [p for p in (tmp_path / "trainer" / "runs").iterdir() if p.name != "areal-eval"]
    assert "train/loss" in sink_points.scalars(trainers)
    [run] = sink_points.of_kind(tmp_path / "run" / "sinks", sink_points.wandb_run_id(tmp_path / "run"), "run")
    assert (run.project, run.run_group) == ("reward-models", trainer_run) and run.run_id != trainer_run
    assert {u.key: json.loads(u.value_json) for u in run.config.update}["trainer_run"] == trainer_run
