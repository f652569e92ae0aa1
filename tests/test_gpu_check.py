"""scripts/gpu_check.sh runs where only torch and transformers are installed: what it imports
must not pull in Prefect, MLflow or the flow side's packages. (The check itself needs a GPU,
or 2.5 minutes with --allow-cpu: run by hand, never in CI.)"""

import json
import subprocess
import sys

import pytest

FLOW_SIDE = ["prefect", "mlflow", "psutil", "boto3", "matplotlib"]


@pytest.mark.integration
def test_the_gpu_checks_library_parts_import_without_the_flow_sides_packages():
    code = (
        "import sys, json; import areal_eval.gpu_check, areal_eval.evaluation.worker, "
        "areal_eval.evaluation.generation, areal_eval.evaluation.lm_loss, areal_eval.devices, "
        "areal_eval.models.objectives; "
        f"print(json.dumps(sorted(m for m in {FLOW_SIDE!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []
