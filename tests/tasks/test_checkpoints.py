"""Retention's task: the checkpoints it lets go are deleted, and each is named on the MLflow run."""

from __future__ import annotations

from areal_eval.checkpoints.manifest import CheckpointEvent
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import Ledger, LedgerEntry
from tasks.checkpoints import apply_retention, share_run_files
from tests.conftest import tiny_config


def test_retention_deletes_what_it_lets_go_and_tags_the_mlflow_run(prefect_server, tmp_path):
    from prefect import flow

    from tasks.mlflow_logging import start_tracking, tracker_for

    cfg = tiny_config(tmp_path, storage={"retention": {"keep_last": 1, "keep_best": 1}})
    run = RunDir(tmp_path / "run")
    events = []
    for step in (0, 4, 8):
        directory = run.checkpoints / f"global_step_{step:08d}"
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"weights")
        events.append(CheckpointEvent("retained", str(directory), 0, step, step, 0.0, {}, ()))
    run.run_id_file.write_text("retained")
    ledger = Ledger(run.ledger)
    ledger.append(LedgerEntry(4, events[1].uri, "skipped", "too close"))

    @flow
    def retaining() -> tuple[str, list[int]]:
        mlflow_run_id = start_tracking(cfg, run)
        return mlflow_run_id, apply_retention(cfg, run, mlflow_run_id, ledger, doomed=[events[1]])

    mlflow_run_id, deleted = retaining()
    assert deleted == [4]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["global_step_00000000", "global_step_00000008"]
    tags = tracker_for(cfg).client.get_run(mlflow_run_id).data.tags
    assert tags["deleted.4"] == "retention: skipped, not among the last 1 or best 1"
    before = sorted(p.name for p in run.root.rglob("*"))
    share_run_files(cfg, run)  # a local store is the run directory: nothing to mirror, nothing changed
    assert sorted(p.name for p in run.root.rglob("*")) == before
