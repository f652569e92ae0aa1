"""MLflow on a real SQLite store."""

import time

import pytest

from areal_eval.tracking import TRAIN_WATERMARK_TAG, Tracker, TrackingConfig, mlflow_run_url, resolve_tracking_uri
from tests.helpers import sqlite_mlflow_uri


def at(tracking_uri: str, experiment: str) -> Tracker:
    return Tracker(TrackingConfig(tracking_uri, experiment))


@pytest.fixture
def tracker(tmp_path):
    return at(sqlite_mlflow_uri(tmp_path), "test")


def test_one_run_per_training_run_with_params(tracker):
    run_id = tracker.start_run("demo-1", {"train": {"lr": 0.001, "save": {"freq_steps": 25}}})
    assert tracker.start_run("demo-1", {"ignored": True}) == run_id  # a resumed flow reuses it
    assert tracker.start_run("demo-2", {}) != run_id
    params = tracker.client.get_run(run_id).data.params
    assert params["train.lr"] == "0.001" and params["train.save.freq_steps"] == "25"


def test_the_experiment_opens_as_model_training_in_the_ui_unless_its_kind_was_set(tracker, tmp_path):
    kind = "mlflow.experimentKind"
    assert tracker.client.get_experiment(tracker.experiment_id).tags[kind] == "custom_model_development"
    made_before = tracker.client.create_experiment("made-before")  # by an older version: no kind
    assert at(tracker.tracking_uri, "made-before").client.get_experiment(made_before).tags[kind] == (
        "custom_model_development"
    )
    tracker.client.set_experiment_tag(made_before, kind, "finetuning")  # the user's choice stays
    assert at(tracker.tracking_uri, "made-before").client.get_experiment(made_before).tags[kind] == "finetuning"


def test_links_open_the_run_in_the_uis_model_training_view():
    url = "/#/experiments/1/runs/abc?workflowType=machine_learning"  # not MLflow 3's GenAI view
    assert mlflow_run_url(TrackingConfig(), "sqlite:///m.db", "1", "abc") == "http://127.0.0.1:5000" + url
    assert mlflow_run_url(TrackingConfig(), "http://mlflow:5000/", "1", "abc") == "http://mlflow:5000" + url
    assert (
        mlflow_run_url(TrackingConfig(ui_url="https://ml.example"), "http://x", "1", "abc")
        == "https://ml.example" + url
    )


