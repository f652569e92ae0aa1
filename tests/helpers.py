"""Helpers for tests that run real processes."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import torch


@contextlib.contextmanager
def tmpfs(mount: Path, size: str):
    """A real tmpfs of ``size`` (``8m``) at ``mount``: a disk that fills up (skips where it
    cannot be mounted)."""
    import pytest

    mount.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def require(ok: bool, why: str) -> None:
    """An engine a test needs (Ray, Slurm, Chromium): under CI (``CI`` set) its absence fails
    the test; elsewhere it skips it, saying how to get it."""
    if not ok:
        import pytest

        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)


def wait_for(condition, timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; after ``timeout_s``, fail naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(process: psutil.Process) -> bool:
    """Whether ``process`` still runs (a zombie does not); one that ends while being asked is not
    alive (``is_running`` then ``status`` races its exit)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
    """The registered model's ``best`` alias is on a best evaluated checkpoint (of ties, the one
    registered first: a tie does not move it), sourced from its URI, with its step and metrics as
    tags; and each registered version beat the one before it."""
    evaluated = [e for e in ledger.entries() if e.status == "evaluated"]
    top = max(e.metrics[metric] for e in evaluated)
    version = tracker.client.get_model_version_by_alias(name, "best")
    best = next((e for e in evaluated if str(e.step) == version.tags["global_step"]), None)
    versions = tracker.client.search_model_versions(f"name='{name}'")
    shown = sorted((int(v.version), v.tags.get("global_step"), v.tags.get(f"eval/{metric}")) for v in versions)
    results = [(e.step, e.metrics[metric]) for e in evaluated]
    why = f"alias on version {version.version}; versions {shown}; results {results}"
    assert best is not None and best.metrics[metric] == top, why
    assert (version.source, version.run_id) == (best.uri, mlflow_run_id), why
    assert float(version.tags[f"eval/{metric}"]) == best.metrics[metric]
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


def single_process_metrics(event, data, batch_size=7, items=False):
    """The reward model's metrics on ``event``'s checkpoint in this process, on one rank: the
    reference every distributed evaluation must equal (with ``items``: and its per-item rows)."""
    from areal_eval import distributed
    from areal_eval.evaluation.reward_model_evaluator import RewardModelEvaluator
    from areal_eval.evaluation.worker import compute_metrics

    evaluator = RewardModelEvaluator(max_length=64)
    evaluator.load(Path(event.uri), data)
    if items:
        evaluator.keep_items()
    metrics = compute_metrics(evaluator, distributed.ParallelLayout(1, 0, 1), batch_size)
    return (metrics, sorted_items(evaluator)) if items else metrics


def sorted_items(evaluator) -> dict[str, list[dict]]:
    """An in-process evaluator's per-item rows in item order, as the worker writes them."""
    return {
        name: sorted(rows, key=lambda r: (r["item"], r.get("sample", 0)))
        for name, rows in evaluator.item_tables().items()
    }


def assert_same_items(files: dict[str, str], reference: dict[str, list[dict]]) -> None:
    """The per-item files of a distributed evaluation hold the reference's rows: every item
    once, in item order, each value equal (floats to 1e-6)."""
    import pytest

    from areal_eval.evaluation.items import read_items

    assert set(files) == set(reference)
    for name, path in files.items():
        rows = read_items(path)
        assert [(r["item"], r.get("sample", 0)) for r in rows] == [
            (r["item"], r.get("sample", 0)) for r in reference[name]
        ], name
        for row, expected in zip(rows, reference[name], strict=True):
            assert row == pytest.approx(expected, abs=1e-6), (name, row["item"])


def start_mlflow_server(db: Path, artifacts: Path, port: int | None = None):
    """``mlflow server`` on loopback over SQLite ``db``; returns the process once it answers.
    The process has a session of its own, so ``os.killpg`` stops its workers too."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = port or free_port()
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{db}", "--default-artifact-root", str(artifacts), "--workers", "1"]
    # MLflow's job runner (huey consumers for its GenAI jobs) is not used here: 2-3 CPU-s a start.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    proc.url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            urllib.request.urlopen(proc.url + "/health", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"mlflow server did not start (exit {proc.poll()})")


def copy_trained_run(original, run_root, run_id: str | None = None):
    """A copy of the trained run at ``run_root`` (its manifest pointing at the copy), with no
    ledger, decisions or evaluations yet: a run whose checkpoints a test's flow evaluates afresh.
    ``run_id`` gives the copy an id of its own, for tests that share an MLflow store."""
    import dataclasses

    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.runs.directory import RunDir

    run = RunDir(run_root)
    state = ("ledger.jsonl", "evals", "decisions.lock", "evaluation_state.json", "directive*")
    shutil.copytree(original.root, run.root, ignore=shutil.ignore_patterns(*state))
    run.manifest.write_text(run.manifest.read_text().replace(str(original.root), str(run.root)))
    if run_id is not None:
        events = Manifest(run.manifest).events()
        run.manifest.unlink()
        for event in events:
            Manifest(run.manifest).append(dataclasses.replace(event, run_id=run_id))
        run.run_id_file.write_text(run_id)
    return run


def mlflow_run(cfg):
    """The tracker of ``cfg`` and the MLflow runs of its experiment."""
    from areal_eval.tracking import Tracker, TrackingConfig

    tracker = Tracker(TrackingConfig(tracking_uri=cfg.tracking.tracking_uri, experiment=cfg.tracking.experiment))
    return tracker, tracker.client.search_runs([tracker.experiment_id])


def train_causal_lm(work: Path, steps: int = 150, valid_problems: int = 41) -> tuple[Path, Path]:
    """A small causal LM trained in this process by SFT on arithmetic problems for ``steps``
    steps (half-way up its accuracy curve at 150), saved with its tokenizer; returns (checkpoint
    directory, validation prompts: an odd number)."""
    import random

    import torch

    from areal_eval.data.math_problems import SyntheticMathProblems
    from areal_eval.models.objectives import ModelConfig, SFTObjective

    train_path, valid_path = SyntheticMathProblems(
        SyntheticMathProblems.Config(train_problems=2000, valid_problems=valid_problems)
    ).generate(work / "data")
    rows = SFTObjective.read(train_path)
    SFTObjective.train_tokenizer(rows, work / "tokenizer", 512)
    tokenizer = SFTObjective.load_tokenizer(work / "tokenizer")
    torch.manual_seed(0)
    model_cfg = ModelConfig(objective="sft", hidden_size=64, num_layers=2, num_heads=2, max_length=64)
    model = SFTObjective.build_model(model_cfg, tokenizer)
    examples = SFTObjective.encode(tokenizer, rows, model_cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    rng = random.Random(0)
    for _ in range(steps):
        batch = SFTObjective.collate([examples[rng.randrange(len(examples))] for _ in range(32)], tokenizer)
        SFTObjective.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint = work / "checkpoint"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    return checkpoint, valid_path


def causal_metrics(checkpoint, data, evaluator="generation", batch_size=7, items=False, **settings):
    """Metrics of the causal-LM ``evaluator`` on ``checkpoint`` in this process, on one rank
    (with ``items``: and its per-item rows)."""
    from areal_eval import distributed
    from areal_eval.evaluation.evaluators import make_evaluator
    from areal_eval.evaluation.job_spec import EvaluatorSettings
    from areal_eval.evaluation.worker import compute_metrics

    evaluator = make_evaluator(evaluator, EvaluatorSettings(**settings))
    evaluator.load(Path(checkpoint), Path(data))
    if items:
        evaluator.keep_items()
    metrics = compute_metrics(evaluator, distributed.ParallelLayout(1, 0, 1), batch_size)
    return (metrics, sorted_items(evaluator)) if items else metrics


def harness_reference(checkpoint, cfg) -> dict:
    """What a harness user gets: simple_evaluate on an HFLM wrapping the same model (``cfg``: an
    ``LMEvalConfig``), one process."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from areal_eval.evaluation.lm_eval_tasks import flatten_results, task_manager
    from areal_eval.models import causal_lm

    model, tokenizer = causal_lm.load_model(checkpoint).eval(), causal_lm.load_tokenizer(checkpoint)
    out = simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size),
        tasks=cfg.tasks,
        task_manager=task_manager(cfg.include_path, tuple(cfg.tasks)),  # the harness's own, indexed once
        log_samples=False,
        random_seed=cfg.seed,
        numpy_random_seed=cfg.seed,
        torch_random_seed=cfg.seed,
        fewshot_random_seed=cfg.seed,
    )
    return flatten_results(out["results"])


def checkpoints_table(tracker, mlflow_run_id: str) -> dict[int, dict]:
    """The MLflow run's table of checkpoints (``checkpoints.json``), its rows by step; it must be
    marked as a table, as ``log_table`` marks one (MLflow's UI then shows it as a table)."""
    import json
    import tempfile

    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

    from areal_eval.logged_models import CHECKPOINTS_TABLE

    marked = json.loads(tracker.client.get_run(mlflow_run_id).data.tags[MLFLOW_LOGGED_ARTIFACTS])
    assert {"path": CHECKPOINTS_TABLE, "type": "table"} in marked, marked
    with tempfile.TemporaryDirectory() as tmp:
        table = json.loads(Path(tracker.client.download_artifacts(mlflow_run_id, CHECKPOINTS_TABLE, tmp)).read_text())
    return {int(row[0]): dict(zip(table["columns"], row, strict=True)) for row in table["data"]}


class LaneService:
    """A service that the tests of a lane share while they run one after another: started by the
    first that asks (:meth:`get`), stopped by ``pytest_runtest_teardown`` (tests/conftest.py)
    when the lane's next test is in a file where no test uses it (``name`` among a test's
    fixtures, or the test marked ``@pytest.mark.uses(name)``), started again if a later test
    does. For services that cost CPU while idle, which a session fixture would keep until the
    lane's last test."""

    running: dict[str, LaneService] = {}
    _files: dict[str, set] = {}

    def __init__(self, name: str, start):
        """``start``: a generator function that yields the service and stops it when resumed."""
        self.name, self.start, self._run, self.value = name, start, None, None

    def get(self):
        if self._run is None:
            run = self.start()
            self.value = next(run)
            self._run, LaneService.running[self.name] = run, self
        return self.value

    def stop(self) -> None:
        run, self._run = self._run, None
        LaneService.running.pop(self.name, None)
        if run is not None:
            next(run, None)

    @staticmethod
    def used_by(item, name: str) -> bool:
        return name in getattr(item, "fixturenames", ()) or any(name in mark.args for mark in item.iter_markers("uses"))

    @staticmethod
    def used_in_file_of(item, name: str) -> bool:
        """Some test in ``item``'s file uses the service: it is kept through a file's other tests
        (a lane runs a file's tests one after another)."""
        if name not in LaneService._files:
            users = (i for i in item.session.items if LaneService.used_by(i, name))
            LaneService._files[name] = {i.path for i in users}
        return item.path in LaneService._files[name]
