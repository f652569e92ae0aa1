"""scripts/gpu_check.sh runs where only torch and transformers are installed: what it imports
must not pull in Prefect, MLflow or the flow side's packages, and every step must run without the
packages a GPU machine's image lacks. (The full check needs a GPU, or about 40 s with
--allow-cpu: run by hand, never in CI; the tests run its --small form.)"""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

FLOW_SIDE = ["prefect", "mlflow", "psutil", "boto3", "matplotlib"]

ABSENT_ON_GPU_IMAGES = {
    *("math_verify", "latex2sympy2_extended", "lm_eval", "vllm", "matplotlib", "mpl_toolkits"),
    *("prefect", "prefect_kubernetes", "mlflow", "mlflow_skinny", "mlflow_tracing", "boto3", "botocore", "s3transfer"),
    *("pydantic", "pydantic_core", "pydantic_settings"),
}
"""What this project's environment has and a GPU machine with only torch and transformers (and
the common scientific packages: numpy, pyarrow, psutil) lacks."""

SITE_PACKAGES = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
"""This environment's site-packages (pure-Python and compiled packages may have one each)."""

SITECUSTOMIZE = """import sys
mirrors = {mirrors!r}
sys.path[:] = [mirrors.get(p, p) for p in sys.path]
"""
"""Puts each site-packages' mirror in its place, in every process that starts."""


def site_packages_without(absent: set[str], mirror_root: Path) -> dict[str, str]:
    """A mirror of each site-packages under ``mirror_root``: links to everything but ``absent``'s
    packages and their metadata, so imports and ``importlib.metadata`` both find them missing."""
    mirrors = {}
    for i, real in enumerate(SITE_PACKAGES):
        mirror = mirror_root / f"site-packages-{i}"
        mirror.mkdir(parents=True)
        for entry in Path(real).iterdir():
            if entry.name.split("-")[0].removesuffix(".py") not in absent:
                (mirror / entry.name).symlink_to(entry)
        mirrors[real] = str(mirror)
    return mirrors


@pytest.mark.integration
def test_the_gpu_checks_library_parts_import_without_the_flow_sides_packages():
    code = (
        "import sys, json; import areal_eval.diagnostics.gpu_check, areal_eval.evaluation.worker, "
        "areal_eval.evaluation.generation, areal_eval.evaluation.lm_loss, areal_eval.launchers.devices, "
        "areal_eval.models.objectives; "
        f"print(json.dumps(sorted(m for m in {FLOW_SIDE!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


@pytest.mark.integration
def test_every_step_of_the_gpu_check_runs_without_the_packages_gpu_images_lack(tmp_path):
    from tests.launchers.conftest import only_loopback

    # A sitecustomize on PYTHONPATH hides them in this process and in the torchrun workers it starts.
    # Ray too where the network is more than loopback: it would advertise this machine's address.
    ray_runs = only_loopback()
    absent = ABSENT_ON_GPU_IMAGES | (set() if ray_runs else {"ray"})
    mirrors = site_packages_without(absent, tmp_path / "mirrors")
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE.format(mirrors=mirrors))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    run = subprocess.run(
        [sys.executable, "-m", "areal_eval.diagnostics.gpu_check", "--allow-cpu", "--small"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("\n") == 1, run.stdout  # one JSON line, nothing else on stdout
    result = json.loads(run.stdout)
    assert result["process_group"]["all_reduce_ok"]
    assert result["prefect_or_mlflow_imported"] == []
    assert result["memory_back_to_baseline"] and result["memory_flat_across_evaluations"]
    assert result["sampled_answers_reproducible"]
    if ray_runs:  # the check's one-node Ray slot: its own Ray, the same accuracy as the warm workers
        ray_slot = result["ray_slot"]
        assert ray_slot["ray_started_here"] and ray_slot["accuracy_equals_warm_workers"], ray_slot
    else:
        assert result["ray_slot"] == {"skipped": "ray is not installed here: pip install 'ray[default]>=2.40'"}
    warm = result["warm_workers"]
    assert warm["torchrun_jobs_started"] == 1  # three evaluations, one warm job
    assert warm["reward_model_accuracy_equals_in_process"]
    assert warm["step_2_items"] == {"generation": True, "lm_loss": True}
    trained = result["pipeline_trainer"]  # the demo's trainer published its checkpoints; they evaluate
    assert trained["checkpoints"] == [0, 2, 4, 6]
    assert trained["accuracy_final"] > trained["accuracy_first"]