def test_flow_runs_starting_at_once_share_one_mlflow_run(tracker, tmp_path):
    """Triggered flow runs of one training run (checkpoints published close together) each find
    or create its MLflow run at the same moment: they must all get the same one."""
    import threading

    trackers = [at(tracker.client.tracking_uri, "test") for _ in range(4)]  # a process's each
    ready, found = threading.Barrier(len(trackers)), []

    def start(t):
        ready.wait()
        found.append(t.start_run("burst-1", {"eval": {"nproc": 1}}, lock=tmp_path / "tracking.lock"))

    threads = [threading.Thread(target=start, args=(t,)) for t in trackers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    runs = tracker.client.search_runs([tracker.experiment_id], filter_string="tags.`areal.run_id` = 'burst-1'")
    assert len(runs) == 1 and found == [runs[0].info.run_id] * len(trackers)


def test_evaluation_logging_is_idempotent(tracker):
    run_id = tracker.start_run("r", {})
    metrics = {"accuracy": 0.8, "loss": 0.4, "n_pairs": 101.0}
    assert tracker.log_evaluation(run_id, 25, metrics, tags={"checkpoint.25.uri": "/c/25"})
    assert not tracker.log_evaluation(run_id, 25, metrics)  # re-run of the same checkpoint
    assert tracker.log_evaluation(run_id, 50, {**metrics, "accuracy": 0.85})
    history = tracker.client.get_metric_history(run_id, "eval/accuracy")
    assert sorted((m.step, m.value) for m in history) == [(25, 0.8), (50, 0.85)]
    assert tracker.client.get_run(run_id).data.tags["checkpoint.25.uri"] == "/c/25"


def test_training_metrics_at_global_step_without_duplicates(tracker):
    run_id = tracker.start_run("r", {})
    rows = [{"step": 5, "loss": 0.7, "lr": 0.001}, {"step": 10, "loss": 0.6, "lr": 0.001}]
    tracker.log_train_metrics(run_id, rows)
    tracker.log_train_metrics(run_id, rows + [{"step": 15, "loss": 0.5, "lr": 0.001}])
    steps = [m.step for m in tracker.client.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == [5, 10, 15]


def test_tracking_uri_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(TrackingConfig(), tmp_path) == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere.db")
    assert resolve_tracking_uri(TrackingConfig(), tmp_path) == "sqlite:////elsewhere.db"
    assert resolve_tracking_uri(TrackingConfig(tracking_uri="http://mlflow:5000"), tmp_path) == "http://mlflow:5000"


def test_training_watermark_survives_a_resume_and_large_flushes(tracker, tmp_path):
    run_id = tracker.start_run("r", {})
    rows = [{"step": s, "loss": 1.0 / (s + 1), "lr": 0.001, "grad_norm": 1.0} for s in range(1, 801)]
    assert tracker.log_train_metrics(run_id, rows[:500]) == 1500  # 1,500 points: two requests
    tags = tracker.client.get_run(run_id).data.tags
    assert tags[TRAIN_WATERMARK_TAG] == "500"
    resumed = at(tracker.tracking_uri, "test")  # a restarted flow: reads the watermark once
    assert resumed.log_train_metrics(run_id, rows[400:]) == 900  # steps 501-800 only
    assert resumed.log_train_metrics(run_id, rows) == 0
    history = tracker.client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 801))


def test_runs_logged_before_the_watermark_resume_from_their_history(tracker):
    from mlflow.entities import Metric

    run_id = tracker.start_run("old", {})
    tracker.client.log_batch(run_id, metrics=[Metric("train/loss", 0.5, 0, s) for s in (5, 10)])
    assert tracker.log_train_metrics(run_id, [{"step": 10, "loss": 0.4}, {"step": 15, "loss": 0.3}]) == 1
    assert sorted(m.step for m in tracker.client.get_metric_history(run_id, "train/loss")) == [5, 10, 15]


def test_evaluation_logged_by_another_tracker_is_not_duplicated(tracker):
    run_id = tracker.start_run("r", {})
    metrics = {"accuracy": 0.8, "n_pairs": 101.0}
    assert tracker.log_evaluation(run_id, 25, metrics)
    other = at(tracker.tracking_uri, "test")
    assert not other.log_evaluation(run_id, 25, metrics)
    assert other.log_evaluation(run_id, 50, metrics) and not tracker.log_evaluation(run_id, 25, metrics)
    assert sorted(m.step for m in tracker.client.get_metric_history(run_id, "eval/accuracy")) == [25, 50]


