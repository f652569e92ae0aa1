"""Shared fixtures: a tiny trained run (real torchrun training), Prefect, a webhook receiver."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from areal_eval.launchers.local import stay_offline
from tests.helpers import LaneService, sqlite_mlflow_uri

stay_offline()
os.environ["WANDB_MODE"] = "offline"  # W&B writes its files only: no test sends anything anywhere
os.environ["DO_NOT_TRACK"] = "1"  # nor does Prefect's client report usage,
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"  # nor its servers
# W&B's files of a run started without a directory (a Trainer's): not in the working tree. Set
# for the session, as W&B reads its settings once per process.
os.environ["WANDB_DIR"] = tempfile.mkdtemp(prefix="areal-eval-tests-wandb-")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Lanes side by side (scripts/test.sh): torch's default of a thread per core would have each
    # lane's OpenMP threads, and those of the jobs it starts, spin against the other lane's (the
    # fast lane took 122 s instead of 54).
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

SERVICE_FIXTURES = {"trained_run", "prefect_server", "webhook", "s3_server", "s3_bucket"}
"""Fixtures that start a process or a server: a test using one is an integration test."""
LIBRARY_PROBES = {"uname", "git", "fc-list"}
"""Commands libraries run to describe the machine (MLflow asks ``platform.processor()``; matplotlib
lists the fonts once, when it builds its font cache on a fresh machine): not ours."""


def pytest_xdist_auto_num_workers(config):
    """Lanes for ``-n auto`` (scripts/test.sh), as measured on a 2-core machine
    (docs/performance.md, "The test suite"): the integration tests spend much of their time
    waiting on the processes they start, and a third lane fills that wait; unit tests only
    compute, and a third lane would cost its own collection."""
    return 2 if "not integration" in (config.getoption("markexpr") or "") else 3


def pytest_collection_modifyitems(items):
    for item in items:
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
    # Longest files first, so that no lane of ``scripts/test.sh`` (``--dist loadfile``) ends alone
    # on a long one: the flow tests, then the other files that start processes, then unit tests.
    slow = {item.path for item in items if item.get_closest_marker("integration")}
    items.sort(key=lambda item: (item.path.parent.name != "flows", item.path not in slow))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the lane's shared services (:class:`~tests.helpers.LaneService`) that no test of its
    next test's file uses, after this test's own fixtures are torn down."""
    for name, service in list(LaneService.running.items()):
        if nextitem is None or not LaneService.used_in_file_of(nextitem, name):
            service.stop()


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """The fast lane (``-m "not integration"``) stays fast and needs nothing running: a test
    that starts a process without the ``integration`` mark fails, saying so."""
    if request.node.get_closest_marker("integration") is None:
        execute_child = subprocess.Popen._execute_child

        def refuse(self, args, *rest, **kwargs):
            command = args if isinstance(args, str) else " ".join(map(str, args))
            if command.split()[0] in LIBRARY_PROBES:
                return execute_child(self, args, *rest, **kwargs)
            raise AssertionError(f"{request.node.nodeid} starts a process ({command[:80]}): mark it integration")

        monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    yield


TINY = {
    "data": {"synthetic": {"train_pairs": 256, "valid_pairs": 101}},
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2},
    "train": {"epochs": 1, "batch_size": 8, "max_steps": 12, "log_every": 2, "save": {"freq_steps": 4}},
    # One evaluation rank: the flow tests are about what happens around evaluations; every world
    # size and fault of the ranks is tested in tests/evaluation (and end to end on 2 ranks).
    "eval": {"nproc": 1, "batch_size": 16, "collective_timeout_s": 30, "job_timeout_s": 120},
    "scheduler": {"min_interval_steps": 0, "max_interval_steps": 8},
    "poll_interval_s": 0.2,
}


