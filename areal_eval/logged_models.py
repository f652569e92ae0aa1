"""MLflow 3's own records of what a run evaluated: a LoggedModel per evaluated checkpoint, and the
validation data as the run's dataset input.

Each evaluated checkpoint becomes an external LoggedModel (its weights stay where they are: only
its name, step and location are recorded), and its ``eval/*`` metrics are linked to it, so
``search_logged_models`` ranks a run's checkpoints by any metric:

    client.search_logged_models([experiment_id], order_by=[{"field_name": "metrics.eval/accuracy", "ascending": False}])
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from pathlib import Path

from areal_eval.runs.directory import file_lock

MODEL_TYPE = "checkpoint"


def model_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


def checkpoint_model(client, experiment_id: str, run_id: str, step: int, *, uri: str) -> str:
    """The LoggedModel of the run's checkpoint at ``step`` (created once, READY, and an output of
    the run at ``step``: the run's page lists it under Logged models); its id."""
    name = model_name(step)
    found = client.search_logged_models(
        [experiment_id], filter_string=f"name = '{name}' AND source_run_id = '{run_id}'", max_results=1
    )
    if found:
        return found[0].model_id
    model = client.create_logged_model(
        experiment_id,
        name=name,
        source_run_id=run_id,
        params={"global_step": str(step), "uri": uri},
        model_type=MODEL_TYPE,
    )
    client.finalize_logged_model(model.model_id, "READY")
    from mlflow.entities import LoggedModelOutput

    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    return model.model_id


def file_digest(path: str | Path) -> str:
    """A file's sha256, as MLflow shows a dataset's digest (its first 16 hex digits)."""
    sha = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()[:16]


def log_validation_data(client, run_id: str, path: str | Path, *, lock: Path | None = None) -> bool:
    """The validation data as the run's dataset input (``mlflow.data.context: eval``), once per
    content; False if the run has it already."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    digest = file_digest(path)
    with file_lock(lock) if lock is not None else contextlib.nullcontext():
        inputs = client.get_run(run_id).inputs.dataset_inputs
        if any(i.dataset.digest == digest for i in inputs):
            return False
        dataset = Dataset(Path(path).stem, digest, "local", str(Path(path).resolve()))
        client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "eval")])])
    return True


CHECKPOINTS_TABLE = "checkpoints.json"
"""Every checkpoint of the run, a row each: its step, status, the scheduler's decision, where it
is, its failed attempts. An MLflow table (the run's Artifacts and Evaluation views), rewritten
whole from the ledger each time, so a retry or a resume never adds a row twice."""
COLUMNS = ("step", "status", "decision", "checkpoint", "failed_attempts")


TABLE_EVERY_S = 30.0
"""How often a result rewrites the table while the run goes on: its cost grows with the run (a
row per checkpoint), so a long run's results do not each pay for it; the run's end writes it."""
_written: dict[str, float] = {}


def log_checkpoints_table(client, run_id: str, entries: list, *, at_most_every_s: float = 0.0) -> bool:
    """The run's checkpoints (ledger entries, by step) as the table :data:`CHECKPOINTS_TABLE`;
    skipped (False) when this process wrote it less than ``at_most_every_s`` ago."""
    import json
    import time

    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

    if time.monotonic() - _written.get(run_id, -math.inf) < at_most_every_s:
        return False

    rows = [[e.step, e.status, e.reason, e.uri, e.failed_attempts] for e in sorted(entries, key=lambda e: e.step)]
    client.log_dict(run_id, {"columns": list(COLUMNS), "data": rows}, CHECKPOINTS_TABLE)  # log_table's own layout
    logged = json.loads(client.get_run(run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
    if {"path": CHECKPOINTS_TABLE, "type": "table"} not in logged:  # shown as a table, as log_table marks it
        logged.append({"path": CHECKPOINTS_TABLE, "type": "table"})
        client.set_tag(run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps(logged))
    _written[run_id] = time.monotonic()
    return True