def test_the_best_checkpoint_is_registered_and_the_alias_follows_improvements(tracker):
    run_id = tracker.start_run("demo-1", {})
    name = "areal-eval-demo-1"
    accuracy = {0: 0.55, 4: 0.71, 8: 0.68, 12: 0.74, 16: 0.74}
    registered = {
        s: tracker.register_if_best(
            name,
            run_id,
            s,
            source=f"/ckpt/global_step_{s}",
            metrics={"accuracy": a, "n_pairs": 101},
            metric="accuracy",
            higher_is_better=True,
        )
        for s, a in accuracy.items()
    }
    assert registered == {0: "1", 4: "2", 8: None, 12: "3", 16: None}  # a tie does not move it
    best = tracker.client.get_model_version_by_alias(name, "best")
    assert (str(best.version), best.source, best.run_id) == ("3", "/ckpt/global_step_12", run_id)
    assert best.tags["global_step"] == "12" and float(best.tags["eval/accuracy"]) == 0.74
    assert best.tags["eval/n_pairs"] == "101.0" and best.tags["metric"] == "accuracy"
    assert (
        tracker.register_if_best(
            name,
            run_id,
            12,
            source="/ckpt/global_step_12",
            metrics={"accuracy": 0.74},
            metric="accuracy",
            higher_is_better=True,
        )
        is None
    )
    # A new best carries how it compares with the best it replaces (compare.versus_previous_best).
    versus = tracker.register_if_best(
        name,
        run_id,
        24,
        source="/c24",
        metrics={"accuracy": 0.9},
        metric="accuracy",
        higher_is_better=True,
        versus=lambda prev: {"vs_previous_best": f"{prev}"},
    )
    version = tracker.client.get_model_version(name, versus)
    assert version.tags["vs_previous_best"] == "12" and version.description.endswith("accuracy = 0.9; 12")
    assert (
        tracker.register_if_best(
            name, run_id, 20, source="/c", metrics={"accuracy": float("nan")}, metric="accuracy", higher_is_better=True
        )
        is None
    )
    # Lower is better: the direction comes from the monitored metric.
    losses = [
        tracker.register_if_best(
            "loss-model", run_id, s, source=f"/c{s}", metrics={"loss": v}, metric="loss", higher_is_better=False
        )
        for s, v in ((0, 0.9), (4, 0.95), (8, 0.5))
    ]
    assert losses == ["1", None, "2"]


def test_artifacts_of_a_sqlite_store_go_beside_it_not_into_the_working_directory(tmp_path, monkeypatch):
    from areal_eval.tracking import artifact_location

    monkeypatch.chdir(tmp_path)  # where ./mlruns would appear
    uri = sqlite_mlflow_uri(tmp_path / "store")
    location = artifact_location(TrackingConfig(), uri)
    assert location == (tmp_path / "store" / "mlartifacts").as_uri()
    assert artifact_location(TrackingConfig(artifact_location="s3://b/mlflow"), uri) == "s3://b/mlflow"
    assert artifact_location(TrackingConfig(), "http://127.0.0.1:5000") is None  # the server decides
    tracker = Tracker(TrackingConfig(tracking_uri=uri, experiment="beside", artifact_location=location))
    run_id = tracker.start_run("demo-1", {})
    (tmp_path / "plot.png").write_bytes(b"png")
    tracker.log_artifact(run_id, tmp_path / "plot.png")
    assert (tmp_path / "store" / "mlartifacts").is_dir() and not (tmp_path / "mlruns").exists()


@pytest.mark.integration
def test_processes_opening_a_fresh_sqlite_store_at_once_all_get_its_experiment(tmp_path):
    """Flow runs triggered together on a new store: each creating its tables, all but one failed
    ("table latest_metrics already exists")."""
    import subprocess
    import sys

    uri, go = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "go"  # no tables yet
    opener = (
        "import pathlib, sys, time\n"
        "from areal_eval.tracking import Tracker, TrackingConfig\n"
        "import mlflow.store.tracking.sqlalchemy_store\n"
        "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.01)\n"
        "print(Tracker(TrackingConfig(sys.argv[1], 'burst')).experiment_id)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", opener, uri, str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    time.sleep(8)  # each has imported what it needs and waits
    go.touch()
    said = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e.decode()[-2000:] for _, e in said]
    assert len({o.strip() for o, _ in said}) == 1


def test_a_tracker_takes_its_config_and_keeps_a_store_without_a_uri_in_the_work_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ValueError, match="tracking.tracking_uri: not set, and no work_dir"):
        Tracker(TrackingConfig())
    tracker = Tracker(TrackingConfig(experiment="here"), work_dir=tmp_path)
    assert tracker.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}" and (tmp_path / "mlflow.db").exists()
    assert tracker.client.get_experiment(tracker.experiment_id).name == "here"
