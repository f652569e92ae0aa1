"""The W&B sink through a crash, against W&B's real service in offline mode (read back from its
own run files): ``kill -9`` of the process tree, W&B's service included, mid-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from areal_eval.runs.ledger import Ledger, LedgerEntry
from tests.sink_points import history, wandb_run_id

pytestmark = pytest.mark.integration  # wandb starts its service process

ROOT = Path(__file__).resolve().parents[2]

LOG_AND_HANG = """
import sys, time
from areal_eval.sinks import TensorBoardConfig, WandbConfig, open_sinks
sinks = open_sinks(["mlflow", "wandb", "tensorboard"], wandb=WandbConfig(project="p"), tensorboard=TensorBoardConfig(),
                   run_dir=sys.argv[1], run_name="crash", on_failure=print, single_writer=True)
sinks.record_training([{"step": s, "loss": 1.0 / (s + 1)} for s in range(0, 60, 5)])
for step in (0, 25, 50):
    sinks.record_evaluation(step, {"accuracy": step / 100})
print("logged", flush=True)
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_a_run_killed_with_its_wandb_service_then_resumed_holds_every_point_exactly_once(tmp_path):
    """The in-flow loop keeps W&B open (``single_writer``): its first three results and its
    training rows are logged, then the whole process tree is killed. The next process catches
    up from the ledger: each step then lands in W&B once, what the killed service had written
    included."""
    from tests.sink_points import every_sink, scalars

    crashed = subprocess.Popen(
        [sys.executable, "-c", LOG_AND_HANG, str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"},  # a W&B service of its own
    )
    try:
        assert crashed.stdout.readline().strip() == "logged"
        family = [psutil.Process(crashed.pid), *psutil.Process(crashed.pid).children(recursive=True)]
        assert any("wandb" in " ".join(p.cmdline()).lower() for p in family[1:])  # its service
        for proc in family:
            proc.send_signal(signal.SIGKILL)
    finally:
        if crashed.poll() is None:
            os.killpg(crashed.pid, signal.SIGKILL)
        crashed.wait(10)

    ledger = Ledger(tmp_path / "ledger.jsonl")
    for step in (0, 25, 50, 75):
        ledger.append(LedgerEntry(step, f"ckpt-{step}", "evaluated", metrics={"accuracy": step / 100}))
    said: list = []
    again = every_sink(tmp_path, "crash", said, wandb=_project("p"))
    again.record_training([{"step": s, "loss": 1.0 / (s + 1)} for s in range(0, 80, 5)])
    again.catch_up(ledger.entries(), tmp_path / "evals")
    again.close()
    assert said == []
    rows = history(tmp_path / "sinks", wandb_run_id(tmp_path))
    assert sorted(r["eval/step"] for r in rows if "eval/accuracy" in r) == [0, 25, 50, 75]
    assert sorted(r["train/step"] for r in rows if "train/loss" in r) == list(range(0, 80, 5))
    assert scalars(tmp_path / "tensorboard" / "areal-eval")["eval/accuracy"] == [0, 25, 50, 75]


def test_wandb_dir_project_and_entity_from_the_environment_are_honoured(tmp_path, monkeypatch):
    from areal_eval.sinks import TensorBoardConfig, WandbConfig, open_sinks
    from tests.sink_points import of_kind

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_ENTITY", "team-env")
    sinks = open_sinks(
        ["mlflow", "wandb"],
        wandb=WandbConfig(),
        tensorboard=TensorBoardConfig(),
        run_dir=tmp_path / "run",
        run_name="env",
        on_failure=lambda sink, message: pytest.fail(message),
    )
    sinks.record_evaluation(3, {"accuracy": 0.5})
    sinks.close()
    rows = history(tmp_path / "elsewhere", wandb_run_id(tmp_path / "run"))
    assert [r["eval/step"] for r in rows if "eval/accuracy" in r] == [3]
    [run] = of_kind(tmp_path / "elsewhere", wandb_run_id(tmp_path / "run"), "run")[-1:]
    assert (run.project, run.entity) == ("from-env", "team-env")
    assert not list((tmp_path / "run" / "sinks").rglob("*.wandb"))


def _project(name: str):
    from areal_eval.sinks import WandbConfig

    return WandbConfig(project=name)
