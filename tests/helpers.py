"""Helpers for tests that run real processes."""

from __future__ import annotations

import functools
import shutil
import socket
import tempfile
from pathlib import Path

import psutil
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_processes(needle: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line contains ``needle``."""
    pids = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and needle in " ".join(proc.info["cmdline"] or ()):
            pids.append(proc.pid)
    return pids


HOLD_RUN_LOCK = """
import sys, time
from areal_eval.runs.directory import RunDir, RunLock
lock = RunLock(RunDir(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(600)
"""
"""A second process that owns a run until killed: ``python -c HOLD_RUN_LOCK RUN_DIR``."""


class TinyModel(torch.nn.Module):
    """Stands in for a transformers model: has save_pretrained with state_dict=."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def save_pretrained(self, path, state_dict, safe_serialization=True):
        from safetensors.torch import save_file

        save_file(state_dict, f"{path}/model.safetensors")


class NoTokenizer:
    def save_pretrained(self, path):
        (Path(path) / "tokenizer.json").write_text("{}")


def assert_best_is_registered(tracker, name, mlflow_run_id, ledger, metric="accuracy"):
    """The registered model's ``best`` alias is on the best evaluated checkpoint (the earliest of
    ties: a tie does not move it), sourced from its URI, with its step and metrics as tags."""
    evaluated = [e for e in ledger.entries() if e.status == "evaluated"]
    best = max(evaluated, key=lambda e: (e.metrics[metric], -e.step))
    version = tracker.client.get_model_version_by_alias(name, "best")
    assert (version.source, version.run_id, version.tags["global_step"]) == (best.uri, mlflow_run_id, str(best.step))
    assert float(version.tags[f"eval/{metric}"]) == best.metrics[metric]
    versions = tracker.client.search_model_versions(f"name='{name}'")
    values = [float(v.tags[f"eval/{metric}"]) for v in sorted(versions, key=lambda v: int(v.version))]
    assert values == sorted(values) and len(set(values)) == len(values)  # each version beat the last


@functools.lru_cache(maxsize=1)
def _migrated_mlflow_db() -> Path:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    path = Path(tempfile.mkdtemp(prefix="mlflow-template-")) / "mlflow.db"
    store = SqlAlchemyStore(f"sqlite:///{path}", str(path.parent / "artifacts"))
    store.engine.dispose()
    return path


def sqlite_mlflow_uri(directory: Path) -> str:
    """``sqlite:///directory/mlflow.db``, a store with MLflow's tables already made: creating
    them runs every schema migration, seconds per store, once per test session instead."""
    db = Path(directory) / "mlflow.db"
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_migrated_mlflow_db(), db)
    return f"sqlite:///{db}"


def single_process_metrics(event, data, batch_size=7):
    """The reward model's metrics on ``event``'s checkpoint in this process, on one rank: the
    reference every distributed evaluation must equal."""
    from areal_eval import distributed
    from areal_eval.evaluation.evaluators import RewardModelEvaluator
    from areal_eval.evaluation.worker import compute_metrics

    evaluator = RewardModelEvaluator(max_length=64)
    evaluator.load(Path(event.uri), data)
    return compute_metrics(evaluator, distributed.ParallelLayout(1, 0, 1), batch_size)
