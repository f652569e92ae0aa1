"""A real Prefect server on loopback with the project's work pools, deployments and workers, as
the README's "Run on a Prefect server" sets them up. Used by the server tests and benchmarks."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.runs.directory import file_lock
from areal_eval.tracking import Tracker, TrackingConfig
from tasks.device_slot import FILE_LEASE_STORAGE, LEASE_STORAGE_ENV
from tests.helpers import free_port, sqlite_mlflow_uri

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))


IDLE_SERVICES_OFF = {
    f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
    for name in ("SCHEDULER", "LATE_RUNS", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP")
}
"""Server loops no test needs (cron schedules, late and paused runs, cancellation clean-up): on 2
cores their polling of SQLite slows every test and can lock the database. Events, automations,
task-run records, concurrency-lease reclaiming and worker status stay on. The scheduler off also
keeps the 30-minute sweep from running in the middle of a test."""


def with_migrated_database(home: Path) -> Path:
    """``home`` given a Prefect database already migrated, unless it has one: a server migrates
    a fresh one at its start (11.5 s to answer here against 4.6 s; a user's database stays
    migrated after their first run), and the suite starts several servers on fresh homes. The
    migrated database is made once per Prefect version, by ``prefect server database upgrade``."""
    import prefect

    home.mkdir(parents=True, exist_ok=True)
    if (home / "prefect.db").exists():
        return home
    made = Path(tempfile.gettempdir()) / "areal-eval-tests" / f"prefect-{prefect.__version__}.db"
    with file_lock(made.with_suffix(".lock")):
        if not made.exists():
            work = Path(tempfile.mkdtemp(dir=made.parent))
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            cli({**env, "PREFECT_HOME": str(work)}, "server", "database", "upgrade", "-y")
            os.replace(work / "prefect.db", made)
            shutil.rmtree(work)
    shutil.copyfile(made, home / "prefect.db")
    return home


def stop(proc: subprocess.Popen) -> None:
    # A Prefect worker needs a second SIGTERM to stop: the first one only starts its shutdown.
    for wait_s in (2, 15):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def cli(env: dict, *args: str, timeout: float = 300) -> str:
    done = subprocess.run([PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def server_env(home: Path, port: int, worker_query_s: float = 2.0) -> dict:
    """The environment of a server on ``port`` with its state under ``home``, and of its clients."""
    return {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **IDLE_SERVICES_OFF,
        LEASE_STORAGE_ENV: FILE_LEASE_STORAGE,  # as the README's server: leases outlive a restart
        "AREAL_EVAL_HOME": str(REPO),
        "AREAL_EVAL_STORE": str(home / "store"),
        "MLFLOW_TRACKING_URI": sqlite_mlflow_uri(home),
        "PYTHONPATH": str(REPO),
        "PREFECT_WORKER_QUERY_SECONDS": str(worker_query_s),
    }


def start_server(env: dict, home: Path) -> subprocess.Popen:
    """``prefect server start`` on the port of ``env``'s API URL; returns once it answers."""
    with_migrated_database(home)
    url = env["PREFECT_API_URL"]
    port = url.rsplit(":", 1)[1].split("/")[0]
    with (home / "server.log").open("a") as log:
        proc = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", port],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url.removesuffix('/api')}/api/health", timeout=2)
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                stop(proc)
                raise RuntimeError(
                    f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}"
                ) from None
            time.sleep(0.5)


@contextlib.contextmanager
def prefect_server(home: Path, worker_query_s: float = 2.0) -> Iterator[dict]:
    """Server, pools ``areal-train`` and ``areal-eval``, the ``gpu:0`` limit, every deployment of
    ``infra/prefect.yaml`` and a worker per pool; yields the environment to talk to them.

    Workers poll for scheduled runs every ``worker_query_s`` (Prefect's default is 10 s: up to
    10 s of waiting before each flow run starts)."""
    env = server_env(home, free_port(), worker_query_s)
    proc = start_server(env, home)
    workers: list[subprocess.Popen] = []
    try:
        for pool in ("areal-train", "areal-eval"):  # pools first: a worker started first makes its own
            cli(env, "work-pool", "create", pool, "--type", "process")
        cli(env, "gcl", "create", "gpu:0", "--limit", "1")
        cli(env, "--no-prompt", "deploy", "--prefect-file", "infra/prefect.yaml", "--all")
        for pool in ("areal-train", "areal-eval"):
            workers.append(
                subprocess.Popen(
                    [PREFECT, "worker", "start", "--pool", pool],
                    cwd=REPO,
                    env=env,
                    start_new_session=True,
                    stdout=(home / f"worker-{pool}.log").open("w"),
                    stderr=subprocess.STDOUT,
                )
            )
        yield env
    finally:
        for p in workers + [proc]:
            stop(p)


def cli_or_fail(env, *args, timeout=300) -> str:
    """``prefect ...`` against the test server; a failure fails the test with its output."""
    try:
        return cli(env, *args, timeout=timeout)
    except RuntimeError as exc:
        pytest.fail(str(exc))


def api_get(env, path: str) -> dict:
    return api(env, path, method="GET")


def eval_steps(env, run_id: str) -> list[int]:
    tracker = Tracker(TrackingConfig(tracking_uri=env["MLFLOW_TRACKING_URI"], experiment="areal-eval"))
    mlflow_run = tracker.find_run(run_id)
    return sorted(tracker.eval_steps(mlflow_run)) if mlflow_run else []


def api(env, path: str, body: dict | None = None, *, method: str = "POST"):
    """One call to the test server's API; a busy server's 503 is retried, as Prefect's own client does."""
    request = urllib.request.Request(
        env["PREFECT_API_URL"] + path,
        data=None if method in ("GET", "DELETE") else json.dumps(body or {}).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    for attempt in range(6):
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code not in (429, 503) or attempt == 5:
                raise
            time.sleep(float(exc.headers.get("Retry-After") or 2))


def wait_for_runs(env, matches, count: int, timeout_s: float = 420) -> list[dict]:
    """Flow runs for which ``matches(run)``, once ``count`` of them reached a final state."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [r for r in api(env, "/flow_runs/filter", {"limit": 200}) if matches(r)]
        if len(runs) >= count and all(r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for r in runs):
            return runs
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(runs)} of {count} runs, states {[r['state_type'] for r in runs]}")
        time.sleep(1)


def republish(original: Path, run_dir: Path, run_id: str, steps: list[int]) -> Path:
    """A run published by a trainer outside the flow: ``steps`` reuse the trained checkpoints."""
    run_dir.mkdir(parents=True)
    shutil.copytree(original / "data", run_dir / "data")
    trained = Manifest(original / "manifest.jsonl").events()
    manifest = Manifest(run_dir / "manifest.jsonl")
    for i, step in enumerate(steps):
        event = trained[i % len(trained)]
        manifest.append(
            dataclasses.replace(
                event,
                run_id=run_id,
                global_step=step,
                final=step == steps[-1],
                train_metrics={"loss": 1.0 / (step + 1)},
            )
        )
    return run_dir / "manifest.jsonl"


class DelayingProxy:
    """A TCP proxy on loopback that holds every reply from ``upstream`` for ``delay_s``: the server
    gets each request at once, its client hears back only after its own timeout."""

    def __init__(self, upstream_port: int, delay_s: float):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream_port, self.delay_s = upstream_port, delay_s
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.delay_s), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        try:
            while data := source.recv(65536):
                time.sleep(delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                s.close()

    def close(self) -> None:
        self.listener.close()
