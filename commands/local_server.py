"""The Prefect server a command starts for itself when none is configured (no ``PREFECT_API_URL``).

Prefect would start a temporary server in the command's own process group, where a Ctrl-C from
the terminal kills it at once, and the run, still running, would lose its orchestrator while it
stops. This one runs in a session of its own, so a Ctrl-C reaches only the command, which stops
training and evaluation, ends the MLflow run KILLED, and then stops the server. Its UI is up for
as long as the run, at the address the command prints.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prefect.settings import PREFECT_API_URL, temporary_settings

from tasks.device_slot import FILE_LEASE_STORAGE, LEASE_STORAGE_ENV

STARTUP_TIMEOUT_S = 180.0
"""A fresh database is migrated first: on 2 busy cores that takes most of a minute."""
IDLE_SERVICES_OFF = {
    f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
    for name in ("SCHEDULER", "LATE_RUNS", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP")
}
"""Loops a single run has no use for (it has no deployments, schedules or paused runs)."""


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def own_prefect_server(log_path: Path) -> Iterator[str | None]:
    """A Prefect server for this command, its output in ``log_path``; yields its UI's address,
    or None where ``PREFECT_API_URL`` names a server already (then nothing is started)."""
    if os.environ.get("PREFECT_API_URL"):
        yield None
        return
    port = _free_port()
    ui = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **IDLE_SERVICES_OFF,
        LEASE_STORAGE_ENV: FILE_LEASE_STORAGE,  # concurrency leases outlive a restart of this server
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": f"{ui}/api",  # the UI calls this API (its default is port 4200's)
    }
    with log_path.open("ab") as log:
        prefect = str(Path(sys.executable).with_name("prefect"))
        server = subprocess.Popen(
            [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the terminal's Ctrl-C is not its to take
        )
    try:
        _wait_until_up(server, f"{ui}/api/health", log_path)
        with temporary_settings(updates={PREFECT_API_URL: f"{ui}/api"}):
            os.environ["PREFECT_API_URL"] = f"{ui}/api"  # and for this command's own children
            try:
                yield ui
            finally:
                _drain_to(server)
                os.environ.pop("PREFECT_API_URL", None)
    finally:
        _stop(server)


def _drain_to(server: subprocess.Popen) -> None:
    """Send the logs and events still queued while the server is up: queued for a stopped server,
    they would be retried at exit for over a minute."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    if server.poll() is None:
        for worker in (APILogWorker, EventsWorker):
            with contextlib.suppress(Exception):
                worker.drain_all(timeout=10)


def _wait_until_up(server: subprocess.Popen, health: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            urllib.request.urlopen(health, timeout=2)
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Prefect server this command starts did not come up in {STARTUP_TIMEOUT_S:.0f} s "
                    f"(its log: {log_path})"
                ) from None
            time.sleep(0.5)


def _stop(server: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if server.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(wait_s)
