"""The recording step's Prefect side: one tracker per store and experiment in a process, the
other sinks only where the config names them, and a result recorded once through the task."""

from __future__ import annotations

from areal_eval.evaluation.jobs import EvalResult
from areal_eval.runs.directory import RunDir
from tasks.mlflow_logging import log_evaluation, sinks_for, start_tracking, tracker_for
from tests.conftest import tiny_config


def test_one_tracker_per_store_and_experiment_and_sinks_only_where_named(tmp_path):
    cfg = tiny_config(tmp_path)
    assert tracker_for(cfg) is tracker_for(tiny_config(tmp_path))  # what it logged stays known
    other = tiny_config(tmp_path, tracking={"experiment": "another"})
    assert (
        tracker_for(other) is not tracker_for(cfg)
        and tracker_for(other).experiment_id != tracker_for(cfg).experiment_id
    )
    run = RunDir(tmp_path / "run")
    assert sinks_for(cfg, run, "mlflow-run") is None  # MLflow alone: nothing else to open


def test_a_result_is_recorded_once_at_its_step_through_the_task(prefect_server, tmp_path):
    from prefect import flow

    cfg = tiny_config(tmp_path)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.run_id_file.write_text("logged")
    result = EvalResult(8, str(tmp_path / "ckpt-8"), {"accuracy": 0.75, "accuracy_stderr": 0.05, "n_pairs": 4}, 1.0)

    @flow
    def logging_twice() -> tuple[str, list[bool]]:
        mlflow_run_id = start_tracking(cfg, run)
        recorded = (run, "logged")
        return mlflow_run_id, [log_evaluation(cfg, mlflow_run_id, result, "final", recorded_in=recorded) for _ in "ab"]

    mlflow_run_id, logged = logging_twice()
    assert logged == [True, False]
    history = tracker_for(cfg).client.get_metric_history(mlflow_run_id, "eval/accuracy")
    assert [(m.step, m.value) for m in history] == [(8, 0.75)]


def test_without_the_mlflow_sink_the_recorder_writes_the_work_dirs_record_alone(tmp_path, monkeypatch):
    from tasks.mlflow_logging import recorder_for

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'users-mlflow.db'}")
    cfg = tiny_config(tmp_path, tracking={"sinks": ["tensorboard"], "tracking_uri": None})
    run = RunDir(tmp_path / "run")
    recorder = recorder_for(cfg, "mlflow-run", run, training_run_id="run-1")
    assert not recorder.to_mlflow and recorder.sinks is not None
    assert recorder.tracker.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert not (tmp_path / "users-mlflow.db").exists()
