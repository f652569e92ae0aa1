"""Fixtures of the flow tests on a real Prefect server: one server per test module."""

import shutil
from pathlib import Path

import pytest

from tests.prefect_services import prefect_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real ``prefect server`` with the README's pools, deployments and workers (one a module,
    so the modules can run side by side)."""
    with prefect_server(tmp_path_factory.mktemp("prefect")) as env:
        yield env


@pytest.fixture(scope="module")
def stored_run(server, trained_run):
    _, original = trained_run
    store = Path(server["AREAL_EVAL_STORE"])
    run_dir = store / original.root.name
    shutil.copytree(
        original.root,
        run_dir,
        ignore=shutil.ignore_patterns("ledger.jsonl", "evals", "decisions.lock", "evaluation_state.json"),
    )
    (run_dir / "manifest.jsonl").write_text((original.manifest).read_text().replace(str(original.root), str(run_dir)))
    return run_dir
