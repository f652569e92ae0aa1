"""Fixtures of the flow tests on a real Prefect server: one server for the session."""

from pathlib import Path

import pytest

from tests.helpers import copy_trained_run
from tests.prefect_services import prefect_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A real ``prefect server`` with the README's pools, deployments and workers."""
    with prefect_server(tmp_path_factory.mktemp("prefect")) as env:
        yield env


@pytest.fixture(scope="module")
def stored_run(server, trained_run, request):
    """The trained run copied into the server's store (where the sweep looks), under a run id of
    its own for each test module (the modules share the server and its MLflow store)."""
    _, original = trained_run
    run_id = f"{original.run_id}-{request.module.__name__.rsplit('.', 1)[-1]}"
    return copy_trained_run(original, Path(server["AREAL_EVAL_STORE"]) / run_id, run_id=run_id).root
