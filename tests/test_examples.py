"""Each script in ``examples/`` runs as its docstring says, and what it publishes is a
checkpoint the evaluation workers load (``examples/dcp_loop.py``: tests/checkpoints/test_dcp.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import Manifest
from tests.helpers import single_process_metrics

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]


def run_example(command: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the manifest only
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_hf_trainer_example(tmp_path):
    run_dir = tmp_path / "hf-demo"
    run_example([sys.executable, "-m", "examples.hf_trainer", "--run-dir", str(run_dir), "--steps", "16"])
    events = Manifest(run_dir / "manifest.jsonl").events()
    assert [(e.global_step, e.final) for e in events] == [(8, False), (16, True)]
    assert single_process_metrics(events[-1], events[-1].valid_data)["n_pairs"] == 41


def test_ddp_loop_example_on_two_ranks(tmp_path):
    run_dir = tmp_path / "ddp-demo"
    run_example([*TORCHRUN, "-m", "examples.ddp_loop", "--run-dir", str(run_dir), "--steps", "8"])
    events = Manifest(run_dir / "manifest.jsonl").events()
    assert [(e.global_step, e.final) for e in events] == [(4, False), (8, True)]
    assert single_process_metrics(events[-1], events[-1].valid_data)["n_pairs"] == 41


def test_areal_loop_example_on_two_ranks(tmp_path):
    run_dir = tmp_path / "areal-demo"
    run_example([*TORCHRUN, "-m", "examples.areal_loop", "--run-dir", str(run_dir)])
    events = Manifest(run_dir / "manifest.jsonl").events()
    # 80 pairs a rank, 16 a batch: 5 steps an epoch, 10 in all; before training (0), every 4th
    # step (3, 7), and the last (9), final.
    assert [(e.global_step, e.final) for e in events] == [(0, False), (3, False), (7, False), (9, True)]
    assert single_process_metrics(events[-1], events[-1].valid_data)["n_pairs"] == 41