def tiny_config(tmp_path: Path, **sections):
    from areal_eval.config.parsing import merge
    from areal_eval.pipeline.config import load_pipeline_config

    params = merge(TINY, {"work_dir": str(tmp_path), "tracking": {"tracking_uri": sqlite_mlflow_uri(tmp_path)}})
    return load_pipeline_config(params=merge(params, sections))


def built_once(tmp_path_factory, name: str, build) -> Path:
    """Directory ``name``, filled by ``build(directory)`` once for the whole session: with test
    lanes (pytest-xdist), the first lane that asks builds it and the others wait for it, instead
    of each paying for the same training. What is built there is only read."""
    from areal_eval.runs.directory import file_lock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        work = tmp_path_factory.mktemp(name)
        build(work)
        return work
    work = tmp_path_factory.getbasetemp().parent / name  # shared by the lanes of this session
    with file_lock(work.with_name(f"{name}.lock")):
        if not (work / ".built").exists():
            shutil.rmtree(work, ignore_errors=True)  # a lane that failed half-way
            work.mkdir()
            build(work)
            (work / ".built").touch()
    return work


def _train_tiny_run(work: Path) -> None:
    from areal_eval.launchers.local import TorchrunJob
    from areal_eval.pipeline.setup import prepare_run

    run = prepare_run(tiny_config(work))
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], 2, run.logs / "train.log")
    job.wait(300)
    job.raise_for_status("training")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A run directory trained for 12 steps on 2 ranks: checkpoints at 0, 4, 8 and final 12."""
    from areal_eval.runs.directory import RunDir

    cfg = tiny_config(built_once(tmp_path_factory, "trained", _train_tiny_run))
    return cfg, RunDir(cfg.run_root)


@pytest.fixture(scope="module")
def final_checkpoint(trained_run):
    """The trained run's final checkpoint: (run directory, its event)."""
    from areal_eval.checkpoints.manifest import Manifest

    cfg, run = trained_run
    return run, Manifest(run.manifest).events()[-1]


def _train_causal_lm(work: Path) -> None:
    from tests.helpers import train_causal_lm

    checkpoint, prompts = train_causal_lm(work)
    (work / "built.json").write_text(json.dumps([str(checkpoint), str(prompts)]))


@pytest.fixture(scope="session")
def causal_checkpoint(tmp_path_factory):
    """A small causal LM trained by SFT on arithmetic problems (about 15 s), and 41 validation
    prompts: (checkpoint directory, prompts file)."""
    work = built_once(tmp_path_factory, "causal", _train_causal_lm)
    checkpoint, prompts = json.loads((work / "built.json").read_text())
    return Path(checkpoint), Path(prompts)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One Prefect test harness (a real temporary API server) for the whole session.

    The harness puts a fresh database in a directory it makes, and its server migrates it, most
    of its start (docs/performance.md, "The test suite"): here it gets a directory holding one
    migrated once (``with_migrated_database``)."""
    from unittest import mock

    from prefect.testing.utilities import prefect_test_harness

    from tests.prefect_services import with_migrated_database

    home = tmp_path_factory.mktemp("prefect-harness")
    with_migrated_database(home).joinpath("prefect.db").rename(home / "prefect-test.db")
    with mock.patch("prefect.testing.utilities.mkdtemp", return_value=str(home)):
        with prefect_test_harness(server_startup_timeout=120):
            yield


class WebhookReceiver:
    def __init__(self):
        self.requests: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.requests.append({"path": self.path, "json": json.loads(body or b"null")})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def webhook():
    receiver = WebhookReceiver()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server in its own process on loopback; test credentials in the environment
    (inherited by torchrun workers, as a real deployment's would be)."""
    from tests.s3_servers import TEST_CREDENTIALS, MotoServer

    os.environ.update(TEST_CREDENTIALS)
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket on the session's S3 server; returns its name."""
    import boto3

    name = "t-" + "".join(c for c in request.node.name.lower() if c.isalnum())[:40] + f"-{os.getpid() % 1000}"
    boto3.client("s3", endpoint_url=s3_server.url).create_bucket(Bucket=name)
    return name
