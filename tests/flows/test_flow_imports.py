"""What a flow-run process pays before its flow starts: every flow run on a worker imports its
flow module first (11-19 s measured on these 2 cores), and torch with transformers would add
2-3 CPU-seconds more to each one, for code that only runs in the torchrun workers."""

import subprocess
import sys

import pytest

from tests.prefect_services import REPO

pytestmark = pytest.mark.integration

FLOWS = ["flows.train_and_evaluate", "flows.evaluate_checkpoint", "flows.sweep_checkpoints", "flows.serve_evaluations"]


def test_the_flows_import_neither_torch_nor_transformers():
    code = (
        "import importlib, sys\n"
        f"for name in {FLOWS!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
