"""The device slot across restarts of a real ``prefect server`` (same database, same port): no
wait for it lasts past its bound, and no slot stays held once its holder is gone, whether the
server keeps leases in memory (Prefect's default) or on disk (the README's server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from tasks.device_slot import FILE_LEASE_STORAGE, LEASE_S, LEASE_STORAGE_ENV, leases_kept_in_memory
from tests.helpers import free_port
from tests.prefect_services import REPO, api_get, cli, server_env, start_server, stop

pytestmark = pytest.mark.integration

HOLDER = """
import logging, pathlib, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
from tasks.device_slot import DeviceSlot
name, release, wait_s = sys.argv[1], pathlib.Path(sys.argv[2]), float(sys.argv[3])
try:
    with DeviceSlot(name, wait_s=wait_s):
        print("held", name, flush=True)
        while not release.exists():
            time.sleep(0.2)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
print("released", name, flush=True)
"""
REPOSSESSOR_LOOP_S = 1.0


class Holder:
    """A process that holds slot ``name`` until told to let go (or waits ``wait_s`` for it)."""

    def __init__(self, env: dict, tmp: Path, name: str, wait_s: float = 120):
        self.release, self.log = tmp / f"release-{name}", tmp / f"holder-{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, name, str(self.release), str(wait_s)],
            cwd=REPO,
            env=env,
            start_new_session=True,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def said(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.said():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.said()[-3000:]
            time.sleep(0.2)

    def let_go(self) -> int:
        self.release.touch()
        return self.proc.wait(timeout=180)


def active_slots(env: dict, name: str) -> int:
    return api_get(env, f"/v2/concurrency_limits/{name}")["active_slots"]


def wait_until_free(env: dict, name: str, timeout_s: float) -> float:
    """Seconds until limit ``name`` has no active slot; fails after ``timeout_s``."""
    start = time.monotonic()
    while active_slots(env, name):
        assert time.monotonic() - start < timeout_s, f"{name} still held after {timeout_s} s"
        time.sleep(0.5)
    return time.monotonic() - start


def test_no_slot_stays_held_and_no_wait_lasts_past_its_bound_across_server_restarts(tmp_path):
    home = tmp_path / "prefect"
    env = server_env(home, free_port())
    env["PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS"] = str(REPOSSESSOR_LOOP_S)
    in_memory = {**env, LEASE_STORAGE_ENV: "prefect.server.concurrency.lease_storage.memory"}
    server = start_server(env, home)  # as the README starts it: leases on disk
    holders: list[Holder] = []
    try:
        for name in ("gpu:0", "gpu:1", "gpu:2"):
            cli(env, "gcl", "create", name, "--limit", "1")
        # A holder killed while it holds its slot (its lease then expires unrenewed, whatever
        # happens to the server meanwhile).
        killed = Holder(env, tmp_path, "gpu:1")
        holders.append(killed)
        killed.wait_for("held gpu:1")
        os.killpg(killed.proc.pid, signal.SIGKILL)
        killed.proc.wait()

        # Prefect's default server forgets every lease when it restarts, the slots still counted.
        stop(server)
        server = start_server(in_memory, home)
        forgotten = Holder(env, tmp_path, "gpu:2")
        holders.append(forgotten)
        with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
            warning = leases_kept_in_memory()  # what the evaluation service says when it connects
        assert warning is not None and f"{LEASE_STORAGE_ENV}={FILE_LEASE_STORAGE}" in warning
        forgotten.wait_for("held gpu:2")
        stop(server)
        server = start_server(env, home)  # leases on disk again
        with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
            assert leases_kept_in_memory() is None

        kept = Holder(env, tmp_path, "gpu:0")
        holders.append(kept)
        kept.wait_for("held gpu:0")
        waiter = Holder(env, tmp_path, "gpu:0", wait_s=5)  # gpu:0 stays held past its wait
        holders.append(waiter)
        assert waiter.proc.wait(timeout=180) == 3
        refusal = waiter.said().strip().splitlines()[-1]
        assert refusal.startswith("OrchestrationUnavailable: concurrency slot 'gpu:0' not acquired in 5 s: "), refusal
        assert "every slot is held (1/1 held by evaluations still running; a holder that died frees" in refusal
        stop(server)  # a restart while gpu:0 is held
        server = start_server(env, home)

        assert kept.let_go() == 0, kept.said()[-3000:]
        assert active_slots(env, "gpu:0") == 0  # released through the lease the restart kept
        assert forgotten.let_go() == 0, forgotten.said()[-3000:]
        assert "forgotten by a server restart" in forgotten.said(), forgotten.said()[-3000:]
        assert active_slots(env, "gpu:2") == 0  # freed by name: nothing else would ever free it
        # The dead holder's lease expired unrenewed, and the server's repossessor freed its slot.
        wait_until_free(env, "gpu:1", timeout_s=LEASE_S + 60)  # a deadline, so a leak fails the test
        leases = home / "concurrency_leases"  # the server's lease files: every one released or revoked
        assert (leases / "expirations.json").exists() and not list(leases.glob("*-*.json"))

        taken = Holder(env, tmp_path, "gpu:1")  # and it can be taken again
        holders.append(taken)
        taken.wait_for("held gpu:1")
        assert taken.let_go() == 0
        unknown = Holder(env, tmp_path, "gpu:9")
        holders.append(unknown)
        assert unknown.proc.wait(timeout=120) == 3
        assert unknown.said().strip().splitlines()[-1] == (
            "ConfigError: gpu_slot: no global concurrency limit 'gpu:9' (prefect gcl create gpu:9 --limit 1)"
        )
        assert all(active_slots(env, name) == 0 for name in ("gpu:0", "gpu:1", "gpu:2"))
    finally:
        for holder in holders:
            stop(holder.proc)
        stop(server)
