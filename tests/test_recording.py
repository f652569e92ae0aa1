"""The one recording step on a real MLflow store and real sinks (TensorBoard, W&B offline)."""

from __future__ import annotations

import dataclasses

import pytest

from areal_eval.alerts import Alert
from areal_eval.evaluation.jobs import EvalResult
from areal_eval.recording import Recorder
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger, LedgerEntry
from areal_eval.tracking import Tracker, TrackingConfig
from tests.helpers import checkpoints_table, sqlite_mlflow_uri
from tests.sink_points import every_sink, scalars


def recorder(tmp_path, warned: list, sinks=None, *, to_mlflow: bool = True) -> Recorder:
    tracker = Tracker(TrackingConfig(tracking_uri=sqlite_mlflow_uri(tmp_path), experiment="areal-eval"))
    return Recorder(
        tracker,
        tracker.start_run("run-1", {}),
        run=RunDir(tmp_path / "run"),
        training_run_id="run-1",
        sinks=sinks,
        to_mlflow=to_mlflow,
        registered_model="best-of-{run_id}",
        warn=warned.append,
    )


def result(step: int, accuracy: float) -> EvalResult:
    return EvalResult(step, f"/ckpt/{step}", {"accuracy": accuracy, "n_pairs": 8}, 1.0)


def test_a_result_lands_once_with_its_model_table_and_registered_best_and_the_end_closes_the_run(tmp_path):
    warned: list = []
    rec = recorder(tmp_path, warned)
    ledger = Ledger(rec.run.ledger)
    for step, accuracy in ((0, 0.5), (4, 0.75)):
        ledger.append(LedgerEntry(step, f"/ckpt/{step}", "evaluated", "checkpoint due", metrics={"accuracy": accuracy}))
        assert rec.result(result(step, accuracy)) is True
    assert rec.result(result(4, 0.75)) is False  # a retry: nothing twice
    assert rec.training([{"step": 2, "loss": 1.0}, {"step": 4, "loss": 0.5}]) == 2
    assert rec.training([{"step": 4, "loss": 0.5}]) == 0
    rec.alert(Alert("drop", 4, "accuracy fell", stop_training=False), {"alert.drop": "step 4: accuracy fell"})
    rec.end(ledger, None, status="FINISHED")

    client, run_id = rec.tracker.client, rec.mlflow_run_id
    assert [m.step for m in client.get_metric_history(run_id, "eval/accuracy")] == [0, 4]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_model_version_by_alias("best-of-run-1", "best").tags["global_step"] == "4"
    assert {m.name for m in client.search_logged_models([rec.tracker.experiment_id])} == {
        "checkpoint-00000000",
        "checkpoint-00000004",
    }
    assert sorted(checkpoints_table(rec.tracker, run_id)) == [0, 4]
    assert client.get_run(run_id).data.tags["alert.drop"] == "step 4: accuracy fell"
    assert [a.path for a in client.list_artifacts(run_id, "alerts")] == ["alerts/step_00000004_drop.json"]
    assert warned == []


@pytest.mark.integration  # W&B starts its service process
def test_a_side_record_that_fails_is_said_in_one_line_and_the_metrics_and_sinks_still_land(tmp_path):
    warned, said = [], []
    rec = recorder(tmp_path, warned, every_sink(tmp_path / "run", "run-1", said))
    rec.registered_model = "bad/name{run_id}"  # the registry refuses the name
    Ledger(rec.run.ledger).append(LedgerEntry(8, "/ckpt/8", "evaluated", "checkpoint due"))
    assert rec.result(result(8, 0.5)) is True
    assert [m.step for m in rec.tracker.client.get_metric_history(rec.mlflow_run_id, "eval/accuracy")] == [8]
    [line] = warned
    assert line.startswith("step 8: not registered in model 'bad/namerun-1': ") and "\n" not in line
    assert scalars(tmp_path / "run" / "tensorboard" / "areal-eval")["eval/accuracy"] == [8] and said == []


def test_without_the_mlflow_sink_the_record_keeps_the_metrics_and_nothing_is_made_for_mlflows_ui(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from areal_eval.sinks import TensorBoardConfig, WandbConfig, open_sinks

    warned, said = [], []
    run = RunDir(tmp_path / "run")
    tensorboard = open_sinks(
        ["tensorboard"],
        wandb=WandbConfig(),
        tensorboard=TensorBoardConfig(),
        run_dir=run.root,
        run_name="run-1",
        on_failure=lambda sink, message: said.append(message),
    )
    rec = recorder(tmp_path, warned, tensorboard, to_mlflow=False)
    ledger = Ledger(rec.run.ledger)
    ledger.append(LedgerEntry(4, "/ckpt/4", "evaluated", "checkpoint due", metrics={"accuracy": 0.75}))
    items = tmp_path / "items.parquet"
    pq.write_table(pa.table({"prompt": ["2 + 2?"], "answer": ["4"], "score": [1.0]}), items)
    assert rec.result(dataclasses.replace(result(4, 0.75), items={"pairs": str(items)})) is True
    assert rec.result(result(4, 0.75)) is False  # the record still keeps it exactly once
    rec.end(ledger, None, status="FINISHED")

    client, run_id = rec.tracker.client, rec.mlflow_run_id
    assert [m.step for m in client.get_metric_history(run_id, "eval/accuracy")] == [4]  # resume reads it
    assert client.search_logged_models([rec.tracker.experiment_id]) == []
    assert client.search_registered_models() == []
    assert [a.path for a in client.list_artifacts(run_id)] == ["scheduler_decisions.json"]
    assert scalars(run.root / "tensorboard" / "areal-eval")["eval/accuracy"] == [4]
    assert warned == [] and said == []
