"""MLflow 3's LoggedModels of evaluated checkpoints and the run's dataset input, on a real store."""

from __future__ import annotations

from areal_eval.logged_models import checkpoint_model, file_digest, log_checkpoints_table, log_validation_data
from areal_eval.runs.ledger import LedgerEntry
from areal_eval.tracking import Tracker, TrackingConfig
from tests.helpers import checkpoints_table, sqlite_mlflow_uri


def test_a_checkpoint_is_one_logged_model_its_metrics_rank_it_and_the_data_is_logged_once(tmp_path):
    tracker = Tracker(TrackingConfig(tracking_uri=sqlite_mlflow_uri(tmp_path), experiment="areal-eval"))
    run_id = tracker.start_run("run-1", {})
    for step, accuracy in ((0, 0.5), (4, 0.75), (8, 0.625)):
        model_id = checkpoint_model(tracker.client, tracker.experiment_id, run_id, step, uri=f"/ckpt/{step}")
        assert checkpoint_model(tracker.client, tracker.experiment_id, run_id, step, uri=f"/ckpt/{step}") == model_id
        tracker.log_evaluation(run_id, step, {"accuracy": accuracy, "n_pairs": 8}, model_id=model_id)
    ranked = tracker.client.search_logged_models(
        [tracker.experiment_id], order_by=[{"field_name": "metrics.eval/accuracy", "ascending": False}]
    )
    assert [(m.name, m.params["uri"], m.status.to_int()) for m in ranked] == [
        ("checkpoint-00000004", "/ckpt/4", 2),
        ("checkpoint-00000008", "/ckpt/8", 2),
        ("checkpoint-00000000", "/ckpt/0", 2),
    ]  # READY, one each
    assert [m.step for m in tracker.client.get_metric_history(run_id, "eval/accuracy")] == [0, 4, 8]
    outputs = tracker.client.get_run(run_id).outputs.model_outputs  # the run's page lists them, once each
    assert sorted(o.step for o in outputs) == [0, 4, 8]
    assert {o.model_id for o in outputs} == {m.model_id for m in ranked}

    data = tmp_path / "valid.jsonl"
    data.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    assert log_validation_data(tracker.client, run_id, data) is True
    assert log_validation_data(tracker.client, run_id, data) is False  # a resumed run: once
    [dataset] = tracker.client.get_run(run_id).inputs.dataset_inputs
    assert (dataset.dataset.name, dataset.dataset.digest) == ("valid", file_digest(data))
    assert [(t.key, t.value) for t in dataset.tags] == [("mlflow.data.context", "eval")]


def test_the_checkpoints_table_is_rewritten_whole_so_a_retry_adds_no_row(tmp_path):
    tracker = Tracker(TrackingConfig(tracking_uri=sqlite_mlflow_uri(tmp_path), experiment="areal-eval"))
    run_id = tracker.start_run("run-1", {})
    entries = [LedgerEntry(0, "/ckpt/0", "evaluated", "first"), LedgerEntry(4, "/ckpt/4", "skipped", "plateau")]
    log_checkpoints_table(tracker.client, run_id, entries[:1])
    log_checkpoints_table(tracker.client, run_id, entries)
    log_checkpoints_table(tracker.client, run_id, entries)  # a retry, or a resumed run
    table = checkpoints_table(tracker, run_id)  # read back as MLflow's tables are (load_table)
    assert {step: (r["status"], r["decision"], r["checkpoint"]) for step, r in table.items()} == {
        0: ("evaluated", "first", "/ckpt/0"),
        4: ("skipped", "plateau", "/ckpt/4"),
    }
    assert not [tag for tag in tracker.client.get_run(run_id).data.tags if tag.startswith("decision.")]
