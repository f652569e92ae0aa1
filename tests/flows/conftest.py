"""Fixtures of the flow tests on a real Prefect server (test_prefect_server.py, test_published_checkpoints.py)."""

from pathlib import Path

import pytest

from tests.helpers import copy_trained_run
from tests.prefect_services import prefect_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real ``prefect server`` with the README's pools, deployments and workers, for one module:
    it stops when the module's tests are done (its services would tax every later test)."""
    with prefect_server(tmp_path_factory.mktemp("prefect")) as env:
        yield env


@pytest.fixture(scope="module")
def stored_run(server, trained_run):
    """The trained run copied into the server's store (where the sweep looks), under a run id of
    its own (the server's MLflow store may hold other runs of the trained checkpoints)."""
    _, original = trained_run
    run_id = f"{original.run_id}-stored"
    return copy_trained_run(original, Path(server["AREAL_EVAL_STORE"]) / run_id, run_id=run_id).root
