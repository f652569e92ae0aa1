"""``evaluate-checkpoint`` as the event trigger runs it, on checkpoints a trainer published on its
own: what one flow run evaluates beyond the checkpoint it was started for."""

import dataclasses
import json
import shutil
import time

from areal_eval.checkpoints.manifest import checkpoint_name
from areal_eval.checkpoints.publisher import publish_checkpoint
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger
from areal_eval.sinks import WandbConfig
from tests import sink_points
from tests.helpers import mlflow_run, sqlite_mlflow_uri

# Tests that use prefect_server or trained_run are marked integration by tests/conftest.py.


def test_the_flow_run_whose_result_is_a_suspected_regression_looks_back_at_the_skipped_checkpoint(
    prefect_server, trained_run, tmp_path
):
    # The trained run's checkpoints, published by a trainer of its own, the final one (12) with its
    # reward head's sign flipped: every preference reversed, accuracy 0.55 -> 0.45. 8 is skipped
    # (a plateau to this scheduler), so 12's flow run evaluates it too, once 12's result is in.
    from safetensors.torch import load_file, save_file

    from flows.evaluate_checkpoint import evaluate_checkpoint
    from tasks.evaluation import serve_warm_workers

    cfg, trained = trained_run
    cfg = dataclasses.replace(
        cfg,
        # 101 pairs: the flip is about one error of the difference, so suspect from half of one.
        scheduler=dataclasses.replace(
            cfg.scheduler,
            min_interval_steps=0,
            max_interval_steps=None,
            max_interval_growth=None,
            drift_tolerance=1e6,
            regression_z=0.5,
        ),
        # Every sink: one flow run per event, each recording in turn (W&B's files only, offline).
        tracking=dataclasses.replace(
            cfg.tracking,
            tracking_uri=sqlite_mlflow_uri(tmp_path),
            sinks=["mlflow", "tensorboard", "wandb"],
            wandb=WandbConfig(mode="offline"),
        ),
    )
    params = json.loads(json.dumps(dataclasses.asdict(cfg)))
    run, results = RunDir(tmp_path / "run"), {}
    with serve_warm_workers(cfg, tmp_path / "warm"):
        for step in (0, 4, 8, 12):  # each published, then its event's flow run
            checkpoint = tmp_path / "trainer" / f"checkpoint-{step}"
            shutil.copytree(trained.checkpoints / checkpoint_name(step), checkpoint)
            if step == 12:
                weights = load_file(checkpoint / "model.safetensors")
                weights["score.weight"] = -weights["score.weight"]
                save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
            valid = trained.root / "data" / "valid.jsonl"
            publish_checkpoint(checkpoint, run.manifest, "own-trainer", step, final=step == 12, valid_data=valid)
            results[step] = evaluate_checkpoint(step, str(run.manifest), params=params)
    assert [results[s]["evaluated"] for s in (0, 4, 8, 12)] == [True, True, False, True]
    assert results[12]["looked_back"] == [8] and results[12]["metrics"]["accuracy"] < 0.5
    ledger = Ledger(run.ledger)
    assert ledger.latest(8).status == "evaluated" and ledger.latest(8).reason.startswith("look back: step 12 is ")
    tracker, runs = mlflow_run(cfg)
    history = tracker.client.get_metric_history(runs[0].info.run_id, "eval/accuracy")
    assert sorted(m.step for m in history) == [0, 4, 8, 12]  # each once, at its own step
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["checkpoints.evaluated"] == "4"
    # The other sinks hold the same points once each, 8 after 12 (on W&B's eval/step axis).
    assert sink_points.scalars(run.root / "tensorboard" / "areal-eval")["eval/accuracy"] == [0, 4, 8, 12]
    rows = sink_points.history(run.root / "sinks", sink_points.wandb_run_id(run.root))
    assert [r["eval/step"] for r in rows if "eval/accuracy" in r] == [0, 4, 12, 8]


