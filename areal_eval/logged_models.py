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
from pathlib import Path

from areal_eval.runs.directory import file_lock

MODEL_TYPE = "checkpoint"


def model_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


def checkpoint_model(client, experiment_id: str, run_id: str, step: int, uri: str) -> str:
    """The LoggedModel of the run's checkpoint at ``step`` (created once, READY); its id."""
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