def test_a_step_not_in_the_manifest_fails_in_one_line_even_when_a_live_flow_owns_the_run(
    prefect_server, trained_run, tmp_path
):
    from areal_eval.runs.directory import RunLock
    from flows.evaluate_checkpoint import evaluate_checkpoint
    from tests.helpers import copy_trained_run

    _, original = trained_run
    run = copy_trained_run(original, tmp_path / "owned")
    params = {"work_dir": str(tmp_path), "tracking": {"tracking_uri": sqlite_mlflow_uri(tmp_path)}}
    with RunLock(run):  # a live train-and-evaluate follows the run
        missing = evaluate_checkpoint(110, str(run.manifest), params=params, return_state=True)
        left = evaluate_checkpoint(4, str(run.manifest), params=params, return_state=True)
    assert missing.is_failed()
    assert missing.message == f"owned@110 failed: {run.manifest}: no checkpoint at step 110 in the manifest"
    assert (
        left.is_completed()
        and left.result()["evaluated"] is False
        and "it evaluates its own" in left.result()["reason"]
    )
    assert not run.ledger.exists()  # nothing recorded for either


def test_a_trainer_on_another_machine_is_stopped_through_s3_and_its_answer_is_on_record(
    prefect_server, s3_server, s3_bucket, tmp_path
):
    # The trainer (torchrun, 2 ranks) publishes to S3 from its own directory; the flow run of its
    # checkpoint's event evaluates from a copy in a work directory of its own: S3 is all they share.
    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.launchers.local import TorchrunJob
    from areal_eval.pipeline.setup import prepare_run
    from areal_eval.runs.directives import Directives, evaluation_results
    from flows.evaluate_checkpoint import evaluate_checkpoint
    from tests.conftest import tiny_config

    s3 = {"endpoint_url": s3_server.url, "control_poll_s": 0.2}
    trainer = prepare_run(
        tiny_config(
            tmp_path / "trainer",
            storage={"checkpoint_uri": f"s3://{s3_bucket}/ckpt", "s3": s3},
            train={"max_steps": 100000, "epochs": 100000, "save": {"freq_steps": 100, "eval_before_train": False}},
        )
    )
    evaluator = tiny_config(
        tmp_path / "evaluator",
        storage={"s3": s3},
        feedback={"stop": "act", "target": 0.0, "min_step": 1, "patience": 1, "max_lr_scales": 10},
    )
    params = json.loads(json.dumps(dataclasses.asdict(evaluator)))
    manifest = f"s3://{s3_bucket}/ckpt/{trainer.run_id}/manifest.jsonl"
    job = TorchrunJob("areal_eval.train", ["--config", str(trainer.train_config)], 2, trainer.logs / "train.log")
    try:
        deadline = time.monotonic() + 300
        while not Manifest(trainer.manifest).events():
            assert time.monotonic() < deadline and job.poll() is None, "no checkpoint published"
            time.sleep(0.1)
        first = evaluate_checkpoint(100, manifest, params=params)
        job.wait(300)
    finally:
        job.kill(grace_s=0)
    job.raise_for_status("training")
    assert first["evaluated"]
    # The trainer took the stop from S3 on both ranks, answered it and ended with a final checkpoint.
    [stop] = Directives(trainer.root).all()
    [answer] = Directives(trainer.root).answers()
    final = Manifest(trainer.manifest).events()[-1]
    assert stop.id == "stop@100" and answer.applied and final.final and final.global_step == answer.step < 100000
    assert final.train_metrics["stopped"].startswith("stop@100: accuracy ")
    assert [step for step, _ in evaluation_results(trainer.root)] == [100]  # what the trainer's own code reads
    # The flow runs of the later checkpoints' events, the final one's last, read the answer from
    # S3: the run ends in MLflow with what came of the stop.
    for event in Manifest(trainer.manifest).events()[1:]:
        evaluate_checkpoint(event.global_step, manifest, params=params)
    copy = RunDir(tmp_path / "evaluator" / "remote-runs" / s3_bucket / "ckpt" / trainer.run_id)
    assert [a.id for a in Directives(copy.root).answers()] == ["stop@100"]
    _, [recorded] = mlflow_run(evaluator)
    assert recorded.data.tags["directive.stop_at_100"] == f"applied at step {answer.step}"
    assert recorded.info.status == "FINISHED"
